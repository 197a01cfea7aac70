"""The DALI backend's compiler: transform definitions → one DALI graph.

Images flow through the graph as HWC uint8 (DALI's layout), on the CPU (``device="cpu"``, DALI CPU
operators) or the GPU (``device="gpu"``, after nvJPEG's ``mixed`` decoder). Compilation:

1. Decode. A leading ``RandomResizedCrop`` is fused into it: its window is decoded alone
   (``decoders.image_slice``: region-of-interest decode) — or, on a GPU whose nvJPEG cannot decode
   a region with the requested chroma upsampling, the whole image is decoded on the GPU and the
   window cut there (:class:`~gpupipe.DecodeMode`) — then ``resize`` scales it.
2. Tail fusion. A final run of ``CenterCrop`` / ``RandomHorizontalFlip`` / ``ToDtype(float)`` /
   ``Normalize`` becomes one ``crop_mirror_normalize``, which also writes CHW. A
   ``RandomHorizontalFlip`` followed only by steps that a flip commutes with (the photometric
   transforms) moves into it too.
3. Every other transform goes through :data:`LOWERINGS` (transform type → lowering function).

A pipeline of several views decodes each image once and lowers each view's list on that decoded
node (steps 2 and 3 per view; no region-of-interest decode): the graph has one image output per
view.

Per-sample values come from the host (``_host``). Randomness: no DALI random operator; each random
step's factors (``Transform.sample`` of the uniforms ``gpupipe.core._random`` draws from ``(seed,
epoch, sample)``) are computed by the runner for each batch. Geometry: the images' sizes are read
from their headers by the runner's reader threads, so crop windows, resize sizes and anchors are
computed there with ``gpupipe.core._geometry`` (vectorized over the batch, the same functions and
float64 arithmetic as the torch backend) and enter the graph as ``external_source`` arguments —
the ImageNet train recipe is 7 operators, val 7. So the DALI backend draws what the torch backend
draws, a resumed epoch draws what the interrupted one did, and one pipeline serves every epoch.

Where the host cannot know a size (EXIF orientation applied by the decoders; after a step whose
output size depends on its pixels) the same geometry runs in the graph on shape nodes
(``DALI_OPS``). A sample a transform cannot take (a ``RandomCrop`` larger than its image) fails a
per-sample check (:meth:`Ctx.require`): on the host before the batch is fed, or in the graph (one
extra int32 output, read by the runner); either way the same error as the torch backend, naming
the sample. DALI is imported only when a graph is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ... import transforms as T
from ...core._config import DecodeMode
from ...core._geometry import center_crop_anchor
from ...transforms._apply import RandomChoice as SampleChoice
from ._context import DALI_OPS, LOWERINGS, Check, Ctx, Lowered, dali_type, hw, peek_shape, scaled_to_uint8
from ._host import SOURCE
from ._lowerings import BUILTIN, crop_window, relative_position, resize

__all__ = ["LOWERINGS", "DALI_OPS", "Ctx", "Check", "Lowered", "lower", "dali_type", "scaled_to_uint8"]

_FLOAT_OUT = {torch.float32: "FLOAT", torch.float16: "FLOAT16"}


def lower(
    views: Sequence[Sequence[T.Transform]],
    encoded: Any,
    ctx: Ctx,
    *,
    channels_last: bool = False,
    per_source: bool = False,
) -> Lowered:
    """Builds the graph of each view's transform list on ``encoded`` images: ``[C, H, W]`` (or HWC
    where ``channels_last``) images, one node per view, the inputs fed per batch and the
    per-sample checks the lowerings required. One view may fuse a leading ``RandomResizedCrop``
    into the decoder; several views share one full decode. ``per_source``: the views are a
    ``gp.Mix``'s lists, one per source, and the one output takes each sample's row from its
    source's (:func:`by_source`)."""
    fused: list[DecodeMode] = []
    if len(views) == 1:
        images: tuple[Any, ...] = (_lower_images(views[0], encoded, ctx, channels_last=channels_last, fused=fused),)
    else:
        decoded = decode(encoded, ctx)
        images = tuple(
            _lower_images(steps, encoded, ctx, channels_last=channels_last, view=view, decoded=decoded)
            for view, steps in enumerate(views)
        )
        if per_source:
            images = (by_source(images, ctx, channels_last=channels_last),)
    built = ctx.built  # what the steps added to the graph
    common: dict[str, Any] = dict(
        feeds=built.feeds,
        host_checks=tuple(built.host_checks),
        draws=frozenset(built.draws),
        host_geometry=built.host_geometry,
        decode=fused[0] if fused else None,
    )
    if not built.checks:
        return Lowered(images, **common)
    fn, types = built.fn, built.types
    size = peek_shape(ctx, encoded)
    parts = [size[0], size[1]]
    for check in built.checks:
        parts += [fn.cast(check.ok, dtype=types.INT32), *(fn.cast(v, dtype=types.INT32) for v in check.values)]
    return Lowered(images, tuple(built.checks), fn.stack(*parts), **common)


