"""The DALI backend's compiler: transform definitions → one DALI graph.

Images flow through the graph as HWC uint8 (DALI's layout), on the CPU (``device="cpu"``, DALI CPU
operators) or the GPU (``device="gpu"``, after nvJPEG's ``mixed`` decoder). Compilation:

1. Decode. A leading ``RandomResizedCrop`` is fused into it: its window is computed in the graph
   from the encoded image's size (``peek_image_shape``) and ``decoders.image_slice`` decodes only
   that region (region-of-interest decode), then ``resize`` scales it.
2. Tail fusion. A final run of ``CenterCrop`` / ``RandomHorizontalFlip`` / ``ToDtype(float)`` /
   ``Normalize`` becomes one ``crop_mirror_normalize``, which also writes CHW.
3. Every other transform goes through :data:`LOWERINGS` (transform type → lowering function).

A pipeline of several views decodes each image once and lowers each view's list on that decoded
node (steps 2 and 3 per view; no region-of-interest decode): the graph has one image output per
view.

Randomness: no DALI random operator. Each random step's factors (``Transform.sample`` of the
uniforms ``gpupipe._random`` draws from ``(seed, epoch, sample)``) enter the graph through an
``external_source`` named ``factors<step>`` (float64 ``[F]`` per sample, fed by the runner for
each batch: :attr:`Lowered.inputs`), and the lowering turns them into parameters with the same
float64 arithmetic as ``Transform.make_params``. So the DALI backend draws what the torch backend
draws, a resumed epoch draws what the interrupted one did, and one pipeline serves every epoch.

Geometry is ``gpupipe._geometry``'s — the functions the torch backend and ``output_spec`` use —
evaluated on per-sample shape nodes with :data:`DALI_OPS` (DALI's ``resize_shorter`` and crop
positions round differently from torchvision). Where a sample cannot be transformed (a
``RandomCrop`` larger than its image), a lowering adds a per-sample check (:meth:`Ctx.require`);
the checks become one extra int32 output of the graph, which the runner reads to raise the same
error as the torch backend, naming the sample. DALI is imported only when a graph is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ... import transforms as T
from ..._errors import BackendUnavailableError
from ..._geometry import ATTEMPTS, center_crop_anchor, crop_padding, crop_too_large, resize_empty, resize_size
from ..._registry import Registry

__all__ = ["LOWERINGS", "DALI_OPS", "Ctx", "Check", "Lowered", "lower"]

LOWERINGS = Registry("dali")

_FLOAT_OUT = {torch.float32: "FLOAT", torch.float16: "FLOAT16"}


@dataclasses.dataclass(frozen=True)
class Check:
    """A per-sample condition the graph computes: where ``ok`` is false, the sample fails with
    ``message(*values)`` (``values``: per-sample int nodes, read back with the condition)."""

    ok: Any
    values: tuple[Any, ...]
    message: Callable[..., str]


@dataclasses.dataclass
class Ctx:
    """What a lowering function needs: the device its operators run on, the step's random factors
    (:meth:`random`), and :meth:`require` for per-sample conditions.

    Attributes:
        device: ``"cpu"`` or ``"gpu"``.
        seed: the loader's seed, for a user lowering that uses DALI's own random operators (with
            :meth:`next_seed`); those are seeded once per loader, so they are not reproducible per
            sample or on resume, and differ from the torch backend's draws. Use :meth:`random`.
        decoder_args: extra arguments of the ``mixed`` decoders (GPU only).
        dtype: the dtype of the node being lowered.
        channels: the channels of the node being lowered.
        step: the position in its view's transform list of the transform being lowered.
        view: the view being lowered (0 for a pipeline of one transform list); each view's steps
            have their own factors, drawn from ``(seed, epoch, sample, view, step)``.
        inputs: ``external_source`` name → ``(view, step)``, for each step whose factors the
            graph takes.
        exif: apply EXIF orientation in the decoders (``adjust_orientation``); default ``False``,
            as torchvision's decoders (the torch backend).
        color_twist: lower ColorJitter to DALI's ``color_twist`` (``DaliOptions.color_twist``).
    """

    device: str  # "cpu" or "gpu"
    seed: int = 0
    decoder_args: dict[str, Any] = dataclasses.field(default_factory=dict)  # for the mixed decoders
    dtype: torch.dtype = torch.uint8  # dtype of the node being lowered
    channels: int = 3  # channels of the node being lowered
    checks: list[Check] = dataclasses.field(default_factory=list)
    step: int = 0
    view: int = 0
    inputs: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    exif: bool = False
    color_twist: bool = False
    _seeds: Any = None
    _nodes: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    _scoped: Any = None

    def __post_init__(self) -> None:
        self._seeds = itertools.count(1)

    def require(self, ok: Any, values: Sequence[Any], message: Callable[..., str]) -> None:
        """Fails a sample where the boolean node ``ok`` is false, with ``message(*values)``."""
        self.checks.append(Check(ok, tuple(values), message))

    def random(self, step: int | None = None) -> Any:
        """The random factors of ``step`` (default: the step being lowered): a CPU node, float64
        ``[F]`` per sample — one row of ``Transform.sample``'s output, fed for each batch."""
        if step is None and self._scoped is not None:
            return self._scoped
        key = (self.view, self.step if step is None else step)
        if key not in self._nodes:
            name = f"factors{key[1]}" if key[0] == 0 else f"factors{key[1]}_view{key[0]}"
            self._nodes[key] = self.fn.external_source(name=name, dtype=self.types.FLOAT64, ndim=1, device="cpu")
            self.inputs[name] = key
        return self._nodes[key]

    @contextlib.contextmanager
    def scoped_factors(self, factors: Any) -> Iterator[None]:
        """Within the block, :meth:`random` (without ``step``) returns ``factors``: a composite
        transform gives each inner transform's lowering its own slice of the step's factors
        (``with ctx.scoped_factors(ctx.random()[1:3]): node = lowering(inner, node, ctx)``)."""
        saved, self._scoped = self._scoped, factors
        try:
            yield
        finally:
            self._scoped = saved

    def next_seed(self) -> int:
        """A distinct seed for each DALI random operator a user lowering adds (see ``seed``)."""
        return (self.seed * 1_000_003 + next(self._seeds) * 7_919) % (2**31 - 1)

    @property
    def orientation(self) -> dict[str, bool]:
        """The decoders' (and ``peek_image_shape``'s) EXIF argument."""
        return {"adjust_orientation": self.exif}

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


