"""The DALI backend's geometric and dtype lowerings (photometric ones: ``_color``).

Geometry is ``gpupipe.core._geometry``'s — the functions the torch backend and ``output_spec`` use — on
whatever the image's size is at that step (:meth:`Ctx.shape`): host values computed per batch from
the images' headers (the default: only the results enter the graph, through :meth:`Ctx.arg`),
ints where the pipeline fixes the size, or DALI shape nodes where only the graph knows it (with
EXIF orientation, or after a step whose output size the host cannot know), evaluated there with
:data:`DALI_OPS`. DALI's ``resize_shorter`` and crop positions round differently from torchvision,
so sizes and anchors are always gpupipe's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import transforms as T
from ...core._errors import BackendUnavailableError
from ...core._geometry import (
    ATTEMPTS,
    center_crop_anchor,
    crop_padding,
    crop_start,
    crop_too_large,
    erasing_windows,
    resize_empty,
    resize_size,
    resized_crop_windows,
    shortest_size,
)
from ...transforms._detection import zoom_out_padding
from ._context import LOWERINGS, Ctx, dali_type, scaled_to_uint8, to_float
from ._host import HostValue, box_window

__all__ = ["crop_window", "resize", "in_float32", "relative_position", "BUILTIN"]


def _interp(ctx: Ctx, mode: T.InterpolationMode | str) -> Any:
    it = ctx.types.DALIInterpType
    return {
        T.InterpolationMode.BILINEAR: it.INTERP_LINEAR,
        T.InterpolationMode.BICUBIC: it.INTERP_CUBIC,
        T.InterpolationMode.NEAREST: it.INTERP_NN,
        T.InterpolationMode.NEAREST_EXACT: it.INTERP_NN,
    }[T.InterpolationMode(mode)]


def in_float32(ctx: Ctx, img: Any, op: Any, takes: tuple[torch.dtype, ...] = (torch.uint8, torch.float32)) -> Any:
    """``op(img)`` for a DALI operator that ``takes`` only some image dtypes (``resize`` and
    ``warp_affine``: uint8 and float32; the CPU ``flip``: no float16): an image of another goes
    through it in float32 and comes back in its own dtype."""
    if ctx.dtype in takes:
        return op(img)
    out = op(ctx.fn.cast(img, dtype=ctx.types.FLOAT, device=ctx.device))
    return ctx.fn.cast(out, dtype=dali_type(ctx, ctx.dtype), device=ctx.device)


def resize(ctx: Ctx, img: Any, h: Any, w: Any, interpolation: T.InterpolationMode | str, antialias: bool) -> Any:
    """``img`` resized to ``h`` x ``w`` (ints, host values or graph nodes: exact integer sizes)."""
    types = ctx.types
    return in_float32(ctx, img, lambda x: ctx.fn.resize(
        x,
        device=ctx.device,
        size=ctx.arg_vector([h, w], np.float32),
        interp_type=_interp(ctx, interpolation),
        antialias=antialias,
        dtype=types.UINT8 if ctx.dtype == torch.uint8 else types.FLOAT,
    ))  # fmt: skip


def crop_window(ctx: Ctx, height: Any, width: Any) -> tuple[Any, Any, Any, Any]:
    """``RandomResizedCrop``'s window ``(top, left, h, w)`` (step ``ctx.step``) on images of
    ``height`` x ``width``: ``gpupipe.core._geometry.resized_crop_windows`` on the host, or its graph
    form where only the graph knows the size."""
    if not _node(height):
        window = HostValue(resized_crop_windows, height, width, ctx.host_random())
        return window[0], window[1], window[2], window[3]
    return _graph_crop_window(ctx, ctx.random(), height, width)


def _graph_crop_window(ctx: Ctx, factors: Any, height: Any, width: Any) -> tuple[Any, ...]:
    """``gpupipe.core._geometry.resized_crop_window`` on graph nodes: int32 ``(top, left, h, w)`` per
    sample, from the step's factors (the ratio bounds come last, as float64 data) and the image's
    int32 ``height``/``width``. The same float64 operations in the same order, the attempts as
    ``[ATTEMPTS]`` vectors; the only constants are 0.5, 1.0 and 2.0, exact in the float32 DALI
    keeps constants in."""
    from nvidia.dali import math as dmath

    fn, types, n = ctx.fn, ctx.types, ATTEMPTS

    def f64(x: Any) -> Any:
        return fn.cast(x, dtype=types.FLOAT64)

    def i32(x: Any) -> Any:
        return fn.cast(x, dtype=types.INT32)

    def rounded(x: Any) -> Any:
        """``round(x)``, half to even (the fallback's, as torchvision's): ``floor(x + 0.5)``, less
        one on a tie (``r - x`` is exact) that went to an odd number."""
        r = dmath.floor(x + 0.5)
        return r - f64((r - x == 0.5) & (r * 0.5 != dmath.floor(r * 0.5)))

    hf, wf = f64(height), f64(width)
    sqa = dmath.sqrt(hf * wf)
    ws = dmath.floor(sqa * factors[0:n] + 0.5)
    hs = dmath.floor(sqa * factors[n : 2 * n] + 0.5)
    fits = (ws >= 1.0) & (ws <= wf) & (hs >= 1.0) & (hs <= hf)
    attempt = fn.constant(idata=list(range(n)), dtype=types.INT32)
    first = i32(fn.reductions.min(attempt + (1 - i32(fits)) * n))  # n where no attempt fits
    chosen = i32(attempt == first)
    found = i32(first < n)
    h = found * i32(fn.reductions.sum(i32(hs) * chosen)) + (1 - found) * dmath.min(
        height, i32(rounded(wf / factors[2 * n + 2]))
    )
    w = found * i32(fn.reductions.sum(i32(ws) * chosen)) + (1 - found) * dmath.min(
        width, i32(rounded(hf * factors[2 * n + 3]))
    )
    top = found * i32(dmath.floor(factors[2 * n] * f64(height - h + 1))) + (1 - found) * ((height - h) // 2)
    left = found * i32(dmath.floor(factors[2 * n + 1] * f64(width - w + 1))) + (1 - found) * ((width - w) // 2)
    return i32(top), i32(left), i32(h), i32(w)


def relative_position(ctx: Ctx, anchor: Any, room: Any) -> Any:
    """``crop_mirror_normalize``'s relative crop position for an integer ``anchor`` with ``room``
    pixels to spare: ``anchor / room`` in float32 (0 where there is no room), which DALI turns
    back into exactly ``anchor`` (``round(pos * room)``, tested against torchvision)."""
    if _node(anchor) or _node(room):
        return to_float(ctx, anchor) / to_float(ctx, ctx.ops(room).where(room == 0, 1, room))
    if isinstance(anchor, HostValue) or isinstance(room, HostValue):
        return ctx.arg(HostValue(_relative, anchor, room), np.float32)
    return float(_relative(anchor, room))


def _relative(anchor: Any, room: Any) -> Any:
    room = np.where(np.asarray(room) == 0, 1, room)
    return np.asarray(anchor, dtype=np.float32) / np.asarray(room, dtype=np.float32)


def _node(value: Any) -> bool:
    return type(value).__name__ == "DataNode"


@LOWERINGS.register(T.RandomResizedCrop)
def _random_resized_crop(t: T.RandomResizedCrop, img: Any, ctx: Ctx) -> Any:
    top, left, ch, cw = crop_window(ctx, *ctx.shape(img))
    start, shape = ctx.arg_vector([top, left], np.int32), ctx.arg_vector([ch, cw], np.int32)
    img = ctx.fn.slice(img, start=start, shape=shape, device=ctx.device, axis_names="HW")
    return resize(ctx, img, t.size[0], t.size[1], t.interpolation, t.antialias)


@LOWERINGS.register(T.Resize)
def _resize(t: T.Resize, img: Any, ctx: Ctx) -> Any:
    if t.size is not None and len(t.size) == 2:
        return resize(ctx, img, t.size[0], t.size[1], t.interpolation, t.antialias)
    h, w = ctx.shape(img)
    ops = ctx.ops(h, w)
    new_h, new_w = resize_size(h, w, t.size, t.max_size, ops)
    if t.max_size is not None:  # a very thin image may round to no rows or columns: the sample fails
        ctx.require(
            (new_h >= 1) & (new_w >= 1), [new_h, new_w], lambda nh, nw: resize_empty(t.size, t.max_size, (nh, nw))
        )
        new_h, new_w = ops.max(new_h, 1), ops.max(new_w, 1)
    ctx.resized = (new_h, new_w)
    return resize(ctx, img, new_h, new_w, t.interpolation, t.antialias)


@LOWERINGS.register(T.RandomResize)
def _random_resize(t: T.RandomResize, img: Any, ctx: Ctx) -> Any:
    """The shorter side to the sample's drawn size, the longer by torchvision's rule
    (``gpupipe.core._geometry.resize_size``), computed on the host per sample."""
    h, w = _host_size(ctx, img, "RandomResize")
    short = HostValue(lambda f: f[:, 0].astype(np.int64), ctx.host_random())
    new_h, new_w = resize_size(h, w, (short,), None, ctx.ops(h, w, short))  # type: ignore[arg-type]  # per sample
    ctx.resized = (new_h, new_w)
    return resize(ctx, img, new_h, new_w, t.interpolation, t.antialias)


@LOWERINGS.register(T.RandomShortestSize)
def _random_shortest_size(t: T.RandomShortestSize, img: Any, ctx: Ctx) -> Any:
    """Each sample's size by torchvision's rule (``gpupipe.core._geometry.shortest_size``) from its
    drawn shorter side, computed on the host."""
    h, w = _host_size(ctx, img, "RandomShortestSize")
    choices = np.asarray(t.min_size, np.int64)

    def sizes(height: Any, width: Any, f: np.ndarray) -> np.ndarray:
        return np.stack(np.broadcast_arrays(*shortest_size(height, width, choices[f[:, 0].astype(np.int64)],
                                                           t.max_size)), axis=1)  # fmt: skip

    size = HostValue(sizes, h, w, ctx.host_random())
    ctx.resized = (size[0], size[1])
    return resize(ctx, img, size[0], size[1], t.interpolation, t.antialias)


@LOWERINGS.register(T.RandomZoomOut)
def _zoom_out(t: T.RandomZoomOut, img: Any, ctx: Ctx) -> Any:
    """A padding ``slice`` onto each sample's canvas (``zoom_out_padding``, on the host)."""
    h, w = _host_size(ctx, img, "RandomZoomOut")
    pad = HostValue(zoom_out_padding, h, w, ctx.host_random())  # (left, top, right, bottom)
    new_h, new_w = h + pad[1] + pad[3], w + pad[0] + pad[2]
    ctx.resized = (new_h, new_w)
    fill = list(t.fill) if isinstance(t.fill, tuple) else float(t.fill)
    return ctx.fn.slice(img, start=ctx.arg_vector([-pad[1], -pad[0]], np.int32),
                        shape=ctx.arg_vector([new_h, new_w], np.int32), axis_names="HW", out_of_bounds_policy="pad",
                        fill_values=fill, device=ctx.device)  # fmt: skip


