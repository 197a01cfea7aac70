"""Runs a compiled pipeline with DALI and hands batches to torch through DLPack.

One DALI pipeline per loader: built with the runner and reused for every epoch, validation pass
and resume (rebuilt only after DALI failed, or for a plan with larger batches). It has no random
operator and no callback: the runner feeds every input of each iteration itself.

Input path (per batch, never per sample on the training thread; ``_input``):

- the index locates the batch's samples at once (:meth:`Index.locate_batch`: shards, keys,
  parsed labels and byte ranges, from arrays);
- reader threads (:data:`READ_THREADS`) prepare the batches ahead of DALI. For a CPU pipeline each
  shard is memory-mapped under a read lease (``storage._mapped``) and the samples are views of
  the page cache: no copy at all. Where no lease can be had (not the file's owner, NFS, ...), and
  for a GPU pipeline, the byte ranges are ``pread`` straight into one reused buffer per batch
  (pinned memory on a GPU, so that the decoder's copies to the device are asynchronous; the GIL
  is released during each read);
- the batch goes to DALI as those views (``external_source(no_copy=True)``): DALI never copies
  the encoded bytes and Python never allocates them. A buffer returns to the pool, and a map's
  lease may go, only once DALI has produced the outputs of every iteration that reads it (on a
  GPU, once the consumer stream has passed them), and an epoch never ends with fed or scheduled
  iterations left: an abandoned epoch drains them, so nothing of it leaks into the next one;
- every other input of the graph is computed there for the whole batch (``_host``): the images'
  sizes are read from their headers, and the crop windows, resize sizes, flip decisions and other
  per-sample arguments follow from them and from the random factors (``gpupipe._random``), each
  fed as one array; labels and keys never enter the graph.

Exactly the samples of the plan in its order, padding and resume included, each rank reading
only its own byte ranges; a shard shorter than its index says (it shrank) is a ``ShardError``
naming the shard and the first key past its end. A shard that is truncated while mapped can never
raise SIGBUS: the truncation waits on the lease, the runner sees the lease breaking and reads that
shard with ``pread`` from the next batch on, and lets the lease go once the batches already
handed to DALI are done.

Hand-off (DALI 2.4, dynamic executor; read in DALI's sources, see docs/guide/gpu.md, "Running on GPUs"):

- Each batch is asked for on the consumer's stream — torch's current stream on the loader's GPU,
  in the thread that iterates: ``pipe.outputs(stream)`` makes that stream wait on DALI's work (a
  ``cudaStreamWaitEvent``) and does not block the host; ``torch.from_dlpack`` waits again on the
  batch's ready event (free). Kernels the training step queues on that stream therefore never
  read a batch before it is ready.
- The dynamic executor never recycles an output buffer that is still referenced, and
  ``as_tensor()`` + ``torch.from_dlpack`` share it without a copy. When torch frees the tensor,
  DALI returns the memory to its pool only after a device-wide synchronization (its DLPack
  "graveyard" thread), so memory is never reused while queued kernels, on any stream, may read it.
- A batch used on another stream needs ``other.wait_stream(torch.cuda.current_stream())`` first,
  as any tensor produced on one stream and used on another.
- CPU outputs (and labels, keys) are host data; labels are copied to the GPU from pinned memory
  on the same current stream.

Lifecycle: the pipeline references no runner (no callback), so it is shut down (its threads
joined) as soon as the runner drops it, by :meth:`DaliRunner.close` or when collected. A forked
child (a torch-backend worker started after a DALI loader) inherits the runner but none of its
threads: there the runner is pinned and never closed or collected, since shutting down DALI's
executor or the reader pool would wait forever for threads that exist only in the parent.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from ..._config import DecodeMode
from ..._dist import ranks_per_node
from ..._errors import ClosedError, SampleError
from ..._plan import RankPlan
from ...sources import RawSample
from ...transforms import Transform
from .._base import RawBatch, Runs, RunSpec, donor, fill, to_device
from ._compiler import Ctx, Lowered, lower
from ._input import READ_THREADS, Batch, Buffers, Maps, Reader
from ._proto import operator_count
from ._strategy import choose, nvjpeg_version

__all__ = ["DaliRunner"]


_LIVE: weakref.WeakSet[DaliRunner] = weakref.WeakSet()
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
        _PINNED.extend(_LIVE)
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


class _Graph:
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
        self.held: list[tuple[Batch, bool]] = []  # fed, waiting for the first schedule_run
        self.flight: collections.deque[tuple[Batch, bool]] = collections.deque()  # (batch, repeat)
        self.uses: collections.Counter[int] = collections.Counter()  # by id(batch.token)
        self.owners: dict[int, Batch] = {}  # a batch per token in use: what abandon() releases

    @property
    def busy(self) -> int:
        return len(self.held) + len(self.flight)

    def push(self, batch: Batch, *, repeat: bool = False) -> None:
        """Feeds ``batch`` and schedules its iteration (a ``repeat`` is not yielded). Anything
        raised midway (a rejected feed, Ctrl-C) leaves the graph :attr:`broken`: the runner then
        drops it rather than guess which of DALI's queues moved."""
        self.uses[id(batch.token)] += 1  # first: a push that fails still owns the batch
        self.owners.setdefault(id(batch.token), batch)
        self._check()
        try:
            self.pipe.feed_input("encoded", batch.encoded)
            for name, value in batch.feeds.items():
                self.pipe.feed_input(name, value)
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

    def pop(self, stream: Any) -> tuple[Batch, bool, Any]:
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

    def done(self, batch: Batch) -> bool:
        """One iteration fed from ``batch`` (or a retried copy of it) is over; whether it was the last."""
        key = id(batch.token)
        self.uses[key] -= 1
        if self.uses[key] > 0:
            return False
        del self.uses[key]
        del self.owners[key]
        return True

    def abandon(self) -> list[Batch]:
        """Shuts the pipeline down (its threads joined: nothing reads a fed batch any more) and
        returns every batch it still owned, for their buffers and maps to be released."""
        self.broken = True
        with contextlib.suppress(Exception):
            self.pipe._shutdown()
        owned = list(self.owners.values())
        self.owners.clear()
        self.uses.clear()
        self.held.clear()
        self.flight.clear()
        return owned


