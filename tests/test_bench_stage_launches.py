"""bench/stage_launches.py: every stage recipe's device operations per batch of 256, the GPU's
way, counted on the meta device, at most its budget (``tests/support/budgets.py``). Counts, not
time: they do not depend on the machine."""

from __future__ import annotations

import json

from .support.bench import run_bench
from .support.budgets import STAGE_LAUNCHES


def test_each_recipe_within_its_budget_of_launches(tmp_path):
    proc = run_bench("stage_launches.py", "--rounds", "1", "--reps", "1", "--out", str(tmp_path))
    (report,) = tmp_path.glob("*-stage-launches-cpu.md")
    (run,) = json.loads(report.with_suffix(".json").read_text())["runs"]["this tree"]
    assert set(run) == set(STAGE_LAUNCHES)
    for recipe, budget in STAGE_LAUNCHES.items():
        assert 0 < run[recipe]["ops"] <= budget, (recipe, run[recipe])
        assert run[recipe]["copies"] < run[recipe]["ops"]
    assert f"wrote {report}" in proc.stdout
