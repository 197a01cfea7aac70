"""What one DALI operator costs per batch, beside what one torch kernel costs: the figure that
decides how operator-heavy recipes should be lowered on a GPU.

    python bench/operator_cost.py                        # each DALI device present, and torch on it
    python bench/operator_cost.py --device cpu --quick   # a smoke run on DALI's CPU operators

On one H100 and one H200 the train recipe (7 operators) ran 1.3-1.6x the V2 recipe (129 operators
then, 77 on the GPU now) and 20-30x DINO's ten views (1,383 then, 903 now). A fit of those three
runs put the cost at 0.05-0.2 ms per operator per batch, far above a kernel launch
(`bench/results/2026-11-26-nvidia-h200-gpu.md`). This benchmark measures it directly: about 0.2 ms
on an H100, against 6-16 µs for a torch kernel (`bench/results/2026-11-27-h100-gpu-run.md`). A DALI
pipeline is fed the same batch of B uint8 images (H x W x 3) every iteration, then runs a chain of
N operators of one kind on it. ms per batch is fit against N: the slope is one operator's cost.

- **image**: ``x * 3`` in uint8 over the whole image (the pixels and the operator);
- **tiny**: the same on each sample's ``[1, 1, 3]`` channel means (the operator alone);
- **branch**: a ``split``/``merge`` pair of half the samples with nothing inside (a conditional,
  as the policies' families use; one pair counts as one step of the chain).

torch: the same chains as in-place kernels (``x.mul_(3)``) on ``[B, 3, H, W]``, on the same
device(s), one launch each on CUDA (torch's own intra-op threads on the CPU). Results go to
``bench/results/<date>-operator-cost-<machine>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish
from _timing import devices, ms_per_call

KINDS = ("image", "tiny", "branch")


def dali_chain(kind: str, n: int, *, device: str, batch: list[np.ndarray], threads: int) -> Any:
    """A built DALI pipeline: the fed batch, then ``n`` operators of ``kind``."""
    from nvidia.dali import fn as dali_fn
    from nvidia.dali import pipeline_def, types

    fn: Any = dali_fn

    cuda = device == "gpu"
    half = [np.array(i % 2 == 0) for i in range(len(batch))]

    @pipeline_def(batch_size=len(batch), num_threads=threads, device_id=0 if cuda else None, exec_dynamic=True,
                  prefetch_queue_depth=2)  # fmt: skip
    def chain() -> Any:
        x = fn.external_source(source=lambda: batch, batch=True, device=device, layout="HWC", dtype=types.UINT8)
        if kind == "tiny":
            x = fn.reductions.mean(x, axes=[0, 1], keep_dims=True, device=device)
        three = types.Constant(3, dtype=types.UINT8 if kind != "tiny" else types.FLOAT)
        predicate = fn.external_source(source=lambda: half, batch=True, dtype=types.BOOL) if kind == "branch" else None
        for _ in range(n):
            if kind == "branch":
                inside, outside = fn._conditional.split(x, predicate=predicate)
                x = fn._conditional.merge(inside, outside, predicate=predicate)
            else:
                x = x * three
        return x

    pipe = chain()
    pipe.build()
    return pipe


def torch_chain(kind: str, n: int, images: torch.Tensor) -> Callable[[], None]:
    """One batch of ``n`` in-place kernels of ``kind`` (``branch``: a gather and a scatter of half
    the batch, as a conditional does with indices)."""
    rows = torch.arange(0, images.shape[0], 2, device=images.device)

    def one_batch() -> None:
        x = images.float().mean((2, 3), keepdim=True) if kind == "tiny" else images.clone()
        for _ in range(n):
            if kind == "branch":
                x.index_copy_(0, rows, x.index_select(0, rows))
            else:
                x.mul_(3)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    return one_batch


def slope(counts: list[int], ms: list[float]) -> float:
    """µs per operator: the least-squares slope of ms against the chain's length."""
    return float(np.polyfit(counts, ms, 1)[0]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="all", choices=("all", "cpu", "gpu"), help="DALI's device(s)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--size", type=int, default=176, help="images of size x size (the V2 recipe's crop)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--counts", default="0,16,64", help="the chains' lengths")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 8, 32 x 32, chains 0 and 4")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    if args.quick:
        args.batch_size, args.size, args.counts, args.iters = 8, 32, "0,4", 3
    counts = [int(c) for c in args.counts.split(",")]
    cuda = torch.cuda.is_available()
    chosen = devices(parser, args.device)
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8) for _ in range(args.batch_size)]
    results: list[dict[str, Any]] = []
    for device in chosen:
        for kind in KINDS:
            ms = [ms_per_call(dali_chain(kind, n, device=device, batch=batch, threads=args.threads).run, args.iters)
                  for n in counts]  # fmt: skip
            results.append({"impl": f"DALI {device}", "kind": kind, "ms": ms, "us_per_op": slope(counts, ms)})
            print(json.dumps(results[-1]), flush=True)
    for device in chosen:
        where = "cuda" if device == "gpu" else "cpu"
        images = torch.from_numpy(np.stack(batch)).permute(0, 3, 1, 2).contiguous().to(where)
        for kind in KINDS:
            ms = [ms_per_call(torch_chain(kind, n, images), args.iters) for n in counts]
            results.append({"impl": f"torch {where}", "kind": kind, "ms": ms, "us_per_op": slope(counts, ms)})
            print(json.dumps(results[-1]), flush=True)
    machine = torch.cuda.get_device_name() if cuda else f"{os.cpu_count()}-core CPU"
    name = "operator-cost-" + machine.replace(" ", "-").lower() + ("-quick" if args.quick else "")
    import nvidia.dali

    intro = (f"{machine}; DALI {nvidia.dali.__version__}, torch {torch.__version__}; batch {args.batch_size} of "
             f"{args.size} x {args.size} x 3 uint8, {args.threads} DALI threads, {args.iters} iterations per chain "
             "after 3. ms per batch for each chain length, and the fitted cost of one operator "
             "(`bench/operator_cost.py`).")  # fmt: skip
    header = ["implementation", "operator", *(f"ms, {n} ops" for n in counts), "µs per operator"]
    rows = [[r["impl"], r["kind"], *(f"{m:.2f}" for m in r["ms"]), f"{r['us_per_op']:.0f}"] for r in results]
    data = {"machine": machine, "batch_size": args.batch_size, "size": args.size, "threads": args.threads,
            "counts": counts, "results": results}  # fmt: skip
    path = publish(args.out, name, f"One operator's cost per batch, {machine}", intro, header, rows, data)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
