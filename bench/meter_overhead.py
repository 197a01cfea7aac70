"""What the always-on data-stall meter and stage clocks cost: a loader's images/s with them on
against the same loader with them off, side by side in one run (issue 54: at most 1%).

    python bench/meter_overhead.py                       # both backends present, 5 rounds
    python bench/meter_overhead.py --quick               # a few seconds: the script still works

Where the cost shows most: small images (``--size``, 32 px) in small batches (``--batch-size``, 8),
so that the loader hands over as many batches a second as it can and the per-batch work of the
meter (two clock readings, a few additions, the stage times' sums) is the largest share of a
batch. Each backend runs one loader; its epochs alternate between the meter on and off in the
order on, off, off, on (then again), the first epoch a warm-up, so that both arms see the same
workers, threads, page cache and drift. Reported per backend: the median images/s of each arm,
the ratio off/on (the meter's cost: 1.01 would be 1%) with its range over the rounds, and the
meter's own time per batch measured in a tight loop, as a share of the batch period measured.

"Off" swaps the loader's meter and stage times for objects that do nothing (this script's
``Off``): the library has no switch, the meter is always on. The workers' stage clocks (four
``perf_counter`` readings per batch, in the workers) stay on in both arms.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.core._shards import ShardWriter
from gpupipe.loader._meter import Meter
from gpupipe.loader._verdict import StageTimes
from gpupipe.runtime._dist import cpu_cores
from gpupipe.testing import encode_jpeg, synthetic_image


class Off:
    """A meter and stage times that measure nothing (the arm without them)."""

    def begin(self, *args: Any) -> None:
        pass

    def ready(self, images: int | None = None) -> None:
        pass

    def resumed(self) -> None:
        pass

    def add(self, *args: Any, **kwargs: Any) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


def shards(data: str, images: int, size: int) -> list[str]:
    """``images`` small JPEGs of ``size`` px in shards of 256, made once under ``data``."""
    pattern = os.path.join(data, f"meter-{size}-%06d.tar")
    count = (images + 255) // 256
    found = [pattern % i for i in range(count)]
    if all(os.path.exists(p) for p in found):
        return found
    os.makedirs(data, exist_ok=True)
    with ShardWriter(pattern, max_count=256) as w:
        for i in range(images):
            w.write(f"{i:06d}", {"jpg": encode_jpeg(synthetic_image(i, size=(size, size))), "cls": i % 10})
    return w.shards


def epoch(loader: gp.Loader, number: int, on: bool, meter: Meter, times: StageTimes) -> float:
    """One epoch's images/s, the meter on or off."""
    loader._meter, loader._times = (meter, times) if on else (Off(), Off())  # type: ignore[assignment]
    loader.set_epoch(number)
    n, start = 0, time.perf_counter()
    for batch in loader:
        n += len(batch.keys)
    return n / (time.perf_counter() - start)


def meter_us_per_batch(batches: int = 200_000) -> float:
    """The meter's and stage times' own work per batch, in µs: a tight loop of what the loader
    calls per batch (``resumed``, ``ready``, ``add`` with a torch worker's four stage times)."""
    meter, times = Meter(), StageTimes()
    meter.begin(0, 8)
    found = {"read": 1e-4, "decode": 1e-3, "transform": 1e-3, "collate": 1e-4}
    start = time.perf_counter()
    for _ in range(batches):
        meter.resumed()
        times.add(found, None)
        meter.ready()
    return (time.perf_counter() - start) / batches * 1e6


def run(backend: str, files: list[str], args: argparse.Namespace) -> dict[str, Any]:
    steps = [T.CenterCrop(args.size - 4), T.ToDtype(torch.float32, scale=True)]
    rates: dict[bool, list[float]] = {True: [], False: []}
    ratios = []
    with gp.Loader(gp.Pipeline(files, steps), args.batch_size, shuffle=True, backend=backend, device="cpu",
                   num_workers=args.workers, seed=0) as loader:  # fmt: skip
        meter, times = Meter(), StageTimes()
        number = 0
        epoch(loader, number, True, meter, times)  # warm-up: workers, DALI's build, the page cache
        for r in range(args.rounds):
            got: dict[bool, list[float]] = {}
            for on in (True, False, False, True) if r % 2 == 0 else (False, True, True, False):
                number += 1
                rate = epoch(loader, number, on, meter, times)
                got.setdefault(on, []).append(rate)
                rates[on].append(rate)
            ratios.append(statistics.mean(got[False]) / statistics.mean(got[True]))
        workers = loader.num_workers
        loader._meter, loader._times = meter, times  # (its own again, for close())
    rate_on, rate_off = statistics.median(rates[True]), statistics.median(rates[False])
    return {"backend": backend, "workers": workers, "on": rate_on, "off": rate_off, "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "batches_per_s": rate_on / args.batch_size}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=None, help="torch,dali (default: those present)")
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--size", type=int, default=32, help="the JPEGs' side, px (default 32)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--quick", action="store_true", help="a few seconds: 512 images, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.images, args.rounds = 512, 1
    backends = args.backends.split(",") if args.backends else ["torch"]
    if args.backends is None:
        try:
            import nvidia.dali  # noqa: F401

            backends.append("dali")
        except ImportError:
            pass
    files = shards(args.data, args.images, args.size)
    own = meter_us_per_batch(20_000 if args.quick else 200_000)
    results = [run(b, files, args) for b in backends]
    rows = []
    for r in results:
        share = own * 1e-6 * r["batches_per_s"]
        rows.append([r["backend"], str(r["workers"]), f"{r['on']:,.0f}", f"{r['off']:,.0f}",
                     f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})",
                     f"{r['batches_per_s']:,.0f}", f"{share:.4%}"])  # fmt: skip
    command = " ".join(["python bench/meter_overhead.py", *sys.argv[1:]])
    intro = (
        f"`{command}` on {platform.node() or 'this machine'} "
        f"({cpu_cores()} cores, CPU only): {args.images} JPEGs of {args.size} x {args.size} px, batches of "
        f"{args.batch_size}, CenterCrop and ToDtype, {args.rounds} rounds of epochs alternating on, off, off, on. "
        f"**off / on** is the meter's cost (1.010 = 1%); its range is over the rounds. The meter's own work, "
        f"timed in a tight loop: **{own:.2f} µs per batch**; its share of the batch period measured is the last "
        "column."
    )
    header = ["backend", "workers", "images/s, meter on", "images/s, off", "off / on (range)", "batches/s",
              "the meter's own share"]  # fmt: skip
    data = {"meter_us_per_batch": own, "args": vars(args), "results": results}
    publish(args.out, "meter-overhead", "The data-stall meter's cost, side by side", intro, header, rows, data)


if __name__ == "__main__":
    main()
