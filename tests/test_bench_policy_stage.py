"""bench/policy_stage.py: its quick form runs every policy through the stage (the library's,
tested exact in tests/test_stage.py) and sample by sample, and reports the stage 0 values apart
from the torch backend. Performance is never asserted."""

from __future__ import annotations

import json

from .support.bench import run_bench


def test_the_quick_run_writes_its_report(tmp_path):
    proc = run_bench("policy_stage.py", "--device", "cpu", "--quick", "--out", str(tmp_path))
    (report,) = tmp_path.glob("*-policy-stage-*-quick.md")
    result = json.loads(report.with_suffix(".json").read_text())
    rows = {(r["policy"], r["impl"]): r for r in result["results"]}
    policies = {"TrivialAugmentWide", "RandAugment", "AutoAugment", "timm rand-m9", "AugMix"}
    assert {p for p, _ in rows} == policies
    for policy in policies:
        assert rows[policy, "the stage (torch, batched)"]["apart"] == 0
        assert rows[policy, "torch backend, per sample"]["apart"] == 0
    assert f"wrote {report}" in proc.stdout
