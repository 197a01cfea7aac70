"""What a DALI lowering function works with: the :class:`Ctx` of its step (the graph being built,
``_built.Built``; the step's random factors, per-sample values fed from the host, per-sample
checks), the registry of lowerings, and the compiled graph's description (:class:`Lowered`). DALI
is imported only when a graph is defined."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ...core._config import DecodeMode
from .._registry import Registry
from ._built import NUMPY_TO_DALI, Built, Check, is_node
from ._host import HOST_OPS, Feed, HostCheck, HostValue, image_sizes

__all__ = [
    "LOWERINGS",
    "DALI_OPS",
    "Ctx",
    "Check",
    "Lowered",
    "dali_type",
    "scaled_to_uint8",
    "where",
    "to_float",
    "hw",
]

LOWERINGS = Registry("dali")


class Ctx:
    """What a lowering function sees at its step: the graph being built (:attr:`built`: the
    device, options, and what the steps add), the step's random factors, the size of the image
    being lowered (:meth:`shape`), per-sample values fed from the host (:meth:`arg`) and
    :meth:`require` for per-sample conditions.

    The compiler moves one ``Ctx`` from step to step; what it holds of the step being lowered:

    Attributes:
        dtype: the dtype of the node being lowered.
        channels: the channels of the node being lowered.
        step: the position in its view's transform list of the transform being lowered.
        view: the view being lowered (0 for a pipeline of one transform list); each view's steps
            have their own factors, drawn from ``(seed, epoch, sample, view, step)``.
        size: the node's per-sample ``(height, width)`` where known outside the graph.
        resized: set by a lowering whose output size depends on its input's.
        layout: of the node being lowered (CHW after the fused tail, or its transpose).
        branch: the predicates of the conditional branches being lowered, outermost first.

    The graph's (:class:`~gpupipe.backends._dali._built.Built`), read here as they were:
    ``device`` (``"cpu"`` or ``"gpu"``), ``seed`` (the loader's, for a user lowering that uses
    DALI's own random operators with :meth:`next_seed`: seeded once per loader, so not
    reproducible per sample or on resume, and not the torch backend's draws; use
    :meth:`random`), ``decoder_args``, ``exif`` (EXIF orientation in the decoders; default
    ``False``, as torchvision's decoders), ``color_twist``, ``host_geometry``, ``decode``,
    ``feeds``, ``checks``, ``host_checks`` and ``draws``.
    """

    def __init__(self, device: str, seed: int = 0, *, decoder_args: dict[str, Any] | None = None, exif: bool = False,
                 color_twist: bool = False, host_geometry: bool = True,
                 decode: DecodeMode = DecodeMode.ROI) -> None:  # fmt: skip
        self.built = Built(device, seed, dict(decoder_args or {}), exif, color_twist, host_geometry, decode)
        self.dtype: torch.dtype = torch.uint8
        self.channels = 3
        self.step = 0
        self.view = 0
        self.size: tuple[Any, Any] | None = None
        self.resized: tuple[Any, Any] | None = None
        self.layout = "HWC"
        self.branch: tuple[Any, ...] = ()
        self._scope: tuple[int, int] | None = None

    def __repr__(self) -> str:
        return (f"DaliContext(device={self.device!r}, view={self.view}, step={self.step}, dtype={self.dtype}, "
                f"layout={self.layout!r})")  # fmt: skip

    # ----------------------------------------------------------- the graph's --
    device = property(lambda self: self.built.device, doc='``"cpu"`` or ``"gpu"``.')
    seed = property(lambda self: self.built.seed, doc="The loader's seed.")
    decoder_args = property(lambda self: self.built.decoder_args, doc="The ``mixed`` decoders' extra arguments.")
    exif = property(lambda self: self.built.exif, doc="Whether the decoders apply EXIF orientation.")
    color_twist = property(lambda self: self.built.color_twist, doc="ColorJitter as DALI's ``color_twist``.")
    host_geometry = property(lambda self: self.built.host_geometry, doc="Sizes and windows computed on the host.")
    decode = property(lambda self: self.built.decode, doc="How a leading RandomResizedCrop is decoded (GPU).")
    feeds = property(lambda self: self.built.feeds, doc="The inputs the runner feeds per batch, by name.")
    checks = property(lambda self: self.built.checks, doc="Per-sample conditions computed in the graph.")
    host_checks = property(lambda self: self.built.host_checks, doc="Per-sample conditions checked on the host.")
    draws = property(lambda self: self.built.draws, doc="The ``(view, step)`` of every random step used.")
    orientation = property(lambda self: self.built.orientation, doc="The decoders' EXIF argument.")
    decoder_device = property(lambda self: self.built.decoder_device, doc="``mixed`` on the GPU, else ``cpu``.")
    fn = property(lambda self: self.built.fn, doc="``nvidia.dali.fn``.")
    types = property(lambda self: self.built.types, doc="``nvidia.dali.types``.")

    def next_seed(self) -> int:
        """A distinct seed for each DALI random operator a user lowering adds (see ``seed``)."""
        return self.built.next_seed()

    def require(self, ok: Any, values: Sequence[Any], message: Callable[..., str]) -> None:
        """Fails a sample where ``ok`` is false, with ``message(*values)``: checked on the host
        before the batch is fed where ``ok`` is a host value (or a constant), else in the graph."""
        self.built.require(ok, values, message)

    # ---------------------------------------------------------------- randomness --
    def random(self, step: int | None = None) -> Any:
        """The random factors of ``step`` (default: the step being lowered) as a graph node: a CPU
        node, float64 ``[F]`` per sample — one row of ``Transform.sample``'s output, fed for each
        batch. Inside :meth:`scoped_factors` (without ``step``), the scope's columns."""
        node = self.built.graph_factors((self.view, self.step if step is None else step))
        if step is None and self._scope is not None:
            return node[self._scope[0] : self._scope[1]]
        return node

    def host_random(self, step: int | None = None) -> HostValue:
        """The random factors of ``step`` (default: the step being lowered) as a host value
        (float64 ``[B, F]``): what the graph needs of them goes in through :meth:`arg`, computed
        on the host (a flip decision, a crop window), so that no arithmetic on them runs in the
        graph. Inside :meth:`scoped_factors` (without ``step``), the scope's columns."""
        factors = self.built.host_factors((self.view, self.step if step is None else step))
        if step is None and self._scope is not None:
            return factors[self._scope[0] : self._scope[1]]
        return factors

    def factor(self, i: int, dtype: Any = np.float32) -> Any:
        """Factor ``i`` of the step being lowered, as a per-sample graph argument of ``dtype``."""
        return self.arg(self.host_random()[i], dtype)

    def decision(self, i: int = 0) -> Any:
        """Factor ``i`` (a 0/1 decision: a flip, a grayscale) as the int32 argument DALI's
        operators take."""
        return self.factor(i, np.int32)

    @contextlib.contextmanager
    def scoped_factors(self, start: int, stop: int) -> Iterator[None]:
        """Within the block, :meth:`random` and :meth:`host_random` (without ``step``) return
        columns ``start:stop`` of the step's factors: a composite transform gives each inner
        transform's lowering its own slice (``with ctx.scoped_factors(1, 3): node =
        lowering(inner, node, ctx)``). Scopes nest."""
        saved = self._scope
        offset = saved[0] if saved is not None else 0
        self._scope = (offset + start, offset + stop)
        try:
            yield
        finally:
            self._scope = saved

    # ---------------------------------------------------------- per-sample values --
    def shape(self, img: Any) -> tuple[Any, Any]:
        """The per-sample ``(height, width)`` of ``img``, the node being lowered: host values (or
        ints, where the pipeline fixes them) where the host knows them, else int32 graph nodes."""
        return self.size if self.size is not None else hw(img)

    def ops(self, *values: Any) -> Any:
        """The ``gpupipe.core._geometry`` operations for ``values``: on host values, graph nodes or ints."""
        from ...core._geometry import INT

        if any(isinstance(v, HostValue) for v in values):
            return HOST_OPS
        if any(is_node(v) for v in values):
            return DALI_OPS
        return INT

    def arg(self, value: Any, dtype: Any) -> Any:
        """``value`` as a per-sample argument of a DALI operator, of NumPy ``dtype`` (int32,
        float32 or float64): a host value becomes an ``external_source`` the runner feeds (one
        operator, no arithmetic in the graph), a graph node is cast, a number stays a constant."""
        dtype = np.dtype(dtype)
        if isinstance(value, HostValue):
            return self.local(self.built.feed(value, dtype, ndim=0))
        if is_node(value):
            return self.fn.cast(value, dtype=getattr(self.types, NUMPY_TO_DALI[dtype]))
        return int(value) if dtype.kind in "iu" else float(np.asarray(value, dtype=dtype))

    def arg_vector(self, values: Sequence[Any], dtype: Any) -> Any:
        """``values`` (one per element) as a per-sample vector argument (a crop's start, a size):
        one fed ``external_source`` where any is a host value, a stack of graph nodes, or a list."""
        dtype = np.dtype(dtype)
        if any(isinstance(v, HostValue) for v in values):
            return self.local(self.built.feed(HostValue(_columns, *values), dtype, ndim=1))
        if any(is_node(v) for v in values):
            return self.fn.stack(*(self.arg(v, dtype) for v in values))
        return [self.arg(v, dtype) for v in values]

    def channel_constant(self, values: Sequence[float]) -> Any:
        """A float32 constant ``[C]``, one value per channel, for arithmetic with an HWC image: of
        the branch's samples inside one (:meth:`local`)."""
        if not self.branch:
            return self.types.Constant(np.array(values, np.float32))
        return self.local(self.fn.constant(fdata=[float(v) for v in values], shape=[len(values)]))

    def arg_matrices(self, value: HostValue, dtype: Any) -> Any:
        """``value`` (``[B, 6]`` on the host) as a per-sample ``[2, 3]`` matrix argument (an affine
        map): one fed ``external_source``, no reshape in the graph."""
        matrices = HostValue(lambda m: np.reshape(m, (-1, 2, 3)), value)
        return self.local(self.built.feed(matrices, np.dtype(dtype), ndim=2))

    def arg_tensors(self, value: HostValue, dtype: Any, layout: str) -> Any:
        """``value`` (one array per sample, each of its own shape) as a per-sample input of
        ``layout``: an ``external_source`` the runner feeds as a list of tensors."""
        return self.local(self.built.feed(value, np.dtype(dtype), ndim=len(layout), layout=layout))

    def local(self, node: Any) -> Any:
        """``node`` (of the whole batch: a fed argument, a constant) for the operators being
        lowered: inside conditional branches (``branch``), their samples only."""
        for predicate in self.branch:
            node = self.fn._conditional.split(node, predicate=predicate)[0]
        return node

    @contextlib.contextmanager
    def branched(self, predicate: Any) -> Iterator[None]:
        """Lowers the block in the conditional branch of ``predicate`` (a per-sample boolean node
        of the current samples): fed arguments and constants split alike (:meth:`local`), sizes
        read from the branch's own nodes. DALI's ``_conditional.split`` and ``merge`` (the
        operators behind its ``if``) around it are the caller's."""
        saved = self.size, self.branch
        self.size, self.branch = None, (*self.branch, predicate)
        try:
            yield
        finally:
            self.size, self.branch = saved

    # ------------------------------------------------------------------- DALI --
    def encoded_shape(self, encoded: Any) -> tuple[Any, Any]:
        """The encoded images' ``(height, width)`` as the decoders output them: from the headers
        on the host, or (``host_geometry`` off) ``peek_image_shape`` in the graph."""
        if self.host_geometry:
            return image_sizes()
        shape = peek_shape(self, encoded)
        return shape[0], shape[1]


def _columns(*values: Any) -> np.ndarray:
    """Per-sample scalars (arrays ``[B]`` or constants) as one ``[B, k]`` array."""
    batch = max((np.shape(v)[0] for v in values if np.ndim(v)), default=1)
    return np.stack([np.broadcast_to(np.asarray(v), (batch,)) for v in values], axis=1)


def peek_shape(ctx: Ctx, encoded: Any) -> Any:
    """The encoded images' ``[H, W, C]`` (int32, CPU), from their headers, as the decoders see them."""
    return ctx.fn.peek_image_shape(encoded, dtype=ctx.types.INT32, **ctx.orientation)


def hw(img: Any) -> tuple[Any, Any]:
    """A graph node's per-sample ``(height, width)``: int32 CPU nodes (HWC layout)."""
    from nvidia.dali import types

    shape = img.shape(dtype=types.INT32, device="cpu")
    return shape[0], shape[1]


def to_float(ctx: Ctx, value: Any) -> Any:
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


def where(cond: Any, a: Any, b: Any) -> Any:
    """Per-sample ``a if cond else b`` in DALI arithmetic (``cond`` a boolean node)."""
    return cond * a + (1 - cond) * b


class _DaliOps:
    """gpupipe.core._geometry's operations on DALI nodes (integer arithmetic, per sample)."""

    where = staticmethod(where)

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
    """A compiled graph: the images of each view, the inputs fed per batch (:attr:`feeds`: random
    factors and host-computed arguments), the per-sample conditions checked on the host before
    feeding (:attr:`host_checks`) and, where a lowering required conditions in the graph, one int32
    vector per sample — the encoded image's ``(height, width)``, then each check's ``ok`` and
    values. ``draws``: the ``(view, step)`` of every random step whose factors the graph uses;
    ``host_geometry``: whether the runner must give the images' header sizes."""

    images: tuple[Any, ...]  # one node per view
    checks: tuple[Check, ...] = ()
    check_output: Any = None
    feeds: dict[str, Feed] = dataclasses.field(default_factory=dict)
    host_checks: tuple[HostCheck, ...] = ()
    draws: frozenset[tuple[int, int]] = frozenset()
    host_geometry: bool = False
    decode: DecodeMode | None = None  # how a leading RandomResizedCrop is decoded, where one is fused

    def outputs(self) -> list[Any]:
        return [*self.images] if self.check_output is None else [*self.images, self.check_output]

    def failures(self, rows: np.ndarray) -> list[tuple[int, tuple[int, int], str]]:
        """``(sample, (height, width), message)`` for each sample of the batch that failed a
        graph check, from the check output's ``[B, M]`` rows."""
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