@LOWERINGS.register(T.RandomIoUCrop)
def _iou_crop(t: T.RandomIoUCrop, img: Any, ctx: Ctx) -> Any:
    """A ``slice`` by the window the boxes chose on the host (``backends._torch._targets``, in the
    reader threads: :func:`box_window`); the whole image where none was."""
    h, w = _host_size(ctx, img, "RandomIoUCrop")

    def windows(found: np.ndarray, height: Any, width: Any) -> np.ndarray:
        whole = np.stack(np.broadcast_arrays(0, 0, height, width, found[:, 0])[:4], axis=1)
        return np.where(found[:, :1] < 0, whole, found)

    window = HostValue(windows, box_window(ctx.step), h, w)
    ctx.resized = (window[2], window[3])
    return ctx.fn.slice(img, start=ctx.arg_vector([window[0], window[1]], np.int32),
                        shape=ctx.arg_vector([window[2], window[3]], np.int32), axis_names="HW",
                        device=ctx.device)  # fmt: skip


def _slice(ctx: Ctx, img: Any, top: Any, left: Any, h: int, w: int, fill: Any = 0.0) -> Any:
    return ctx.fn.slice(
        img,
        start=ctx.arg_vector([top, left], np.int32),
        shape=[h, w],
        device=ctx.device,
        axis_names="HW",
        out_of_bounds_policy="pad",
        fill_values=fill,
    )