def by_source(images: Sequence[Any], ctx: Ctx, *, channels_last: bool) -> Any:
    """Per sample, the row of ``images`` (one node per source, all of one shape and dtype) that
    its source (fed, ``SOURCE``) says: stacked and the sample's one sliced out — exact for every
    dtype (DALI 2.4 has no per-sample select outside its conditionals)."""
    fn, types = ctx.fn, ctx.types
    stacked = fn.stack(*images, device=ctx.device)
    start = fn.stack(ctx.arg(SOURCE, np.int32))
    one = fn.slice(stacked, start, fn.constant(idata=[1], dtype=types.INT32), axes=[0], device=ctx.device)
    layout = "HWC" if channels_last else "CHW"
    return fn.reshape(fn.squeeze(one, axes=[0], device=ctx.device), layout=layout, device=ctx.device)


def decode(encoded: Any, ctx: Ctx) -> Any:
    """The whole images, RGB (``mixed`` on the GPU)."""
    return ctx.fn.decoders.image(
        encoded, device=ctx.decoder_device, output_type=ctx.types.RGB, **ctx.orientation, **ctx.decoder_args
    )


def _lower_images(
    transforms: Sequence[T.Transform],
    encoded: Any,
    ctx: Ctx,
    *,
    channels_last: bool,
    view: int = 0,
    decoded: Any = None,
    fused: list[DecodeMode] | None = None,
) -> Any:
    """One view's output node: from ``decoded`` images where given (several views), else decoding
    ``encoded`` itself, fusing a leading ``RandomResizedCrop`` into the decoder."""
    spec = T.ImageSpec()  # as Pipeline checks it: each step sees its input's full spec
    ctx.view, ctx.dtype, ctx.channels = view, spec.dtype, spec.channels
    ctx.size = ctx.encoded_shape(encoded) if ctx.host_geometry else None
    steps = list(enumerate(transforms))
    first = steps[0][1] if steps else None
    if decoded is not None:
        img = decoded
    elif isinstance(first, T.RandomResizedCrop) and _builtin(first):
        steps.pop(0)
        ctx.step = 0
        spec = first.output_spec(spec)
        img = decode_random_crop(first, encoded, ctx)
        img = resize(ctx, img, first.size[0], first.size[1], first.interpolation, first.antialias)
        ctx.size = first.size
        if fused is not None:
            fused.append(ctx.decode if ctx.device == "gpu" else DecodeMode.ROI)
    else:
        img = decode(encoded, ctx)
    end = len(steps)  # trailing erasing runs after the fused tail, on its output (RandomErasing after Normalize)
    while end and type(steps[end - 1][1]) is T.RandomErasing:
        end -= 1
    tail = _fusable_tail([t for _, t in steps[:end]])
    if not tail and not channels_last:
        tail = _uint8_tail([t for _, t in steps[:end]], spec)
    body, fused_tail = steps[: end - len(tail)], steps[end - len(tail) : end]
    flip = _sinkable_flip(body, tail)
    if flip is not None:
        body.remove(flip)
        fused_tail.insert(0, flip)
    for ctx.step, t in body:
        size, ctx.resized = ctx.size, None
        img = LOWERINGS.lookup(t)(t, img, ctx)
        spec = t.output_spec(spec)
        ctx.dtype, ctx.channels = spec.dtype, spec.channels
        ctx.size = _size_after(t, spec, size, ctx)
    if tail:
        img = _crop_mirror_normalize(fused_tail, img, ctx, channels_last=channels_last)
        for t in tail:
            spec = t.output_spec(spec)
        ctx.dtype, ctx.channels = spec.dtype, spec.channels
        ctx.size = (spec.height, spec.width) if spec.fixed_size else ctx.size
    elif not channels_last:
        img = ctx.fn.transpose(img, device=ctx.device, perm=[2, 0, 1], output_layout="CHW")
    ctx.layout = "HWC" if channels_last else "CHW"
    for ctx.step, t in steps[end:]:  # RandomErasing keeps the size, in either layout
        img = LOWERINGS.lookup(t)(t, img, ctx)
    return img


