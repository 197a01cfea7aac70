"""The DALI backend's photometric lowerings: ColorJitter, RandomGrayscale, GaussianBlur,
RandomSolarize, RandomInvert, RandomPosterize, RandomAutocontrast, RandomAdjustSharpness,
RandomEqualize and RandomApply.

``ColorJitter`` follows torchvision's kernels (``torchvision.transforms.v2.functional``), written
as DALI arithmetic on the image's channels, per sample:

- brightness: ``x * f``; saturation: a blend with the image's luma (0.2989 R + 0.587 G + 0.114 B,
  floored for uint8); contrast: a blend with the mean of that luma over the image; each clamped to
  the dtype's range and, for uint8, truncated as torch's ``.to(torch.uint8)`` does;
- hue: RGB → HSV, the hue shifted by the factor (modulo 1), HSV → RGB, as torchvision's
  ``_rgb_to_hsv``/``_hsv_to_rgb`` (uint8 through float32, back with ``to_dtype``'s rounding).

The adjustments run in the fixed order brightness, contrast, saturation, hue, not in the drawn
order: brightness, contrast and saturation commute (up to rounding and clamping), so the
difference from torchvision is where hue falls in the drawn order (measured in the tests).
DALI's ``color_twist`` (``DaliOptions(color_twist=True)``: faster) rounds where torch truncates,
pivots contrast on mid-grey and rotates hue in YIQ space (10 grey levels apart on average at hue
0.1, measured).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import transforms as T
from ...transforms._apply import RandomChoice as SampleChoice
from .._registry import inner_unsupported
from ._context import LOWERINGS, Ctx, dali_type, scaled_to_uint8, to_float, where
from ._host import HostValue
from ._lowerings import in_float32

__all__: list[str] = []

_LUMA = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale weights


# ----------------------------------------------------------------- ColorJitter --


def luma(ctx: Ctx, x: Any) -> Any:
    """torchvision's grayscale of an HWC image (uint8, or float32 on the image's scale) as float32
    ``[H, W, 1]``, floored for a uint8 image (its ``.to(uint8)``); a 1-channel image as it is.
    One ``coord_transform``, where torchvision's three products and two sums would take eight
    operators; its sums' rounding may differ in the last bit (a grey level apart on up to 0.3% of
    a uint8 image's pixels, measured against torchvision's Color operation on 2026-11-25)."""
    from nvidia.dali import math as dmath

    fn, float32 = ctx.fn, ctx.types.FLOAT
    if ctx.channels == 1:
        return fn.cast(x, dtype=float32, device=ctx.device)
    gray = fn.coord_transform(x, M=list(_LUMA), dtype=float32, device=ctx.device)
    return dmath.floor(gray) if ctx.dtype == torch.uint8 else gray


def _blend(ctx: Ctx, x: Any, other: Any, ratio: Any) -> Any:
    """torchvision's ``_blend``, then the ``.to(uint8)`` between two adjustments (the integer
    part) for a uint8 image: ``clamp(ratio * x + (1 - ratio) * other, 0, bound)``; ``other``
    ``None``: black (brightness)."""
    from nvidia.dali import math as dmath

    mixed = x * ratio if other is None else x * ratio + other * (1.0 - ratio)
    out = dmath.clamp(mixed, 0.0, 255.0 if ctx.dtype == torch.uint8 else 1.0)
    return dmath.floor(out) if ctx.dtype == torch.uint8 else out


# Where hue's arithmetic takes the three channels together (``[H, W, 3]`` nodes against
# ``[H, W, 1]``: 41 operators) or one by one (``[H, W]`` nodes: 72), by device. A GPU launches
# each operator, so fewer is faster there (not yet measured); DALI's CPU kernels broadcast and
# reduce over the channels slowly (ColorJitter's train recipe 152-169 images/s together against
# 190-191 one by one, 2 cores, 2026-11-26). The tests run both on the CPU.
HUE_CHANNELS_TOGETHER = {"gpu": True, "cpu": False}


def _hue(ctx: Ctx, x: Any, shift: Any) -> Any:
    """torchvision's ``adjust_hue_image`` on a float32 HWC image (0..255 for a uint8 image), in
    closed form: with ``v``/``m`` the channels' max/min, ``6h`` is ``_rgb_to_hsv``'s sector
    formula, shifted by ``6 * shift`` modulo 6, and ``_hsv_to_rgb``'s table is
    ``v - (v - m) * clamp(min(k, 4 - k), 0, 1)`` with ``k = (6h + n) mod 6`` for n = 5, 3, 1 (R, G,
    B; ``v * s = v - m``). A float image may hold values outside [0, 1] (after ``Normalize``):
    there torchvision's ``s = (v - m) / v`` and its clamping of ``p``, ``q``, ``t`` to [0, 1]
    (``v`` itself unclamped) are followed exactly. The channels go through the nodes together or
    one by one (:data:`HUE_CHANNELS_TOGETHER`), with the same values."""
    from nvidia.dali import math as dmath

    if ctx.dtype == torch.uint8:
        x = x * (1.0 / 255.0)
    together = HUE_CHANNELS_TOGETHER[ctx.device]
    v, span, h6 = (_sector_together if together else _sector_per_channel)(ctx, x)
    h6 = h6 + (shift * 6.0 + 6.0)  # torchvision: fmod(h + 1, 1), then (h + shift) mod 1
    h6 = h6 - dmath.floor(h6 * (1.0 / 6.0)) * 6.0
    saturation = None if ctx.dtype == torch.uint8 else span / where(span == 0.0, 1.0, v)

    def channel(k: Any) -> Any:  # the output channel(s) whose hsv_to_rgb offset gave ``k``
        k = k - (k >= 6.0) * 6.0
        share = dmath.clamp(dmath.min(k, 4.0 - k), 0.0, 1.0)  # 0: v, 1: p, else q or t
        if saturation is None:  # uint8: every value in range
            return v - span * share
        clamped = dmath.clamp(v * (1.0 - saturation * share), 0.0, 1.0)
        return clamped + (share == 0.0) * (v - clamped)

    if together:
        out = channel(h6 + _per_channel(ctx, (5.0, 3.0, 1.0)))
    else:
        out = ctx.fn.stack(*(channel(h6 + n) for n in (5.0, 3.0, 1.0)), axis=2, axis_name="C")
    return scaled_to_uint8(out) if ctx.dtype == torch.uint8 else out  # torchvision's to_dtype back


def _sector_per_channel(ctx: Ctx, x: Any) -> tuple[Any, Any, Any]:
    """``(v, v - m, 6h)`` before the shift, ``[H, W]`` each, from the channels one by one:
    torchvision's sector (the first channel at the max, in R, G, B order) and its formula."""
    from nvidia.dali import math as dmath

    r, g, b = x[:, :, 0], x[:, :, 1], x[:, :, 2]
    v, m = dmath.max(dmath.max(r, g), b), dmath.min(dmath.min(r, g), b)
    span = v - m
    not_r = v != r
    is_r, is_g, is_b = v == r, (v == g) & not_r, (v != g) & not_r
    inv = 1.0 / (span + (span == 0.0))  # eqc: any divisor; the sector terms are 0 there
    return v, span, ((g - b) * is_r + (b - r) * is_g + (r - g) * is_b) * inv + is_g * 2.0 + is_b * 4.0