class IterationFailed(RuntimeError):
    """DALI failed on one iteration (``error``), of ``batch``."""

    def __init__(self, batch: Batch, repeat: bool, error: RuntimeError) -> None:
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
            lowered = lower(views, encoded, ctx, channels_last=channels_last)
        else:
            lowered = Lowered((graph(encoded, ctx),), feeds=ctx.feeds, draws=frozenset(ctx.draws),
                              host_checks=tuple(ctx.host_checks), host_geometry=ctx.host_geometry)  # fmt: skip
        pipe.set_outputs(*lowered.outputs())
    return Defined(pipe, lowered)


class DaliRunner:
    """Runs ``spec`` on one DALI pipeline (``graph``: see :func:`define_graph`)."""

    def __init__(self, spec: RunSpec, *, graph: Callable[[Any, Ctx], Any] | None = None) -> None:
        self._define = graph
        self._pid = os.getpid()
        self.index, self.views = spec.index, spec.views
        self.num_threads, self.prefetch = max(1, spec.workers), spec.prefetch
        self.channels_last = spec.config.channels_last
        self.device, self.rank, self.seed = spec.device, spec.rank, spec.seed
        self.skip = spec.skip
        self.exif, self.max_pixels = spec.config.apply_exif_orientation, spec.config.max_image_pixels
        self.decoder_args = spec.config.dali.decoder_args(ranks_per_node=ranks_per_node())
        self.color_twist = spec.config.dali.color_twist
        # How a leading RandomResizedCrop is decoded on the GPU (the CPU graph decodes its region).
        self.strategy = choose(spec.config.dali, nvjpeg=nvjpeg_version()) if self.device.type == "cuda" else None
        self.builds = 0  # pipelines built (one per loader, unless DALI fails)
        self._runs = Runs()
        self._closed = False
        self._buffers = Buffers(pinned=self.device.type == "cuda")
        # A CPU pipeline reads views of mapped shards (no copy); a GPU pipeline reads into pinned
        # buffers, so that the decoder's copies to the device are asynchronous.
        self.mapped = self.device.type == "cpu"
        self._pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="gpupipe-read")
        # Built now, so that a graph DALI rejects fails when the loader is built.
        self._graph: _Graph | None = self._build(spec.config.batch_size)
        _LIVE.add(self)

    # -------------------------------------------------------------------- graph --
    def _build(self, batch_size: int) -> _Graph:
        gpu = self.device.type == "cuda"
        pipe, lowered = define_graph(
            self.views,
            gpu=gpu,
            device_id=(self.device.index or 0) if gpu else None,
            batch_size=batch_size,
            num_threads=self.num_threads,
            prefetch=self.prefetch,
            seed=self.seed & 0x7FFFFFFF,
            channels_last=self.channels_last,
            decoder_args=self.decoder_args,
            graph=self._define,
            exif=self.exif,
            color_twist=self.color_twist,
            decode=self.strategy.mode if self.strategy is not None else DecodeMode.ROI,
        )
        pipe.build()
        self.operators, self.host_geometry, self.fused = operator_count(pipe), lowered.host_geometry, lowered.decode
        self.builds += 1
        self.max_batch = batch_size
        return _Graph(pipe, lowered, self.prefetch)

    # --------------------------------------------------------------------- run --
    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        """Yields batches ``start..plan.num_batches-1`` of the plan."""
        if self._closed:
            raise ClosedError("the DALI runner is closed")
        return self._runs.track(self._run(plan, start))

    def _run(self, plan: RankPlan, start: int) -> Generator[RawBatch, None, None]:
        if start >= plan.num_batches:
            return
        if self._graph is None or plan.batch_size > self.max_batch:
            self._graph = None  # the old pipeline goes first (its memory)
            self._graph = self._build(max(plan.batch_size, self.max_batch))
        graph = self._graph
        maps = Maps(self.index.reader.storage) if self.mapped else None  # type: ignore[attr-defined]
        reader = Reader(self.index, plan, graph.lowered, self.views, self._buffers, maps, self._pool,
                        ahead=self.prefetch + 1, skip=self.skip, max_pixels=self.max_pixels)  # fmt: skip
        fed, limit, error = start, plan.num_batches, None  # feeding stops at `limit`: an unreadable batch
        failed = False
        ready: dict[int, tuple[Batch, Any]] = {}  # popped ahead of their turn (behind a retried batch)
        try:
            for b in range(start, plan.num_batches):
                if self._closed:  # closed from another thread while this epoch runs
                    raise ClosedError("the DALI runner was closed during an epoch")
                while fed < limit and graph.busy < self.prefetch:
                    try:
                        batch = reader.checked(reader.get(fed))
                    except Exception as e:  # raised when its batch is due, after the ones before it
                        error, limit = e, fed
                        break
                    graph.push(batch)
                    fed += 1
                if fed == limit:
                    graph.start()
                if b == limit:
                    if self._closed:
                        raise ClosedError("the DALI runner was closed during an epoch")
                    assert error is not None
                    raise error
                stream = consumer_stream(self.device)  # torch's current stream, asked for each batch
                while b not in ready:
                    try:
                        with on_device(self.device):  # DALI reads torch's default stream (0) as the current device's
                            popped, repeat, outputs = graph.pop(stream)
                    except IterationFailed as f:
                        if not self.skip or not self._retry(graph, reader, f):
                            failed = True
                            raise self._locate_bad_sample(f.error, plan, b) from f.error
                        continue
                    self._release(graph, popped, stream)
                    if not repeat:
                        ready[popped.b] = (popped, outputs)
                batch, outputs = ready.pop(b)
                views = len(graph.lowered.images)
                images = tuple(self._to_torch(view) for view in outputs[:views])
                yield self._deliver(graph.lowered, batch, images, outputs[views] if len(outputs) > views else None)
        finally:
            reader.close()
            if failed or graph.broken or not self._drain(graph):
                self._graph = None  # DALI failed, or a call failed midway: a fresh pipeline next epoch
                for batch in graph.abandon():  # after the shutdown: no thread reads them any more
                    Batch.release(batch.maps, batch.buffer, self._buffers)
            if maps is not None:
                maps.close()  # each lease goes once no batch in flight uses its map
            self.index.close()  # the reader threads' open files end with the epoch

    def _drain(self, graph: _Graph) -> bool:
        """Finishes every iteration fed or scheduled (an abandoned epoch's), so that none leaks
        into the next epoch; ``False`` if DALI failed on one."""
        try:
            graph.start()
            while graph.flight:
                batch, _, outputs = graph.pop(None)  # host-synchronous: the iteration is over
                del outputs
                self._release(graph, batch, None)
        except Exception:  # failed on an iteration nobody will see
            return False
        return True

    def _release(self, graph: _Graph, batch: Batch, stream: Any) -> None:
        """Returns the batch's buffer to the pool, and ends its maps' uses, once no scheduled
        iteration reads them. Outputs taken without a stream are host-synchronous; taken on a
        CUDA stream, the buffer waits for an event recorded on that stream (which waits on DALI's
        work). Maps are used by CPU pipelines only."""
        if not graph.done(batch):
            return
        event = None
        if stream is not None and batch.buffer is not None:
            event = torch.cuda.Event()
            event.record(stream)
        Batch.release(batch.maps, batch.buffer, self._buffers, event)

    def describe(self) -> dict[str, Any]:
        """DALI's CPU threads, how a leading ``RandomResizedCrop`` is decoded (on a GPU: the
        strategy and why), the graph's operators and where its geometry is computed."""
        if self.fused is None:
            decode = "whole images"
        elif self.strategy is None:
            decode = "roi (libjpeg-turbo on the CPU)"
        else:
            decode = str(self.strategy)
        return {"threads": self.num_threads, "decode": decode, "operators": self.operators,
                "geometry": "host" if self.host_geometry else "graph"}  # fmt: skip

    def close(self) -> None:
        """Stops an unfinished epoch and drops the pipeline, which shuts it down (a run executing in
        another thread stops at its next batch), and ends the reader threads. In a forked child it
        does nothing: the pipeline and the threads are the parent's."""
        if os.getpid() != self._pid:
            return
        self._closed = True
        self._runs.close()
        self._graph = None
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _deliver(self, lowered: Lowered, batch: Batch, images: tuple[torch.Tensor, ...], checks: Any) -> RawBatch:
        """The batch as yielded. A sample that failed a check the graph computed (too small for a
        transform) raises its error, or with ``skip`` is left out: its images (every view), label
        and key are replaced by those of the batch's first good sample (zeros if none is), as are
        those of the samples left out before (their donor may be the one that failed)."""
        skipped, labels, keys = dict(batch.skipped), batch.labels, batch.keys
        failures = lowered.failures(np.asarray(checks.as_tensor())) if checks is not None else []
        new = {}
        for b, size, message in failures:
            error = SampleError.at(message, shard=batch.shards[b], key=batch.keys[b], size=size)
            if not self.skip:
                raise error
            if b not in skipped:
                new[b] = error
        if new:
            # Every bad position, the earlier ones too: their copies may be of a donor that has
            # just failed a check. The first sample that passes both is the donor of them all.
            skipped.update(new)
            positions = sorted(skipped)
            good = donor(len(keys), skipped)
            if good is None:
                for view in images:
                    view[positions] = 0
            else:
                keys, labels = list(keys), None if labels is None else labels.copy()
                label = None if labels is None else labels[good]
                columns, values = (*images, keys, labels), (*(view[good].clone() for view in images), keys[good], label)
                fill(positions, columns, values)
        label_tensor = None if labels is None else to_device(torch.from_numpy(labels), self.device)
        return RawBatch(images, label_tensor, keys, tuple(sorted(skipped.items())))

    def _retry(self, graph: _Graph, reader: Reader, failure: IterationFailed) -> bool:
        """With ``skip``, after DALI failed on a batch: finds the samples gpupipe's decoder rejects
        and feeds the batch again with copies of a good sample in their places (it comes out
        after the iterations already scheduled, which wait for it). ``False`` if the failure is
        not known to be bad data (then it is raised)."""
        from nvidia.dali.tensors import TensorCPU

        batch = failure.batch
        if failure.repeat:  # a padding iteration nobody sees
            graph.recover()
            self._release(graph, batch, None)
            return True
        if device_failure(failure.error, batch=batch.b) is not None:
            return False
        from ..._decode import verdicts

        bad: dict[int, Any] = dict(batch.skipped)
        suspects = [i for i in range(len(batch.views)) if i not in bad]
        sizes = [(int(batch.sizes[i, 0]), int(batch.sizes[i, 1])) if graph.lowered.host_geometry else None
                 for i in suspects]  # fmt: skip
        found = verdicts([(bytes(batch.views[i]), batch.shards[i], batch.keys[i]) for i in suspects],
                         max_pixels=self.max_pixels, sizes=sizes)  # fmt: skip
        bad.update({i: error for i, error in zip(suspects, found, strict=True) if error is not None})
        if len(bad) == len(batch.skipped):
            return False
        views, keys, shards, sizes = list(batch.views), list(batch.keys), list(batch.shards), batch.sizes.copy()
        labels, drawn = reader.substitute(bad, batch.samples, views, batch.labels, keys, shards, sizes)
        encoded = [TensorCPU(view) for view in views]
        fixed = batch._replace(keys=keys, shards=shards, labels=labels, encoded=encoded, views=views, sizes=sizes,
                               feeds=reader.feeds(drawn, sizes), skipped=tuple(sorted(bad.items())))  # fmt: skip
        graph.recover()
        graph.push(fixed)  # shares the batch's buffer and maps (same token): they stay
        self._release(graph, batch, None)
        return True

    def _to_torch(self, images: Any) -> torch.Tensor:
        out = torch.from_dlpack(images.as_tensor())
        return out.permute(0, 3, 1, 2) if self.channels_last else out

    def _locate_bad_sample(self, error: RuntimeError, plan: RankPlan, batch: int) -> Exception:
        """The exception to raise for a DALI failure on ``batch``: the failing sample may be in it
        or in one DALI was already preparing (``prefetch`` ahead). The pipeline is not reused."""
        last = min(plan.num_batches, batch + self.prefetch + 1)
        candidates = (self.index.read(int(s)) for b in range(batch, last) for s in plan.batch(b)[0])
        return explain_failure(error, candidates, batch=batch, ahead=self.prefetch)


