"""The fuzzer of hostile shards (issue 51; ``tests/support/fuzz.py``) in every ``make test``: a
short budget finds nothing, and a limit removed on purpose is found. Each runs in a child process,
so that a crash fails the test (naming the signal and keeping the case) instead of ending the run.
``make fuzz`` runs a long budget and writes its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")
SECONDS = float(os.environ.get("GPUPIPE_FUZZ_SECONDS", "60"))


def fuzz(tmp_path, *args: str, plant: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GPUPIPE_FUZZ_PLANT"}
    if plant:
        env["GPUPIPE_FUZZ_PLANT"] = plant
    keep = str(tmp_path / "case")
    # (errors="replace": a generated file name need not be UTF-8, and the logs may print it)
    out = subprocess.run([sys.executable, "-m", "tests.support.fuzz", "--keep", keep, *args], capture_output=True,
                         text=True, errors="replace", cwd=ROOT, env=env, timeout=1200)  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, (
        f"the fuzzer's process died ({out.returncode}; its case is in {keep}): {out.stderr[-3000:]}"
    )
    return json.loads(line.removeprefix("RESULT "))


def test_the_fuzzer_finds_nothing_in_its_budget(tmp_path):
    report = fuzz(tmp_path, "--seconds", str(SECONDS))
    failure = report["failure"]
    assert failure is None, f"{failure['error']}\n{failure['traceback']}"
    assert report["cases"] >= 50 and report["folder_cases"] >= 10 and report["memory_measured"] and report["backends"]
    reached = set(report["verdicts"])  # the cases reach the verdicts, not only the good path
    assert {"ok", "too-large", "bad-label", "undecodable"} <= reached, reached


def test_the_fuzzer_finds_a_limit_removed(tmp_path):
    report = fuzz(tmp_path, "--seconds", "30", plant="image-bytes")
    assert report["plant"] == "image-bytes"
    failure = report["failure"]
    assert failure is not None, f"not found in {report['cases']} cases"
    assert "too-large" in failure["error"] or "memory" in failure["error"], failure["error"]
