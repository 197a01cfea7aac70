"""bench/operator_cost.py: its quick form runs on DALI's CPU operators, so that it keeps working
between the sessions that have a GPU. Performance is never asserted: only that every row and the
report come out."""

from __future__ import annotations

import json

import pytest

from .support.bench import run_bench

pytest.importorskip("nvidia.dali")


def test_the_quick_run_writes_every_row(tmp_path):
    proc = run_bench("operator_cost.py", "--device", "cpu", "--quick", "--out", str(tmp_path))
    (report,) = tmp_path.glob("*-operator-cost-*-quick.md")
    result = json.loads(report.with_suffix(".json").read_text())
    rows = {(r["impl"], r["kind"]) for r in result["results"]}
    assert rows == {(impl, kind) for impl in ("DALI cpu", "torch cpu") for kind in ("image", "tiny", "branch")}
    assert all(len(r["ms"]) == len(result["counts"]) == 2 and min(r["ms"]) > 0 for r in result["results"])
    assert "| DALI cpu | branch |" in report.read_text() and f"wrote {report}" in proc.stdout
