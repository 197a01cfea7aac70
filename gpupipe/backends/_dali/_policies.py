"""The DALI backend's augmentation policies (TrivialAugmentWide, RandAugment, AutoAugment): one
graph whatever the operations and bins, each sample its own operation.

The host draws every sample's operations and magnitudes (``gpupipe.transforms._policies``, the
draws of every backend) and turns them into per-sample arguments. Each slot (one operation per
sample) then runs every operation family of the policy once over the whole batch — the drawn one
with its magnitude, the others as the identity, which each family keeps exactly:

- geometry (ShearX/Y, TranslateX/Y, Rotate): one ``warp_affine`` with the sample's inverse matrix
  (``gpupipe._geometry.affine_matrices``; shears about the top-left corner, as torchvision's
  policies), the identity matrix elsewhere;
- Brightness, Color, Contrast: torchvision's blend ``x·f + other·(1 − f)`` with ``other`` 0, the
  pixel's luma or the image's mean luma, ``f = 1`` elsewhere;
- Sharpness: torchvision's interior blend with the rounded 3x3 smoothing, ``1 − f = 0`` elsewhere;
- Posterize, Solarize, Invert: ``v & mask`` then ``v ≥ k → 255 − v`` (Invert is ``k = 0``), with
  ``mask = 255`` and ``k = 256`` elsewhere;
- AutoContrast and Equalize: computed on the slot's input and selected per sample.

The graph has a fixed size: families × slots, not operations × bins. Its cost is every family on
every sample (measured in ``bench/``); DALI's conditionals run each operation on its samples only,
at the price of a split and a merge per operation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import transforms as T
from ..._errors import BackendUnavailableError
from ..._geometry import affine_matrices
from ...transforms._policies import _CODE, COLOR, GEOMETRY
from ._color import _LUMA, autocontrasted, select, sharpened
from ._context import LOWERINGS, Ctx
from ._host import HostValue

__all__: list[str] = []


def _unsupported(t: Any) -> str | None:
    if isinstance(t.fill, tuple) and len(set(t.fill)) > 1:
        return "a fill per channel: DALI's warp_affine fills every channel with one value"
    return None


def _column(fn: Any, drawn: HostValue, slot: int) -> HostValue:
    """A per-sample host value: ``fn(codes, magnitudes)`` of slot ``slot``'s columns."""
    return HostValue(lambda cm: fn(cm[0][:, slot], cm[1][:, slot]), drawn)


def _matrices(h: Any, w: Any, codes: np.ndarray, mags: np.ndarray) -> np.ndarray:
    """``[B, 6]`` inverse maps of each sample's geometric operation (the identity for the others),
    with torchvision's arguments: shears ``atan(m)`` in degrees about ``(0, 0)``, translations
    truncated to whole pixels, rotations counter-clockwise about the centre."""

    def on(name: str, value: np.ndarray) -> np.ndarray:
        return np.where(codes == _CODE[name], value, 0.0)

    shear = np.degrees(np.arctan(mags))
    batch = len(codes)
    hh = np.broadcast_to(np.asarray(h, dtype=np.float64), (batch,))
    ww = np.broadcast_to(np.asarray(w, dtype=np.float64), (batch,))
    sheared = (codes == _CODE["ShearX"]) | (codes == _CODE["ShearY"])
    center = (np.where(sheared, 0.0, ww / 2), np.where(sheared, 0.0, hh / 2))
    translate = (on("TranslateX", np.trunc(mags)), on("TranslateY", np.trunc(mags)))
    return affine_matrices(hh, ww, on("Rotate", -mags), translate, 1.0, (on("ShearX", shear), on("ShearY", shear)),
                           center=center)  # fmt: skip


