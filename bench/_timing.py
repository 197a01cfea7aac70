"""What the benchmarks share: for the operator probes (``operator_cost.py``, ``policy_stage.py``,
``stage_profile.py``) the devices asked for and ms per call of a function that runs one batch; for
the loader comparisons (``stage_cpu.py``, ``mix_owner_cpu.py``) a loader's best rate and a
median with its range."""

from __future__ import annotations

import argparse
import statistics
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


def best_rate(loader: Any, epochs: int) -> float:
    """Best images/s of ``loader``'s epochs 1..``epochs - 1`` (epoch 0 includes start-up)."""
    best = 0.0
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        start, n = time.perf_counter(), 0
        for b in loader:
            n += len(b.keys)
        if epoch:
            best = max(best, n / (time.perf_counter() - start))
    return best


def spread(values: list[float], fmt: str) -> str:
    """The median of ``values`` and their range, each formatted with ``fmt``."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"
