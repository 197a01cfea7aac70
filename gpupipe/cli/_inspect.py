"""``gpupipe inspect``: a PNG grid of what a pipeline does to images — N samples (rows) x K
augmentation draws (columns; for a pipeline of views, every view of each draw, each at its own
size), with each sample's key and label — and, with ``compare``, the same
draws on each backend side by side with their largest difference, so that a user sees the recipe
and that the backends agree. A pipeline's masks and boxes (``gp.fields.Mask``, ``Boxes``) are drawn
over its images (:func:`overlay`): each label a colour, the mask's fill white, each box's outline.

The draws are epochs ``0..K-1`` of an unshuffled loader: the same samples, augmented as each epoch
would be (the draws depend on the seed, the epoch and the sample only, so every backend makes the
same ones). Outputs are shown as images: the last ``Normalize`` is undone (where only geometric
steps follow it), floats from ``ToDtype(scale=True)`` are scaled to 0..255 (clipped), one channel
is shown grey. Drawing needs Pillow (torchvision's dependency; the ``inspect`` extra).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..core._errors import ConfigError
from ..loader._loader import Loader
from ..pipeline._pipeline import Pipeline
from ..transforms import (
    CenterCrop,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RandomVerticalFlip,
    Resize,
    ToDtype,
)

log = logging.getLogger("gpupipe")

__all__ = ["Draws", "draw", "grid", "to_uint8"]

MARGIN = 4  # pixels between cells
LABEL_WIDTH = 150  # the left column: key and label


def label_text(label: Any) -> str:
    """A class index as it is; a soft target (MixUp, CutMix: a list of weights) as its classes of
    weight, heaviest first: ``3: 0.87, 5: 0.13``."""
    if not isinstance(label, list):
        return str(label)
    weights = sorted(((w, k) for k, w in enumerate(label) if w > 0.005), reverse=True)[:2]
    return ", ".join(f"{k}: {w:.2f}" for w, k in weights)


HEADER = 16  # the top row: column titles (two rows for a pipeline of views: the view below)


@dataclasses.dataclass
class Draws:
    """One backend's draws: ``images``, per view, uint8 ``[K, N, H, W, C]`` (K draws of N samples,
    for display), and the samples' ``keys`` and ``labels`` (``None`` for unlabeled data)."""

    backend: str
    images: tuple[np.ndarray, ...]  # one per view
    raw: tuple[np.ndarray, ...]  # per view, the outputs as they are, [K, N, C, H, W] float64: for differences
    keys: list[str]
    labels: list[Any] | None  # class indices, or soft targets (lists of weights)


# steps that move pixels without changing their values: a Normalize before them can be undone
_GEOMETRIC = (RandomHorizontalFlip, RandomVerticalFlip, CenterCrop, RandomCrop, Resize, RandomResizedCrop)


def to_uint8(images: torch.Tensor, pipeline: Pipeline, view: int = 0) -> np.ndarray:
    """``[N, C, H, W]`` outputs of the pipeline (of its view ``view``) as uint8 ``[N, H, W, 3]``
    for display: the last ``Normalize`` undone where only geometric steps follow it, floats from
    ``ToDtype(scale=True)`` scaled by 255; any other float output is stretched to its own range
    (logged)."""
    x = images.detach().to("cpu", torch.float64)
    steps = pipeline.views[view]
    last = max((i for i, t in enumerate(steps) if isinstance(t, Normalize)), default=None)
    undone = last is not None and all(isinstance(t, _GEOMETRIC) for t in steps[last + 1 :])
    if undone:
        norm = steps[last]  # type: ignore[index]
        assert isinstance(norm, Normalize)
        x = x * torch.tensor(norm.std, dtype=torch.float64).view(1, -1, 1, 1)
        x = x + torch.tensor(norm.mean, dtype=torch.float64).view(1, -1, 1, 1)
    if images.dtype.is_floating_point:
        scaled = any(isinstance(t, ToDtype) and t.scale for t in steps)
        if last is not None and not undone:
            log.info("gpupipe inspect: a Normalize followed by non-geometric steps: images stretched to their range")
            low, high = x.amin(dim=(1, 2, 3), keepdim=True), x.amax(dim=(1, 2, 3), keepdim=True)
            x = (x - low) / (high - low).clamp(min=1e-12) * 255.0
        elif scaled:
            x = x * 255.0
    x = x.clamp(0, 255).round().to(torch.uint8)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    return x[:, :3].permute(0, 2, 3, 1).contiguous().numpy()


# label colours (tab20, as matplotlib's): label k is _PALETTE[k % 20]
_PALETTE = np.array([
    (31, 119, 180), (174, 199, 232), (255, 127, 14), (255, 187, 120), (44, 160, 44), (152, 223, 138),
    (214, 39, 40), (255, 152, 150), (148, 103, 189), (197, 176, 213), (140, 86, 75), (196, 156, 148),
    (227, 119, 194), (247, 182, 210), (127, 127, 127), (199, 199, 199), (188, 189, 34), (219, 219, 141),
    (23, 190, 207), (158, 218, 229)], np.float64)  # fmt: skip
