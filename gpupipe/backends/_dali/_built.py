"""What a DALI graph is built with and what its lowerings add to it, once per graph
(:class:`Built`): the options every step reads (device, seed, decoder arguments, EXIF, colour twist,
host geometry, the GPU decode), and what the steps accumulate — the inputs the runner feeds per
batch, the per-sample checks, the random factors used. A lowering sees it through its step's
:class:`~gpupipe.backends._dali._context.Ctx`, which holds what is particular to the step being
lowered (its place, the node's dtype, size and layout, the branch it is in)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...core._config import DecodeMode
from ._host import Feed, HostCheck, HostValue, step_factors

__all__ = ["Built", "Check", "NUMPY_TO_DALI", "is_node"]

NUMPY_TO_DALI = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.int32): "INT32",
    np.dtype(np.float32): "FLOAT",
    np.dtype(np.float64): "FLOAT64",
}


@dataclasses.dataclass(frozen=True)
class Check:
    """A per-sample condition the graph computes: where ``ok`` is false, the sample fails with
    ``message(*values)`` (``values``: per-sample int nodes, read back with the condition)."""

    ok: Any
    values: tuple[Any, ...]
    message: Callable[..., str]


def is_node(value: Any) -> bool:
    """Whether ``value`` is a DALI graph node."""
    return type(value).__name__ == "DataNode"


@dataclasses.dataclass
class Built:
    """One graph's options and what its lowerings added to it so far.

    Attributes:
        device: ``"cpu"`` or ``"gpu"``.
        seed: the loader's seed (for DALI's own random operators: :meth:`next_seed`).
        decoder_args: extra arguments of the ``mixed`` decoders (GPU only).
        exif: apply EXIF orientation in the decoders.
        color_twist: lower ColorJitter to DALI's ``color_twist``.
        host_geometry: sizes and crop windows computed on the host from the headers (never with
            ``exif``: the headers' sizes are before orientation).
        decode: how a GPU graph decodes a leading ``RandomResizedCrop``.
        feeds: ``external_source`` name → :class:`~gpupipe.backends._dali._host.Feed`: every input
            the runner feeds per batch besides the encoded images.
        checks: per-sample conditions computed in the graph; ``host_checks``: on the host.
    """

    device: str
    seed: int = 0
    decoder_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    exif: bool = False
    color_twist: bool = False
    host_geometry: bool = True
    decode: DecodeMode = DecodeMode.ROI
    feeds: dict[str, Feed] = dataclasses.field(default_factory=dict)
    checks: list[Check] = dataclasses.field(default_factory=list)
    host_checks: list[HostCheck] = dataclasses.field(default_factory=list)
    _seeds: Any = None
    _graph_factors: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    _host_factors: dict[tuple[int, int], HostValue] = dataclasses.field(default_factory=dict)
    _fed: dict[tuple[int, str], Any] = dataclasses.field(default_factory=dict)  # (id(value), dtype) -> node

    def __post_init__(self) -> None:
        self._seeds = itertools.count(1)
        self.host_geometry = self.host_geometry and not self.exif

    def graph_factors(self, key: tuple[int, int]) -> Any:
        """The random factors of ``(view, step)`` as a CPU graph node fed per batch (once)."""
        if key not in self._graph_factors:
            name = f"factors{key[1]}" if key[0] == 0 else f"factors{key[1]}_view{key[0]}"
            node = self.fn.external_source(name=name, dtype=self.types.FLOAT64, ndim=1, device="cpu")
            self._graph_factors[key] = node
            self.feeds[name] = Feed(step_factors(*key), np.float64, draw=key)
        return self._graph_factors[key]

    def host_factors(self, key: tuple[int, int]) -> HostValue:
        """The random factors of ``(view, step)`` as a host value (once)."""
        factors = self._host_factors.get(key)
        if factors is None:
            factors = self._host_factors[key] = step_factors(*key)
        return factors

    def feed(self, value: HostValue, dtype: np.dtype, *, ndim: int, layout: str | None = None) -> Any:
        """The ``external_source`` fed ``value`` (once per value and dtype); ``layout``: one
        tensor per sample, each of its own shape (a ragged feed)."""
        key = (id(value), dtype.str)  # the feed keeps the value: its id stays its own
        if key not in self._fed:
            name = f"arg{len(self._fed)}"
            dali_type = getattr(self.types, NUMPY_TO_DALI[dtype])
            extra = {} if layout is None else {"layout": layout}
            self._fed[key] = self.fn.external_source(name=name, dtype=dali_type, ndim=ndim, device="cpu", **extra)
            self.feeds[name] = Feed(value, dtype, ragged=layout)
        return self._fed[key]

    @property
    def draws(self) -> set[tuple[int, int]]:
        """The ``(view, step)`` of every random step whose factors the graph uses so far."""
        return set(self._graph_factors) | set(self._host_factors)

    def require(self, ok: Any, values: Sequence[Any], message: Callable[..., str]) -> None:
        """Fails a sample where ``ok`` is false, with ``message(*values)``: checked on the host
        before the batch is fed where ``ok`` is a host value (or a constant), else in the graph."""
        if ok is True:  # holds for every sample (fixed sizes)
            return
        if is_node(ok) or any(is_node(v) for v in values):
            self.checks.append(Check(ok, tuple(values), message))
        else:
            self.host_checks.append(HostCheck(ok, tuple(values), message))

    def next_seed(self) -> int:
        """A distinct seed for each DALI random operator a user lowering adds."""
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
