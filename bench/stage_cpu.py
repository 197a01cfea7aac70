"""The recipes on the CPU with the stage (``Loader(stage=True)``: each view's tail of per-sample
steps run by the loader as batched kernels on the delivered batch, ``gpupipe/backends/_stage``)
and without it (``stage=False``: the backend runs the tail: the torch backend's workers sample by
sample, DALI's graph for the colour steps; DALI runs the policies in the stage only, and those
rows read "stage only"), side by side, on the torch and DALI backends.

    python bench/stage_cpu.py                   # every recipe, 3 rounds
    python bench/stage_cpu.py --quick           # a smoke run

Issue 52 asks that on the 2-core machine the torch backend's V2, timm and AugMix rates be no lower
than before the stage, and DALI-CPU's no lower either: this picks the default on the CPU
(``stage_for``). Each round runs every configuration once, every other round in
reverse order; each ratio is taken within a round; the table gives medians and ranges. A run's
rate is its best epoch after the first (which includes start-up). Results go to
``bench/results/<date>-stage-cpu.md`` and ``.json``.
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
from gpupipe import transforms as T


def _recipe(name: str, file: str = "imagenet.py", **options: Any) -> Any:
    factory = gp.load_pipeline(os.path.join(ROOT, "pipelines", f"{file}:{name}"))
    return lambda source: factory(source, **options)


RECIPES = {
    "V2 (TrivialAugmentWide)": _recipe("train_v2"),
    "V2 with RandAugment": _recipe("train_v2", auto_augment="ra"),
    "V2 with AugMix": _recipe("train_v2", auto_augment="augmix"),
    "timm rand-m9": _recipe("train_timm"),
    "train (no tail to stage)": _recipe("train"),
}


def _tail(*tail: Any) -> Any:
    """The train recipe's crop and flip, then ``tail``, then float and ImageNet's normalisation."""
    steps = [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), *tail, T.ToDtype(torch.float32, scale=True),
             T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))]  # fmt: skip
    return lambda source: gp.Pipeline(source, steps)


# the colour steps' recipes, run by name (--recipes): DINO's 10 views are slow on a CPU
COLOUR = {
    "3-Augment": _recipe("train_3augment"),
    "SimCLR": _recipe("simclr", "ssl.py"),
    "DINO": _recipe("dino", "ssl.py"),
    "photometric distort": _tail(T.RandomPhotometricDistort()),
    "tone steps": _tail(
        T.RandomAutocontrast(),
        T.RandomEqualize(),
        T.RandomAdjustSharpness(2.0),
        T.RandomPosterize(4),
        T.RandomInvert(p=0.2),
    ),
}


def rate(recipe: str, shards: list[str], *, backend: str, stage: bool, batch: int, workers: int,
         epochs: int) -> float | None:  # fmt: skip
    """Best images/s of epochs 1.. of ``recipe`` on ``backend``, with or without the stage;
    ``None`` where the backend runs the recipe's tail in the stage only (DALI's policies, since
    2026-11-29)."""
    pipeline = {**RECIPES, **COLOUR}[recipe](gp.WebDataset(shards))
    try:
        loader = gp.Loader(pipeline, batch, backend=backend, device="cpu", num_workers=workers, shuffle=True,
                           drop_last=True, stage=stage)  # fmt: skip
    except gp.UnsupportedTransformError:
        return None
    with loader:
        return best_rate(loader, epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="torch,dali")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names of RECIPES and COLOUR")
    parser.add_argument("--quick", action="store_true", help="one round, 256 images, 2 epochs")
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.images, args.epochs = 1, 256, 2
    recipes = [r for r in args.recipes.split(",") if r]
    shards, _, kb = make_set(args.data, "photo", (375, 500), args.images, os.cpu_count() or 1)
    names = args.backends.split(",")
    rows: dict[tuple[str, str], dict[bool, list[float | None]]] = {(b, r): {True: [], False: []} for b in names
                                                                    for r in recipes}  # fmt: skip
    for round_ in range(args.rounds):
        order = [(b, r, s) for b in names for r in recipes for s in (True, False)]
        for backend, recipe, stage in order if round_ % 2 == 0 else order[::-1]:
            value = rate(recipe, shards, backend=backend, stage=stage, batch=args.batch_size, workers=args.workers,
                         epochs=args.epochs)  # fmt: skip
            rows[backend, recipe][stage].append(value)
            said = "the stage only" if value is None else f"{value:.0f} images/s"
            print(f"round {round_}: {backend}, {recipe}, stage={stage}: {said}", flush=True)

    table, data = [], []
    for (backend, recipe), by in rows.items():
        staged, plain = [v for v in by[True] if v is not None], [v for v in by[False] if v is not None]
        if not plain:  # the backend runs this tail in the stage only
            table.append([backend, recipe, spread(staged, "{:.0f}"), "(stage only)", "-"])
            data.append({"backend": backend, "recipe": recipe, "stage": staged, "backend_tail": [], "ratios": []})
            continue
        ratios = [s / p for s, p in zip(staged, plain, strict=True)]
        table.append([backend, recipe, spread(staged, "{:.0f}"), spread(plain, "{:.0f}"), spread(ratios, "{:.2f}x")])
        data.append({"backend": backend, "recipe": recipe, "stage": staged, "backend_tail": plain, "ratios": ratios})
    machine = f"{os.cpu_count()}-core CPU"
    intro = (f"{machine}, no GPU; torch {torch.__version__}; {args.images} photo-like JPEGs of 500 x 375 ({kb:.0f} KB "
             f"mean), batch {args.batch_size}, {args.workers} workers or threads; {args.rounds} rounds, "
             f"each run's best epoch of 1..{args.epochs - 1}; ratios within a round "
             "(`bench/stage_cpu.py`).")  # fmt: skip
    header = ["backend", "recipe", "stage=True, images/s", "stage=False, images/s", "stage / without"]
    path = publish(args.out, "stage-cpu" + ("-quick" if args.quick else ""),
                   "The recipes with and without the stage on the CPU, side by side", intro, header, table,
                   {"machine": machine, "rows": data})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
