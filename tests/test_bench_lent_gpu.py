"""``bench/lent_gpu.sh``: one step of a lent GPU machine's session, packed into one file."""

import os
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "lent_gpu.sh")


def run(tmp_path, *args, **env):
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path), **env})  # fmt: skip


def test_an_unknown_step_or_missing_slices_print_the_usage(tmp_path):
    for args in (("nonsense",), ("tests",), ("rows",), ()):
        proc = run(tmp_path, *args)
        assert proc.returncode == 2 and proc.stderr.startswith("usage: bash bench/lent_gpu.sh"), args
    assert not list(tmp_path.iterdir())


def test_a_step_packs_its_logs_and_their_status_into_one_file(tmp_path):
    """Without a GPU the probes fail: the step still ends, with their status and logs in one file."""
    proc = run(tmp_path, "probes", LENT_TIMEOUT="120", PY=sys.executable)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["probes.tgz"]
    with tarfile.open(tmp_path / "probes.tgz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
        env = tar.extractfile("./env.txt").read().decode()  # type: ignore[union-attr]
    assert {"env.txt", "operator_cost.log", "policy_stage.log"} <= names
    assert "operator_cost: rc=" in env and "policy_stage: rc=" in env
    assert "== operator_cost.log" in proc.stdout and "--device gpu needs CUDA" in proc.stdout
