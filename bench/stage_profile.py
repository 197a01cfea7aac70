"""Where the device stage's time goes: each recipe's stage tail (the steps after decode, crop and
flip that ``gpupipe/backends/_stage`` runs as batched torch kernels) on a batch of uint8 images,
timed and profiled with ``torch.profiler``: ms per batch, CUDA kernels launched per batch, and the
operators that take the most device time and host time.

    python bench/stage_profile.py                  # the GPU where there is one, else the CPU
    python bench/stage_profile.py --device gpu     # the GPU or an error (bench/lent_gpu.sh probes)
    python bench/stage_profile.py --quick          # a smoke run: batch 8 of the tails' sizes / 4

It answers "why is recipe X slower than train" on a lent GPU machine (issue 52): a recipe's
images/s against train's is in ``bench/gpu.py``; this says which kernels make the difference.
Printed, and written to ``bench/results/<date>-stage-profile-<machine>.md``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish
from _timing import devices, ms_per_call

import gpupipe as gp
from gpupipe.backends._stage import run_stage, stage_start
from gpupipe.core._random import factors

# name: (the recipe, its options, the view), each profiled from the view's stage tail (stage_start),
# as a loader on a GPU runs it: pipelines/ is the one definition of the recipes
TAILS = {
    "v2 (TrivialAugmentWide)": ("imagenet.py:train_v2", {}, 0),
    "timm rand-m9": ("imagenet.py:train_timm", {}, 0),
    "v2 augmix": ("imagenet.py:train_v2", {"auto_augment": "augmix"}, 0),
    "dino global view 1": ("ssl.py:dino", {}, 0),
    "dino local view": ("ssl.py:dino", {}, 2),
}


def tail(name: str) -> tuple[int, list[Any]]:
    """The size of the images the tail ``name`` gets (its views are square) and its steps."""
    recipe, options, view = TAILS[name]
    pipeline = gp.load_pipeline(os.path.join(ROOT, "pipelines", recipe))(gp.FakeData(8), **options)
    steps, specs = pipeline.views[view], pipeline.view_specs[view]
    start = stage_start(steps, specs)
    assert start is not None, f"{name}: no stage tail"
    return int(specs[start].height), list(steps[start:])


RUNTIME = (
    "cudaLaunchKernel",
    "cudaMemcpyAsync",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemsetAsync",
    "cudaHostAlloc",
)


def profile(steps: list[Any], images: torch.Tensor, drawn: list[Any], top: int) -> tuple[int, list[str]]:
    """Kernels launched per batch, and the ``top`` operators by device (or host) time, then the
    CUDA runtime calls per batch (copies and synchronisations hold the host)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    cuda = images.is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    reps = 3
    with prof(activities=activities) as p:
        for _ in range(reps):
            run_stage(steps, images, drawn)
        if cuda:
            torch.cuda.synchronize()
    events = p.key_averages()
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = events.table(sort_by=key, row_limit=top, max_name_column_width=48).splitlines()
    calls = {e.key: e for e in events if e.key in RUNTIME}
    table += [f"{k}: {e.count / reps:.0f} per batch, {e.cpu_time_total / reps / 1000:.2f} ms host"
              for k, e in sorted(calls.items())]  # fmt: skip
    return kernels // reps, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"), help="auto: a GPU if any")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--tails", default=",".join(TAILS), help="comma-separated names of TAILS")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=12, help="operators listed per tail")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    if args.quick:
        args.batch_size, args.iters, args.top = 8, 2, 5
    from gpupipe.testing import synthetic_image

    auto = "gpu" if torch.cuda.is_available() else "cpu"
    (chosen,) = devices(parser, auto if args.device == "auto" else args.device)
    device = torch.device("cuda" if chosen == "gpu" else "cpu")
    rows, details = [], []
    for name in args.tails.split(","):
        size, steps = tail(name)
        size = size // 4 if args.quick else size
        hwc = np.stack([synthetic_image(i, size=(size, size)) for i in range(args.batch_size)])
        images = torch.from_numpy(hwc).permute(0, 3, 1, 2).contiguous().to(device)
        drawn = factors(steps, 0, 0, list(range(args.batch_size)))
        run_stage(steps, images, drawn)  # warm-up: cuDNN's choices, caches
        ms = ms_per_call(functools.partial(run_stage, steps, images, drawn), args.iters)
        kernels, table = profile(steps, images, drawn, args.top)
        rows.append([name, f"{size} x {size}", f"{ms:.2f}", str(kernels) if device.type == "cuda" else "-"])
        details += ["", f"## {name}", "", "```", *table, "```"]
        print(f"{name}: {ms:.2f} ms per batch of {args.batch_size}, {kernels} kernels", flush=True)
        print("\n".join(table), flush=True)
    machine = torch.cuda.get_device_name() if device.type == "cuda" else f"{os.cpu_count()}-core CPU"
    intro = (f"{machine}; torch {torch.__version__}; each recipe's stage tail on a batch of "
             f"{args.batch_size} uint8 images, draws of samples 0..{args.batch_size - 1}; ms per batch "
             f"({args.iters} iterations after a warm-up) and CUDA kernels per batch "
             "(`bench/stage_profile.py`). Below: the operators with the most self time, per tail.")  # fmt: skip
    out_name = "stage-profile-" + machine.replace(" ", "-").lower() + ("-quick" if args.quick else "")
    path = publish(
        args.out,
        out_name,
        f"The stage's time, {machine}",
        intro,
        ["tail", "images", "ms per batch", "kernels per batch"],
        rows,
    )
    with open(path, "a") as f:
        f.write("\n".join(details) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
