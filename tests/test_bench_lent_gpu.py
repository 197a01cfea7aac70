"""``bench/lent_gpu.sh``: one step of a lent GPU machine's session, packed into one file."""

import os
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "lent_gpu.sh")


def run(out, *args, **env):
    environ = {k: v for k, v in os.environ.items() if k != "OUT"}
    if out is not None:
        environ["OUT"] = str(out)
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**environ, **env})  # fmt: skip


def test_a_bad_command_line_prints_the_usage_and_exits_2(tmp_path):
    for args in (("nonsense",), ("tests",), ("rows",), ("rows", "a", "b"), ()):
        proc = run(tmp_path, *args)
        assert proc.returncode == 2 and proc.stderr.startswith("usage: bash bench/lent_gpu.sh"), args
    proc = run(tmp_path, "tests", "1", "7")
    assert proc.returncode == 2 and "tests: slices are 1 to 6, got '7'" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_out_must_be_an_existing_folder(tmp_path):
    for out in (None, tmp_path / "missing"):
        proc = run(out, "probes")
        assert proc.returncode == 2 and "OUT must name an existing folder" in proc.stderr


def test_a_step_packs_its_logs_and_their_status_into_one_file(tmp_path):
    """Without a GPU the probes fail: the step still packs their status and logs, and exits 1."""
    proc = run(tmp_path, "probes", LENT_TIMEOUT="120", PY=sys.executable)
    assert proc.returncode == 1, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["probes.tgz"]
    with tarfile.open(tmp_path / "probes.tgz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
        env = tar.extractfile("./env.txt").read().decode()  # type: ignore[union-attr]
    assert {"env.txt", "operator_cost.log", "policy_stage.log", "stage_profile.log"} <= names
    for probe in ("operator_cost", "policy_stage", "stage_profile"):
        assert f"{probe}: rc=2 in" in env
    assert "Python 3." in env
    assert "== operator_cost.log" in proc.stdout and "--device gpu needs CUDA" in proc.stdout


def test_a_step_past_its_deadline_runs_nothing_more(tmp_path):
    proc = run(tmp_path, "probes", LENT_TIMEOUT="0", PY=sys.executable)
    assert proc.returncode == 1
    assert "operator_cost: not run, no time left" in proc.stdout and "policy_stage: not run" in proc.stdout