def _interp(ctx: Ctx, mode: T.InterpolationMode | str) -> Any:
    it = ctx.types.DALIInterpType
    return {
        T.InterpolationMode.BILINEAR: it.INTERP_LINEAR,
        T.InterpolationMode.BICUBIC: it.INTERP_CUBIC,
        T.InterpolationMode.NEAREST: it.INTERP_NN,
        T.InterpolationMode.NEAREST_EXACT: it.INTERP_NN,
    }[T.InterpolationMode(mode)]


def _resize(ctx: Ctx, img: Any, h: Any, w: Any, interpolation: T.InterpolationMode | str, antialias: bool) -> Any:
    types = ctx.types
    return ctx.fn.resize(
        img,
        device=ctx.device,
        resize_x=w,
        resize_y=h,
        interp_type=_interp(ctx, interpolation),
        antialias=antialias,
        dtype=types.UINT8 if ctx.dtype == torch.uint8 else types.FLOAT,
    )


def _hw(img: Any) -> tuple[Any, Any]:
    from nvidia.dali import types

    shape = img.shape(dtype=types.INT32, device="cpu")
    return shape[0], shape[1]


def _to_float(ctx: Ctx, value: Any) -> Any:
    return ctx.fn.cast(value, dtype=ctx.types.FLOAT)


def dali_type(ctx: Ctx, dtype: torch.dtype) -> Any:
    """DALI's type for an image dtype gpupipe has (no bfloat16: ``ToDtype`` refuses it)."""
    types = ctx.types
    return {torch.uint8: types.UINT8, torch.float16: types.FLOAT16, torch.float64: types.FLOAT64}.get(
        dtype, types.FLOAT
    )


