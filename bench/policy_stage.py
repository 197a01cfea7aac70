"""Each augmentation policy (TrivialAugmentWide, RandAugment, AutoAugment, timm's RandAugment,
AugMix) on a batch of decoded images: gpupipe's stage (batched torch kernels,
``gpupipe/backends/_stage``) against the torch backend's per-sample kernels, with the same draws,
on each device present.

    python bench/policy_stage.py                          # each device present
    python bench/policy_stage.py --device cpu --quick     # a smoke run

It first answered issue 37's question: on a GPU, where a DALI operator costs far more than a
torch kernel launch (``bench/operator_cost.py``), would the policy run faster as a torch stage
after DALI's decode and crop than as DALI's 70-odd operators? (One H100, 2026-11-27: yes, 2.95
against 5.81 ms per batch of 256: ``bench/results/2026-11-27-policy-stage-*.md``.) DALI's own
graph of the policies was removed since (issue 52): DALI runs them in the stage. Both sides get
the same batch of B uint8 images (already decoded) and the same draws (gpupipe's, of samples
0..B-1). Reported: ms per batch of each, and how far the stage is from the torch backend's
torchvision kernels sample by sample: 0 values apart but where a library computes differently on
a device (stated with the figures).

The stage applies each operation once to the samples that drew it (on a GPU; on a CPU once per
operation and magnitude), with per-sample magnitudes: its kernels are torchvision's arithmetic
(``gpupipe/backends/_stage/_kernels.py``, tested exact at every bin). Results go to
``bench/results/<date>-policy-stage-<machine>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish
from _timing import devices, ms_per_call

from gpupipe import transforms as T
from gpupipe.backends._stage import run_stage

POLICIES = {
    "TrivialAugmentWide": lambda mode: T.TrivialAugmentWide(interpolation=mode),
    "RandAugment": lambda mode: T.RandAugment(interpolation=mode),
    "AutoAugment": lambda mode: T.AutoAugment(interpolation=mode),
    "timm rand-m9": lambda mode: T.TimmRandAugment.from_config("rand-m9-mstd0.5-inc1", interpolation=mode),
    "AugMix": lambda mode: T.AugMix(interpolation=mode),
}

# ------------------------------------------------------------------------- the runs --


def draws(t: Any, n: int, seed: int = 0) -> np.ndarray:
    """The factors of samples ``0..n-1`` (every backend's)."""
    from gpupipe.core._random import factors

    (f,) = factors([t], seed, 0, list(range(n)))
    return f


def per_sample(t: Any, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """The torch backend's per-sample path (each operation on a batch of one)."""
    from gpupipe.backends._torch._kernels import apply_pipeline

    return torch.stack([apply_pipeline([t], images[i], [factors[i]]) for i in range(len(images))])


def apart(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    """Share of values apart and the largest difference."""
    d = (got.int() - want.int()).abs()
    return float((d > 0).double().mean()), int(d.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="all", choices=("all", "cpu", "gpu"))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--size", type=int, default=176, help="images of size x size (the V2 recipe's crop)")
    parser.add_argument("--interpolation", default="bilinear", choices=("bilinear", "nearest"))
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated names of POLICIES")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 16 of 32 x 32")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    if args.quick:
        args.batch_size, args.size, args.iters = 16, 32, 2
    cuda = torch.cuda.is_available()
    chosen = devices(parser, args.device)
    from gpupipe.testing import synthetic_image

    n, size = args.batch_size, args.size
    mode = T.InterpolationMode(args.interpolation)
    hwc = [np.ascontiguousarray(synthetic_image(i, size=(size, size))) for i in range(n)]
    results: list[dict[str, Any]] = []
    for name in args.policies.split(","):
        t = POLICIES[name](mode)
        factors = draws(t, n)
        for device in chosen:
            gpu = device == "gpu"
            where = torch.device("cuda" if gpu else "cpu")
            images = torch.from_numpy(np.stack(hwc)).permute(0, 3, 1, 2).contiguous().to(where)
            want = per_sample(t, images.cpu(), factors)
            stage = functools.partial(run_stage, [t], images, [factors])
            got = stage()
            torch_ms = ms_per_call(stage, args.iters)
            per_sample_ms = ms_per_call(functools.partial(per_sample, t, images, factors), max(1, args.iters // 4))
            for impl, ms, value in (("the stage (torch, batched)", torch_ms, got.cpu()),
                                    ("torch backend, per sample", per_sample_ms, want)):  # fmt: skip
                share, largest = apart(value, want)
                results.append({"policy": name, "device": device, "impl": impl, "ms": ms, "apart": share,
                                "max_diff": largest})  # fmt: skip
                print(json.dumps(results[-1]), flush=True)
    machine = torch.cuda.get_device_name() if cuda else f"{os.cpu_count()}-core CPU"
    out_name = "policy-stage-" + machine.replace(" ", "-").lower() + ("-quick" if args.quick else "")
    intro = (f"{machine}; torch {torch.__version__}; each policy ({args.interpolation}) on a batch of {n} uint8 "
             f"images of {size} x {size}, already decoded, gpupipe's draws of samples 0..{n - 1}; {args.iters} "
             "iterations after 3. ms per batch, and the values apart from the torch backend's (sample by sample) "
             "(`bench/policy_stage.py`).")  # fmt: skip
    header = ["policy", "device", "implementation", "ms per batch", "values apart", "largest difference"]
    rows = [[r["policy"], r["device"], r["impl"], f"{r['ms']:.2f}", f"{r['apart']:.2%}", str(r["max_diff"])]
            for r in results]  # fmt: skip
    data = {"machine": machine, "batch_size": n, "size": size, "interpolation": args.interpolation,
            "results": results}  # fmt: skip
    path = publish(args.out, out_name, f"The policies in the stage or sample by sample, {machine}", intro, header, rows,
                   data)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
