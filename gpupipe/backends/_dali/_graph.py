"""The DALI pipeline a runner drives: :func:`define_graph` defines it from the views (built by
the runner), :class:`Graph` feeds and schedules its iterations, and the fork hooks keep every
pipeline of the parent alive in a forked child (see ``_runner``'s "Lifecycle")."""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ...core._config import DecodeMode
from ...transforms import Transform
from ._compiler import Ctx, Lowered, lower
from ._input import FeedBatch

__all__ = ["define_graph", "Defined", "Graph", "IterationFailed", "LIVE_RUNNERS", "feed"]

LIVE_RUNNERS: weakref.WeakSet[Any] = weakref.WeakSet()  # every DaliRunner alive (pinned in a forked child)
_PINNED: list[Any] = []  # in a forked child: the parent's runners and pipelines, never released here


_GC_WAS_ENABLED = [False]


def _hold_gc() -> None:
    """Before a fork: no garbage collection until the child has pinned the parent's pipelines.
    Python's own after-fork hooks (threading's, registered before this module's) run first in the
    child and allocate; a collection there that finds a leaked DALI pipeline in a reference cycle
    would destroy it in the child, and wait forever (seen: a torch worker forked after a failed
    DALI loader whose traceback was not yet collected)."""
    _GC_WAS_ENABLED[0] = gc.isenabled()
    gc.disable()


def _release_gc() -> None:
    if _GC_WAS_ENABLED[0]:
        gc.enable()


def _pin_in_child() -> None:
    """After a fork, in the child: keep every runner and every DALI pipeline of the parent alive
    for good. A DALI pipeline destroyed in a forked child waits forever in its executor's
    destructor for the parent's threads — and one can be referenced from anywhere (a traceback's
    frames, say), so all of them are pinned, not only the runners'. The garbage collector, held
    since before the fork, runs again once they are."""
    import sys

    try:
        _PINNED.extend(LIVE_RUNNERS)
        dali = sys.modules.get("nvidia.dali.pipeline")
        refs = getattr(getattr(dali, "Pipeline", None), "_pipes", None)  # DALI's set of weak references to them
        for ref in list(refs or ()):
            pipe = ref() if callable(ref) else None
            backend = getattr(pipe, "_pipe", None)
            if backend is not None:  # the C++ pipeline: pinned, and detached so that no shutdown reaches it
                _PINNED.append(backend)
                pipe._pipe = None  # type: ignore[union-attr]
    finally:
        _release_gc()


os.register_at_fork(before=_hold_gc, after_in_parent=_release_gc, after_in_child=_pin_in_child)


class Graph:
    """One built DALI pipeline, fed and scheduled by the runner: :meth:`push` feeds a batch and
    schedules its iteration, :meth:`pop` returns the oldest scheduled one with its outputs.

    DALI's first ``schedule_run`` starts ``prefetch`` iterations at once, so the first batches are
    held until that many are fed; :meth:`start` pads a shorter first run with repeats of its last
    batch, whose outputs nobody sees. ``uses`` counts the iterations fed from each batch: its
    buffer returns to the pool, and its maps' uses end, when its last one is popped."""

    def __init__(self, pipe: Any, lowered: Lowered, depth: int) -> None:
        self.pipe, self.lowered, self.depth = pipe, lowered, depth
        self.started = False
        self.broken = False  # a feed, schedule or output call failed midway: DALI's queues are unknown
        self.held: list[tuple[FeedBatch, bool]] = []  # fed, waiting for the first schedule_run
        self.flight: collections.deque[tuple[FeedBatch, bool]] = collections.deque()  # (batch, repeat)
        self.uses: collections.Counter[int] = collections.Counter()  # by id(batch.token)
        self.owners: dict[int, FeedBatch] = {}  # a batch per token in use: what abandon() releases

    @property
    def busy(self) -> int:
        return len(self.held) + len(self.flight)

    def push(self, batch: FeedBatch, *, repeat: bool = False) -> None:
        """Feeds ``batch`` and schedules its iteration (a ``repeat`` is not yielded). Anything
        raised midway (a rejected feed, Ctrl-C) leaves the graph :attr:`broken`: the runner then
        drops it rather than guess which of DALI's queues moved."""
        self.uses[id(batch.token)] += 1  # first: a push that fails still owns the batch
        self.owners.setdefault(id(batch.token), batch)
        self._check()
        try:
            feed(self.pipe, "encoded", batch.encoded)
            for name, value in batch.feeds.items():
                feed(self.pipe, name, value)
            if self.started:
                self.pipe.schedule_run()
                self.flight.append((batch, repeat))
                return
            self.held.append((batch, repeat))
            if len(self.held) == self.depth:
                self.pipe.schedule_run()  # runs all `depth` held iterations
                self.flight.extend(self.held)
                self.held.clear()
                self.started = True
        except BaseException:
            self.broken = True
            raise

    def start(self) -> None:
        """Schedules the held batches now, padding with repeats of the last."""
        for _ in range(self.depth - len(self.held) if self.held else 0):
            self.push(self.held[-1][0], repeat=True)

    def pop(self, stream: Any) -> tuple[FeedBatch, bool, Any]:
        """``(batch, repeat, outputs)`` of the oldest scheduled iteration. DALI's failure on that
        iteration is an :class:`IterationFailed`; the graph is then :attr:`broken` until
        :meth:`recover` (DALI has consumed the failed iteration and runs the next ones)."""
        self._check()
        try:
            batch, repeat = self.flight.popleft()
        except BaseException:
            self.broken = True
            raise
        try:
            return batch, repeat, self.pipe.outputs(stream)
        except RuntimeError as e:
            self.broken = True
            raise IterationFailed(batch, repeat, e) from e
        except BaseException:
            self.broken = True
            raise

    def recover(self) -> None:
        """After an :class:`IterationFailed`: the queues are known again (the failed iteration is
        gone, the later ones stand), so the graph is used on."""
        self.broken = False

    def _check(self) -> None:
        if self.broken:
            raise RuntimeError("gpupipe: this DALI pipeline's queues are in an unknown state (a call failed midway)")

    def done(self, batch: FeedBatch) -> bool:
        """One iteration fed from ``batch`` (or a retried copy of it) is over; whether it was the last."""
        key = id(batch.token)
        self.uses[key] -= 1
        if self.uses[key] > 0:
            return False
        del self.uses[key]
        del self.owners[key]
        return True

    def shutdown(self) -> None:
        """Shuts the pipeline down now (its threads joined), whoever else still references it: a
        finished run's frame, kept by the traceback of the error it raised, holds its graph until
        the garbage collector breaks that cycle. Idempotent; the graph is unusable afterwards."""
        self.broken = True
        with contextlib.suppress(Exception):
            self.pipe._shutdown()

    def abandon(self) -> list[FeedBatch]:
        """Shuts the pipeline down (its threads joined: nothing reads a fed batch any more) and
        returns every batch it still owned, for their buffers and maps to be released."""
        self.shutdown()
        owned = list(self.owners.values())
        self.owners.clear()
        self.uses.clear()
        self.held.clear()
        self.flight.clear()
        return owned