def scaled_to_uint8(x: Any) -> Any:
    """torchvision's ``to_dtype(float image, uint8, scale=True)``: ``floor(x * (256 - 1e-3))``,
    saturated to 0..255 (a float node; cast it)."""
    from nvidia.dali import math as dmath

    return dmath.clamp(dmath.floor(x * (255.0 + 1.0 - 1e-3)), 0.0, 255.0)


def _where(cond: Any, a: Any, b: Any) -> Any:
    """Per-sample ``a if cond else b`` in DALI arithmetic (``cond`` a boolean node)."""
    return cond * a + (1 - cond) * b


class _DaliOps:
    """gpupipe._geometry's operations on DALI nodes (integer arithmetic, per sample)."""

    where = staticmethod(_where)

    @staticmethod
    def min(a: Any, b: Any) -> Any:
        from nvidia.dali import math as dmath

        return dmath.min(a, b)

    @staticmethod
    def max(a: Any, b: Any) -> Any:
        from nvidia.dali import math as dmath

        return dmath.max(a, b)


DALI_OPS = _DaliOps()


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A compiled graph's outputs: the images of each view and, where a lowering required
    conditions, one int32 vector per sample — the encoded image's ``(height, width)``, then each
    check's ``ok`` and values."""

    images: tuple[Any, ...]  # one node per view
    checks: tuple[Check, ...] = ()
    check_output: Any = None
    inputs: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # name -> (view, step)

    def outputs(self) -> list[Any]:
        return [*self.images] if self.check_output is None else [*self.images, self.check_output]

    def failures(self, rows: np.ndarray) -> list[tuple[int, tuple[int, int], str]]:
        """``(sample, (height, width), message)`` for each sample of the batch that failed a
        check, from the check output's ``[B, M]`` rows."""
        failed = []
        for b, row in enumerate(np.asarray(rows).reshape(len(rows), -1).tolist()):
            pos = 2
            for check in self.checks:
                ok, values = row[pos], row[pos + 1 : pos + 1 + len(check.values)]
                pos += 1 + len(check.values)
                if not ok:
                    failed.append((b, (row[0], row[1]), check.message(*values)))
                    break
        return failed


def lower(views: Sequence[Sequence[T.Transform]], encoded: Any, ctx: Ctx, *, channels_last: bool = False) -> Lowered:
    """Builds the graph of each view's transform list on ``encoded`` images: ``[C, H, W]`` (or HWC
    where ``channels_last``) images, one node per view, and the per-sample checks the lowerings
    required. One view may fuse a leading ``RandomResizedCrop`` into the decoder; several views
    share one full decode."""
    if len(views) == 1:
        images: tuple[Any, ...] = (_lower_images(views[0], encoded, ctx, channels_last=channels_last),)
    else:
        decoded = _decode(encoded, ctx)
        images = tuple(
            _lower_images(steps, encoded, ctx, channels_last=channels_last, view=view, decoded=decoded)
            for view, steps in enumerate(views)
        )
    if not ctx.checks:
        return Lowered(images, inputs=ctx.inputs)
    fn, types = ctx.fn, ctx.types
    size = peek_shape(ctx, encoded)
    parts = [size[0], size[1]]
    for check in ctx.checks:
        parts += [fn.cast(check.ok, dtype=types.INT32), *(fn.cast(v, dtype=types.INT32) for v in check.values)]
    return Lowered(images, tuple(ctx.checks), fn.stack(*parts), ctx.inputs)


def peek_shape(ctx: Ctx, encoded: Any) -> Any:
    """The encoded images' ``[H, W, C]`` (int32, CPU), from their headers, as the decoders see them."""
    return ctx.fn.peek_image_shape(encoded, dtype=ctx.types.INT32, **ctx.orientation)


