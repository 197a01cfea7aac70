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
- ``RandomResizedCrop``: see :func:`resized_crop_window` (the DALI backend computes the same
  window in its graph, from the same float64 arithmetic).
- ``RandomCrop``: padding first; with ``pad_if_needed`` a too-small side gets ``crop - padded``
  more on both sides; the window's start is uniform in ``[0, padded - crop]``. An image still
  smaller than the crop is an error — on every backend, naming the sample (torchvision raises).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = [
    "Ops",
    "INT",
    "ATTEMPTS",
    "resize_size",
    "shortest_size",
    "resize_empty",
    "center_crop_anchor",
    "crop_padding",
    "crop_too_large",
    "TooSmall",
    "resized_crop_window",
    "resized_crop_windows",
    "crop_start",
    "erasing_window",
    "erasing_windows",
    "rotation_matrices",
    "affine_matrices",
]

ATTEMPTS = 10  # RandomResizedCrop's tries before its central-crop fallback (torchvision's number)


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


def shortest_size(height: Any, width: Any, short: Any, max_size: int | None) -> tuple[Any, Any]:
    """Output ``(h, w)`` of ``RandomShortestSize`` with the shorter side ``short`` (ints or arrays
    over a batch): torchvision v2's rule, the scale ``short / min(h, w)`` capped by
    ``max_size / max(h, w)``, each side ``int(side * scale)`` in float64 (truncated), at least 1
    (where torchvision's resize would fail on a very thin image)."""
    h, w = np.asarray(height, np.float64), np.asarray(width, np.float64)
    scale = np.asarray(short, np.float64) / np.minimum(h, w)
    if max_size is not None:
        scale = np.minimum(scale, max_size / np.maximum(h, w))
    return np.maximum((h * scale).astype(np.int64), 1), np.maximum((w * scale).astype(np.int64), 1)


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


class TooSmall(ValueError):
    """An image too small for a transform's geometry (:func:`crop_too_large`, :func:`resize_empty`):
    the sample is refused as ``too-small``. Any other error a transform raises is not the data's
    (a user's function failing): it ends the epoch, as on DALI."""


def resize_empty(size: tuple[int, ...] | None, max_size: int | None, new: tuple[int, int]) -> str:
    """The error of a Resize whose output would have no rows or columns (a very thin image under
    ``max_size``), the same on every backend."""
    return (
        f"Resize(size={size}, max_size={max_size}) would make this image {new[0]}x{new[1]}: it is too thin to keep "
        "its aspect ratio within max_size"
    )


def crop_too_large(crop: tuple[int, int], padded: tuple[int, int], *, padding: bool) -> str:
    """The error of a crop larger than its (padded) image, the same on every backend."""
    return (
        f"RandomCrop: crop size {tuple(crop)} is larger than the {'padded ' if padding else ''}image size "
        f"{tuple(padded)}; set pad_if_needed=True to pad small images"
    )