def _size_after(t: T.Transform, spec: T.ImageSpec, before: tuple[Any, Any] | None, ctx: Ctx) -> tuple[Any, Any] | None:
    """The per-sample size after step ``t`` where it is known outside the graph: fixed by the
    pipeline, computed by the lowering (``ctx.resized``), or kept; ``None``: only the graph knows."""
    if spec.fixed_size:
        return spec.height, spec.width
    if ctx.resized is not None and before is not None:
        return ctx.resized
    return before if t.size_kept() else None


# ------------------------------------------------------------------------ fusion --


def decode_random_crop(t: T.RandomResizedCrop, encoded: Any, ctx: Ctx) -> Any:
    """The crop window of ``t`` (step ``ctx.step``), computed from the encoded image's size, and
    the window decoded: only that region (``DecodeMode.ROI``, and always on the CPU), or the whole
    image on the GPU and the window cut there (``DecodeMode.FULL``)."""
    top, left, h, w = crop_window(ctx, *ctx.encoded_shape(encoded))
    start, shape = ctx.arg_vector([top, left], "int32"), ctx.arg_vector([h, w], "int32")
    fn = ctx.fn
    if ctx.device == "gpu" and ctx.decode == DecodeMode.FULL:
        return fn.slice(decode(encoded, ctx), start=start, shape=shape, axis_names="HW", device="gpu")
    return fn.decoders.image_slice(
        encoded,
        device=ctx.decoder_device,
        output_type=ctx.types.RGB,
        start=start,
        shape=shape,
        axis_names="HW",
        **ctx.orientation,
        **ctx.decoder_args,
    )


def _builtin(t: T.Transform) -> bool:
    """Whether ``t`` lowers with the built-in lowering of its exact type: only those are fused; a
    subclass, or a type whose lowering was replaced (``register_lowering(..., replace=True)``),
    runs its own registered lowering."""
    builtin = BUILTIN.get(type(t))
    return builtin is not None and LOWERINGS.lookup(t) is builtin


def _fusable_tail(steps: list[T.Transform]) -> list[T.Transform]:
    """The longest suffix shaped ``[CenterCrop] [RandomHorizontalFlip] ToDtype(float) [Normalize]``."""
    tail = _suffix(steps, (T.CenterCrop, T.RandomHorizontalFlip, T.ToDtype, T.Normalize))
    dtype_steps = [t for t in tail if isinstance(t, T.ToDtype)]
    if not dtype_steps or dtype_steps[0].dtype not in _FLOAT_OUT:
        return []
    return tail


def _uint8_tail(steps: list[T.Transform], spec: T.ImageSpec) -> list[T.Transform]:
    """The longest suffix shaped ``[CenterCrop] [RandomHorizontalFlip]`` of a view that ends on
    uint8 ``[C, H, W]`` images (``spec``: the input of ``steps``): one ``crop_mirror_normalize``
    of mean 0 and std 1 gives it and the layout, where a ``flip`` and a ``transpose`` would be two
    operators (a view cut for the device stage ends so)."""
    tail = _suffix(steps, (T.CenterCrop, T.RandomHorizontalFlip))
    for t in steps[: len(steps) - len(tail)]:
        spec = t.output_spec(spec)
    return tail if tail and spec.dtype == torch.uint8 and spec.channels == 3 else []