def _decode(encoded: Any, ctx: Ctx) -> Any:
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
) -> Any:
    """One view's output node: from ``decoded`` images where given (several views), else decoding
    ``encoded`` itself, fusing a leading ``RandomResizedCrop`` into the decoder."""
    spec = T.ImageSpec()  # as Pipeline checks it: each step sees its input's full spec
    ctx.view, ctx.dtype, ctx.channels = view, spec.dtype, spec.channels
    steps = list(enumerate(transforms))
    first = steps[0][1] if steps else None
    if decoded is not None:
        img = decoded
    elif isinstance(first, T.RandomResizedCrop) and _builtin(first):
        steps.pop(0)
        ctx.step = 0
        spec = first.output_spec(spec)
        img = decode_random_crop(first, encoded, ctx)
        img = _resize(ctx, img, float(first.size[0]), float(first.size[1]), first.interpolation, first.antialias)
    else:
        img = _decode(encoded, ctx)
    tail = _fusable_tail([t for _, t in steps])
    for ctx.step, t in steps[: len(steps) - len(tail)]:
        img = LOWERINGS.lookup(t)(t, img, ctx)
        spec = t.output_spec(spec)
        ctx.dtype, ctx.channels = spec.dtype, spec.channels
    if tail:
        return _crop_mirror_normalize(steps[len(steps) - len(tail) :], img, ctx, channels_last=channels_last)
    fn = ctx.fn
    return img if channels_last else fn.transpose(img, device=ctx.device, perm=[2, 0, 1], output_layout="CHW")


# ------------------------------------------------------------------------ fusion --


def decode_random_crop(t: T.RandomResizedCrop, encoded: Any, ctx: Ctx) -> Any:
    """The crop window of ``t`` (step ``ctx.step``), computed from the encoded image's size and
    decoded at once (only that region is decoded)."""
    shape = peek_shape(ctx, encoded)
    top, left, h, w = resized_crop_window(ctx, ctx.random(), shape[0], shape[1])
    fn = ctx.fn
    return fn.decoders.image_slice(
        encoded,
        device=ctx.decoder_device,
        output_type=ctx.types.RGB,
        start=fn.stack(top, left),
        shape=fn.stack(h, w),
        axis_names="HW",
        **ctx.orientation,
        **ctx.decoder_args,
    )


