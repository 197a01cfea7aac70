"""``gpupipe bench``: images/s of a pipeline through the Loader over a grid of backends, batch sizes
and worker counts, beside the usual baseline — webdataset + torchvision transforms in a torch
DataLoader, the same recipe (gpupipe's transforms have torchvision's names and arguments, so the
baseline is built from the pipeline itself) — as a table, JSON and a plot.

Every configuration runs ``epochs`` shuffled epochs; its rate is the best epoch after the first
(which includes start-up), or the first when there is one. Configurations run one after another
in the order given. On a noisy machine run more rounds (``--rounds``): every configuration runs
once per round, every other round in reverse order, each ratio is taken between runs of the same
round, and the table gives the median rate and ratio with their range over the rounds.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..core._errors import ConfigError
from ..pipeline._pipeline import Pipeline

__all__ = [
    "Run",
    "run_loader",
    "run_baseline",
    "baseline_loader",
    "require_baseline",
    "torchvision_equivalent",
    "plot",
    "summary",
    "table",
]

BASELINE = "dataloader"  # the baseline's name in tables and plots


@dataclasses.dataclass
class Run:
    """One configuration's result. ``backend`` is the Loader's (or ``"dataloader"``); ``workers``
    as run (the Loader's default resolved)."""

    backend: str
    device: str
    batch_size: int
    workers: int
    epochs: list[dict[str, Any]]
    auto: str | None = None  # why backend="auto" / device=None chose what they chose
    operators: int | None = None  # the DALI graph's, where the backend has one
    round: int = 0  # which of ``--rounds`` it ran in
    profile: dict[str, Any] | None = None  # --profile: the last epoch's stage times (``_profile``)

    @property
    def images_per_s(self) -> float:
        rates = [e["images_per_s"] for e in self.epochs if e["images_per_s"]]
        later = rates[1:] or rates
        return max(later) if later else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "images_per_s": round(self.images_per_s, 1)}


def _epochs(
    batches: Callable[[int], Iterable[Any]], count: Callable[[Any], int], epochs: int, progress: Callable[[int], Any]
) -> list[dict[str, Any]]:
    results = []
    for epoch in range(epochs):
        n, start = 0, time.perf_counter()
        with progress(epoch) as bar:
            for batch in batches(epoch):
                n += count(batch)
                bar.update(1)
        seconds = time.perf_counter() - start
        results.append({"epoch": epoch, "images": n, "seconds": round(seconds, 3),
                        "images_per_s": round(n / seconds, 1) if seconds else None})  # fmt: skip
    return results


def run_loader(
    pipeline: Pipeline, *, backend: str, device: str | None, batch_size: int, workers: int | None, epochs: int,
    progress: Callable[[int, int], Any], profile: bool = False,
) -> Run:  # fmt: skip
    """``epochs`` shuffled epochs of ``pipeline`` through :class:`~gpupipe.Loader`.
    ``progress(epoch, batches)`` returns a progress bar (a context manager with ``update``).
    ``profile``: keep each batch's stage times and the loop's wait in the last epoch
    (``Run.profile``, ``_profile``)."""
    from ..loader._loader import Loader
    from ._profile import profile_of

    with Loader(pipeline, batch_size, shuffle=True, drop_last=True, seed=0, backend=backend, device=device,
                num_workers=workers) as loader:  # fmt: skip
        loader._times.keep = profile
        waits: list[float] = []

        def batches(epoch: int) -> Iterable[Any]:
            loader.set_epoch(epoch)
            waits.clear()
            it = iter(loader)
            while True:
                asked = time.perf_counter()
                batch = next(it, None)
                if batch is None:
                    return
                waits.append(time.perf_counter() - asked)
                images = batch.views[0]
                if images.is_cuda:
                    torch.cuda.synchronize(images.device)
                yield images

        results = _epochs(batches, len, epochs, lambda e: progress(e, len(loader)))
        operators = loader._runner.describe().get("operators")  # (the loader's repr says it too)
        return Run(loader.backend, loader.device, batch_size, loader.num_workers, results, loader.chosen, operators,
                   profile=profile_of(loader, waits) if profile else None)  # fmt: skip


