"""The DALI backend's compiler: transform definitions → one DALI graph.

Images flow through the graph as HWC uint8 (DALI's layout), on the CPU (``device="cpu"``, DALI CPU
operators) or the GPU (``device="gpu"``, after nvJPEG's ``mixed`` decoder). Compilation:

1. Decode. A leading ``RandomResizedCrop`` is fused into it: ``decoders.image_random_crop`` decodes
   only the region it draws (region-of-interest decode), then ``resize`` scales it.
2. Tail fusion. A final run of ``CenterCrop`` / ``RandomHorizontalFlip`` / ``ToDtype(float)`` /
   ``Normalize`` becomes one ``crop_mirror_normalize``, which also writes CHW.
3. Every other transform goes through :data:`LOWERINGS` (transform type → lowering function).

Geometry follows torchvision exactly: sizes after ``Resize(int)`` and center-crop offsets are
computed in the graph with torchvision's integer rules (DALI's ``resize_shorter`` and crop
positions round differently). DALI is imported only when a graph is built.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ... import transforms as T
from ..._registry import Registry

__all__ = ["LOWERINGS", "Ctx", "lower"]

LOWERINGS = Registry("dali")

_FLOAT_OUT = {torch.float32: "FLOAT", torch.float16: "FLOAT16"}


@dataclasses.dataclass
class Ctx:
    """What a lowering function needs: the device its operators run on and a seed source."""

    device: str  # "cpu" or "gpu"
    seed: int
    dtype: torch.dtype = torch.uint8  # dtype of the node being lowered
    _seeds: Any = None

    def __post_init__(self) -> None:
        self._seeds = itertools.count(1)

    def next_seed(self) -> int:
        """A distinct, reproducible seed for each random operator of the graph."""
        return (self.seed * 1_000_003 + next(self._seeds) * 7_919) % (2**31 - 1)

    @property
    def decoder_device(self) -> str:
        """nvJPEG's ``mixed`` decoder feeds the GPU; DALI's CPU decoder the CPU."""
        return "mixed" if self.device == "gpu" else "cpu"

    @property
    def fn(self) -> Any:
        from nvidia.dali import fn

        return fn

    @property
    def types(self) -> Any:
        from nvidia.dali import types

        return types


def _interp(ctx: Ctx, mode: T.InterpolationMode) -> Any:
    it = ctx.types.DALIInterpType
    return {T.InterpolationMode.BILINEAR: it.INTERP_LINEAR, T.InterpolationMode.BICUBIC: it.INTERP_CUBIC,
            T.InterpolationMode.NEAREST: it.INTERP_NN, T.InterpolationMode.NEAREST_EXACT: it.INTERP_NN}[mode]


def _resize(ctx: Ctx, img: Any, h: Any, w: Any, interpolation: T.InterpolationMode, antialias: bool) -> Any:
    types = ctx.types
    return ctx.fn.resize(img, device=ctx.device, resize_x=w, resize_y=h, interp_type=_interp(ctx, interpolation),
                         antialias=antialias, dtype=types.UINT8 if ctx.dtype == torch.uint8 else types.FLOAT)


def _hw(img: Any) -> tuple[Any, Any]:
    from nvidia.dali import types

    shape = img.shape(dtype=types.INT32, device="cpu")
    return shape[0], shape[1]


def _to_float(ctx: Ctx, value: Any) -> Any:
    return ctx.fn.cast(value, dtype=ctx.types.FLOAT)


def _where(cond: Any, a: Any, b: Any) -> Any:
    """Per-sample ``a if cond else b`` in DALI arithmetic (``cond`` a boolean node)."""
    return cond * a + (1 - cond) * b


def lower(transforms: Sequence[T.Transform], encoded: Any, ctx: Ctx, *, channels_last: bool = False) -> Any:
    """Builds the graph for ``transforms`` on ``encoded`` images; returns ``[C, H, W]`` (or HWC
    where ``channels_last``) images."""
    fn, types = ctx.fn, ctx.types
    steps = list(transforms)
    if steps and type(steps[0]) is T.RandomResizedCrop:
        t = steps.pop(0)
        img = decode_random_crop(t, encoded, ctx)
        img = _resize(ctx, img, float(t.size[0]), float(t.size[1]), t.interpolation, t.antialias)
    else:
        img = fn.decoders.image(encoded, device=ctx.decoder_device, output_type=types.RGB)
    tail = _fusable_tail(steps)
    for t in steps[: len(steps) - len(tail)]:
        img = LOWERINGS.lookup(t)(t, img, ctx)
        ctx.dtype = t.output_spec(T.ImageSpec(dtype=ctx.dtype)).dtype
    if tail:
        return _crop_mirror_normalize(tail, img, ctx, channels_last=channels_last)
    return img if channels_last else fn.transpose(img, device=ctx.device, perm=[2, 0, 1], output_layout="CHW")


# ------------------------------------------------------------------------ fusion --


def decode_random_crop(t: T.RandomResizedCrop, encoded: Any, ctx: Ctx) -> Any:
    """The crop window of ``t``, drawn and decoded at once (only that region is decoded)."""
    return ctx.fn.decoders.image_random_crop(encoded, device=ctx.decoder_device,
                                             output_type=ctx.types.RGB, random_area=list(t.scale),
                                             random_aspect_ratio=list(t.ratio), num_attempts=10,
                                             seed=ctx.next_seed())


def _fusable_tail(steps: list[T.Transform]) -> list[T.Transform]:
    """The longest suffix shaped ``[CenterCrop] [RandomHorizontalFlip] ToDtype(float) [Normalize]``."""
    pattern = [T.CenterCrop, T.RandomHorizontalFlip, T.ToDtype, T.Normalize]
    i, tail = len(steps), []
    for kind in reversed(pattern):
        if i and type(steps[i - 1]) is kind:
            i -= 1
            tail.insert(0, steps[i])
    dtype_steps = [t for t in tail if isinstance(t, T.ToDtype)]
    if not dtype_steps or dtype_steps[0].dtype not in _FLOAT_OUT:
        return []
    return tail


def _center_crop_anchor(size: Any, crop: int) -> Any:
    """torchvision's anchor in DALI integer arithmetic: ``round((size - crop) / 2)`` with Python's
    round-half-to-even, or ``-((crop - size) // 2)`` where the image is smaller than the crop."""
    d = size - crop
    q = d // 2  # floor; an odd d is a .5 tie, rounded up only when q is odd (to the even neighbour)
    return _where(d >= 0, q + (d & 1) * (q & 1), -((crop - size) // 2))


def _crop_mirror_normalize(tail: list[T.Transform], img: Any, ctx: Ctx, *, channels_last: bool) -> Any:
    fn, types = ctx.fn, ctx.types
    kwargs: dict[str, Any] = {}
    for t in tail:
        if isinstance(t, T.CenterCrop):
            h, w = _hw(img)
            top, left = _center_crop_anchor(h, t.size[0]), _center_crop_anchor(w, t.size[1])
            # crop_pos_x/y are relative: anchor = pos * (W - crop_w), which gives back the exact
            # integer anchor, inside the image or in the padding (tested against torchvision).
            kwargs.update(crop=list(t.size), out_of_bounds_policy="pad", fill_values=0.0,
                          crop_pos_y=_relative(ctx, top, h - t.size[0]), crop_pos_x=_relative(ctx, left, w - t.size[1]))
        elif isinstance(t, T.RandomHorizontalFlip):
            kwargs["mirror"] = fn.random.coin_flip(probability=t.p, seed=ctx.next_seed())
    to_dtype = next(t for t in tail if isinstance(t, T.ToDtype))
    norm = next((t for t in tail if isinstance(t, T.Normalize)), None)
    scale = 255.0 if to_dtype.scale and ctx.dtype == torch.uint8 else 1.0
    mean = [m * scale for m in norm.mean] if norm else [0.0]
    std = [s * scale for s in norm.std] if norm else [scale]
    return fn.crop_mirror_normalize(img, device=ctx.device, dtype=getattr(types, _FLOAT_OUT[to_dtype.dtype]),
                                    output_layout="HWC" if channels_last else "CHW", mean=mean, std=std, **kwargs)


def _relative(ctx: Ctx, anchor: Any, room: Any) -> Any:
    """``anchor / room`` as crop_mirror_normalize's relative position; with no room the anchor is 0."""
    return _to_float(ctx, anchor) / _to_float(ctx, _where(room == 0, 1, room))


# -------------------------------------------------------------------- lowerings --


@LOWERINGS.register(T.RandomResizedCrop)
def _random_resized_crop(t: T.RandomResizedCrop, img: Any, ctx: Ctx) -> Any:
    return ctx.fn.random_resized_crop(img, device=ctx.device, size=list(t.size), random_area=list(t.scale),
                                      random_aspect_ratio=list(t.ratio), num_attempts=10,
                                      interp_type=_interp(ctx, t.interpolation), antialias=t.antialias,
                                      seed=ctx.next_seed())


@LOWERINGS.register(T.Resize)
def _resize_lowering(t: T.Resize, img: Any, ctx: Ctx) -> Any:
    if t.size is not None and len(t.size) == 2:
        return _resize(ctx, img, float(t.size[0]), float(t.size[1]), t.interpolation, t.antialias)
    h, w = _hw(img)
    from nvidia.dali import math as dmath

    short, long = dmath.min(h, w), dmath.max(h, w)
    if t.size is None:
        new_short, new_long = (t.max_size * short) // long, long * 0 + t.max_size
    else:
        new_short, new_long = short * 0 + t.size[0], (t.size[0] * long) // short
        if t.max_size is not None:
            over = new_long > t.max_size
            new_short = _where(over, (t.max_size * new_short) // new_long, new_short)
            new_long = _where(over, t.max_size, new_long)
    portrait = w <= h  # torchvision: (new_w, new_h) = (short, long) if w <= h else (long, short)
    new_h = _where(portrait, new_long, new_short)
    new_w = _where(portrait, new_short, new_long)
    return _resize(ctx, img, _to_float(ctx, new_h), _to_float(ctx, new_w), t.interpolation, t.antialias)


def _slice(ctx: Ctx, img: Any, top: Any, left: Any, h: int, w: int, fill: Any = 0.0) -> Any:
    fn = ctx.fn
    anchor = fn.stack(top, left)
    return fn.slice(img, anchor, fn.constant(idata=[h, w], dtype=ctx.types.INT32), device=ctx.device,
                    axis_names="HW", out_of_bounds_policy="pad", fill_values=fill)


@LOWERINGS.register(T.CenterCrop)
def _center_crop(t: T.CenterCrop, img: Any, ctx: Ctx) -> Any:
    h, w = _hw(img)
    return _slice(ctx, img, _center_crop_anchor(h, t.size[0]), _center_crop_anchor(w, t.size[1]), *t.size)


def _random_crop_unsupported(t: T.RandomCrop) -> str | None:
    if t.padding_mode != "constant" and (t.padding or t.pad_if_needed):
        return f"padding_mode={t.padding_mode!r} (DALI pads with constants only); use padding_mode='constant'"
    return None


@LOWERINGS.register(T.RandomCrop, unsupported=_random_crop_unsupported)
def _random_crop(t: T.RandomCrop, img: Any, ctx: Ctx) -> Any:
    from nvidia.dali import math as dmath

    fn = ctx.fn
    h, w = _hw(img)
    left, top, right, bottom = t.padding or (0, 0, 0, 0)
    ch, cw = t.size

    def axis(size: Any, before: int, after: int, crop: int) -> Any:
        padded = size + before + after
        if t.pad_if_needed:
            diff = dmath.max(crop - padded, 0)
            before, padded = diff + before, padded + 2 * diff
        u = fn.random.uniform(range=[0.0, 1.0], seed=ctx.next_seed())
        room = padded - crop + 1  # crop start uniform in [0, room); negative room: image too small
        start = fn.cast(dmath.floor(u * _to_float(ctx, room)), dtype=ctx.types.INT32)
        return dmath.min(start, room - 1) - before

    fill = list(t.fill) if isinstance(t.fill, tuple) else float(t.fill)
    return _slice(ctx, img, axis(h, top, bottom, ch), axis(w, left, right, cw), ch, cw, fill)


@LOWERINGS.register(T.RandomHorizontalFlip)
def _hflip(t: T.RandomHorizontalFlip, img: Any, ctx: Ctx) -> Any:
    return ctx.fn.flip(img, device=ctx.device, vertical=0,
                       horizontal=ctx.fn.random.coin_flip(probability=t.p, seed=ctx.next_seed()))


@LOWERINGS.register(T.RandomVerticalFlip)
def _vflip(t: T.RandomVerticalFlip, img: Any, ctx: Ctx) -> Any:
    return ctx.fn.flip(img, device=ctx.device, horizontal=0,
                       vertical=ctx.fn.random.coin_flip(probability=t.p, seed=ctx.next_seed()))


@LOWERINGS.register(T.ColorJitter)
def _color_jitter(t: T.ColorJitter, img: Any, ctx: Ctx) -> Any:
    fn = ctx.fn

    def draw(r: tuple[float, float] | None, neutral: float, scale: float = 1.0) -> Any:
        if r is None:
            return neutral
        if r[0] == r[1]:
            return r[0] * scale
        return fn.random.uniform(range=[r[0] * scale, r[1] * scale], seed=ctx.next_seed())

    return fn.color_twist(img, device=ctx.device, brightness=draw(t.brightness, 1.0), contrast=draw(t.contrast, 1.0),
                          saturation=draw(t.saturation, 1.0), hue=draw(t.hue, 0.0, 360.0))


@LOWERINGS.register(T.RandomGrayscale)
def _grayscale(t: T.RandomGrayscale, img: Any, ctx: Ctx) -> Any:
    keep = 1 - ctx.fn.random.coin_flip(probability=t.p, seed=ctx.next_seed())
    return ctx.fn.hsv(img, device=ctx.device, saturation=_to_float(ctx, keep))


@LOWERINGS.register(T.GaussianBlur)
def _gaussian_blur(t: T.GaussianBlur, img: Any, ctx: Ctx) -> Any:
    kx, ky = t.kernel_size
    sigma = t.sigma[0] if t.sigma[0] == t.sigma[1] else \
        ctx.fn.random.uniform(range=list(t.sigma), seed=ctx.next_seed())
    return ctx.fn.gaussian_blur(img, device=ctx.device, window_size=[ky, kx], sigma=sigma)


def _to_dtype_unsupported(t: T.ToDtype) -> str | None:
    if t.dtype == torch.bfloat16:
        return "DALI has no bfloat16; use ToDtype(torch.float16) or convert the batch in torch"
    return None


@LOWERINGS.register(T.ToDtype, unsupported=_to_dtype_unsupported)
def _to_dtype(t: T.ToDtype, img: Any, ctx: Ctx) -> Any:
    from nvidia.dali import math as dmath

    fn, types = ctx.fn, ctx.types
    target = {torch.uint8: types.UINT8, torch.float16: types.FLOAT16, torch.float32: types.FLOAT,
              torch.float64: types.FLOAT64}[t.dtype]
    src_int, dst_int = ctx.dtype == torch.uint8, t.dtype == torch.uint8
    if t.scale and src_int and not dst_int:
        img = _to_float(ctx, img) * (1.0 / 255.0)
    elif t.scale and dst_int and not src_int:  # torchvision: floor(x * (256 - 1e-3)), saturated
        img = dmath.clamp(dmath.floor(img * (255.0 + 1.0 - 1e-3)), 0.0, 255.0)
    return fn.cast(img, device=ctx.device, dtype=target)


@LOWERINGS.register(T.Normalize)
def _normalize(t: T.Normalize, img: Any, ctx: Ctx) -> Any:
    mean, std = list(t.mean) * (3 // len(t.mean)), list(t.std) * (3 // len(t.std))
    return ctx.fn.crop_mirror_normalize(img, device=ctx.device, mean=mean, std=std, output_layout="HWC",
                                        dtype=ctx.types.FLOAT)


@LOWERINGS.register(T.Arithmetic)
def _arithmetic(t: T.Arithmetic, img: Any, ctx: Ctx) -> Any:
    dtype = {torch.float16: ctx.types.FLOAT16, torch.float64: ctx.types.FLOAT64}.get(ctx.dtype, ctx.types.FLOAT)
    return ctx.fn.cast(t.apply(img), device=ctx.device, dtype=dtype)