@LOWERINGS.register(T.CenterCrop)
def _center_crop(t: T.CenterCrop, img: Any, ctx: Ctx) -> Any:
    h, w = ctx.shape(img)
    ops = ctx.ops(h, w)
    return _slice(ctx, img, center_crop_anchor(t.size[0], h, ops), center_crop_anchor(t.size[1], w, ops), *t.size)


def _random_crop_unsupported(t: T.RandomCrop) -> str | None:
    if t.padding_mode != "constant" and (t.padding or t.pad_if_needed):
        return f"padding_mode={t.padding_mode!r} (DALI pads with constants only); use padding_mode='constant'"
    return None


@LOWERINGS.register(T.RandomCrop, unsupported=_random_crop_unsupported)
def _random_crop(t: T.RandomCrop, img: Any, ctx: Ctx) -> Any:
    h, w = ctx.shape(img)
    ops = ctx.ops(h, w)
    left, top, right, bottom = t.padding or (0, 0, 0, 0)
    ch, cw = t.size

    def axis(size: Any, before: int, after: int, crop: int, i: int) -> tuple[Any, Any]:
        """The window's first input pixel (negative: in the padding), and the padded size."""
        before, _, padded = crop_padding(size, before, after, crop, t.pad_if_needed, ops)
        room = padded - crop + 1  # the start is floor(u * room), in [0, room); room <= 0: too small
        if _node(room):
            from nvidia.dali import math as dmath

            u = ctx.random()[i]
            start = ctx.fn.cast(dmath.floor(u * ctx.fn.cast(room, dtype=ctx.types.FLOAT64)), dtype=ctx.types.INT32)
            return dmath.min(start, room - 1) - before, padded
        return HostValue(crop_start, ctx.host_random()[i], room) - before, padded

    top_px, padded_h = axis(h, top, bottom, ch, 0)
    left_px, padded_w = axis(w, left, right, cw, 1)
    if not t.pad_if_needed:  # too small even padded: the sample fails, as on the torch backend
        ctx.require(
            (padded_h >= ch) & (padded_w >= cw),
            [padded_h, padded_w],
            lambda ph, pw: crop_too_large((ch, cw), (ph, pw), padding=t.padding is not None),
        )
    fill = list(t.fill) if isinstance(t.fill, tuple) else float(t.fill)
    return _slice(ctx, img, top_px, left_px, ch, cw, fill)