def _factor(codes: np.ndarray, mags: np.ndarray, kinds: frozenset[int]) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(f, 1 - f)`` of torchvision's blends, ``f = 1 + m`` where the code is of
    ``kinds``, 1 elsewhere (``1 - f`` as torch computes it: in float64, then float32)."""
    on = np.isin(codes, list(kinds))
    ratio = np.where(on, 1.0 + mags, 1.0)
    return ratio.astype(np.float32), (1.0 - ratio).astype(np.float32)


def _slot(t: Any, img: Any, ctx: Ctx, drawn: HostValue, slot: int, height: Any, width: Any) -> Any:
    """One operation per sample: every family of the policy's space, the identity where the sample
    drew another (module docstring)."""
    import nvidia.dali.math as dmath

    fn, types, ops = ctx.fn, ctx.types, t.ops

    def arg(value_of: Any, dtype: Any) -> Any:
        return ctx.arg(_column(value_of, drawn, slot), dtype)

    if ops & GEOMETRY:
        matrices = HostValue(lambda h, w, cm: _matrices(h, w, cm[0][:, slot], cm[1][:, slot]), height, width, drawn)
        matrix = fn.reshape(ctx.arg_vector([matrices[k] for k in range(6)], np.float32), shape=[2, 3])
        fill = 0.0 if t.fill is None else t.fill[0] if isinstance(t.fill, tuple) else t.fill
        nearest = t.interpolation == T.InterpolationMode.NEAREST
        img = fn.warp_affine(img, matrix=matrix, fill_value=fill, device=ctx.device,
                             interp_type=types.INTERP_NN if nearest else types.INTERP_LINEAR)  # fmt: skip
    if ops & COLOR:
        # torchvision keeps a 1-channel image as it is under Color (saturation): the identity here
        kinds = COLOR if ctx.channels == 3 else COLOR - {_CODE["Color"]}
        factors = HostValue(lambda cm: _factor(cm[0][:, slot], cm[1][:, slot], kinds), drawn)
        f = ctx.arg(HostValue(lambda v: v[0], factors), np.float32)
        g = ctx.arg(HostValue(lambda v: v[1], factors), np.float32)
        x = fn.cast(img, dtype=types.FLOAT, device=ctx.device)
        # torchvision's luma, floored (uint8), [H, W, 1]: one coord_transform (a 1-channel image is its own)
        luma = x if ctx.channels == 1 else dmath.floor(fn.coord_transform(x, M=list(_LUMA), device=ctx.device))
        pixel = arg(lambda c, m: (c == _CODE["Color"]).astype(np.float32), np.float32)
        mean = arg(lambda c, m: (c == _CODE["Contrast"]).astype(np.float32), np.float32)
        other = luma * pixel + fn.reductions.mean(luma) * mean
        out = dmath.floor(dmath.clamp(x * f + other * g, 0.0, 255.0))
        img = fn.cast(out, dtype=types.UINT8, device=ctx.device)
    if _CODE["Sharpness"] in ops:
        alpha = arg(lambda c, m: _factor(c, m, frozenset({_CODE["Sharpness"]}))[1], np.float32)
        img = sharpened(ctx, img, alpha)
    if ops & {_CODE["Posterize"], _CODE["Solarize"], _CODE["Invert"]}:
        img = _tone(ctx, img, arg(_posterize_mask, np.int32), arg(_solarize_from, np.int32))
    auto, equalize = _CODE["AutoContrast"] in ops, _CODE["Equalize"] in ops
    if auto or equalize:
        candidates = [img] + ([autocontrasted(ctx, img)] if auto else []) + ([fn.equalize(img, device=ctx.device)]
                                                                           if equalize else [])  # fmt: skip
        which = [c for c, on in ((_CODE["AutoContrast"], auto), (_CODE["Equalize"], equalize)) if on]
        img = select(ctx, arg(lambda c, m: _index_of(c, which), np.int32), *candidates)
    return img


def _index_of(codes: np.ndarray, which: list[int]) -> np.ndarray:
    """0 where the code is none of ``which``, else 1 + its position there."""
    out = np.zeros(len(codes), dtype=np.int32)
    for i, code in enumerate(which):
        out[codes == code] = i + 1
    return out


def _posterize_mask(codes: np.ndarray, mags: np.ndarray) -> np.ndarray:
    """torchvision's posterize mask of ``int(m)`` bits; 255 (the identity) for other operations."""
    bits = np.where(codes == _CODE["Posterize"], np.trunc(mags), 8).astype(np.int64)
    return (((1 << bits) - 1) << (8 - bits)).astype(np.int32)


def _solarize_from(codes: np.ndarray, mags: np.ndarray) -> np.ndarray:
    """The smallest value solarize inverts: torch compares a uint8 image with the float32
    threshold ``255 · m``, so ``v >= ceil(float32(255 · m))``; 0 for Invert, 256 (none) for other
    operations."""
    threshold = np.ceil((255.0 * mags).astype(np.float32)).astype(np.int32)
    return np.where(codes == _CODE["Solarize"], threshold, np.where(codes == _CODE["Invert"], 0, 256)).astype(np.int32)


def _tone(ctx: Ctx, img: Any, mask: Any, start: Any) -> Any:
    """``v & mask``, then ``v ≥ start → 255 − v`` (as ``v ^ 255``), on a uint8 image."""
    fn, types = ctx.fn, ctx.types
    x = fn.cast(img, dtype=types.INT32, device=ctx.device) & mask
    x = x ^ ((x >= start) * 255)
    return fn.cast(x, dtype=types.UINT8, device=ctx.device)


@LOWERINGS.register(T.TrivialAugmentWide, T.RandAugment, T.AutoAugment, unsupported=_unsupported)
def _policy(t: Any, img: Any, ctx: Ctx) -> Any:
    """Each slot in order (:func:`_slot`), from the host's draws."""
    if t.slots == 0:
        return img
    height, width = ctx.shape(img)
    if not all(isinstance(v, (int, HostValue)) for v in (height, width)):
        raise BackendUnavailableError(
            f"{type(t).__name__} on the DALI backend needs the image's size known outside the graph: put it after "
            "a step that fixes the size (a crop), or with apply_exif_orientation=False"
        )
    drawn = HostValue(lambda h, w, f: t.magnitudes(h, w, f), height, width, ctx.host_random())
    for slot in range(t.slots):
        img = _slot(t, img, ctx, drawn, slot, height, width)
    return img
