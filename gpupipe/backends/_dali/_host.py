"""Per-sample values the DALI runner computes on the host for each batch and feeds to the graph.

DALI knows an image's size only inside its graph, where every arithmetic node is an operator run
per batch (on the CPU, in float64 for the crop windows): the train recipe's graph had 101
operators, nearly all of them geometry. gpupipe knows the sizes before DALI does — the reader
threads parse every image's header anyway, for the pixel limit — so the geometry is computed there,
vectorized over the batch with NumPy, and enters the graph as a few ``external_source`` arguments
(a crop window, a resize size, a flip decision): the train recipe becomes 7 operators.

The lowerings are written once for both places. A :class:`HostValue` is a deferred NumPy
expression over one batch: ``gpupipe.core._geometry``'s functions run on it with :data:`HOST_OPS`, as
they run on Python ints (``output_spec``, the torch backend) and on DALI nodes (``DALI_OPS``, where
a size is known only in the graph: after a step whose output size the host cannot know, or with
EXIF orientation applied). :meth:`Ctx.arg <gpupipe.backends._dali._compiler.Ctx.arg>` turns a
host value into the graph argument it feeds; the runner evaluates every fed value of a batch with
:func:`evaluate` in a reader thread, off the training thread.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "HostValue",
    "HostEnv",
    "HOST_OPS",
    "Feed",
    "HostCheck",
    "evaluate",
    "failures",
    "image_sizes",
    "box_window",
    "step_factors",
]


class HostValue:
    """A per-sample value of one batch, computed on the host: ``fn`` applied to its inputs' values
    (other host values, or constants), a NumPy array with the batch on its first axis.

    Arithmetic, comparisons, ``&``/``|`` and indexing build new host values; indexing selects along
    the second axis (``factors[2]`` is each sample's factor 2, as on a DALI node of per-sample
    vectors). A host value has no truth value: use :data:`HOST_OPS` ``where``.
    """

    __slots__ = ("fn", "inputs", "name")

    def __init__(self, fn: Callable[..., Any], *inputs: Any, name: str = "") -> None:
        self.fn, self.inputs, self.name = fn, inputs, name

    def evaluate(self, env: HostEnv) -> Any:
        memo = env.memo
        key = id(self)
        if key not in memo:
            memo[key] = self.fn(*(env.value(i) for i in self.inputs))  # the graph's values outlive the batch
        return memo[key]

    def __bool__(self) -> bool:
        raise TypeError("a HostValue is known per batch only: it has no truth value (use HOST_OPS.where)")

    def __getitem__(self, index: int | slice) -> HostValue:
        return HostValue(lambda a: a[:, index], self)

    def __neg__(self) -> HostValue:
        return HostValue(operator.neg, self)

    def __add__(self, other: Any) -> HostValue:
        return HostValue(operator.add, self, other)

    def __radd__(self, other: Any) -> HostValue:
        return HostValue(operator.add, other, self)

    def __sub__(self, other: Any) -> HostValue:
        return HostValue(operator.sub, self, other)

    def __rsub__(self, other: Any) -> HostValue:
        return HostValue(operator.sub, other, self)

    def __mul__(self, other: Any) -> HostValue:
        return HostValue(operator.mul, self, other)

    def __rmul__(self, other: Any) -> HostValue:
        return HostValue(operator.mul, other, self)

    def __truediv__(self, other: Any) -> HostValue:
        return HostValue(operator.truediv, self, other)

    def __rtruediv__(self, other: Any) -> HostValue:
        return HostValue(operator.truediv, other, self)

    def __floordiv__(self, other: Any) -> HostValue:
        return HostValue(operator.floordiv, self, other)

    def __rfloordiv__(self, other: Any) -> HostValue:
        return HostValue(operator.floordiv, other, self)

    def __mod__(self, other: Any) -> HostValue:
        return HostValue(operator.mod, self, other)

    def __rmod__(self, other: Any) -> HostValue:
        return HostValue(operator.mod, other, self)

    def __and__(self, other: Any) -> HostValue:
        return HostValue(operator.and_, self, other)

    def __rand__(self, other: Any) -> HostValue:
        return HostValue(operator.and_, other, self)

    def __or__(self, other: Any) -> HostValue:
        return HostValue(operator.or_, self, other)

    def __ror__(self, other: Any) -> HostValue:
        return HostValue(operator.or_, other, self)

    def __lt__(self, other: Any) -> HostValue:
        return HostValue(operator.lt, self, other)

    def __le__(self, other: Any) -> HostValue:
        return HostValue(operator.le, self, other)

    def __gt__(self, other: Any) -> HostValue:
        return HostValue(operator.gt, self, other)

    def __ge__(self, other: Any) -> HostValue:
        return HostValue(operator.ge, self, other)

    def __eq__(self, other: Any) -> HostValue:  # type: ignore[override]
        return HostValue(operator.eq, self, other)

    def __ne__(self, other: Any) -> HostValue:  # type: ignore[override]
        return HostValue(operator.ne, self, other)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"HostValue({self.name or getattr(self.fn, '__name__', 'fn')})"


class _HostOps:
    """``gpupipe.core._geometry``'s operations on host values (NumPy, vectorized over the batch)."""

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> HostValue:
        return HostValue(np.where, cond, a, b)

    @staticmethod
    def min(a: Any, b: Any) -> HostValue:
        return HostValue(np.minimum, a, b)

    @staticmethod
    def max(a: Any, b: Any) -> HostValue:
        return HostValue(np.maximum, a, b)