@LOWERINGS.register(T.RandomHorizontalFlip)
def _hflip(t: T.RandomHorizontalFlip, img: Any, ctx: Ctx) -> Any:
    return _flip(ctx, img, vertical=0, horizontal=ctx.decision())


@LOWERINGS.register(T.RandomVerticalFlip)
def _vflip(t: T.RandomVerticalFlip, img: Any, ctx: Ctx) -> Any:
    return _flip(ctx, img, horizontal=0, vertical=ctx.decision())


def _flip(ctx: Ctx, img: Any, **axes: Any) -> Any:
    """DALI's ``flip`` along ``axes``; a float16 image (which its CPU flip does not take) in float32."""
    return in_float32(ctx, img, lambda x: ctx.fn.flip(x, device=ctx.device, **axes),
                      takes=(torch.uint8, torch.float32, torch.float64))  # fmt: skip


def _to_dtype_unsupported(t: T.ToDtype) -> str | None:
    if t.dtype == torch.bfloat16:
        return "DALI has no bfloat16; use ToDtype(torch.float16) or convert the batch in torch"
    return None


@LOWERINGS.register(T.ToDtype, unsupported=_to_dtype_unsupported)
def _to_dtype(t: T.ToDtype, img: Any, ctx: Ctx) -> Any:
    src_int, dst_int = ctx.dtype == torch.uint8, t.dtype == torch.uint8
    if t.scale and src_int and not dst_int:
        img = to_float(ctx, img) * (1.0 / 255.0)
    elif t.scale and dst_int and not src_int:
        img = scaled_to_uint8(img)
    return ctx.fn.cast(img, device=ctx.device, dtype=dali_type(ctx, t.dtype))


