"""Running a ``bench/`` script as a reader runs it (a child process from the repository's root),
for the tests that keep each benchmark's quick form working. Performance is never asserted."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python bench/<script> <args>``, which must exit 0 (its stderr's end otherwise)."""
    argv = [sys.executable, os.path.join(ROOT, "bench", script), *args]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
