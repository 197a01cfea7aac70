"""The Makefile installs builds that match the driver's CUDA (dry runs: nothing is installed), and
runs the gpu tests in parts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from .support.parts import parse_part, part_slice

ROOT = os.path.join(os.path.dirname(__file__), "..")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(cuda: str, target: str = ".venv/.installed") -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-n", "-B", target, f"CUDA={cuda}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.mark.parametrize("cuda", ["12", "12.4", "12.8"])
def test_a_cuda_12_driver_gets_cuda_12_builds(cuda):
    for target, extras in ((".venv/.installed", "cuda12,cupy12"), (".venv/.installed-dev", "dev,cuda12,cupy12")):
        out = dry_run(cuda, target).stdout
        assert "pip install -q torch torchvision --index-url https://download.pytorch.org/whl/cu126" in out
        assert "grep -v '^torch' constraints.txt > .venv/constraints-cuda12.txt" in out  # not PyPI's CUDA 13 pins
        assert f"-c .venv/constraints-cuda12.txt -e '.[{extras}]'" in out


@pytest.mark.parametrize("cuda", ["13", "13.0", "14.1"])
def test_a_cuda_13_driver_gets_cuda_13_builds(cuda):
    out = dry_run(cuda).stdout
    assert "-c constraints.txt -e '.[cuda13,cupy13]'" in out and "--index-url" not in out
    assert "-c constraints.txt -e '.[dev,cuda13,cupy13]'" in dry_run(cuda, ".venv/.installed-dev").stdout


def test_no_driver_installs_what_ci_runs():
    out = dry_run("", "test").stdout
    assert "-c constraints.txt -e '.[dev,cuda12]'" in out and "--index-url" not in out


@pytest.mark.parametrize("cuda", ["", "12.4", "13.0"])
def test_the_demo_installs_the_runtime_only_and_the_tests_add_the_dev_tools(cuda):
    def installs(target: str) -> list[str]:
        return [line for line in dry_run(cuda, target).stdout.splitlines() if "pip install" in line and " -e " in line]

    assert len(installs("demo")) == 1 and "dev" not in installs("demo")[0]
    assert len(installs("bench-gpu")) == 1 and "dev" not in installs("bench-gpu")[0]
    for target in ("test", "lint", "docs", "test-gpu"):  # one install: the runtime with the dev tools
        assert len(installs(target)) == 1 and "-e '.[dev," in installs(target)[0], target


def test_an_old_driver_is_refused_with_the_way_out():
    proc = dry_run("11.8")
    assert proc.returncode != 0 and "DALI 2.4 needs 12 or newer" in proc.stderr and "make CUDA=" in proc.stderr


class TestGpuTestsInParts:
    """``make test-gpu PART=K/N``: a lent GPU machine runs a command for 10 minutes at most, and
    the gpu tests take longer; N calls run them all, each once."""

    def test_make_passes_the_part_and_runs_doctor_with_the_first(self):
        def dry(*args: str) -> str:
            return subprocess.run(["make", "-n", "test-gpu", "PY=python3", *args], cwd=ROOT, capture_output=True,
                                  text=True, timeout=60, check=True).stdout  # fmt: skip

        assert "doctor --run" in dry() and "--part" not in dry()
        assert "doctor --run" in dry("PART=1/3") and "-m gpu -rs --part 1/3" in dry("PART=1/3")
        assert "doctor" not in dry("PART=2/3") and "-m gpu -rs --part 2/3" in dry("PART=2/3")

    @pytest.mark.parametrize("count", [0, 1, 5, 548, 1000])
    @pytest.mark.parametrize("n", [1, 2, 3, 7])
    def test_the_parts_run_each_test_once_in_near_equal_slices(self, count, n):
        parts = [list(range(count))[part_slice(count, (k, n))] for k in range(1, n + 1)]
        assert [t for part in parts for t in part] == list(range(count))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1

    @pytest.mark.parametrize("text", ["0/3", "4/3", "2", "a/b", "1/0", ""])
    def test_a_bad_part_is_refused_naming_the_form(self, text):
        with pytest.raises(ValueError, match="expected K/N with 1 <= K <= N"):
            parse_part(text)

    def test_pytest_runs_only_its_part(self):
        def collected(part: str) -> list[str]:
            proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                   "--part", part, "tests/test_make.py::TestGpuTestsInParts"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
            assert proc.returncode == 0, proc.stdout + proc.stderr
            return [line for line in proc.stdout.splitlines() if "::" in line]

        parts = [collected(f"{k}/2") for k in (1, 2)]
        assert parts[0] and parts[1] and not set(parts[0]) & set(parts[1])
        assert len(parts[0]) + len(parts[1]) == len(collected("1/1"))