@LOWERINGS.register(T.Normalize)
def _normalize(t: T.Normalize, img: Any, ctx: Ctx) -> Any:
    """``crop_mirror_normalize``, in the image's dtype (float16 or float32; a float64 image in float32)."""
    mean, std = list(t.mean) * (3 // len(t.mean)), list(t.std) * (3 // len(t.std))
    dtype = ctx.types.FLOAT16 if ctx.dtype == torch.float16 else ctx.types.FLOAT
    return in_float32(ctx, img, lambda x: ctx.fn.crop_mirror_normalize(
        x, device=ctx.device, mean=mean, std=std, output_layout="HWC", dtype=dtype
    ), takes=(torch.float16, torch.float32))  # fmt: skip


@LOWERINGS.register(T.Arithmetic)
def _arithmetic(t: T.Arithmetic, img: Any, ctx: Ctx) -> Any:
    return ctx.fn.cast(t.apply(img), device=ctx.device, dtype=dali_type(ctx, ctx.dtype))  # a float input


@LOWERINGS.register(T.ArrayFunction)
def _array_function(t: T.ArrayFunction, img: Any, ctx: Ctx) -> Any:
    if ctx.device == "gpu":
        try:
            import cupy as xp
        except ImportError:
            raise BackendUnavailableError(
                f"{type(t).__name__} (an ArrayFunction) on the GPU needs CuPy: pip install cupy-cuda12x (or "
                "cupy-cuda13x, as DALI's CUDA major)"
            ) from None
    else:
        import numpy as xp

    def run(image: Any) -> Any:
        return t.apply(image, xp)

    return ctx.fn.python_function(img, function=run, device=ctx.device, batch_processing=False, output_layouts="HWC")


@LOWERINGS.register(T.RandomErasing)
def _random_erasing(t: T.RandomErasing, img: Any, ctx: Ctx) -> Any:
    """The box computed on the host from the image's size and the sample's factors
    (``gpupipe.core._geometry.erasing_windows``: a zero-sized box where nothing is erased), then
    ``erase`` filling it with ``value`` (one number, or one per channel). ``value="random"``: the
    box erased to 0 and the sample's noise added, the very values the torch backend draws (its
    generator, seeded alike, on the host), placed by a padding ``slice`` (a float image)."""
    height, width = _host_size(ctx, img, "RandomErasing")
    factors = ctx.host_random()
    box = HostValue(erasing_windows, height, width, factors)
    anchor = ctx.arg_vector([box[0], box[1]], np.float32)
    shape = ctx.arg_vector([box[2], box[3]], np.float32)
    if not t.noise:
        fill = t.value[0] if len(t.value) == 1 else list(t.value)
        return in_float32(ctx, img, lambda x: ctx.fn.erase(x, device=ctx.device, anchor=anchor, shape=shape,
                                                           axis_names="HW", fill_value=fill),
                          takes=(torch.uint8, torch.float16, torch.float32))  # (erase takes no float64)  # fmt: skip
    if not ctx.dtype.is_floating_point:
        raise BackendUnavailableError("RandomErasing(value='random') on the DALI backend takes a float image: put it "
                                      "after ToDtype (and Normalize, as the recipes do)")  # fmt: skip
    layout, channels = ctx.layout, ctx.channels
    noise = ctx.arg_tensors(HostValue(lambda b, f: _noise(b, f, channels, layout), box, factors), np.float32, layout)
    if ctx.device == "gpu":
        noise = noise.gpu()
    start = ctx.arg_vector([-box[0], -box[1]], np.int32)
    canvas = ctx.fn.slice(noise, start, ctx.arg_vector([height, width], np.int32), axis_names="HW",
                          out_of_bounds_policy="pad", fill_values=0.0, device=ctx.device)  # fmt: skip

    def noised(x: Any) -> Any:  # (in float32: DALI's arithmetic takes no float16, its erase no float64)
        erased = ctx.fn.erase(x, device=ctx.device, anchor=anchor, shape=shape, axis_names="HW", fill_value=0.0)
        return erased + canvas

    return in_float32(ctx, img, noised, takes=(torch.float32,))


def _noise(boxes: np.ndarray, factors: np.ndarray, channels: int, layout: str) -> list[np.ndarray]:
    """Each sample's N(0, 1) noise for its box, ``[C, h, w]`` drawn as the torch backend draws it
    (``torch.Generator`` seeded with ``int(u · 2**53)`` of the factors' last uniform), in
    ``layout``."""
    out = []
    for (_, _, h, w), u in zip(boxes.tolist(), factors[:, -1].tolist(), strict=True):
        generator = torch.Generator().manual_seed(int(u * 2**53))
        values = torch.empty([channels, h, w], dtype=torch.float32).normal_(generator=generator).numpy()
        out.append(values if layout == "CHW" else values.transpose(1, 2, 0))
    return out


def _host_size(ctx: Ctx, img: Any, name: str) -> tuple[Any, Any]:
    """The image's size as the host knows it (ints or host values), for a lowering that computes
    its per-sample arguments there."""
    height, width = ctx.shape(img)
    if not all(isinstance(v, (int, HostValue)) for v in (height, width)):
        raise BackendUnavailableError(
            f"{name} on the DALI backend needs the image's size known outside the graph: put it after a step that "
            "fixes the size (a crop), or with apply_exif_orientation=False"
        )
    return height, width


# The lowerings fusion stands in for (see _compiler._builtin).
BUILTIN: dict[type, Any] = {
    T.RandomResizedCrop: _random_resized_crop,
    T.CenterCrop: _center_crop,
    T.RandomHorizontalFlip: _hflip,
    T.ToDtype: _to_dtype,
    T.Normalize: _normalize,
}
