"""bench/stage_profile.py: its quick form times and profiles every recipe's stage tail and writes
its report. Performance is never asserted."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_the_quick_run_writes_its_report(tmp_path):
    argv = [sys.executable, os.path.join(ROOT, "bench", "stage_profile.py"), "--device", "cpu", "--quick",
            "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (report,) = tmp_path.glob("*-stage-profile-*-quick.md")
    text = report.read_text()
    for tail in ("v2 (TrivialAugmentWide)", "timm rand-m9", "v2 augmix", "dino global view 1", "dino local view"):
        assert f"| {tail} |" in text and f"## {tail}" in text
    assert f"wrote {report}" in proc.stdout