def _suffix(steps: list[T.Transform], pattern: tuple[type, ...]) -> list[T.Transform]:
    """The longest suffix of ``steps`` made of built-in steps of ``pattern``'s types, each at most
    once, in its order."""
    i, tail = len(steps), list[T.Transform]()
    for kind in reversed(pattern):
        if i and type(steps[i - 1]) is kind and _builtin(steps[i - 1]):
            i -= 1
            tail.insert(0, steps[i])
    return tail


def _commutes_with_flip(t: T.Transform) -> bool:
    """Whether a horizontal flip commutes with ``t`` as gpupipe lowers it (a subclass, or a
    lowering registered in its place, may not)."""
    if not getattr(LOWERINGS.lookup(t), "__module__", "").startswith(__package__ or "-"):
        return False
    if isinstance(t, (T.RandomApply, SampleChoice)) and type(t) in (T.RandomApply, SampleChoice):
        return all(_commutes_with_flip(inner) for inner in t.transforms)
    return t.commutes_with_flip


def _sinkable_flip(body: list[tuple[int, T.Transform]], tail: list[T.Transform]) -> tuple[int, T.Transform] | None:
    """The ``RandomHorizontalFlip`` of ``body`` that can move into the fused ``tail``: the last
    one, with only steps it commutes with after it, into a tail without a flip or a crop of its
    own (a centre crop of an odd margin is not symmetric)."""
    if not tail or any(isinstance(t, (T.CenterCrop, T.RandomHorizontalFlip)) for t in tail):
        return None
    for k in range(len(body) - 1, -1, -1):
        t = body[k][1]
        if type(t) is T.RandomHorizontalFlip and _builtin(t):
            return body[k]
        if not _commutes_with_flip(t):
            return None
    return None


def _crop_mirror_normalize(steps: list[tuple[int, T.Transform]], img: Any, ctx: Ctx, *, channels_last: bool) -> Any:
    fn, types = ctx.fn, ctx.types
    kwargs: dict[str, Any] = {}
    tail = [t for _, t in steps]
    for step, t in steps:
        ctx.step = step
        if isinstance(t, T.CenterCrop):
            h, w = ctx.shape(img)
            ops = ctx.ops(h, w)
            top, left = center_crop_anchor(t.size[0], h, ops), center_crop_anchor(t.size[1], w, ops)
            # crop_pos_x/y are relative: anchor = round(pos * (W - crop_w)), which gives back the
            # exact integer anchor, inside the image or in the padding (tested against torchvision).
            kwargs.update(
                crop=list(t.size),
                out_of_bounds_policy="pad",
                crop_pos_y=relative_position(ctx, top, h - t.size[0]),
                crop_pos_x=relative_position(ctx, left, w - t.size[1]),
            )
        elif isinstance(t, T.RandomHorizontalFlip):
            kwargs["mirror"] = ctx.decision()
    to_dtype = next((t for t in tail if isinstance(t, T.ToDtype)), None)
    norm = next((t for t in tail if isinstance(t, T.Normalize)), None)
    scale = 255.0 if to_dtype is not None and to_dtype.scale and ctx.dtype == torch.uint8 else 1.0
    if ctx.dtype == torch.float64:  # crop_mirror_normalize takes no float64 image: float32 (its output's)
        img = fn.cast(img, dtype=types.FLOAT, device=ctx.device)
    mean = [m * scale for m in norm.mean] if norm else [0.0]
    std = [s * scale for s in norm.std] if norm else [scale]
    if "crop" in kwargs:  # the padding, in the output's units: the crop's zeros normalized as the pixels
        n = max(len(mean), len(std))  # (DALI wants the three of one length)
        mean, std = mean * (n // len(mean)), std * (n // len(std))
        kwargs["fill_values"] = [(0.0 - m) / s for m, s in zip(mean, std, strict=True)]
    return fn.crop_mirror_normalize(
        img,
        device=ctx.device,
        dtype=getattr(types, "UINT8" if to_dtype is None else _FLOAT_OUT[to_dtype.dtype]),
        output_layout="HWC" if channels_last else "CHW",
        mean=mean,
        std=std,
        **kwargs,
    )


__all__ += ["decode", "decode_random_crop", "hw"]
