"""Image geometry, defined once for every backend: output sizes, center-crop anchors and random-crop
windows, and what happens when an image is too small.

Each function computes with ``+ - * //``, comparisons and the three operations of an :class:`Ops`
(``where``, ``min``, ``max``) only. With :data:`INT` (the default) it runs on Python ints — for
``output_spec`` at build time and in the torch backend per sample; with the DALI backend's ops it
runs on DALI graph nodes, where sizes are known per sample only when the graph runs. So the
backends cannot disagree on geometry: there is one definition.

The rules are torchvision's (``torchvision.transforms.v2.functional``), tested against it:

- ``Resize``: the longer side is ``int(size * long / short)``. torchvision computes it in floating
  point; here it is ``size * long // short`` in integers, which is the same number for every
  image size below 2**26 pixels a side (the exact quotient is at least ``1 / short`` away from the
  next integer, far more than the floating-point error).
- ``CenterCrop``: the anchor is ``round((size - crop) / 2)`` with Python's round-half-to-even; an
  image smaller than the crop is padded with ``(crop - size) // 2`` zeros before it (the odd pixel
  after).
- ``RandomCrop``: padding first; with ``pad_if_needed`` a too-small side gets ``crop - padded``
  more on both sides; the window's start is uniform in ``[0, padded - crop]``. An image still
  smaller than the crop is an error — on every backend, naming the sample (torchvision raises).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Ops", "INT", "resize_size", "center_crop_anchor", "crop_padding", "crop_too_large"]


class Ops(Protocol):
    """What geometry needs beyond arithmetic: a per-value select and min/max."""

    def where(self, cond: Any, a: Any, b: Any) -> Any: ...

    def min(self, a: Any, b: Any) -> Any: ...

    def max(self, a: Any, b: Any) -> Any: ...


class _IntOps:
    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    @staticmethod
    def min(a: Any, b: Any) -> Any:
        return min(a, b)

    @staticmethod
    def max(a: Any, b: Any) -> Any:
        return max(a, b)


INT: Ops = _IntOps()


def resize_size(
    height: Any, width: Any, size: tuple[int, ...] | None, max_size: int | None, ops: Ops = INT
) -> tuple[Any, Any]:
    """Output ``(h, w)`` of ``Resize(size, max_size=max_size)`` on a ``height x width`` image.

    ``size``: ``(h, w)`` (exact), ``(s,)`` (the shorter side, the longer keeps the aspect ratio,
    rounded down, then capped by ``max_size``), or ``None`` (the longer side is ``max_size``).
    """
    if size is not None and len(size) == 2:
        return size[0], size[1]
    portrait = width <= height  # torchvision: (new_w, new_h) = (short, long) if w <= h else (long, short)
    short, long = ops.where(portrait, width, height), ops.where(portrait, height, width)
    if size is None:
        assert max_size is not None
        new_short, new_long = (max_size * short) // long, long * 0 + max_size
    else:
        new_short, new_long = short * 0 + size[0], (size[0] * long) // short
        if max_size is not None:
            over = new_long > max_size
            new_short = ops.where(over, (max_size * new_short) // new_long, new_short)
            new_long = ops.where(over, max_size, new_long)
    return ops.where(portrait, new_long, new_short), ops.where(portrait, new_short, new_long)


def center_crop_anchor(crop: int, size: Any, ops: Ops = INT) -> Any:
    """The first input row (or column) of a center crop of ``crop`` pixels from ``size``:
    ``round((size - crop) / 2)``, half to even; negative where the image is smaller than the crop
    (that many zero rows come first)."""
    d = size - crop
    q = d // 2  # floor; an odd d is a .5 tie, rounded up only when q is odd (to the even neighbour)
    return ops.where(d >= 0, q + (d & 1) * (q & 1), -((crop - size) // 2))


def crop_padding(
    size: Any, before: int, after: int, crop: int, pad_if_needed: bool, ops: Ops = INT
) -> tuple[Any, Any, Any]:
    """One axis of ``RandomCrop``: ``(before, after, padded)`` — the padding on each side and the
    padded size — for an image side of ``size`` with ``padding`` ``before``/``after``. The window
    then starts anywhere in ``[0, padded - crop]``, at input pixel ``start - before``; it fits
    only where ``padded >= crop``."""
    padded = size + before + after
    if pad_if_needed:
        extra = ops.max(crop - padded, 0)
        return before + extra, after + extra, padded + 2 * extra
    return before + size * 0, after + size * 0, padded


def crop_too_large(crop: tuple[int, int], padded: tuple[int, int], *, padding: bool) -> str:
    """The error of a crop larger than its (padded) image, the same on every backend."""
    return (
        f"RandomCrop: crop size {tuple(crop)} is larger than the {'padded ' if padding else ''}image size "
        f"{tuple(padded)}; set pad_if_needed=True to pad small images"
    )