_BOX = np.array((255, 220, 0), np.uint8)  # a box's outline: yellow


def overlay(images: np.ndarray, targets: dict[str, Any], fields: dict[str, Any], *, width: int = 1) -> np.ndarray:
    """``images`` (uint8 ``[N, H, W, 3]``, for display) with the batch's ``targets`` (name: the
    batch's value of a mask or boxes field, rows as the images') drawn over them: a mask blended
    in (each label its colour, 45%; its ``fill`` white, 50%), each box's outline in yellow, ``width``
    pixels, inside the box and the image."""
    from ..core._targets import Boxes, BoxFormat, Mask

    out = images.astype(np.float64)
    for name, value in targets.items():
        field = fields[name]
        if isinstance(field, Mask):
            for i in range(len(out)):
                mask = np.asarray(value[i].cpu() if hasattr(value[i], "cpu") else value[i])
                if mask.shape != out.shape[1:3]:
                    continue  # (a mask left at another size than its image: not drawn)
                colour = _PALETTE[mask.astype(np.int64) % len(_PALETTE)]
                white = (mask == field.fill)[..., None]
                out[i] = np.where(white, 0.5 * out[i] + 127.5, 0.55 * out[i] + 0.45 * colour)
    shown = out.round().clip(0, 255).astype(np.uint8)
    for name, value in targets.items():
        field = fields[name]
        if isinstance(field, Boxes):
            for i in range(len(shown)):
                _outline(shown[i], _xyxy(_rows(value, i), BoxFormat(field.format).value), width)
    return shown


def _rows(value: Any, i: int) -> np.ndarray:
    """Sample ``i``'s boxes ``[K, 4]`` of a batch's boxes (a ``Padded``, a list or a tensor)."""
    data, lengths = (value.data, value.lengths) if hasattr(value, "lengths") else (value, None)
    rows = data[i] if lengths is None else data[i, : int(lengths[i, 0])]
    return np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows, np.float64).reshape(-1, 4)


def _xyxy(boxes: np.ndarray, fmt: str) -> np.ndarray:
    a, b, c, d = boxes.T
    if fmt == "XYWH":
        return np.stack([a, b, a + c, b + d], 1)
    if fmt == "CXCYWH":
        return np.stack([a - c / 2, b - d / 2, a + c / 2, b + d / 2], 1)
    return boxes


def _outline(image: np.ndarray, boxes: np.ndarray, width: int = 1) -> None:
    """Draws each XYXY box's outline into ``image`` ``[H, W, 3]``: its first and last ``width``
    pixel rows and columns, clipped to the image."""
    h, w = image.shape[:2]
    for x1, y1, x2, y2 in np.floor(boxes).astype(np.int64).tolist():
        if x1 > w - 1 or y1 > h - 1 or x2 < 1 or y2 < 1:
            continue
        x1, y1, x2, y2 = max(x1, 0), max(y1, 0), min(max(x2 - 1, x1), w - 1), min(max(y2 - 1, y1), h - 1)
        k = max(1, width)
        image[y1 : y1 + k, x1 : x2 + 1] = image[max(y2 - k + 1, y1) : y2 + 1, x1 : x2 + 1] = _BOX
        image[y1 : y2 + 1, x1 : x1 + k] = image[y1 : y2 + 1, max(x2 - k + 1, x1) : x2 + 1] = _BOX


