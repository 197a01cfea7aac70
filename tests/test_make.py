"""The Makefile installs builds that match the driver's CUDA (dry runs: nothing is installed)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(cuda: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-n", "-B", ".venv/.installed", f"CUDA={cuda}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize("cuda", ["12", "12.4", "12.8"])
def test_a_cuda_12_driver_gets_cuda_12_builds(cuda):
    out = dry_run(cuda).stdout
    assert "pip install -q torch torchvision --index-url https://download.pytorch.org/whl/cu126" in out
    assert "grep -v '^torch' constraints.txt > .venv/constraints-cuda12.txt" in out  # not PyPI's CUDA 13 pins
    assert "-c .venv/constraints-cuda12.txt -e '.[dev,cuda12,cupy12]'" in out


@pytest.mark.parametrize("cuda", ["13", "13.0", "14.1"])
def test_a_cuda_13_driver_gets_cuda_13_builds(cuda):
    out = dry_run(cuda).stdout
    assert "-c constraints.txt -e '.[dev,cuda13,cupy13]'" in out and "--index-url" not in out


def test_no_driver_installs_what_ci_runs():
    out = dry_run("").stdout
    assert "-c constraints.txt -e '.[dev,cuda12]'" in out and "--index-url" not in out


def test_an_old_driver_is_refused_with_the_way_out():
    proc = dry_run("11.8")
    assert proc.returncode != 0 and "DALI 2.4 needs 12 or newer" in proc.stderr and "make CUDA=" in proc.stderr
