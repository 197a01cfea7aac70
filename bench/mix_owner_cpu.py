"""Where the stage runs with the torch backend on the CPU: in its worker processes, where each
batch is collated (``TorchBackend.batches_stage``, the default), or in the loader, on the
training thread, as it runs for DALI and Ray. Side by side, on the recipes whose stage on the CPU
holds the batch transform alone (V2: MixUp/CutMix).

    python bench/mix_owner_cpu.py               # 3 rounds
    python bench/mix_owner_cpu.py --quick       # a smoke run

Issue 52 asks for one owner of the batch transforms. The stage (``backends/_stage``) is that
owner; this measures where it should run on the CPU. Each round runs both placements, every other
round in reverse order; each ratio is taken within a round; the table gives medians and ranges. A
run's rate is its best epoch after the first. Results go to
``bench/results/<date>-mix-owner-cpu.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish
from _timing import best_rate, spread
from gpu import make_set

import gpupipe as gp
from gpupipe import backends

RECIPES = {
    "V2 (TrivialAugmentWide, MixUp/CutMix)": {},
    "V2 with RandAugment": {"auto_augment": "ra"},
}
PLACES = ("workers", "loader")


def rate(options: dict[str, Any], shards: list[str], *, where: str, batch: int, workers: int, epochs: int) -> float:
    """Best images/s of epochs 1.. of the V2 recipe with ``options``, the stage run ``where``."""
    torch_backend = backends.get("torch")
    torch_backend.batches_stage = ("cpu",) if where == "workers" else ()  # type: ignore[misc]
    try:
        factory = gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:train_v2"))
        with gp.Loader(factory(gp.WebDataset(shards), **options), batch, backend="torch", device="cpu",
                       num_workers=workers, shuffle=True, drop_last=True) as loader:  # fmt: skip
            return best_rate(loader, epochs)
    finally:
        del torch_backend.batches_stage  # the class's again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="one round, 256 images, 2 epochs")
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.images, args.epochs = 1, 256, 2
    shards, _, kb = make_set(args.data, "photo", (375, 500), args.images, os.cpu_count() or 1)
    rows: dict[str, dict[str, list[float]]] = {r: {p: [] for p in PLACES} for r in RECIPES}
    for round_ in range(args.rounds):
        order = [(r, p) for r in RECIPES for p in PLACES]
        for recipe, where in order if round_ % 2 == 0 else order[::-1]:
            value = rate(RECIPES[recipe], shards, where=where, batch=args.batch_size, workers=args.workers,
                         epochs=args.epochs)  # fmt: skip
            rows[recipe][where].append(value)
            print(f"round {round_}: {recipe}, stage in the {where}: {value:.0f} images/s", flush=True)

    table, data = [], []
    for recipe, by in rows.items():
        ratios = [w / o for w, o in zip(by["loader"], by["workers"], strict=True)]
        table.append([recipe, spread(by["workers"], "{:.0f}"), spread(by["loader"], "{:.0f}"),
                      spread(ratios, "{:.2f}x")])  # fmt: skip
        data.append({"recipe": recipe, "workers": by["workers"], "loader": by["loader"], "ratios": ratios})
    machine = f"{os.cpu_count()}-core CPU"
    intro = (f"{machine}, no GPU; torch {torch.__version__}; the torch backend, device='cpu'; {args.images} "
             f"photo-like JPEGs of 500 x 375 ({kb:.0f} KB mean), batch {args.batch_size}, {args.workers} workers; "
             f"{args.rounds} rounds, each run's best epoch of 1..{args.epochs - 1}; ratios within a round "
             "(`bench/mix_owner_cpu.py`).")  # fmt: skip
    header = ["recipe", "stage in the workers, images/s", "stage in the loader, images/s", "loader / workers"]
    path = publish(args.out, "mix-owner-cpu" + ("-quick" if args.quick else ""),
                   "The torch backend's stage (MixUp/CutMix) in its workers or in the loader, on the CPU", intro,
                   header, table, {"machine": machine, "rows": data})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