def draw(pipeline: Pipeline, *, samples: int, draws: int, backend: str, seed: int, device: str = "cpu",
         cell: int | None = None) -> Draws:  # fmt: skip
    """The first ``samples`` samples of ``pipeline``'s source, ``draws`` times, on ``backend``
    delivering to ``device`` (``cell``: the grid's cell, so that boxes' outlines stay visible
    scaled down to it)."""
    views = len(pipeline.output_specs)  # (a per_source pipeline: one output)
    shown: list[list[np.ndarray]] = [[] for _ in range(views)]
    raw: list[list[np.ndarray]] = [[] for _ in range(views)]
    keys: list[str] = []
    labels: list[Any] | None = None
    with Loader(pipeline, samples, backend=backend, device=device, seed=seed, num_workers=0 if backend == "torch"
                else None) as loader:  # fmt: skip
        name = f"{loader.backend}" if loader.device == "cpu" else f"{loader.backend}-{loader.device}"
        for k in range(draws):
            loader.set_epoch(k)
            batch = next(iter(loader))
            keep = batch.valid.cpu()  # padding (fewer samples than asked) and skipped samples left out
            targets = {name: batch[name] for name in pipeline.targets}
            rows = keep.nonzero()[:, 0].tolist()
            for v, output in enumerate(batch.views):
                images = output.cpu()[keep]
                picture = to_uint8(images, pipeline, v)
                if targets:  # (one view: the pipeline checked)
                    kept = {name: _kept(value, rows) for name, value in targets.items()}
                    width = 1 if cell is None else -(-2 * max(picture.shape[1:3]) // cell)  # ~2 px in the cell
                    picture = overlay(picture, kept, pipeline.source.extra_fields(), width=width)  # type: ignore[attr-defined]
                shown[v].append(picture)
                raw[v].append(images.to(torch.float64).numpy())
            keys = [k for k, v in zip(batch.keys, keep.tolist(), strict=True) if v]
            labels = None if batch.labels is None else batch.labels.cpu()[keep].tolist()
    return Draws(name, tuple(map(np.stack, shown)), tuple(map(np.stack, raw)), keys, labels)


def _kept(value: Any, rows: list[int]) -> Any:
    """A batch's target value at ``rows`` (the valid samples)."""
    if hasattr(value, "lengths"):
        return type(value)(value.data[rows], value.lengths[rows])
    if isinstance(value, list):
        return [value[r] for r in rows]
    return value[rows]


def grid(all_draws: Sequence[Draws], *, cell: int | None = None) -> tuple[object, list[str]]:
    """The PNG grid (a Pillow image) of one or more backends' draws, and the report's lines
    (with several backends: the largest difference of each from the first)."""
    try:
        from PIL import Image, ImageDraw
    except ImportError as e:  # pragma: no cover - torchvision brings Pillow
        raise ConfigError("gpupipe inspect draws with Pillow: pip install gpupipe[inspect]") from e
    first = all_draws[0]
    views = len(first.images)
    k, n = first.images[0].shape[:2]
    sizes = [view.shape[2:4] for view in first.images]  # (h, w) of each view
    scale = 1.0 if cell is None else cell / max(max(h, w) for h, w in sizes)
    scaled = [(max(1, round(h * scale)), max(1, round(w * scale))) for h, w in sizes]
    ch = max(h for h, _ in scaled)  # a row's height: the largest view's
    # draw j's views, each of every backend side by side
    columns = [(d, j, v) for j in range(k) for v in range(views) for d in all_draws]
    width = LABEL_WIDTH + sum(scaled[v][1] + MARGIN for _, _, v in columns) + MARGIN
    top = HEADER if views == 1 else 2 * HEADER
    height = top + n * (ch + MARGIN) + MARGIN
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    pen = ImageDraw.Draw(canvas)
    x = LABEL_WIDTH + MARGIN
    for d, j, v in columns:
        title = f"{d.backend} #{j}" if len(all_draws) > 1 else f"draw {j}"
        pen.text((x, 2), title, fill=(0, 0, 0))
        if views > 1:
            pen.text((x, HEADER + 2), f"view {v}", fill=(80, 80, 80))
        for i in range(n):
            tile = Image.fromarray(d.images[v][j, i])
            if scaled[v] != tuple(sizes[v]):
                tile = tile.resize((scaled[v][1], scaled[v][0]), Image.Resampling.BILINEAR)
            canvas.paste(tile, (x, top + MARGIN + i * (ch + MARGIN)))
        x += scaled[v][1] + MARGIN
    for i, key in enumerate(first.keys):
        y = top + MARGIN + i * (ch + MARGIN)
        pen.text((MARGIN, y), key[-22:], fill=(0, 0, 0))
        if first.labels is not None:
            pen.text((MARGIN, y + 14), f"label {label_text(first.labels[i])}", fill=(80, 80, 80))
    outputs = ", ".join(f"[{raw.shape[2]}, {raw.shape[3]}, {raw.shape[4]}]" for raw in first.raw)
    lines = [f"{n} samples x {k} draws, output{'s' if views > 1 else ''} {outputs}, backends: "
             + ", ".join(d.backend for d in all_draws)]  # fmt: skip
    for d in all_draws[1:]:
        same = [a.shape == b.shape for a, b in zip(d.raw, first.raw, strict=True)]
        diffs = [np.abs(a - b) for a, b in zip(d.raw, first.raw, strict=True)] if all(same) else []
        diff = max(float(e.max()) for e in diffs) if diffs else float("inf")
        mean = sum(float(e.sum()) for e in diffs) / sum(e.size for e in diffs) if diffs else float("inf")
        lines.append(f"{d.backend} vs {first.backend}: largest difference {diff:.4g}, mean {mean:.4g} "
                     "(in the pipeline's output units)")  # fmt: skip
    return canvas, lines


def inspect(
    pipeline: Pipeline, out: str, *, samples: int = 8, draws: int = 4, backends: Sequence[str] = ("auto",),
    seed: int = 0, cell: int | None = None, device: str = "cpu",
) -> list[str]:  # fmt: skip
    """Writes the grid to ``out`` (PNG); returns the report's lines."""
    if samples < 1 or draws < 1:
        raise ConfigError("inspect: samples and draws must be positive")
    found = [draw(pipeline, samples=samples, draws=draws, backend=b, seed=seed, device=device, cell=cell)
             for b in backends]  # fmt: skip
    canvas, lines = grid(found, cell=cell)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    canvas.save(out)  # type: ignore[attr-defined]
    return [f"wrote {out}: " + lines[0], *lines[1:]]
