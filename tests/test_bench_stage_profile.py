"""bench/stage_profile.py: its quick form times and profiles every recipe's stage tail and writes
its report. Performance is never asserted."""

from __future__ import annotations

from .support.bench import run_bench


def test_the_quick_run_writes_its_report(tmp_path):
    proc = run_bench("stage_profile.py", "--device", "cpu", "--quick", "--out", str(tmp_path))
    (report,) = tmp_path.glob("*-stage-profile-*-quick.md")
    text = report.read_text()
    for tail in ("v2 (TrivialAugmentWide)", "timm rand-m9", "v2 augmix", "dino global view 1", "dino local view"):
        assert f"| {tail} |" in text and f"## {tail}" in text
    assert f"wrote {report}" in proc.stdout
