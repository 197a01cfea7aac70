"""Data stall: the same training step fed by each loader, against the same step on synthetic data
already on the device (the step's own ceiling), in one run.

    python bench/data_stall.py                               # small: CPU here, a GPU where there is one
    python bench/data_stall.py --arch resnet50 --image-size 224 --batch-size 256 --steps 100   # full size
    python bench/data_stall.py --plot                        # also a PNG beside the report

Feeders: ``synthetic`` (one batch made once on the device: no input pipeline at all), gpupipe on
each backend present (``backend=auto`` first), and ``dataloader`` (webdataset + torchvision's
transforms of the same names in a torch DataLoader, the usual way). Every feeder runs the
ImageNet train recipe (``pipelines/imagenet.py:train``) into the same model step (forward,
backward, SGD; bf16 autocast and channels_last on a GPU), ``--warmup`` steps not counted, then
``--steps`` timed. Reported: images/s, the data wait (the share of the time spent waiting for the
next batch, on the host), and the stall: how far below the synthetic ceiling the feeder keeps the
step (0% = the step never waits for data).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torchvision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _data import synthetic_shards
from _report import publish

import gpupipe as gp
from gpupipe.cli._bench import baseline_loader
from gpupipe.runtime._dist import default_workers


def step_fn(args: argparse.Namespace, device: torch.device) -> Any:
    """The model step: ``step(images, labels)``."""
    if args.arch == "tiny":
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(32, 1000),
        )  # fmt: skip
    else:
        model = torchvision.models.get_model(args.arch, num_classes=1000)
    gpu = device.type == "cuda"
    model = model.to(device).to(memory_format=torch.channels_last if gpu else torch.contiguous_format)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = loss_fn(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def timed(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], step: Any, args: argparse.Namespace,
          device: torch.device, meter: Any = None) -> tuple[float, float, float | None]:  # fmt: skip
    """``(images/s, data wait %, the loader's meter's stall %)`` of ``args.steps`` steps after
    ``args.warmup``; the last over the same steps where ``meter`` (a loader's ``Meter``) is given,
    from its totals before and after them (else ``None``)."""
    for _ in range(args.warmup):
        step(*next(batches))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    before = meter.totals() if meter is not None else None
    wait, n, start = 0.0, 0, time.perf_counter()
    for _ in range(args.steps):
        asked = time.perf_counter()
        images, labels = next(batches)
        wait += time.perf_counter() - asked
        step(images, labels)
        n += len(labels)
    sync()
    seconds = time.perf_counter() - start
    measured = None
    if meter is not None and before is not None:
        _, waited, stepped = (a - b for a, b in zip(meter.totals(), before, strict=True))
        measured = 100.0 * waited / (waited + stepped) if waited + stepped > 0 else None
    return n / seconds, 100.0 * wait / seconds, measured


def on_device(args: argparse.Namespace, device: torch.device,
              memory_format: torch.memory_format) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """The step's ceiling: one batch made once on the device, given again and again."""
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    images = images.contiguous(memory_format=memory_format)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    while True:
        yield images, labels


def endless(loader: Any, device: torch.device, memory_format: torch.memory_format) -> Iterator[tuple[Any, Any]]:
    """A loader's batches on the device, epoch after epoch."""
    epoch = 0
    while True:
        if isinstance(loader, gp.Loader):
            loader.set_epoch(epoch)
        for images, labels in loader:
            yield (images.to(device, non_blocking=True, memory_format=memory_format),
                   torch.as_tensor(labels).to(device, non_blocking=True))  # fmt: skip
        epoch += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data", "stall"))
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--arch", default=None, help="default: resnet50 on a GPU, tiny on a CPU")
    parser.add_argument("--image-size", type=int, default=None, help="default: 224 on a GPU, 96 on a CPU")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 128 on a GPU, 32 on a CPU")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 40 on a GPU, 20 on a CPU)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None, help="decode workers (default: the loader's)")
    parser.add_argument("--plot", action="store_true", help="also draw the results (matplotlib)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    args.arch = args.arch or ("resnet50" if gpu else "tiny")
    args.image_size = args.image_size or (224 if gpu else 96)
    args.batch_size = args.batch_size or (128 if gpu else 32)
    args.steps = args.steps or (40 if gpu else 20)
    workers = args.workers if args.workers is not None else default_workers()  # the Loader's
    pattern = synthetic_shards(args.data, args.images)
    pipeline = gp.load_pipeline(os.path.join(ROOT, "pipelines/imagenet.py:train"))(pattern, size=args.image_size)
    memory_format = torch.channels_last if gpu else torch.contiguous_format
    step = step_fn(args, device)
    rows: list[tuple[str, float, float, float | None]] = []
    rows.append(("synthetic (on the device)", *timed(on_device(args, device, memory_format), step, args, device)))
    # the backends of one machine (ray scales out: bench/scale_out.py)
    names = [n for n in gp.backends.names() if gp.backends.get(n).auto and gp.backends.get(n).available()]
    for name in names:
        options = dict(backend=name, device=str(device), num_workers=args.workers, memory_format=memory_format)
        with gp.Loader(pipeline, args.batch_size, shuffle=True, drop_last=True, seed=0, **options) as loader:
            fed = timed(endless(loader, device, memory_format), step, args, device, meter=loader._meter)
            rows.append((f"gpupipe {loader.backend} ({loader.device})", *fed))
    baseline, _ = baseline_loader(pipeline, batch_size=args.batch_size, workers=workers, pin_memory=gpu)
    rows.append((f"dataloader ({workers} workers)", *timed(endless(baseline, device, memory_format), step, args,
                                                          device)))  # fmt: skip
    ceiling = rows[0][1]
    table = [[name, f"{rate:.0f}", f"{wait:.1f}", "—" if own is None else f"{own:.1f}",
              f"{max(0.0, 100 * (1 - rate / ceiling)):.0f}"] for name, rate, wait, own in rows]  # fmt: skip
    machine = torch.cuda.get_device_name() if gpu else f"{os.cpu_count()}-core CPU"
    intro = (
        f"`python bench/data_stall.py --arch {args.arch} --image-size {args.image_size} --batch-size "
        f"{args.batch_size} --steps {args.steps}` on {machine} ({platform.node() or 'this machine'}, "
        f"{os.cpu_count()} cores). The ImageNet train recipe over {args.images} synthetic photo-like JPEGs into "
        f"one {args.arch} training step ({'bf16, channels_last' if gpu else 'float32'}); {args.warmup} warm-up "
        "steps, then the timed ones. Data wait: this script's clock around each `next()`; the loader's meter: "
        "`loader.stats()['stall']`'s measure of the same steps (issue 54: they agree within 1 point). Stall: how "
        "far below the synthetic ceiling the feeder keeps the step."
    )
    name = "data-stall-" + ("gpu" if gpu else "cpu")
    header = ["feeder", "images/s", "data wait (% of time)", "the loader's meter (%)", "stall (% below synthetic)"]
    path = publish(args.out, name, f"Data stall — {machine}", intro, header, table)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.6), constrained_layout=True)
        bars = ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color="C0")
        ax.bar_label(bars, fmt="%.0f")
        ax.axvline(ceiling, color="C3", linestyle="--", label="synthetic ceiling")
        ax.set(xlabel="images/s", title=f"{args.arch} step fed by each loader — {machine}")
        ax.legend(loc="lower right")
        fig.savefig(path.removesuffix(".md") + ".png", dpi=100)
        print(f"plot: {path.removesuffix('.md')}.png")


if __name__ == "__main__":
    main()