def torchvision_equivalent(transforms: Sequence[Any]) -> Any:
    """The torchvision ``transforms.v2`` pipeline of gpupipe transforms: the class of the same name
    with the same arguments (gpupipe's enums by value). ConfigError for one torchvision lacks."""
    from torchvision.transforms import v2

    steps = []
    for t in transforms:
        cls = getattr(v2, type(t).__name__, None)
        if cls is None:
            raise ConfigError(f"{type(t).__name__} has no torchvision equivalent: no baseline for this pipeline")
        kwargs = {}
        for field in dataclasses.fields(t):
            if not field.init:
                continue
            value = getattr(t, field.name)
            if isinstance(value, enum.Enum) and field.name == "interpolation":
                value = v2.InterpolationMode(value.value)
            elif isinstance(value, enum.Enum) and field.name == "policy":  # AutoAugment's
                value = v2.AutoAugmentPolicy(value.value)
            elif field.name == "chain_depth" and value is None:  # AugMix's random depth: torchvision's -1
                value = -1
            elif field.name == "transforms" and isinstance(value, tuple):  # RandomApply's inner transforms
                value = list(torchvision_equivalent(value).transforms)
            kwargs[field.name] = value
        steps.append(cls(**kwargs))
    return v2.Compose(steps)


def batch_equivalent(t: Any) -> Any:
    """The torchvision ``transforms.v2`` batch transform of a gpupipe one (MixUp, CutMix,
    RandomChoice of them), or ``None``; ConfigError for what torchvision lacks (label smoothing
    in the targets, timm's per-sample mode)."""
    from torchvision.transforms import v2

    if t is None:
        return None
    if hasattr(t, "transforms"):  # RandomChoice
        return v2.RandomChoice([batch_equivalent(inner) for inner in t.transforms], p=t.p)
    if t.label_smoothing or getattr(t.mode, "value", t.mode) != "batch":
        raise ConfigError(f"{t!r}: torchvision's {type(t).__name__} has no label smoothing nor per-sample mode: "
                          "no baseline")  # fmt: skip
    return getattr(v2, type(t).__name__)(alpha=t.alpha, num_classes=t.num_classes)


def _mixed(mix: Any, samples: list[tuple[Any, int]]) -> tuple[Any, torch.Tensor]:
    """:func:`_collate`, then the batch transform (in the worker, as torchvision's reference
    script does in its ``collate_fn``)."""
    images, labels = _collate(samples)
    return mix(images, labels)


def run_baseline(
    pipeline: Pipeline, *, batch_size: int, workers: int, epochs: int,
    progress: Callable[[int, int], Any], decoder: str = "pillow",
) -> Run:  # fmt: skip
    """:func:`baseline_loader`'s epochs."""
    loader, steps = baseline_loader(pipeline, batch_size=batch_size, workers=workers, decoder=decoder)
    results = _epochs(lambda e: loader, lambda b: len(b[1]), epochs, lambda e: progress(e, steps))
    name = BASELINE if decoder == "pillow" else f"{BASELINE}-{decoder}"
    return Run(name, "cpu", batch_size, workers, results)


def require_baseline(pipeline: Pipeline) -> None:
    """ConfigError unless the baseline can run this pipeline (before anything else runs)."""
    from ..sources import WebDataset

    try:
        import webdataset  # noqa: F401
    except ImportError as e:
        raise ConfigError("the DataLoader baseline reads shards with webdataset: pip install webdataset") from e
    if not isinstance(pipeline.source, WebDataset) or pipeline.source.label is None:
        raise ConfigError("the DataLoader baseline reads labeled WebDataset shards")
    for steps in pipeline.views:
        torchvision_equivalent(steps)
    batch_equivalent(pipeline.batch_transform)