def resized_crop_window(ctx: Ctx, factors: Any, height: Any, width: Any) -> tuple[Any, ...]:
    """``gpupipe._geometry.resized_crop_window`` on graph nodes: int32 ``(top, left, h, w)`` per
    sample, from the step's factors (``RandomResizedCrop.sample``: the ratio bounds come last, as
    float64 data) and the image's int32 ``height``/``width``. The same float64 operations in the
    same order, the attempts as ``[ATTEMPTS]`` vectors; the only constants are 0.5 and 1.0, exact
    in the float32 DALI keeps constants in."""
    from nvidia.dali import math as dmath

    fn, types, n = ctx.fn, ctx.types, ATTEMPTS

    def f64(x: Any) -> Any:
        return fn.cast(x, dtype=types.FLOAT64)

    def i32(x: Any) -> Any:
        return fn.cast(x, dtype=types.INT32)

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
        height, i32(dmath.floor(wf / factors[2 * n + 2] + 0.5))
    )
    w = found * i32(fn.reductions.sum(i32(ws) * chosen)) + (1 - found) * dmath.min(
        width, i32(dmath.floor(hf * factors[2 * n + 3] + 0.5))
    )
    top = found * i32(dmath.floor(factors[2 * n] * f64(height - h + 1))) + (1 - found) * ((height - h) // 2)
    left = found * i32(dmath.floor(factors[2 * n + 1] * f64(width - w + 1))) + (1 - found) * ((width - w) // 2)
    return i32(top), i32(left), i32(h), i32(w)


def _builtin(t: T.Transform) -> bool:
    """Whether ``t`` lowers with the built-in lowering of its exact type: only those are fused; a
    subclass, or a type whose lowering was replaced (``register_lowering(..., replace=True)``),
    runs its own registered lowering."""
    builtin = _BUILTIN.get(type(t))
    return builtin is not None and LOWERINGS.lookup(t) is builtin


def _fusable_tail(steps: list[T.Transform]) -> list[T.Transform]:
    """The longest suffix shaped ``[CenterCrop] [RandomHorizontalFlip] ToDtype(float) [Normalize]``."""
    pattern = [T.CenterCrop, T.RandomHorizontalFlip, T.ToDtype, T.Normalize]
    i, tail = len(steps), list[T.Transform]()
    for kind in reversed(pattern):
        if i and type(steps[i - 1]) is kind and _builtin(steps[i - 1]):
            i -= 1
            tail.insert(0, steps[i])
    dtype_steps = [t for t in tail if isinstance(t, T.ToDtype)]
    if not dtype_steps or dtype_steps[0].dtype not in _FLOAT_OUT:
        return []
    return tail


def _crop_mirror_normalize(steps: list[tuple[int, T.Transform]], img: Any, ctx: Ctx, *, channels_last: bool) -> Any:
    fn, types = ctx.fn, ctx.types
    kwargs: dict[str, Any] = {}
    tail = [t for _, t in steps]
    for step, t in steps:
        if isinstance(t, T.CenterCrop):
            h, w = _hw(img)
            top, left = center_crop_anchor(t.size[0], h, DALI_OPS), center_crop_anchor(t.size[1], w, DALI_OPS)
            # crop_pos_x/y are relative: anchor = pos * (W - crop_w), which gives back the exact
            # integer anchor, inside the image or in the padding (tested against torchvision).
            kwargs.update(
                crop=list(t.size),
                out_of_bounds_policy="pad",
                fill_values=0.0,
                crop_pos_y=_relative(ctx, top, h - t.size[0]),
                crop_pos_x=_relative(ctx, left, w - t.size[1]),
            )
        elif isinstance(t, T.RandomHorizontalFlip):
            kwargs["mirror"] = _decision(ctx, ctx.random(step))
    to_dtype = next(t for t in tail if isinstance(t, T.ToDtype))
    norm = next((t for t in tail if isinstance(t, T.Normalize)), None)
    scale = 255.0 if to_dtype.scale and ctx.dtype == torch.uint8 else 1.0
    mean = [m * scale for m in norm.mean] if norm else [0.0]
    std = [s * scale for s in norm.std] if norm else [scale]
    return fn.crop_mirror_normalize(
        img,
        device=ctx.device,
        dtype=getattr(types, _FLOAT_OUT[to_dtype.dtype]),
        output_layout="HWC" if channels_last else "CHW",
        mean=mean,
        std=std,
        **kwargs,
    )


def _relative(ctx: Ctx, anchor: Any, room: Any) -> Any:
    """``anchor / room`` as crop_mirror_normalize's relative position; with no room the anchor is 0."""
    return _to_float(ctx, anchor) / _to_float(ctx, _where(room == 0, 1, room))


# -------------------------------------------------------------------- lowerings --


def _decision(ctx: Ctx, factors: Any) -> Any:
    """A 0/1 factor (a flip, a grayscale) as the int32 argument DALI's operators take."""
    return ctx.fn.cast(factors[0], dtype=ctx.types.INT32)


def _factor(ctx: Ctx, factors: Any, i: int) -> Any:
    """Factor ``i`` as a float32 argument."""
    return ctx.fn.cast(factors[i], dtype=ctx.types.FLOAT)


@LOWERINGS.register(T.RandomResizedCrop)
def _random_resized_crop(t: T.RandomResizedCrop, img: Any, ctx: Ctx) -> Any:
    fn = ctx.fn
    h, w = _hw(img)
    top, left, ch, cw = resized_crop_window(ctx, ctx.random(), h, w)
    img = fn.slice(img, fn.stack(top, left), fn.stack(ch, cw), device=ctx.device, axis_names="HW")
    return _resize(ctx, img, float(t.size[0]), float(t.size[1]), t.interpolation, t.antialias)


@LOWERINGS.register(T.Resize)
def _resize_lowering(t: T.Resize, img: Any, ctx: Ctx) -> Any:
    if t.size is not None and len(t.size) == 2:
        return _resize(ctx, img, float(t.size[0]), float(t.size[1]), t.interpolation, t.antialias)
    h, w = _hw(img)
    new_h, new_w = resize_size(h, w, t.size, t.max_size, DALI_OPS)
    if t.max_size is not None:  # a very thin image may round to no rows or columns: the sample fails
        ctx.require(
            (new_h >= 1) & (new_w >= 1), [new_h, new_w], lambda nh, nw: resize_empty(t.size, t.max_size, (nh, nw))
        )
        new_h, new_w = DALI_OPS.max(new_h, 1), DALI_OPS.max(new_w, 1)
    return _resize(ctx, img, _to_float(ctx, new_h), _to_float(ctx, new_w), t.interpolation, t.antialias)


def _slice(ctx: Ctx, img: Any, top: Any, left: Any, h: int, w: int, fill: Any = 0.0) -> Any:
    fn = ctx.fn
    anchor = fn.stack(top, left)
    return fn.slice(
        img,
        anchor,
        fn.constant(idata=[h, w], dtype=ctx.types.INT32),
        device=ctx.device,
        axis_names="HW",
        out_of_bounds_policy="pad",
        fill_values=fill,
    )


@LOWERINGS.register(T.CenterCrop)
def _center_crop(t: T.CenterCrop, img: Any, ctx: Ctx) -> Any:
    h, w = _hw(img)
    return _slice(
        ctx, img, center_crop_anchor(t.size[0], h, DALI_OPS), center_crop_anchor(t.size[1], w, DALI_OPS), *t.size
    )


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

    factors = ctx.random()

    def axis(size: Any, before: int, after: int, crop: int, u: Any) -> tuple[Any, Any]:
        """The window's first input pixel (negative: in the padding), and the padded size."""
        before, _, padded = crop_padding(size, before, after, crop, t.pad_if_needed, DALI_OPS)
        room = padded - crop + 1  # the start is floor(u * room), in [0, room); room <= 0: too small
        start = fn.cast(dmath.floor(u * fn.cast(room, dtype=ctx.types.FLOAT64)), dtype=ctx.types.INT32)
        return dmath.min(start, room - 1) - before, padded

    top_px, padded_h = axis(h, top, bottom, ch, factors[0])
    left_px, padded_w = axis(w, left, right, cw, factors[1])
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
    return ctx.fn.flip(img, device=ctx.device, vertical=0, horizontal=_decision(ctx, ctx.random()))


@LOWERINGS.register(T.RandomVerticalFlip)
def _vflip(t: T.RandomVerticalFlip, img: Any, ctx: Ctx) -> Any:
    return ctx.fn.flip(img, device=ctx.device, horizontal=0, vertical=_decision(ctx, ctx.random()))


def _to_dtype_unsupported(t: T.ToDtype) -> str | None:
    if t.dtype == torch.bfloat16:
        return "DALI has no bfloat16; use ToDtype(torch.float16) or convert the batch in torch"
    return None


@LOWERINGS.register(T.ToDtype, unsupported=_to_dtype_unsupported)
def _to_dtype(t: T.ToDtype, img: Any, ctx: Ctx) -> Any:
    src_int, dst_int = ctx.dtype == torch.uint8, t.dtype == torch.uint8
    if t.scale and src_int and not dst_int:
        img = _to_float(ctx, img) * (1.0 / 255.0)
    elif t.scale and dst_int and not src_int:
        img = scaled_to_uint8(img)
    return ctx.fn.cast(img, device=ctx.device, dtype=dali_type(ctx, t.dtype))


@LOWERINGS.register(T.Normalize)
def _normalize(t: T.Normalize, img: Any, ctx: Ctx) -> Any:
    mean, std = list(t.mean) * (3 // len(t.mean)), list(t.std) * (3 // len(t.std))
    return ctx.fn.crop_mirror_normalize(
        img, device=ctx.device, mean=mean, std=std, output_layout="HWC", dtype=ctx.types.FLOAT
    )


@LOWERINGS.register(T.Arithmetic)
def _arithmetic(t: T.Arithmetic, img: Any, ctx: Ctx) -> Any:
    return ctx.fn.cast(t.apply(img), device=ctx.device, dtype=dali_type(ctx, ctx.dtype))  # a float input


# The lowerings fusion stands in for (see _builtin).
_BUILTIN: dict[type, Any] = {
    T.RandomResizedCrop: _random_resized_crop,
    T.CenterCrop: _center_crop,
    T.RandomHorizontalFlip: _hflip,
    T.ToDtype: _to_dtype,
    T.Normalize: _normalize,
}


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
