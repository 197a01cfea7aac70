"""The DALI backend's affine warps: ``RandomRotation`` and ``RandomAffine``, ``warp_affine`` by
inverse maps the host computes per sample (``gpupipe.core._geometry``), with torchvision's fill."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import transforms as T
from ...core._geometry import affine_matrices, rotation_matrices
from ._context import LOWERINGS, Ctx, dali_type
from ._host import HostValue
from ._lowerings import _host_size, in_float32

__all__ = ["warp", "PAD_FOR_ZEROS"]


def _warp_unsupported(t: T.RandomRotation | T.RandomAffine) -> str | None:
    if isinstance(t, T.RandomRotation) and t.expand:
        return "expand=True (a size per sample) runs on the torch backend only, for now"
    return None


@LOWERINGS.register(T.RandomRotation, unsupported=_warp_unsupported)
def _rotation(t: T.RandomRotation, img: Any, ctx: Ctx) -> Any:
    """``warp_affine`` with torchvision's inverse map (``gpupipe.core._geometry.rotation_matrices``),
    computed on the host from the image's size and the sample's angle."""
    height, width = _host_size(ctx, img, "RandomRotation")
    matrices = HostValue(lambda h, w, f: rotation_matrices(h, w, f[:, 0], t.center), height, width, ctx.host_random())
    return _warp(t, img, ctx, matrices, (height, width))


@LOWERINGS.register(T.RandomAffine, unsupported=_warp_unsupported)
def _affine(t: T.RandomAffine, img: Any, ctx: Ctx) -> Any:
    """``warp_affine`` with torchvision's inverse map (``gpupipe.core._geometry.affine_matrices``),
    computed on the host from the image's size and the sample's angle, translation (rounded to
    whole pixels as the torch backend rounds it), scale and shears."""
    height, width = _host_size(ctx, img, "RandomAffine")

    def matrices_of(h: Any, w: Any, f: np.ndarray) -> np.ndarray:
        translate = t.translation(h, w, f[:, 1], f[:, 2])
        return affine_matrices(h, w, f[:, 0], translate, f[:, 3], (f[:, 4], f[:, 5]), t.center)

    return _warp(t, img, ctx, HostValue(matrices_of, height, width, ctx.host_random()), (height, width))


def _warp(t: T.RandomRotation | T.RandomAffine, img: Any, ctx: Ctx, matrices: HostValue, size: tuple[Any, Any]) -> Any:
    """:func:`warp` of ``img`` (of ``size``) by per-sample ``[B, 6]`` host matrices."""
    return warp(ctx, img, matrices, t.fill, nearest=t.interpolation == T.InterpolationMode.NEAREST, size=size)


# Zeros outside, bilinear: DALI's ``fill_value`` (each tap outside is the fill) or, the same
# values, the image padded by one pixel of zeros and sampled with DALI's border clamp. On DALI's
# CPU kernels the clamp is much the faster: 176 x 176 RGB uint8, 1 thread, 0.97 ms per image
# with the pad against 1.45-1.53 ms with the fill (2026-11-26, DALI 2.4.0; torchvision's
# ``affine`` 0.61 ms). On a GPU the pad is one more launch: not yet measured there, so kept off.
PAD_FOR_ZEROS = {"cpu": True, "gpu": False}


def is_plain(fill: Any, *, nearest: bool) -> bool:
    """Whether :func:`warp` is DALI's ``warp_affine`` alone, with its own fill, in the image's
    dtype: no fill (zeros outside), or nearest neighbour with one value."""
    return fill is None or (nearest and len(set(fill if isinstance(fill, tuple) else (fill,))) == 1)


def warp(ctx: Ctx, img: Any, matrices: HostValue, fill: Any, *, nearest: bool, size: tuple[Any, Any]) -> Any:
    """``warp_affine`` by ``matrices`` (per-sample ``[B, 6]`` inverse maps on the host, fed as
    ``[2, 3]``; ``size`` the image's ``(height, width)``, ints or host values) with torchvision's
    fill: ``None`` (zeros sampled outside, as torchvision without a fill: the policies' default),
    one value, or one per channel. ``None``, or nearest neighbour with one value: DALI's own fill,
    the same as torchvision's. Otherwise the image is warped with an extra channel of ones (255 for
    uint8), which says where, and bilinear how much, the source covers, and the fill is put in as
    torchvision's ``_apply_grid_transform`` does: where that mask is below 0.5 (nearest), or
    ``(v − fill) · mask + fill`` rounded (bilinear). Bilinear with zeros outside pads the image
    with zeros on the CPU (:data:`PAD_FOR_ZEROS`)."""
    import nvidia.dali.math as dmath

    fn, types = ctx.fn, ctx.types
    if is_plain(fill, nearest=nearest):
        # torchvision without a fill samples zeros outside (as DALI's fill 0); nearest with one
        # value is DALI's own fill
        value = 0.0 if fill is None else float(fill[0] if isinstance(fill, tuple) else fill)
        return in_float32(ctx, img, lambda x: _warp_filled(ctx, x, matrices, size, nearest=nearest, value=value))
    if ctx.dtype not in (torch.uint8, torch.float32):  # float16 or float64: warped in float32, cast back below
        img = fn.cast(img, dtype=types.FLOAT, device=ctx.device)
    fills = tuple(fill) if isinstance(fill, tuple) else (float(fill),)
    uint8 = ctx.dtype == torch.uint8
    one = 255 if uint8 else 1.0
    channels = ctx.channels
    mask = fn.cast_like(img[:, :, 0:1] * 0 + one, img, device=ctx.device)  # (of img's own samples: a branch's)
    warped = _warp_filled(ctx, fn.cat(img, mask, axis=2, device=ctx.device), matrices, size, nearest=nearest)
    x = fn.cast(warped[:, :, 0:channels], dtype=types.FLOAT, device=ctx.device)
    cover = fn.cast(warped[:, :, channels:], dtype=types.FLOAT, device=ctx.device) * np.float32(1 / one)
    values = list(fills) * channels if len(fills) == 1 else list(fills)
    paint = ctx.channel_constant(values)
    if nearest:
        out = x + (cover < 0.5) * (paint - x)
    else:
        out = (x - paint) * cover + paint
        if uint8:
            out = dmath.floor(dmath.clamp(out + 0.5, 0.0, 255.0))
    return fn.cast(out, dtype=dali_type(ctx, ctx.dtype), device=ctx.device)


def _warp_filled(ctx: Ctx, img: Any, matrices: HostValue, size: tuple[Any, Any], *, nearest: bool,
                 value: float = 0.0) -> Any:  # fmt: skip
    """``warp_affine`` sampling ``value`` outside the image: DALI's ``fill_value`` or, bilinear
    on the CPU (:data:`PAD_FOR_ZEROS`), the image padded by a pixel of ``value`` each side and
    sampled with the border clamp by the maps shifted by that pixel, to its own ``size``."""
    fn, types = ctx.fn, ctx.types
    if nearest or not PAD_FOR_ZEROS[ctx.device]:  # (DALI's nearest neighbour is fast with its fill)
        interp = types.INTERP_NN if nearest else types.INTERP_LINEAR
        matrix = ctx.arg_matrices(matrices, np.float32)
        return fn.warp_affine(img, matrix=matrix, fill_value=value, interp_type=interp, device=ctx.device)
    height, width = size
    padded = fn.slice(img, start=[-1, -1], shape=ctx.arg_vector([height + 2, width + 2], np.int32), axis_names="HW",
                      out_of_bounds_policy="pad", fill_values=value, device=ctx.device)  # fmt: skip
    matrix = ctx.arg_matrices(HostValue(_shifted_by_one, matrices), np.float32)
    out_size = ctx.arg_vector([height, width], np.float32)
    return fn.warp_affine(padded, matrix=matrix, size=out_size, interp_type=types.INTERP_LINEAR, device=ctx.device)


def _shifted_by_one(m: np.ndarray) -> np.ndarray:
    """``[B, 6]`` inverse maps onto an image padded by one pixel each side: source + (1, 1)."""
    shifted = np.array(m, dtype=np.float64)
    shifted[:, 2] += 1.0
    shifted[:, 5] += 1.0
    return shifted