def _sector_together(ctx: Ctx, x: Any) -> tuple[Any, Any, Any]:
    """:func:`_sector_per_channel`'s values, ``[H, W, 1]`` each, from ``[H, W, 3]`` nodes: ``v``
    and ``m`` reductions over the channels, the three differences one ``coord_transform``, the
    sector a mask of the channels at the max with none at the max before them, and its term
    summed out by a ``coord_transform`` of ones (the other two terms are 0: the sum is the term,
    exactly)."""
    fn = ctx.fn
    v = fn.reductions.max(x, axes=[2], keep_dims=True, device=ctx.device)
    span = v - fn.reductions.min(x, axes=[2], keep_dims=True, device=ctx.device)
    top = x == v
    before = fn.coord_transform(fn.cast(top, dtype=ctx.types.FLOAT, device=ctx.device), M=[0, 0, 0, 1, 0, 0, 1, 1, 0],
                                device=ctx.device)  # fmt: skip
    sector = top & (before == 0.0)
    inv = 1.0 / (span + (span == 0.0))  # eqc: any divisor; the sector terms are 0 there
    diffs = fn.coord_transform(x, M=[0, 1, -1, -1, 0, 1, 1, -1, 0], device=ctx.device)  # g - b, b - r, r - g
    terms = (diffs * inv + _per_channel(ctx, (0.0, 2.0, 4.0))) * sector
    return v, span, fn.coord_transform(terms, M=[1, 1, 1], device=ctx.device)


