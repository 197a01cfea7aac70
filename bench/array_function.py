"""What the ArrayFunction escape hatch costs: the val recipe alone, with an Arithmetic step, and with
the same arithmetic as an ArrayFunction (Python per sample), side by side on every backend present.

    python bench/array_function.py                # shards in .bench-data/ (made on first use)
    python bench/array_function.py --rounds 3

Each round measures every (backend, variant) once, in turn, so that the machine's drift hits all
alike; the report gives the median images/s over the rounds. The cost of the escape hatch is
ArrayFunction against Arithmetic, the same computation compiled: any step after the recipe also
undoes DALI's fusion of its crop and cast into one operator, which both pay.
Results go to ``bench/results/<date>-array-function.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import statistics
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish
from backends import backends, measure

import gpupipe as gp
from gpupipe import transforms as T


@dataclasses.dataclass(frozen=True)
class Scale(T.Arithmetic):
    """(x - 0.5) * 2: compiled into the DALI graph, a tensor op on torch."""

    def apply(self, x):
        return (x - 0.5) * 2.0


@dataclasses.dataclass(frozen=True)
class ScaleArray(T.ArrayFunction):
    """The same, as an ArrayFunction: one Python call per sample (NumPy, or CuPy on the GPU)."""

    def apply(self, image, xp):
        return (image - xp.float32(0.5)) * xp.float32(2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data"))
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    shards = sorted(glob.glob(os.path.join(args.data, "train-*.tar")))
    if not shards:
        subprocess.run([sys.executable, "-m", "gpupipe", "make-shards", args.data, "--synthetic", str(args.images),
                        "--shard-size", "256"], check=True, cwd=ROOT)  # fmt: skip
        shards = sorted(glob.glob(os.path.join(args.data, "train-*.tar")))
    base = [T.Resize(256), T.CenterCrop(224), T.ToDtype(torch.float32, scale=True)]
    variants = {"recipe alone": base, "+ Arithmetic": [*base, Scale()], "+ ArrayFunction": [*base, ScaleArray()]}
    rates: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.rounds):
        for backend, device in backends():
            for name, steps in variants.items():
                result = measure(gp.Pipeline(shards, steps), backend, device, args.batch_size, 1, args.workers)
                rates.setdefault((backend, device, name), []).append(result["images_per_s"])
                print(backend, device, name, result["images_per_s"], flush=True)
    rows = []
    for (backend, device, name), values in rates.items():
        alone = statistics.median(rates[(backend, device, "recipe alone")])
        compiled = statistics.median(rates[(backend, device, "+ Arithmetic")])
        rate = statistics.median(values)
        rows.append([backend, device, name, f"{rate:.0f}", f"{rate / alone:.2f}×",
                     f"{rate / compiled:.2f}×" if name == "+ ArrayFunction" else "",
                     f"{(1 / rate - 1 / compiled) * 1e6:+.0f}" if name == "+ ArrayFunction" else ""])  # fmt: skip
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()}-core CPU"
    publish(args.out, "array-function", f"ArrayFunction cost — {machine}",
            f"Val recipe (Resize 256, CenterCrop 224, float) on {len(gp.WebDataset(shards).index())} images, batch "
            f"{args.batch_size}, median of {args.rounds} rounds (one epoch each, after a warm-up epoch). The step "
            "added is (x - 0.5) * 2 in both forms; its cost as an ArrayFunction is the last two columns, against the "
            "same step as an Arithmetic (a step after the recipe also undoes DALI's crop+cast fusion, in both).",
            ["backend", "device", "pipeline", "images/s", "vs recipe alone", "ArrayFunction vs Arithmetic",
             "µs/image, ArrayFunction - Arithmetic"], rows)  # fmt: skip


if __name__ == "__main__":
    main()