HOST_OPS = _HostOps()


@dataclasses.dataclass
class HostEnv:
    """One batch, as the host values see it: the encoded images' ``sizes`` (int64 ``[B, 2]``:
    height, width, from their headers), ``factors(view, step)``, the random factors of a step
    (float64 ``[B, F]``), and each sample's source in a ``gp.Mix`` (``sources``, int64 ``[B]``;
    ``None`` for another source)."""

    sizes: np.ndarray
    factors: Callable[[int, int], np.ndarray]
    memo: dict[int, Any] = dataclasses.field(default_factory=dict)
    sources: np.ndarray | None = None
    windows: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # box-chosen crops, by step

    def window(self, step: int) -> np.ndarray:
        """The crop window of ``step`` (a ``RandomIoUCrop``: chosen by the boxes where they were
        moved, ``_input``), int64 ``[B, 4]`` ``(top, left, height, width)``; -1 where there is none."""
        if step not in self.windows:
            raise ValueError(f"step {step}'s windows depend on the boxes: the batch was fed without them")
        return self.windows[step]

    def value(self, x: Any) -> Any:
        return x.evaluate(self) if isinstance(x, HostValue) else x


def step_factors(view: int, step: int) -> HostValue:
    """The random factors of ``step`` of ``view`` (float64 ``[B, F]``)."""
    return _Factors(view, step)


class _Factors(HostValue):
    __slots__ = ("key",)

    def __init__(self, view: int, step: int) -> None:
        super().__init__(lambda: None, name=f"factors{step}" if view == 0 else f"factors{step}_view{view}")
        self.key = (view, step)

    def evaluate(self, env: HostEnv) -> Any:
        return env.factors(*self.key)


class _Size(HostValue):
    __slots__ = ("axis",)

    def __init__(self, axis: int) -> None:
        super().__init__(lambda: None, name=("height", "width")[axis])
        self.axis = axis

    def evaluate(self, env: HostEnv) -> Any:
        return env.sizes[:, self.axis]


HEIGHT, WIDTH = _Size(0), _Size(1)


class _Source(HostValue):
    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(lambda: None, name="source")

    def evaluate(self, env: HostEnv) -> Any:
        if env.sources is None:
            raise ValueError("a per-source graph fed a batch of a source that is not a gp.Mix")
        return env.sources


SOURCE = _Source()  # each sample's source number in a gp.Mix (int64 [B])


class _Window(HostValue):
    __slots__ = ("step",)

    def __init__(self, step: int) -> None:
        super().__init__(lambda: None, name=f"window{step}")
        self.step = step

    def evaluate(self, env: HostEnv) -> Any:
        return env.window(self.step)


def box_window(step: int) -> HostValue:
    """Step ``step``'s crop window as the boxes chose it (:meth:`HostEnv.window`)."""
    return _Window(step)


def image_sizes() -> tuple[HostValue, HostValue]:
    """The encoded images' ``(height, width)`` as host values (int64 ``[B]`` each), as their
    headers declare them (the size the decoders output)."""
    return HEIGHT, WIDTH


@dataclasses.dataclass(frozen=True)
class Feed:
    """A graph input the runner feeds for each batch: ``value`` evaluated, as ``dtype`` (a NumPy
    dtype), one row per sample (``[B]`` for a scalar argument, ``[B, k]`` for a vector). ``draw``
    is the ``(view, step)`` whose random factors it carries whole, if it does."""

    value: HostValue
    dtype: Any
    draw: tuple[int, int] | None = None
    ragged: str | None = None  # the layout of a feed of one array per sample, of its own shape

    def __call__(self, env: HostEnv, batch: int) -> Any:
        if self.ragged is not None:  # DALI tensors, wrapped here: off the training thread, no copy
            from nvidia.dali.tensors import TensorCPU

            return [TensorCPU(np.ascontiguousarray(a, dtype=self.dtype), self.ragged) for a in env.value(self.value)]
        out = np.asarray(env.value(self.value), dtype=self.dtype)
        if out.ndim == 0:  # a constant the lowering gave as a host value
            out = np.full(batch, out, dtype=self.dtype)
        return np.ascontiguousarray(out)


@dataclasses.dataclass(frozen=True)
class HostCheck:
    """A per-sample condition computed on the host before the batch is fed: where ``ok`` is false
    the sample fails with ``message(*values)``, as on the torch backend."""

    ok: HostValue
    values: tuple[Any, ...]
    message: Callable[..., str]


def evaluate(feeds: dict[str, Feed], env: HostEnv, batch: int) -> dict[str, np.ndarray]:
    """Every fed input of one batch, by name."""
    return {name: feed(env, batch) for name, feed in feeds.items()}


def failures(checks: Sequence[HostCheck], env: HostEnv, batch: int) -> dict[int, str]:
    """``position -> message`` of the samples that fail a host check (the first check each fails)."""
    failed: dict[int, str] = {}
    for check in checks:
        ok = np.broadcast_to(np.asarray(env.value(check.ok), dtype=bool), (batch,))
        if ok.all():
            continue
        values = [np.broadcast_to(np.asarray(env.value(v)), (batch,)) for v in check.values]
        for i in np.flatnonzero(~ok).tolist():
            failed.setdefault(i, check.message(*(int(v[i]) for v in values)))
    return failed