def _per_channel(ctx: Ctx, values: tuple[float, ...]) -> Any:
    """A float32 constant ``[C]`` for the image's channels (a branch's samples, inside one)."""
    if not ctx.branch:
        return ctx.types.Constant(np.array(values, np.float32))
    return ctx.local(ctx.fn.constant(fdata=list(values), shape=[len(values)]))


@LOWERINGS.register(T.ColorJitter)
def _color_jitter(t: T.ColorJitter, img: Any, ctx: Ctx) -> Any:
    """torchvision's four adjustments with the drawn factors, in the fixed order brightness,
    contrast, saturation, hue (module docstring); float32 arithmetic on the whole HWC image,
    channel by channel only for hue."""
    fn = ctx.fn
    if ctx.color_twist:
        return _color_twist(t, img, ctx)
    x = to_float(ctx, img)
    if t.brightness is not None:
        x = _blend(ctx, x, None, ctx.factor(4))
    if t.contrast is not None:
        x = _blend(ctx, x, fn.reductions.mean(luma(ctx, x)), ctx.factor(5))
    if t.saturation is not None and ctx.channels == 3:
        x = _blend(ctx, x, luma(ctx, x), ctx.factor(6))
    if t.hue is not None and ctx.channels == 3:
        x = _hue(ctx, x, ctx.factor(7))
    return fn.cast(x, device=ctx.device, dtype=dali_type(ctx, ctx.dtype))


def _color_twist(t: T.ColorJitter, img: Any, ctx: Ctx) -> Any:
    """``DaliOptions(color_twist=True)``: the drawn factors applied by one ``color_twist`` (hue in
    degrees); faster, not torchvision's kernels (module docstring)."""

    def factor(i: int, r: tuple[float, float] | None, neutral: float, scale: float = 1.0) -> Any:
        return neutral if r is None else ctx.arg(ctx.host_random()[4 + i] * scale, np.float32)

    return ctx.fn.color_twist(
        img,
        device=ctx.device,
        brightness=factor(0, t.brightness, 1.0),
        contrast=factor(1, t.contrast, 1.0),
        saturation=factor(2, t.saturation, 1.0),
        hue=factor(3, t.hue, 0.0, 360.0),
    )


# ----------------------------------------------------------- the other colours --


@LOWERINGS.register(T.RandomGrayscale)
def _grayscale(t: T.RandomGrayscale, img: Any, ctx: Ctx) -> Any:
    keep = ctx.arg(1.0 - ctx.host_random()[0], np.float32)
    dtype = dali_type(ctx, torch.float32 if ctx.dtype == torch.float64 else ctx.dtype)  # (hsv's default: uint8)
    return in_float32(ctx, img, lambda x: ctx.fn.hsv(x, device=ctx.device, saturation=keep, dtype=dtype),
                      takes=(torch.uint8, torch.float16, torch.float32))  # (hsv takes no float64)  # fmt: skip


@LOWERINGS.register(T.GaussianBlur)
def _gaussian_blur(t: T.GaussianBlur, img: Any, ctx: Ctx) -> Any:
    kx, ky = t.kernel_size
    return ctx.fn.gaussian_blur(img, device=ctx.device, window_size=[ky, kx], sigma=ctx.factor(0))


def _select(ctx: Ctx, decision: Any, a: Any, b: Any) -> Any:
    """Per sample ``a if decision else b`` (``decision``: int32 0/1 per sample; ``a`` and ``b``
    HWC images of the same shape): ``b`` and ``a`` (cast like ``b``) stacked, and the sample's one
    sliced out — exact for every dtype, and three copies where arithmetic blending takes more
    passes (DALI 2.4 has no per-sample select outside its conditionals)."""
    fn, types = ctx.fn, ctx.types
    both = fn.stack(b, fn.cast_like(a, b, device=ctx.device), device=ctx.device)
    length = ctx.local(fn.constant(idata=[1], dtype=types.INT32))  # (a branch's samples, inside one)
    one = fn.slice(both, fn.stack(decision), length, axes=[0], device=ctx.device)
    return fn.reshape(fn.squeeze(one, axes=[0], device=ctx.device), layout="HWC", device=ctx.device)