class _Views:
    """A pipeline of views in torchvision: each view's transforms on the same image, as a tuple
    (what multi-crop recipes write by hand)."""

    def __init__(self, views: Sequence[Any]) -> None:
        self.views = tuple(views)

    def __call__(self, image: Any) -> tuple[Any, ...]:
        return tuple(view(image) for view in self.views)


def _decode_torchvision(data: bytes) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The image decoding", category=DeprecationWarning)
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def _label(value: Any) -> int:
    return int(value)


def _collate(samples: list[tuple[Any, int]]) -> tuple[Any, torch.Tensor]:
    """``(images, labels)`` of a batch: images stacked, per view for a pipeline of views."""
    images, labels = zip(*samples, strict=True)
    if isinstance(images[0], tuple):
        return tuple(torch.stack(view) for view in zip(*images, strict=True)), torch.tensor(labels)
    return torch.stack(images), torch.tensor(labels)


def baseline_loader(
    pipeline: Pipeline, *, batch_size: int, workers: int, pin_memory: bool = False, decoder: str = "pillow"
) -> tuple[Any, int]:
    """The usual way, and its batches per epoch: webdataset reads the shards (shuffled shards, a
    1,000-sample buffer) and decodes with Pillow (``decoder="pillow"``, as most DataLoader
    pipelines do) or torchvision's ``decode_image`` (``"torchvision"``: libjpeg-turbo straight to a
    tensor, the fastest way by hand, and the torch backend's decoder), torchvision applies the
    pipeline's transforms, a torch DataLoader batches ``(images, labels)`` (CPU tensors; ``images``
    a tuple per view for a pipeline of views; pinned with ``pin_memory``, for copies to a GPU) in
    ``workers`` processes."""
    try:
        import webdataset as wds
    except ImportError as e:
        raise ConfigError("the DataLoader baseline reads shards with webdataset: pip install webdataset") from e
    from torch.utils.data import DataLoader
    from torchvision.transforms import v2

    from ..sources import WebDataset

    source = pipeline.source
    if not isinstance(source, WebDataset):
        raise ConfigError("the DataLoader baseline reads WebDataset shards")
    if decoder not in ("pillow", "torchvision"):
        raise ConfigError(f"the baseline decodes with 'pillow' or 'torchvision', got {decoder!r}")
    mix = batch_equivalent(pipeline.batch_transform)
    image_exts, label_ext = source.extensions()
    first = [v2.ToImage()] if decoder == "pillow" else []  # PIL -> uint8 tensor
    views = [v2.Compose([*first, torchvision_equivalent(steps)]) for steps in pipeline.views]
    transform = _Views(views) if pipeline.has_views else views[0]
    total = len(source.index())
    steps = total // batch_size
    dataset = wds.WebDataset(list(source.urls), shardshuffle=100, empty_check=False, seed=0).shuffle(1000)
    if decoder == "pillow":
        dataset = dataset.decode("pilrgb")  # Pillow (libjpeg-turbo)
    dataset = (
        dataset.to_tuple(";".join(image_exts), label_ext or "cls")
        .map_tuple(_decode_torchvision if decoder == "torchvision" else (lambda image: image), _label)
        .map_tuple(transform, int)
        .batched(batch_size, partial=False, collation_fn=_collate if mix is None else functools.partial(_mixed, mix))
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
                        pin_memory=pin_memory)  # fmt: skip
    return loader, steps


def _key(r: Run) -> tuple[str, str, int, int]:
    return (r.backend, r.device, r.batch_size, r.workers)