def check_decodes(
    data: bytes, shard: str, key: str, max_pixels: int | None, size: tuple[int, int] | None
) -> SampleError | None:
    """Why gpupipe's decoder refuses a sample DALI failed on (``None``: it decodes), including an
    image whose pixels are not of the ``size`` its header declares (the graph's windows were
    computed from it); decoded in a child process (``gpupipe._decode.verdicts``)."""
    from ..._decode import verdicts

    return verdicts([(data, shard, key)], max_pixels=max_pixels, sizes=[size])[0]


def consumer_stream(device: torch.device) -> Any:
    """The stream a batch is handed to: torch's current stream on ``device`` in this thread, or
    ``None`` (host-synchronous) for a CPU pipeline."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` current while DALI takes the consumer's stream: torch's default stream is the
    handle 0, which DALI resolves on the current device (a train and a val loader on two GPUs)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# DALI's own allocation failures (libdali_core: "Can't allocate %zu bytes on device %d.", "CUDA
# allocation failed"), CUDA's and C++'s. A decoder's status (nvJPEG, nvImageCodec) is not here: a bad
# bitstream is one, and the sample search below tells the two apart.
_OUT_OF_MEMORY = ("out of memory", "can't allocate", "allocation failed", "cudaerrormemoryallocation",
                  "cuda_error_out_of_memory", "std::bad_alloc", "cudabadalloc")  # fmt: skip
_CUDA_FAILURE = ("cuda error", "cudaerror", "cuda_error", "cuda runtime error")


def _detail(error: BaseException) -> str:
    lines = str(error).strip().splitlines() or ["(no message)"]
    return next((line for line in reversed(lines) if "failure" in line or "rror" in line), lines[0])[:300]


def device_failure(error: BaseException, *, batch: int) -> Exception | None:
    """The error to raise if DALI's failure is the device's or the memory's (never bad data)."""
    lowered = str(error).lower()
    if any(marker in lowered for marker in _OUT_OF_MEMORY):
        return torch.OutOfMemoryError(f"DALI ran out of memory on batch {batch}: {_detail(error)}")
    if any(marker in lowered for marker in _CUDA_FAILURE):
        return RuntimeError(f"DALI failed on the device on batch {batch}: {_detail(error)}")
    return None


def explain_failure(error: RuntimeError, candidates: Iterable[RawSample], *, batch: int, ahead: int) -> Exception:
    """What a DALI failure means. DALI's errors name no sample, so:

    - out of memory (GPU or host) is ``torch.OutOfMemoryError``, as torch's own, never bad data;
    - another CUDA failure is a ``RuntimeError`` about the device;
    - otherwise the candidate samples are decoded with gpupipe's own decoder, in a child process
      (``gpupipe._decode.verdicts``): the first it rejects is the ``SampleError``, naming shard and key;
    - if it reads them all, a ``RuntimeError``: not known to be bad data.
    """
    from ..._decode import verdicts

    detail = _detail(error)
    failure = device_failure(error, batch=batch)
    if failure is not None:
        return failure
    raws = list(candidates)
    for bad in verdicts([(raw.data, raw.shard, raw.key) for raw in raws], max_pixels=None):
        if bad is not None:
            return SampleError(f"{bad} (DALI: {detail})", shard=bad.shard, key=bad.key, kind=bad.kind)
    return RuntimeError(
        f"DALI failed on batch {batch} (or one of the {ahead} after it), whose samples gpupipe's decoder reads "
        f"fine, so the failure is not known to be bad data: {detail}"
    )