@LOWERINGS.register(T.RandomSolarize)
def _solarize(t: T.RandomSolarize, img: Any, ctx: Ctx) -> Any:
    """torchvision's solarize (``v >= threshold`` → ``bound - v``): a lookup table on uint8
    images, arithmetic on float ones (float16 in float32: DALI's arithmetic has no float16); the
    sample's decision then selects it or the input."""
    fn, types = ctx.fn, ctx.types
    if ctx.dtype == torch.uint8:
        threshold = float(np.float32(t.threshold))  # torch compares uint8 with a float32 threshold
        values = [float(255 - v if v >= threshold else v) for v in range(256)]
        solarized = fn.lookup_table(img, device=ctx.device, keys=list(range(256)), values=values, dtype=types.UINT8)
    else:
        x = to_float(ctx, img) if ctx.dtype == torch.float16 else img
        solarized = where(x >= t.threshold, 1.0 - x, x)
    return _select(ctx, ctx.decision(), solarized, img)


def _lookup(ctx: Ctx, img: Any, table: Any) -> Any:
    """A uint8 image through a 256-entry table (exact)."""
    values = [float(table(v)) for v in range(256)]
    return ctx.fn.lookup_table(img, device=ctx.device, keys=list(range(256)), values=values, dtype=ctx.types.UINT8)


@LOWERINGS.register(T.RandomInvert)
def _invert(t: T.RandomInvert, img: Any, ctx: Ctx) -> Any:
    """``255 - v`` through a table (uint8), ``1 - v`` (float); the decision selects."""
    if ctx.dtype == torch.uint8:
        inverted = _lookup(ctx, img, lambda v: 255 - v)
    else:
        inverted = 1.0 - (to_float(ctx, img) if ctx.dtype == torch.float16 else img)
    return _select(ctx, ctx.decision(), inverted, img)


@LOWERINGS.register(T.RandomPosterize)
def _posterize(t: T.RandomPosterize, img: Any, ctx: Ctx) -> Any:
    """``v & mask`` through a table (uint8), ``floor(v · levels)`` clamped, over levels (float)."""
    import nvidia.dali.math as dmath

    if ctx.dtype == torch.uint8:
        mask = ((1 << t.bits) - 1) << (8 - t.bits)
        posterized = _lookup(ctx, img, lambda v: v & mask)
    else:
        levels = float(1 << t.bits)
        x = to_float(ctx, img) if ctx.dtype == torch.float16 else img
        posterized = dmath.clamp(dmath.floor(x * levels), 0.0, levels - 1) * (1.0 / levels)
    return _select(ctx, ctx.decision(), posterized, img)


@LOWERINGS.register(T.RandomAutocontrast)
def _autocontrast(t: T.RandomAutocontrast, img: Any, ctx: Ctx) -> Any:
    """:func:`autocontrasted`; the coin selects."""
    return _select(ctx, ctx.decision(), autocontrasted(ctx, img), img)


def _reducible(ctx: Ctx, img: Any) -> Any:
    """``img`` as DALI's reductions and filter take it: uint8 and float32 as they are, float16 and
    float64 (which they do not take) in float32."""
    if ctx.dtype in (torch.float16, torch.float64):
        return ctx.fn.cast(img, dtype=ctx.types.FLOAT, device=ctx.device)
    return img


def autocontrasted(ctx: Ctx, img: Any) -> Any:
    """torchvision's autocontrast in float32: each channel's min and max over the image, ``(v −
    min) / ((max − min) · (1 / bound))`` clamped to ``[0, bound]`` (a flat channel: min 0, scale
    1), floored back to uint8 (``.to(uint8)`` truncates; the values are not negative)."""
    import nvidia.dali.math as dmath

    fn, types = ctx.fn, ctx.types
    bound = 255.0 if ctx.dtype == torch.uint8 else 1.0
    x = _reducible(ctx, img)  # uint8 stays uint8 up to the division (DALI promotes it there, exactly as a cast would)
    low = fn.reductions.min(x, axis_names="HW", keep_dims=True, device=ctx.device)
    high = fn.reductions.max(x, axis_names="HW", keep_dims=True, device=ctx.device)
    flat = high == low  # a flat channel: torchvision's min 0 and scale 1, which give its value back
    inv_scale = (high - low) * np.float32(1.0 / bound)  # 0 where flat, so + flat is exactly 1 there
    out = (x - low) / (inv_scale + flat) + flat * low  # x - low is 0 where flat; + 0 elsewhere
    if ctx.dtype == torch.uint8:  # [0, 255] but for rounding above: the saturating cast clamps
        return fn.cast(dmath.floor(out), dtype=types.UINT8, device=ctx.device)
    return dmath.clamp(out, 0.0, bound)