def feed(pipe: Any, name: str, data: Any) -> None:
    """``pipe.feed_input(name, data)`` for the runner's own inputs — a list of ``TensorCPU`` views,
    or a NumPy array with the batch on its first axis — straight to DALI's backend call, without
    ``feed_input``'s checks of each sample's type and of every operator's name (a microsecond a
    sample of Python on the training thread; measured with bench/input_path.py). Any other DALI
    goes through ``feed_input``."""
    backend = getattr(pipe, "_pipe", None)
    if backend is None or not hasattr(backend, "SetExternalTensorInput"):
        pipe.feed_input(name, data)
    elif isinstance(data, list):
        backend.SetExternalTensorInput(name, data, None, False)
    else:
        from nvidia.dali.tensors import TensorListCPU

        backend.SetExternalTLInput(name, TensorListCPU(data, ""), None, False)


class IterationFailed(RuntimeError):
    """DALI failed on one iteration (``error``), of ``batch``."""

    def __init__(self, batch: FeedBatch, repeat: bool, error: RuntimeError) -> None:
        super().__init__(str(error))
        self.batch, self.repeat, self.error = batch, repeat, error


class Defined(NamedTuple):
    """A defined (not yet built) DALI pipeline and its lowering."""

    pipe: Any
    lowered: Lowered


def define_graph(
    views: Sequence[Sequence[Transform]],
    *,
    gpu: bool,
    device_id: int | None,
    batch_size: int,
    num_threads: int,
    prefetch: int,
    seed: int,
    channels_last: bool,
    decoder_args: dict[str, Any],
    graph: Callable[[Any, Ctx], Any] | None = None,
    exif: bool = False,
    color_twist: bool = False,
    decode: DecodeMode = DecodeMode.ROI,
    host_geometry: bool = True,
    per_source: bool = False,
) -> Defined:
    """The DALI pipeline of ``views`` (one transform list per output) and its lowering, defined but
    not built. With ``gpu``
    and ``device_id=None`` it is the GPU graph, defined (and serializable) on a machine without a
    GPU: the tests check its operators and their placement that way. ``graph(encoded, ctx)``
    replaces the lowering (``bench/input_path.py`` times the input path with a pass-through)."""
    from nvidia.dali import Pipeline, fn, types

    pipe = Pipeline(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=prefetch,
        exec_dynamic=True,
    )
    with pipe:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1, no_copy=True)
        ctx = Ctx("gpu" if gpu else "cpu", seed, decoder_args=decoder_args if gpu else {}, exif=exif,
                  color_twist=color_twist, decode=decode, host_geometry=host_geometry)  # fmt: skip
        if graph is None:
            lowered = lower(views, encoded, ctx, channels_last=channels_last, per_source=per_source)
        else:
            built = ctx.built
            lowered = Lowered((graph(encoded, ctx),), feeds=built.feeds, draws=frozenset(built.draws),
                              host_checks=tuple(built.host_checks), host_geometry=built.host_geometry)  # fmt: skip
        pipe.set_outputs(*lowered.outputs())
    return Defined(pipe, lowered)