def summary(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One entry per configuration, in the order first run: its median images/s over the rounds
    (each round's rate: :attr:`Run.images_per_s`), their range, and its ratio to each baseline that
    ran at the same batch size and workers (the Pillow one, ``dataloader``, and
    ``dataloader-torchvision``), taken within each round — its median and range over the rounds."""
    names = [n for n in dict.fromkeys(r.backend for r in runs) if n.startswith(BASELINE)]
    base = {(r.backend, r.batch_size, r.workers, r.round): r.images_per_s for r in runs if r.backend in names}
    groups: dict[tuple[str, str, int, int], list[Run]] = {}
    for r in runs:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for (backend, device, size, workers), group in groups.items():
        rates = [r.images_per_s for r in group]
        entry: dict[str, Any] = {"backend": backend, "device": device, "batch_size": size, "workers": workers,
                                 "rounds": len(group), "images_per_s": _spread(rates), "vs": {}}  # fmt: skip
        if not backend.startswith(BASELINE):
            for n in names:
                ratios = [r.images_per_s / b for r in group if (b := base.get((n, size, workers, r.round)))]
                if ratios:
                    entry["vs"][n] = _spread(ratios, digits=3)
        out.append(entry)
    return out


def _spread(values: Sequence[float], digits: int = 1) -> dict[str, float]:
    return {k: round(v, digits) for k, v in
            (("median", statistics.median(values)), ("min", min(values)), ("max", max(values)))}  # fmt: skip


def table(runs: Sequence[Run]) -> str:
    """The results, one line per configuration, with the ratio to each baseline that ran at the same
    batch size and workers (:func:`summary`). Over several rounds: the medians, each with its
    range over the rounds."""
    rows = summary(runs)
    several = any(row["rounds"] > 1 for row in rows)
    names = [n for n in dict.fromkeys(r["backend"] for r in rows) if n.startswith(BASELINE)]
    width = max([21, *(len(r["backend"]) for r in rows)])
    rate_width = 19 if several else 9
    head = f"{'backend':<{width}} {'device':<7} {'batch':>5} {'workers':>7} {'images/s':>{rate_width}}"
    cell_width = {n: len(n) + 3 + (14 if several else 0) for n in names}
    lines = [head + "".join(f"  {'vs ' + n:>{cell_width[n]}}" for n in names)]
    for row in rows:
        rate = row["images_per_s"]
        shown = f"{rate['median']:.0f} ({rate['min']:.0f}-{rate['max']:.0f})" if several else f"{rate['median']:.0f}"
        line = f"{row['backend']:<{width}} {row['device']:<7} {row['batch_size']:>5} {row['workers']:>7} "
        line += f"{shown:>{rate_width}}"
        for n in names:
            ratio = row["vs"].get(n)
            cell = "" if ratio is None else f"{ratio['median']:.2f}x"
            if ratio is not None and several:
                cell += f" ({ratio['min']:.2f}-{ratio['max']:.2f})"
            line += f"  {cell:>{cell_width[n]}}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def plot(runs: Sequence[Run], out: str, *, title: str) -> None:
    """A PNG: the best images/s of each backend and the baseline (bars), and images/s against batch
    size and against workers (a line per backend; the other setting at its best)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("--plot draws with matplotlib: pip install gpupipe[plot]") from e
    names = list(dict.fromkeys(r.backend for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    best = [max(r.images_per_s for r in runs if r.backend == n) for n in names]
    bars = axes[0].bar(names, best, color=[f"C{i}" for i in range(len(names))])
    axes[0].bar_label(bars, fmt="%.0f")
    axes[0].set(title="best images/s", ylabel="images/s")
    for ax, key, label in ((axes[1], "batch_size", "batch size"), (axes[2], "workers", "workers")):
        for i, n in enumerate(names):
            points: dict[int, float] = {}
            for r in runs:
                if r.backend == n:
                    x = getattr(r, key)
                    points[x] = max(points.get(x, 0.0), r.images_per_s)
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", color=f"C{i}", label=n)
        ax.set_xticks(sorted({getattr(r, key) for r in runs}))
        ax.set(title=f"images/s against {label}", xlabel=label, ylabel="images/s")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.savefig(out, dpi=100)
    plt.close(fig)
