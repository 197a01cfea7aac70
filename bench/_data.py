"""The benchmarks' sample shards: synthetic photo-like JPEGs made once by ``gpupipe make-shards``."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_shards(data: str, images: int) -> list[str]:
    """The shards under ``data`` (``train-*.tar``, 256 samples each), made with ``images`` samples
    the first time."""
    found = sorted(glob.glob(os.path.join(data, "train-*.tar")))
    if not found:
        argv = [sys.executable, "-m", "gpupipe", "make-shards", data, "--synthetic", str(images), "--shard-size", "256"]
        subprocess.run(argv, check=True, cwd=ROOT)
        found = sorted(glob.glob(os.path.join(data, "train-*.tar")))
    return found