_A, _B = np.float32(1.0 / 13.0), np.float32(5.0 / 13.0)
_SMOOTH = np.array([[_A, _A, _A], [_A, _B, _A], [_A, _A, _A]], np.float32)  # torchvision's float32 kernel


@LOWERINGS.register(T.RandomAdjustSharpness)
def _sharpness(t: T.RandomAdjustSharpness, img: Any, ctx: Ctx) -> Any:
    """:func:`sharpened` by ``1 - sharpness_factor``; the coin selects."""
    return _select(ctx, ctx.decision(), sharpened(ctx, img, float(np.float32(1.0 - t.sharpness_factor))), img)


def sharpened(ctx: Ctx, img: Any, alpha: Any) -> Any:
    """torchvision's adjust_sharpness with ``alpha = 1 - sharpness_factor`` (a number, or a
    float32 per-sample argument): the 3x3 smoothing (``filter``; rounded for uint8)
    blended into the interior — a mask of the interior (ones of ``(h - 2, w - 2)`` padded by a
    pixel of zeros) keeps the border — clamped, floored back to uint8. ``alpha`` 0 keeps every
    value exactly."""
    import nvidia.dali.math as dmath

    fn, types = ctx.fn, ctx.types
    bound = 255.0 if ctx.dtype == torch.uint8 else 1.0
    height, width = ctx.shape(img)
    ops = ctx.ops(height, width)
    x = _reducible(ctx, img)  # uint8 stays uint8: DALI promotes it to float32 where it meets the float smoothing
    kernel = ctx.local(fn.constant(fdata=_SMOOTH.ravel().tolist(), shape=[3, 3]))  # (a branch's samples, inside one)
    if ctx.dtype == torch.uint8:
        # filtered in uint8: DALI rounds half away from zero where torch rounds half to even, but
        # (8 neighbours + 5 · centre) / 13 of integers is never a half, float32 error included
        smooth = fn.cast(fn.filter(img, kernel, border="clamp", device=ctx.device), dtype=types.FLOAT,
                         device=ctx.device)  # fmt: skip
    else:
        smooth = fn.filter(x, kernel, border="clamp", device=ctx.device)
    one = height * 0 + 1  # (of the image's own batch: a constant would be of the whole batch, not a branch's)
    inner = ctx.arg_vector([ops.max(height - 2, 0), ops.max(width - 2, 0), one], np.int32)
    mask = fn.slice(fn.ones(shape=inner, dtype=types.FLOAT, device="cpu"), start=[-1, -1],
                    shape=ctx.arg_vector([height, width], np.int32), axes=[0, 1], out_of_bounds_policy="pad",
                    fill_values=0.0)  # fmt: skip
    if ctx.device == "gpu":
        mask = mask.gpu()
    out = x + mask * (alpha * (smooth - x))
    if ctx.dtype == torch.uint8:  # the floor, then the saturating cast: torch's clamp and .to(uint8)
        return fn.cast(dmath.floor(out), dtype=types.UINT8, device=ctx.device)
    return dmath.clamp(out, 0.0, bound)


@LOWERINGS.register(T.RandomEqualize)
def _equalize(t: T.RandomEqualize, img: Any, ctx: Ctx) -> Any:
    """DALI's ``equalize`` (OpenCV's table, not PIL's: see RandomEqualize), a float image through
    uint8 and back as torchvision does; the coin selects."""
    fn, types = ctx.fn, ctx.types
    if ctx.dtype == torch.uint8:
        return _select(ctx, ctx.decision(), fn.equalize(img, device=ctx.device), img)
    x = to_float(ctx, img) if ctx.dtype == torch.float16 else img
    as_uint8 = fn.cast(scaled_to_uint8(x), dtype=types.UINT8, device=ctx.device)
    equalized = fn.cast(fn.equalize(as_uint8, device=ctx.device), dtype=types.FLOAT, device=ctx.device) / 255.0
    return _select(ctx, ctx.decision(), equalized, img)


