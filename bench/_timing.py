"""What the operator probes share (``operator_cost.py``, ``policy_stage.py``,
``stage_profile.py``): the devices asked for, and ms per call of a function that runs one batch."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch


def devices(parser: argparse.ArgumentParser, choice: str) -> list[str]:
    """DALI's devices for ``--device`` (``all``: the CPU, and the GPU where there is one)."""
    cuda = torch.cuda.is_available()
    if choice == "gpu" and not cuda:
        parser.error("--device gpu needs CUDA")
    return {"all": ["cpu", "gpu"] if cuda else ["cpu"], "cpu": ["cpu"], "gpu": ["gpu"]}[choice]


def ms_per_call(run: Callable[[], Any], iters: int) -> float:
    """ms per call of ``run`` over ``iters`` calls, after three; with CUDA, the device's work is
    waited for before and after."""
    for _ in range(3):
        run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1000
