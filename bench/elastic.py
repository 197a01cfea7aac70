"""Elastic resume at internet scale: the plan arithmetic of one rank, timed, with its memory.

    python bench/elastic.py                      # 2 B samples, 200,000 shards, 4,096 -> 3,072 ranks
    python bench/elastic.py --samples 1e8 --shards 10000 --old 64 --new 48   # smaller
    python bench/elastic.py --mix                # and a gp.Mix: a 1.28 M-sample source at 10% of the epoch

No data is read: a rank's start-up cost at this scale is its epoch plan (``gpupipe.plan._plan``), a
pure function of the shard sizes. For a few ranks of each world size this times, in this
process, and measures the peak of what Python allocates (``tracemalloc``; NumPy's arrays
included):

- ``rank_plan``: a rank's whole epoch at the old world size (what every start-up does);
- ``remaining``: what an epoch stopped after ``--done`` steps leaves (one range per old rank);
- ``elastic_plan``: a new rank's part of that, reading the old ranks' plans its part touches;
- with ``--mix``: the same through a ``gp.Mix`` (``gpupipe.plan._mix``): the epoch's draw (its
  virtual shards; each shard's samples drawn when a rank reads it), a rank's plan, an elastic one.

``--check`` also counts, over every new rank, that no sample is lost or repeated (slow at full
scale: it builds every new rank's plan; the tests do it on a scaled-down run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import tracemalloc
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish

from gpupipe.plan._elastic import elastic_plan, remaining
from gpupipe.plan._mix import mixed_plan, select
from gpupipe.plan._plan import PlanSpec, rank_plan
from gpupipe.sources._mix import MixCounts, counts_of


def measured(fn):
    """``(result, seconds, peak MB)`` of ``fn()``."""
    tracemalloc.start()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return result, seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=float, default=2e9, help="samples in all (default 2e9)")
    parser.add_argument("--shards", type=int, default=200_000, help="shards (default 200,000)")
    parser.add_argument("--old", type=int, default=4096, help="world size that saved (default 4,096)")
    parser.add_argument("--new", type=int, default=3072, help="world size that resumes (default 3,072)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--done", type=float, default=0.4, help="fraction of the epoch done when stopped")
    parser.add_argument("--ranks", type=int, default=3, help="ranks timed of each world size (default 3)")
    parser.add_argument("--check", action="store_true", help="count every sample over every new rank")
    parser.add_argument("--mix", action="store_true", help="also a gp.Mix with a 1.28 M-sample source at 10%%")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    mean = args.samples / args.shards
    sizes = rng.integers(int(mean * 0.5), int(mean * 1.5) + 1, size=args.shards).astype(np.int64)
    total = int(sizes.sum())
    spec: dict[str, Any] = dict(shuffle=True, shuffle_buffer=4096, interleave=64, drop_last=False)
    first = PlanSpec(num_samples=total, world_size=args.old, batch_size=args.batch_size, **spec)
    new = PlanSpec(num_samples=total, world_size=args.new, batch_size=args.batch_size, **spec)
    done = int(first.num_batches * args.done)
    kw: dict[str, Any] = dict(sequential=True, seed=1, epoch=3)
    rows = []
    for rank in np.linspace(0, args.old - 1, args.ranks).astype(int).tolist():
        plan, s, mb = measured(lambda rank=rank: rank_plan(sizes, first, rank=rank, **kw))
        rows.append([f"rank_plan, rank {rank} of {args.old}", f"{len(plan.samples):,}", f"{s * 1000:.0f}", f"{mb:.1f}"])
    layout, s, mb = measured(lambda: remaining(first, done))
    rows.append([f"remaining after {done:,} of {first.num_batches:,} batches", f"{layout.num_samples:,}",
                 f"{s * 1000:.1f}", f"{mb:.2f}"])  # fmt: skip
    for rank in np.linspace(0, args.new - 1, args.ranks).astype(int).tolist():
        plan, s, mb = measured(lambda rank=rank: elastic_plan(sizes, new, layout, rank=rank, **kw))
        rows.append([f"elastic_plan, rank {rank} of {args.new}", f"{len(plan.samples):,}", f"{s * 1000:.0f}",
                     f"{mb:.1f}"])  # fmt: skip
    if args.mix:  # a second, ImageNet-sized source mixed in at 10% of an epoch of the same size: ~156 passes
        small = rng.integers(1000, 1501, size=1024).astype(np.int64)
        both = np.concatenate([sizes, small])
        counts = counts_of([total, int(small.sum())], weights=[0.9, 0.1], counts=None, num_samples=total)
        mix = MixCounts(counts, (range(0, args.shards), range(args.shards, args.shards + 1024)), False)
        none = np.zeros(0, np.int64)
        sel, s, mb = measured(lambda: select(mix, both, none, seed=1, epoch=3))
        rows.append([f"mix: the epoch's draw ({counts[0]:,} + {counts[1]:,} of {int(small.sum()):,}), "
                     f"{len(sel.sizes):,} virtual shards", f"{int(sel.sizes.sum()):,}", f"{s * 1000:.0f}",
                     f"{mb:.1f}"])  # fmt: skip
        mixed_first, mixed_new = (dataclasses.replace(p, mix="bench") for p in (first, new))
        for rank in np.linspace(0, args.old - 1, args.ranks).astype(int).tolist():
            plan, s, mb = measured(lambda rank=rank: mixed_plan(sel, mixed_first, None, sequential=True, rank=rank))
            rows.append([f"mix: mixed_plan, rank {rank} of {args.old}", f"{len(plan.samples):,}",
                         f"{s * 1000:.0f}", f"{mb:.1f}"])  # fmt: skip
        mixed_layout = remaining(mixed_first, done)
        for rank in np.linspace(0, args.new - 1, args.ranks).astype(int).tolist():
            plan, s, mb = measured(
                lambda rank=rank: mixed_plan(sel, mixed_new, mixed_layout, sequential=True, rank=rank)
            )
            rows.append([f"mix: elastic, rank {rank} of {args.new}", f"{len(plan.samples):,}", f"{s * 1000:.0f}",
                         f"{mb:.1f}"])  # fmt: skip
    counted = ""
    if args.check:
        seen = np.zeros(total, dtype=np.uint8)
        for rank in range(args.old):
            p = rank_plan(sizes, first, rank=rank, **kw)
            n = done * args.batch_size
            np.add.at(seen, p.samples[:n][p.valid[:n]], 1)
        for rank in range(args.new):
            p = elastic_plan(sizes, new, layout, rank=rank, **kw)
            np.add.at(seen, p.samples[p.valid], 1)
        assert (seen == 1).all(), f"{int((seen == 0).sum())} lost, {int((seen > 1).sum())} repeated"
        counted = f" Counted over every rank of both worlds: each of the {total:,} samples exactly once."
    publish(
        args.out,
        "elastic",
        f"Elastic resume at scale, {os.cpu_count()}-core CPU",
        f"`python bench/elastic.py{' --check' if args.check else ''}{' --mix' if args.mix else ''}`: {total:,} "
        f"samples in {args.shards:,} shards "
        f"(sizes uniform in ±50% of the mean), batch {args.batch_size}, shuffle=True (interleave 64, buffer "
        f"4096); an epoch stopped after {args.done:.0%} of its steps at {args.old:,} ranks, resumed at "
        f"{args.new:,}. Per call, in one process: milliseconds and the peak of what Python allocated (MB, "
        f"tracemalloc).{counted}",
        ["step", "samples", "ms", "peak MB"],
        rows,
    )


if __name__ == "__main__":
    main()