@LOWERINGS.register(T.RandomApply, unsupported=lambda t: inner_unsupported(LOWERINGS, t.transforms))
def _random_apply(t: T.RandomApply, img: Any, ctx: Ctx) -> Any:
    """The inner transforms run on every sample, each with its slice of the step's factors; the
    decision (factor 0) then selects, per sample, their output or the input (both of the image's
    shape and dtype: ``RandomApply.output_spec``)."""
    out = img
    for inner, (start, stop) in zip(t.transforms, t.factor_slices, strict=True):
        with ctx.scoped_factors(start, stop):
            out = LOWERINGS.lookup(inner)(inner, out, ctx)
    return _select(ctx, ctx.decision(), out, img)


@LOWERINGS.register(SampleChoice, unsupported=lambda t: inner_unsupported(LOWERINGS, t.transforms))
def _random_choice(t: SampleChoice, img: Any, ctx: Ctx) -> Any:
    """Each transform in a conditional branch of the samples that chose it (factor 0; DALI's
    ``split``/``merge``), with its slice of the step's factors: each sample pays for its own."""
    fn, choice = ctx.fn, ctx.host_random()[0]
    for k, (inner, (start, stop)) in enumerate(zip(t.transforms, t.factor_slices, strict=True)):
        predicate = ctx.arg(choice == k, np.bool_)
        inside, outside = fn._conditional.split(img, predicate=predicate)
        with ctx.branched(predicate), ctx.scoped_factors(start, stop):
            out = LOWERINGS.lookup(inner)(inner, inside, ctx)
        img = fn._conditional.merge(out, outside, predicate=predicate)  # (one dtype: output_spec)
    return img


# ------------------------------------------------------ RandomPhotometricDistort --


@LOWERINGS.register(T.RandomPhotometricDistort)
def _photometric(t: T.RandomPhotometricDistort, img: Any, ctx: Ctx) -> Any:
    """torchvision's order with ``ColorJitter``'s kernels: brightness, contrast (where drawn
    before), saturation, hue, contrast (where drawn after), each with an identity factor where the
    sample's coin said no (a blend of ratio 1 is the image, exactly; hue is selected per sample,
    its round trip not being one), then the channels permuted by a per-sample 0/1 matrix
    (``coord_transform``, exact)."""
    fn, f = ctx.fn, ctx.host_random()

    def factor(column: int, identity: float, unless: Any = None) -> Any:
        def value(a: np.ndarray) -> np.ndarray:
            off = np.isnan(a[:, column]) if unless is None else np.isnan(a[:, column]) | unless(a)
            return np.where(off, identity, a[:, column])

        return ctx.arg(HostValue(value, f), np.float32)

    x = to_float(ctx, img)
    x = _blend(ctx, x, None, factor(0, 1.0))
    x = _blend(ctx, x, fn.reductions.mean(luma(ctx, x)), factor(1, 1.0, lambda a: a[:, 4] == 0))
    if ctx.channels == 3:
        x = _blend(ctx, x, luma(ctx, x), factor(2, 1.0))
        hued = ctx.arg(HostValue(lambda a: (~np.isnan(a[:, 3])).astype(np.float32), f), np.float32)
        x = where(hued, _hue(ctx, x, factor(3, 0.0)), x)
    x = _blend(ctx, x, fn.reductions.mean(luma(ctx, x)), factor(1, 1.0, lambda a: a[:, 4] != 0))
    if ctx.channels != 3:
        return fn.cast(x, device=ctx.device, dtype=dali_type(ctx, ctx.dtype))

    def matrices(a: np.ndarray) -> np.ndarray:
        order = np.where(a[:, 5:6] != 0, a[:, 6:9], np.arange(3.0)).astype(np.int64)  # identity where off
        return np.eye(3, dtype=np.float32)[order].reshape(len(a), 9)  # row c picks channel order[c]

    m = fn.reshape(ctx.arg_vector([HostValue(lambda a, k=k: matrices(a)[:, k], f) for k in range(9)], np.float32),
                   shape=[3, 3])  # fmt: skip
    permuted = fn.coord_transform(x, M=m, dtype=ctx.types.FLOAT, device=ctx.device)  # (it takes no float16)
    return fn.cast(permuted, device=ctx.device, dtype=dali_type(ctx, ctx.dtype))
