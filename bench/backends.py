"""Backends side by side: images/s of the ImageNet pipelines through gp.Loader, in one run.

    python bench/backends.py                       # makes shards in .bench-data/ on first use
    python bench/backends.py --images 4096 --batch-size 128
    python bench/backends.py --plot                # also <date>-<machine>.png: images/s per backend

Every backend present runs on the same shards with the same batch size; the first epoch of each
is a warm-up (worker start, DALI build, index cache) and is not counted. Results go to
``bench/results/<date>-<machine>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _data import synthetic_shards

import gpupipe as gp


def backends() -> list[tuple[str, str]]:
    found = [("torch", "cpu")]
    try:
        import nvidia.dali  # noqa: F401

        found.append(("dali", "cpu"))
        if torch.cuda.is_available():
            found.append(("dali", "cuda"))
    except ImportError:
        pass
    if torch.cuda.is_available():
        found.append(("torch", "cuda"))
    return found


def measure(pipeline, backend: str, device: str, batch_size: int, epochs: int, workers: int | None) -> dict:
    rates = []
    with gp.Loader(
        pipeline, batch_size, shuffle=True, drop_last=True, seed=0, backend=backend, device=device, num_workers=workers
    ) as loader:
        for epoch in range(epochs + 1):
            loader.set_epoch(epoch)
            n, start = 0, time.perf_counter()
            desc = f"{backend}-{device} epoch {epoch}" + (" (warm-up)" if not epoch else "")
            for images, _ in tqdm(loader, total=len(loader), unit="batch", desc=desc, leave=False):
                n += images.shape[0]
            if images.is_cuda:
                torch.cuda.synchronize()
            if epoch:  # epoch 0 is the warm-up
                rates.append(n / (time.perf_counter() - start))
    return {
        "backend": backend,
        "device": device,
        "workers": loader.num_workers,
        "images_per_s": round(sum(rates) / len(rates), 1),
        "epochs": [round(r, 1) for r in rates],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data"))
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--plot", action="store_true", help="also draw the results (matplotlib)")
    args = parser.parse_args()
    shards = synthetic_shards(args.data, args.images)
    recipes = (
        gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:train")),
        gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:val")),
    )
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()}-core CPU"
    rows = []
    for recipe in recipes:
        for backend, device in backends():
            row = {
                "pipeline": recipe.__name__,
                **measure(recipe(shards), backend, device, args.batch_size, args.epochs, args.workers),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    today = datetime.date.today().isoformat()
    meta = {
        "date": today,
        "machine": machine,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "images": len(gp.WebDataset(shards).index()),
        "batch_size": args.batch_size,
    }
    try:
        import nvidia.dali

        meta["dali"] = nvidia.dali.__version__
    except ImportError:
        pass
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{today}-{machine.replace(' ', '-').lower()}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    base = {r["pipeline"]: r["images_per_s"] for r in rows if (r["backend"], r["device"]) == ("torch", "cpu")}
    with open(stem + ".md", "w") as f:
        f.write(f"# Backends side by side — {machine}, {today}\n\n")
        f.write(", ".join(f"{k} {v}" for k, v in meta.items()) + "\n\n")
        f.write(
            "| pipeline | backend | device | workers/threads | images/s | vs torch-cpu |\n|---|---|---|---|---|---|\n"
        )
        for r in rows:
            f.write(
                f"| {r['pipeline']} | {r['backend']} | {r['device']} | {r['workers']} | {r['images_per_s']:.0f} "
                f"| {r['images_per_s'] / base[r['pipeline']]:.2f}× |\n"
            )
    print(f"wrote {stem}.md")
    if args.plot:
        plot(rows, stem + ".png", title=f"{machine}, {meta['images']} images, batch {args.batch_size}")
        print(f"wrote {stem}.png")


def plot(rows: list[dict], out: str, *, title: str) -> None:
    """Images/s per backend and device, one group of bars per pipeline (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pipelines = list(dict.fromkeys(r["pipeline"] for r in rows))
    configs = list(dict.fromkeys(f"{r['backend']}-{r['device']}" for r in rows))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(configs), 3.8), constrained_layout=True)
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        values = [next((r["images_per_s"] for r in rows if r["pipeline"] == p and
                        f"{r['backend']}-{r['device']}" == config), 0.0) for p in pipelines]  # fmt: skip
        bars = ax.bar([j + i * width for j in range(len(pipelines))], values, width, label=config)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(pipelines))], pipelines)
    ax.set(ylabel="images/s", title=f"Backends side by side: {title}")
    ax.legend()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
