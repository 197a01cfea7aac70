"""What torchvision-exact ColorJitter costs on DALI: images/s of the DINO-style train recipe with
ColorJitter lowered as gpupipe does by default (torchvision's kernels in DALI arithmetic), with
DALI's one ``color_twist`` (``DaliOptions(color_twist=True)``: mid-grey contrast, hue rotated in
YIQ), and with no jitter —
side by side in one run, on each DALI device present, and the torch backend for reference.

    python bench/color_jitter.py                   # makes shards in .bench-data/ on first use
    python bench/color_jitter.py --images 2048 --batch-size 128

The first epoch of each configuration is a warm-up and is not counted. Results go to
``bench/results/<date>-color-jitter-<machine>.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _data import synthetic_shards
from _report import publish

import gpupipe as gp
from gpupipe import transforms as T

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def recipe(source, jitter: bool) -> gp.Pipeline:
    steps: list[T.Transform] = [T.RandomResizedCrop(224), T.RandomHorizontalFlip()]
    if jitter:
        steps.append(T.ColorJitter(0.4, 0.4, 0.2, 0.1))
    return gp.Pipeline(source, [*steps, T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)])


def rate(pipeline, backend: str, device: str, batch_size: int, epochs: int, **options) -> float:
    rates = []
    with gp.Loader(pipeline, batch_size, shuffle=True, drop_last=True, backend=backend, device=device,
                   **options) as loader:  # fmt: skip
        for epoch in range(epochs + 1):
            loader.set_epoch(epoch)
            n, start = 0, time.perf_counter()
            for images, _ in loader:
                n += images.shape[0]
            if images.is_cuda:
                torch.cuda.synchronize()
            if epoch:
                rates.append(n / (time.perf_counter() - start))
    return sum(rates) / len(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data"))
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    shards = synthetic_shards(args.data, args.images)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for device in devices:
        plain = rate(recipe(shards, False), "dali", device, args.batch_size, args.epochs)
        jittered = rate(recipe(shards, True), "dali", device, args.batch_size, args.epochs)
        options = {"dali": gp.DaliOptions(color_twist=True)}
        twisted = rate(recipe(shards, True), "dali", device, args.batch_size, args.epochs, **options)
        measured = (
            ("no ColorJitter", plain),
            ("DaliOptions(color_twist=True)", twisted),
            ("torchvision's kernels (default)", jittered),
        )
        for name, value in measured:
            rows.append([f"dali-{device}", name, f"{value:,.0f}", f"{value / plain:.2f}x"])
    torch_rate = rate(recipe(shards, True), "torch", "cpu", args.batch_size, args.epochs)
    rows.append(["torch-cpu", "torchvision's kernels", f"{torch_rate:,.0f}", ""])
    intro = (
        f"`python bench/color_jitter.py --images {args.images} --batch-size {args.batch_size}` on "
        f"{platform.node() or 'this machine'} ({os.cpu_count()} cores"
        f"{', ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ', no GPU'}). RandomResizedCrop(224), "
        "flip, ColorJitter(0.4, 0.4, 0.2, 0.1), float, normalize; synthetic photo-like JPEGs. "
        "The ratio is to the same backend and device without ColorJitter."
    )
    machine = torch.cuda.get_device_name().lower().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    publish(args.out, f"color-jitter-{machine}", "ColorJitter on DALI: torchvision's kernels against color_twist",
            intro, ["backend", "ColorJitter", "images/s", "vs no jitter"], rows)  # fmt: skip


if __name__ == "__main__":
    main()