def resized_crop_window(
    height: int, width: int, factors: Sequence[float], ratio: Sequence[float]
) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of ``RandomResizedCrop``'s window on a ``height x width`` image.

    ``factors`` come from ``RandomResizedCrop.sample``: ``sw[k], sh[k]`` for each of the
    :data:`ATTEMPTS` attempts (``sqrt(s * r)`` and ``sqrt(s / r)`` for an area fraction ``s`` and
    an aspect ratio ``r``), then ``u_top, u_left`` (then ``ratio``, which the DALI graph reads
    from there). torchvision's sampler, in float64:

    - attempt ``k``: ``w = floor(sqrt(H * W) * sw[k] + 0.5)``, ``h = floor(sqrt(H * W) * sh[k] +
      0.5)``; the first with ``0 < w <= W`` and ``0 < h <= H`` wins (torchvision rounds
      ``sqrt(H * W * s * r)`` half to even: the two differ only on exact ties), at ``top =
      floor(u_top * (H - h + 1))``, ``left = floor(u_left * (W - w + 1))``;
    - if none fits, the largest central crop within ``ratio``: ``h = min(H, round(W / ratio[0]))``,
      ``w = min(W, round(H * ratio[1]))``, rounded half to even as torchvision rounds them (ties
      are common here: an odd side over a ratio of 2), at ``((H - h) // 2, (W - w) // 2)``.
    """
    n = ATTEMPTS
    sqa = math.sqrt(float(height * width))
    for k in range(n):
        w = math.floor(sqa * factors[k] + 0.5)
        h = math.floor(sqa * factors[n + k] + 0.5)
        if 0 < w <= width and 0 < h <= height:
            top = math.floor(factors[2 * n] * float(height - h + 1))
            left = math.floor(factors[2 * n + 1] * float(width - w + 1))
            return top, left, h, w
    h = min(height, round(width / ratio[0]))
    w = min(width, round(height * ratio[1]))
    return (height - h) // 2, (width - w) // 2, h, w


def resized_crop_windows(height: Any, width: Any, factors: np.ndarray) -> np.ndarray:
    """:func:`resized_crop_window` for a batch: int64 ``[B, 4]`` rows ``(top, left, h, w)`` from
    ``height``/``width`` (``[B]``) and each sample's factors (``[B, F]``, the ratio in columns
    ``2 * ATTEMPTS + 2`` and ``+ 3``, as ``RandomResizedCrop.sample`` gives them). The same
    float64 operations in the same order, so the same windows (tested against it)."""
    n = ATTEMPTS
    factors = np.asarray(factors, dtype=np.float64)
    batch = len(factors)
    h = np.broadcast_to(np.asarray(height, dtype=np.int64), (batch,))
    w = np.broadcast_to(np.asarray(width, dtype=np.int64), (batch,))
    sqa = np.sqrt((h * w).astype(np.float64))[:, None]
    ws = np.floor(sqa * factors[:, :n] + 0.5)
    hs = np.floor(sqa * factors[:, n : 2 * n] + 0.5)
    fits = (ws >= 1.0) & (ws <= w[:, None]) & (hs >= 1.0) & (hs <= h[:, None])
    found = fits.any(axis=1)
    rows, first = np.arange(batch), fits.argmax(axis=1)
    ch = np.where(found, hs[rows, first], np.minimum(h, np.round(w / factors[:, 2 * n + 2]))).astype(np.int64)
    cw = np.where(found, ws[rows, first], np.minimum(w, np.round(h * factors[:, 2 * n + 3]))).astype(np.int64)
    top = np.where(found, np.floor(factors[:, 2 * n] * (h - ch + 1).astype(np.float64)), (h - ch) // 2)
    left = np.where(found, np.floor(factors[:, 2 * n + 1] * (w - cw + 1).astype(np.float64)), (w - cw) // 2)
    return np.stack([top.astype(np.int64), left.astype(np.int64), ch, cw], axis=1)


def crop_start(u: Any, room: Any) -> Any:
    """``RandomCrop``'s window start on one axis: uniform in ``[0, room)`` from ``u`` in ``[0, 1)``,
    ``min(floor(u * room), room - 1)`` in float64 (``room``: the padded size minus the crop, plus
    one). Ints in, an int out; arrays in, an int64 array out."""
    start = np.minimum(np.floor(np.asarray(u, dtype=np.float64) * np.asarray(room, dtype=np.float64)), room - 1)
    return start.astype(np.int64) if isinstance(start, np.ndarray) and start.ndim else int(start)


def erasing_window(height: int, width: int, factors: Sequence[float]) -> tuple[int, int, int, int] | None:
    """``(top, left, h, w)`` of ``RandomErasing``'s box on a ``height x width`` image, or ``None``
    where no attempt fits. ``factors``: :data:`ATTEMPTS` area fractions, as many aspect ratios,
    then ``u_top, u_left``. torchvision's rule: the sides are ``round(sqrt(area * r))`` and
    ``round(sqrt(area / r))`` (Python's round, half to even) of ``area = fraction * height *
    width``; the first box smaller than the image on both sides is placed uniformly."""
    n, area = ATTEMPTS, height * width
    for k in range(n):
        erase_area = area * factors[k]
        h = round(math.sqrt(erase_area * factors[n + k]))
        w = round(math.sqrt(erase_area / factors[n + k]))
        if h < height and w < width:
            return crop_start(factors[2 * n], height - h + 1), crop_start(factors[2 * n + 1], width - w + 1), h, w
    return None


def erasing_windows(height: Any, width: Any, factors: np.ndarray) -> np.ndarray:
    """:func:`erasing_window` for a batch (``RandomErasing.sample``'s factors ``[B, F]``, the coin
    first): int64 ``[B, 4]`` rows ``(top, left, h, w)``, ``h = w = 0`` where nothing is erased.
    The same float64 operations (tested against it)."""
    n = ATTEMPTS
    factors = np.asarray(factors, dtype=np.float64)
    batch = len(factors)
    h_img = np.broadcast_to(np.asarray(height, dtype=np.int64), (batch,))[:, None]
    w_img = np.broadcast_to(np.asarray(width, dtype=np.int64), (batch,))[:, None]
    erase_area = (h_img * w_img).astype(np.float64) * factors[:, 1 : 1 + n]
    aspect = factors[:, 1 + n : 1 + 2 * n]
    hs = np.round(np.sqrt(erase_area * aspect)).astype(np.int64)
    ws = np.round(np.sqrt(erase_area / aspect)).astype(np.int64)
    fits = (hs < h_img) & (ws < w_img)
    erase = fits.any(axis=1) & (factors[:, 0] != 0)
    rows, first = np.arange(batch), fits.argmax(axis=1)
    h, w = np.where(erase, hs[rows, first], 0), np.where(erase, ws[rows, first], 0)
    top = crop_start(factors[:, 1 + 2 * n], h_img[:, 0] - h + 1)
    left = crop_start(factors[:, 2 + 2 * n], w_img[:, 0] - w + 1)
    return np.stack([np.where(erase, top, 0), np.where(erase, left, 0), h, w], axis=1)


def affine_matrices(
    height: Any,
    width: Any,
    angle: np.ndarray,
    translate: tuple[Any, Any] = (0, 0),
    scale: Any = 1.0,
    shear: tuple[Any, Any] = (0.0, 0.0),
    center: Sequence[Any] | None = None,
) -> np.ndarray:
    """float64 ``[B, 6]``: for each image, the affine map from an output point to the source point
    its value comes from — ``(M11, M12, M13, M21, M22, M23)``, coordinates from the top-left
    corner of the top-left pixel (DALI's ``warp_affine``) — of torchvision's ``affine``: a
    rotation by ``angle`` degrees (clockwise), shears of ``shear`` degrees along x and y, a
    ``scale``, about ``center`` (``(x, y)`` from that corner; ``None``: the image's centre), then a
    translation by ``translate`` pixels. Every argument is per image (``[B]``) or one for all.

    The forward map is ``p ↦ K + T + s·R·Sh·(p − K)``; with the rotation-and-shear matrix
    ``[[a, b], [c, d]]`` of determinant 1 (``a = cos(r − y) / cos(y)``, ``b = −cos(r − y)·tan(x) /
    cos(y) − sin(r)``, ``c = sin(r − y) / cos(y)``, ``d = −sin(r − y)·tan(x) / cos(y) + cos(r)``
    for angle ``r`` and shears ``x``, ``y``), the inverse is ``[[d, −b], [−c, a]] / s``."""
    r = np.radians(np.asarray(angle, dtype=np.float64))
    batch = len(r)
    h = np.broadcast_to(np.asarray(height, dtype=np.float64), (batch,))
    w = np.broadcast_to(np.asarray(width, dtype=np.float64), (batch,))
    sx, sy = (np.radians(np.asarray(v, dtype=np.float64)) for v in shear)
    a = np.cos(r - sy) / np.cos(sy)
    b = -np.cos(r - sy) * np.tan(sx) / np.cos(sy) - np.sin(r)
    c = np.sin(r - sy) / np.cos(sy)
    d = -np.sin(r - sy) * np.tan(sx) / np.cos(sy) + np.cos(r)
    s = np.asarray(scale, dtype=np.float64)
    m11, m12, m21, m22 = d / s, -b / s, -c / s, a / s
    kx, ky = (w / 2, h / 2) if center is None else (np.full(batch, center[0]), np.full(batch, center[1]))
    ox, oy = kx + np.asarray(translate[0], dtype=np.float64), ky + np.asarray(translate[1], dtype=np.float64)
    m11, m12, m21, m22 = (np.broadcast_to(m, (batch,)) for m in (m11, m12, m21, m22))
    return np.stack([m11, m12, kx - m11 * ox - m12 * oy, m21, m22, ky - m21 * ox - m22 * oy], axis=1)


def rotation_matrices(height: Any, width: Any, angles: np.ndarray, center: Sequence[float] | None) -> np.ndarray:
    """:func:`affine_matrices` of ``rotate``: ``angles`` degrees counter-clockwise (an affine
    rotation by minus them) about ``center``."""
    return affine_matrices(height, width, -np.asarray(angles, dtype=np.float64), center=center)


def libm(fn: Any, values: Any) -> np.ndarray:
    """``fn`` (a ``math`` function) on each of ``values``, float64 of their shape: Python's libm,
    whose ``tan`` and ``atan`` NumPy's vectorized ones differ from in the last bit on some inputs
    (1 in 200 on 2026-11-28, NumPy 2.4; ``sin`` and ``cos`` may differ on other CPUs). Once per
    distinct value: the policies' tables have few."""
    values = np.asarray(values, dtype=np.float64)
    if values.size <= 16:  # a few: at once (the stage's one-sample calls)
        return np.array([fn(v) for v in values.ravel().tolist()], dtype=np.float64).reshape(values.shape)
    distinct, at = np.unique(values, return_inverse=True)
    return np.array([fn(v) for v in distinct.tolist()], dtype=np.float64)[at].reshape(values.shape)


def centered_inverse_maps(
    angle: Any, translate: tuple[Any, Any] = (0.0, 0.0), shear: tuple[Any, Any] = (0.0, 0.0),
    center: tuple[Any, Any] = (0.0, 0.0),
) -> np.ndarray:  # fmt: skip
    """float64 ``[B, 6]``: torchvision's ``_get_inverse_affine_matrix`` (scale 1) per image, in
    its own arithmetic and order, so that each value is the bit it computes: the map from an output
    point to its source, coordinates about the image's centre (``center`` relative to it, as
    torchvision's ``affine`` passes it), ``angle`` and ``shear`` in degrees, ``translate`` in
    pixels. :func:`affine_matrices` is the same map about the top-left corner, for DALI."""
    args = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (angle, *translate, *shear, *center)))
    angle, tx, ty, shear_x, shear_y, cx, cy = (np.atleast_1d(a) for a in args)
    rot, sx, sy = np.radians(angle), np.radians(shear_x), np.radians(shear_y)
    cos, sin = (lambda v: libm(math.cos, v)), (lambda v: libm(math.sin, v))
    cos_sy, tan_sx, rot_minus_sy = cos(sy), libm(math.tan, sx), rot - sy
    cx_plus_tx, cy_plus_ty = cx + tx, cy + ty
    a = cos(rot_minus_sy) / cos_sy
    b = -(a * tan_sx + sin(rot))
    c = sin(rot_minus_sy) / cos_sy
    d = cos(rot) - c * tan_sx
    m0, m1, m3, m4 = d / 1.0, -b / 1.0, -c / 1.0, a / 1.0
    m2 = 0.0 + (cx - m0 * cx_plus_tx - m1 * cy_plus_ty)
    m5 = 0.0 + (cy - m3 * cx_plus_tx - m4 * cy_plus_ty)
    return np.stack([m0, m1, m2, m3, m4, m5], axis=1)
