"""The device stage's launches, counted without a GPU: each recipe's stage (every view's tail, as a
loader on a GPU builds it) on a batch of images on PyTorch's ``meta`` device, which the stage
batches the GPU's way (``_kernels.gpu_way``) and which runs every operation's dispatch but no
arithmetic. Counted per batch: the device operations (each a kernel launch, or a few, on a GPU;
views and aliases left out), the host-to-device copies among them, and the host's milliseconds
(Python and dispatch: the part of the stage a GPU cannot hide, ``2026-11-28-h200-gpu-run.md``).

    python bench/stage_launches.py                     # this tree
    python bench/stage_launches.py --before 201f786    # and a commit's, side by side in one run
    python bench/stage_launches.py --quick             # a smoke run

``--before`` runs the same counts on a git worktree of the commit, in a child process, round by
round with this tree's. Written to ``bench/results/<date>-stage-launches-cpu.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)


class _Count:
    """A dispatch mode that counts the operations that write a ``meta`` tensor (not views) and the
    copies from the host to it."""

    def __new__(cls) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        class Count(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.ops = self.copies = 0

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                outs = out if isinstance(out, tuple | list) else (out,)
                if getattr(func, "is_view", False) or str(func.overloadpacket) in ("aten.lift_fresh", "aten.alias"):
                    return out
                if any(isinstance(o, torch.Tensor) and o.is_meta for o in outs):
                    self.ops += 1
                    inputs = [a for a in args if isinstance(a, torch.Tensor)]
                    self.copies += bool(inputs) and all(not a.is_meta for a in inputs)
                return out

        return Count()


# name: (the recipe, its options); each recipe's stage as a loader builds it on a GPU (every view)
RECIPES = {
    "v2 (TrivialAugmentWide)": ("imagenet.py:train_v2", {}),
    "v2 RandAugment": ("imagenet.py:train_v2", {"auto_augment": "ra"}),
    "timm rand-m9": ("imagenet.py:train_timm", {}),
    "v2 augmix": ("imagenet.py:train_v2", {"auto_augment": "augmix"}),
    "dino (2 + 8 views)": ("ssl.py:dino", {}),
}


def counts(names: list[str], batch: int, reps: int) -> dict[str, dict[str, float]]:
    """Per recipe: its stage's operations and copies per batch (every view's tail; MixUp/CutMix
    left out), and the best host ms of ``reps``."""
    import numpy as np

    import gpupipe as gp
    from gpupipe.backends._stage import stage_for

    result = {}
    for name in names:
        recipe, options = RECIPES[name]
        pipeline = gp.load_pipeline(os.path.join(ROOT, "pipelines", recipe))(gp.FakeData(8), **options)
        stage = stage_for(pipeline, torch.device("meta"), True)
        assert stage is not None and stage.tails, f"{name}: no stage tail"
        specs = stage.cut_specs(tuple(pipeline.view_specs))
        assert all(s.height and s.width for s in specs), f"{name}: a view of no fixed size"
        images = tuple(torch.empty(batch, 3, s.height or 0, s.width or 0, dtype=torch.uint8, device="meta")
                       for s in specs)  # fmt: skip
        draws = np.arange(batch)

        run = functools.partial(stage.run, images, seed=0, epoch=0, draws=draws)
        run()  # warm-up: caches of constants and grids
        with _Count() as c:
            run()
        best = float("inf")
        for _ in range(reps):
            started = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - started)
        result[name] = {"ops": c.ops, "copies": c.copies, "host_ms": best * 1e3}
    return result


def _child(tree: str, names: list[str], batch: int, reps: int) -> dict[str, dict[str, float]]:
    """:func:`counts` run on ``tree``'s gpupipe (this file's code, the tree's library)."""
    code = (f"import sys, json; sys.path[:0] = [{tree!r}, {HERE!r}]; import gpupipe; "  # (the tree's, before ours)
            f"assert gpupipe.__file__.startswith({tree!r}), gpupipe.__file__; import stage_launches as s; "
            f"print(json.dumps(s.counts({names!r}, {batch}, {reps})))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from _report import publish

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="a commit to count side by side (a temporary git worktree)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5, help="host-time repetitions per round")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names of RECIPES")
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 16, one round")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    if args.quick:
        args.batch_size, args.rounds, args.reps = 16, 1, 1
    names = args.recipes.split(",")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    trees = {"this tree": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            before = os.path.join(tmp, "before")
            subprocess.run(["git", "worktree", "add", "--detach", "-q", before, args.before], cwd=ROOT, check=True)
            trees = {args.before: before, **trees}
        try:
            runs: dict[str, list[dict[str, dict[str, float]]]] = {label: [] for label in trees}
            for r in range(args.rounds):
                for label, tree in trees.items():
                    runs[label].append(_child(tree, names, args.batch_size, args.reps))
                    print(f"round {r}: {label}: {runs[label][-1]}", flush=True)
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", before], cwd=ROOT, check=False)
    rows = []
    for name in names:
        row = [name]
        for label in trees:
            first = runs[label][0][name]
            host = min(run[name]["host_ms"] for run in runs[label])
            row += [str(int(first["ops"])), str(int(first["copies"])), f"{host:.1f}"]
        rows.append(row)
    header = ["recipe"] + [f"{label}: {what}" for label in trees for what in ("ops", "H2D copies", "host ms")]
    command = "bench/stage_launches.py" + (f" --before {args.before}" if args.before else "")
    intro = (f"{os.cpu_count()}-core CPU, no GPU; torch {torch.__version__}; each recipe's stage (every view's tail, "
             f"MixUp/CutMix left out) on a batch of {args.batch_size} uint8 images on the `meta` device, batched "
             f"the GPU's way: device operations per batch (views left out), copies from the host among them, and "
             f"the host's ms (best of {args.rounds} x {args.reps}; `{command}`, this tree after "
             f"`{head.strip()}`).")  # fmt: skip
    path = publish(args.out, "stage-launches-cpu" + ("-quick" if args.quick else ""),
                   "The stage's launches per batch, counted on the CPU", intro, header, rows,
                   {"batch_size": args.batch_size, "runs": runs})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
