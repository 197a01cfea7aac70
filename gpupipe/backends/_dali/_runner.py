"""Runs a compiled pipeline with DALI and hands batches to torch through DLPack.

One DALI pipeline per loader: built with the runner and reused for every epoch, validation pass
and resume (rebuilt only after a failure that is not bad data, or for a plan with larger
batches). It has no random operator and no callback: the runner feeds every input of each
iteration itself.

Files DALI's decoders do not read never reach them (``_fallback``: decoded by gpupipe in a child
process, fed as PPMs); a batch DALI fails on anyway is probed sample by sample at batch size 1 and
fed again (:meth:`DaliRunner._retry`), so each file gets the torch backend's verdict.

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
  per-sample arguments follow from them and from the random factors (``gpupipe.core._random``), each
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
  ``cudaStreamWaitEvent``) and does not block the host; the DLPack hand-off (``to_torch``, on that
  stream) waits again on the batch's ready event (free). Kernels the training step queues on that
  stream therefore never read a batch before it is ready.
- The dynamic executor never recycles an output buffer that is still referenced, and
  ``as_tensor()`` + DLPack (``to_torch``) share it without a copy. When torch frees the tensor,
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

import contextlib
import os
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ...core._batch import map_tensors
from ...core._config import DecodeMode
from ...core._errors import ClosedError, SampleError
from ...plan._plan import RankPlan
from ...runtime._dist import ranks_per_node
from .._base import QUEUE_DEPTH, QUEUE_READY, READ_BYTES, RawBatch, Runs, RunSpec, donor, fill, in_collection, to_device
from .._fields import refill
from ._compiler import Ctx, Lowered
from ._failures import device_failure, explain_failure
from ._fallback import Probe
from ._graph import LIVE_RUNNERS, Graph, IterationFailed, define_graph
from ._headers import Sizes
from ._input import READ_THREADS, BatchReader, FeedBatch
from ._memory import Buffers, Maps
from ._proto import operator_count
from ._strategy import choose, nvjpeg_version

__all__ = ["DaliRunner"]


class DaliRunner:
    """Runs ``spec`` on one DALI pipeline (``graph``: see :func:`define_graph`)."""

    def __init__(self, spec: RunSpec, *, graph: Callable[[Any, Ctx], Any] | None = None) -> None:
        self._define = graph
        self._pid = os.getpid()
        self.index, self.views, self.per_source = spec.index, spec.views, spec.per_source
        self.num_threads, self.prefetch = max(1, spec.workers), spec.prefetch
        self.channels_last = spec.config.channels_last
        self.device, self.rank, self.seed = spec.device, spec.rank, spec.seed
        self.skip = spec.skip
        self._fields = spec.index.fields  # the source's other fields (read by the reader threads)
        out = spec.outputs[0] if spec.outputs else None  # a stand-in mask's size: its image's (one view)
        self._blank = None if out is None or out.height is None or out.width is None else (out.height, out.width)
        self.exif, self.max_pixels = spec.config.apply_exif_orientation, spec.config.max_image_pixels
        self.decoder_args = spec.config.dali.decoder_args(ranks_per_node=ranks_per_node())
        self.color_twist = spec.config.dali.color_twist
        # How a leading RandomResizedCrop is decoded on the GPU (the CPU graph decodes its region).
        self.strategy = choose(spec.config.dali, nvjpeg=nvjpeg_version()) if self.device.type == "cuda" else None
        self.builds = 0  # pipelines built (one per loader, unless DALI fails)
        self._runs = Runs()
        self._closed = False
        self._buffers = Buffers(pinned=self.device.type == "cuda")
        self._sizes = Sizes(self.index, max_pixels=self.max_pixels)  # the images' sizes, read once (_headers)
        # A CPU pipeline reads views of mapped shards (no copy); a GPU pipeline reads into pinned
        # buffers, so that the decoder's copies to the device are asynchronous.
        self.mapped = self.device.type == "cpu"
        self._pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="gpupipe-read")
        # Built now, so that a graph DALI rejects fails when the loader is built.
        self._graph: Graph | None = self._build(spec.config.batch_size)
        LIVE_RUNNERS.add(self)

    # -------------------------------------------------------------------- graph --
    def _build(self, batch_size: int) -> Graph:
        pipe, lowered = self._pipeline(batch_size, self.prefetch, self.num_threads)
        self.operators, self.host_geometry, self.fused = operator_count(pipe), lowered.host_geometry, lowered.decode
        self.builds += 1
        self.max_batch = batch_size
        return Graph(pipe, lowered, self.prefetch)

    def _pipeline(self, batch_size: int, prefetch: int, threads: int) -> Any:
        """The runner's DALI pipeline, built: ``(pipe, lowered)``."""
        gpu = self.device.type == "cuda"
        defined = define_graph(
            self.views,
            gpu=gpu,
            device_id=(self.device.index or 0) if gpu else None,
            batch_size=batch_size,
            num_threads=threads,
            prefetch=prefetch,
            seed=self.seed & 0x7FFFFFFF,
            channels_last=self.channels_last,
            decoder_args=self.decoder_args,
            graph=self._define,
            exif=self.exif,
            color_twist=self.color_twist,
            decode=self.strategy.mode if self.strategy is not None else DecodeMode.ROI,
            per_source=self.per_source,
        )
        defined.pipe.build()
        return defined

    def _probe(self) -> Any:
        """The graph at batch size 1, for :class:`Probe` (one thread, no prefetch)."""
        return self._pipeline(1, 1, 1).pipe

    # --------------------------------------------------------------------- run --
    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        """Yields batches ``start..plan.num_batches-1`` of the plan."""
        if self._closed:
            raise ClosedError("the DALI runner is closed")
        # one run at a time on the one graph: an earlier one still open (its generator kept alive,
        # by a traceback say) ends first, or its queued batches would be the new run's
        self._runs.close()
        return self._runs.track(self._run(plan, start))

    def _run(self, plan: RankPlan, start: int) -> Generator[RawBatch, None, None]:
        if start >= plan.num_batches:
            return
        if self._graph is None or plan.batch_size > self.max_batch:
            old, self._graph = self._graph, None  # the old pipeline goes first (its memory)
            if old is not None:
                old.shutdown()  # now: an earlier run's frame kept by a traceback may still hold it
            self._graph = self._build(max(plan.batch_size, self.max_batch))
        graph = self._graph
        self._sizes.begin()
        maps = Maps(self.index.reader.storage) if self.mapped else None
        reader = BatchReader(self.index, plan, graph.lowered, self.views, self._buffers, maps, self._pool,
                             ahead=self.prefetch + 1, skip=self.skip, max_pixels=self.max_pixels,
                             exif=self.exif, sizes=self._sizes, blank=self._blank)  # fmt: skip
        probe = Probe(self._probe)  # built if DALI fails on a batch
        fed, limit, error = start, plan.num_batches, None  # feeding stops at `limit`: an unreadable batch
        failed = False
        ready: dict[int, tuple[FeedBatch, Any]] = {}  # popped ahead of their turn (behind a retried batch)
        due: dict[int, Exception] = {}  # what a batch raises when its turn comes (DALI failed on it)
        try:
            for b in range(start, plan.num_batches):
                if self._closed:  # closed from another thread while this epoch runs
                    raise ClosedError("the DALI runner was closed during an epoch")
                asked = time.perf_counter()
                queued = {QUEUE_READY: float(reader.ready()), QUEUE_DEPTH: float(reader.ahead)}  # when asked
                reading = 0.0  # the waits for the reader threads' batches (not their feeding to DALI: the graph's)
                while fed < limit and graph.busy < self.prefetch:
                    got = time.perf_counter()
                    try:
                        batch = reader.checked(reader.get(fed))
                    except Exception as e:  # raised when its batch is due, after the ones before it
                        error, limit = e, fed
                        break
                    finally:
                        reading += time.perf_counter() - got
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
                while b not in ready and b not in due:
                    try:
                        with on_device(self.device):  # DALI reads torch's default stream (0) as the current device's
                            popped, repeat, outputs = graph.pop(stream)
                    except IterationFailed as f:
                        problem = self._retry(graph, reader, f, probe)
                        if problem is not None:
                            due[f.batch.b] = problem
                        continue
                    self._release(graph, popped, stream)
                    if not repeat:
                        ready[popped.b] = (popped, outputs)
                if b in due:
                    failed = True
                    raise due[b]
                batch, outputs = ready.pop(b)
                views = len(graph.lowered.images)
                images = tuple(self._to_torch(view) for view in outputs[:views])
                checks = outputs[views] if len(outputs) > views else None
                waited = time.perf_counter() - asked
                waits = {"wait_read": reading, "wait_graph": max(waited - reading, 0.0),
                         READ_BYTES: float(batch.nbytes), **(batch.reads or {}), **queued}  # fmt: skip
                yield self._deliver(graph.lowered, batch, images, checks)._replace(times=waits)
        finally:
            reader.close()
            probe.close()
            if failed or graph.broken or not self._drain(graph):
                self._graph = None  # DALI failed, or a call failed midway: a fresh pipeline next epoch
                for batch in graph.abandon():  # after the shutdown: no thread reads them any more
                    FeedBatch.release(batch.maps, batch.buffer, self._buffers)
            if self._closed:  # closed from another thread meanwhile: close() left the pipeline to this run
                graph.shutdown()
            if maps is not None:
                maps.close()  # each lease goes once no batch in flight uses its map
            self.index.close()  # the reader threads' open files end with the epoch
            if not self._closed:  # the sizes learned, recorded by a reader thread
                with contextlib.suppress(RuntimeError):  # (closed meanwhile: the pool takes no more)
                    self._pool.submit(self._sizes.save)

    def _drain(self, graph: Graph) -> bool:
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

    def _release(self, graph: Graph, batch: FeedBatch, stream: Any) -> None:
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
        FeedBatch.release(batch.maps, batch.buffer, self._buffers, event)

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
        another thread stops at its next batch), and ends the reader threads: waits for them, unless
        the garbage collector closes it (``_base.collecting``: the collector may run inside
        ``threading``'s locks, which a join takes). In a forked child it does nothing: the pipeline
        and the threads are the parent's."""
        if os.getpid() != self._pid:
            return
        self._closed = True
        stopped = self._runs.close()
        graph, self._graph = self._graph, None
        collecting = in_collection()
        if graph is not None and stopped and not collecting:
            # shut down now, not when the last reference goes: a run that raised keeps its frame,
            # which holds the graph, in its error's traceback (a cycle the collector breaks later,
            # or never, if the error is kept); a run still executing shuts it down as it ends
            graph.shutdown()
        self._pool.shutdown(wait=not collecting, cancel_futures=True)
        if not collecting:
            self._sizes.save()  # what the last epoch learned, where its reader thread did not

    def _deliver(self, lowered: Lowered, batch: FeedBatch, images: tuple[torch.Tensor, ...], checks: Any) -> RawBatch:
        """The batch as yielded. A sample that failed a check the graph computed (too small for a
        transform) raises its error, or with ``skip`` is left out: its images (every view), label
        and key are replaced by those of the batch's first good sample (zeros if none is), as are
        those of the samples left out before (their donor may be the one that failed)."""
        skipped, labels, keys, fields = dict(batch.skipped), batch.labels, batch.keys, batch.fields
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
            fields = refill(fields, positions, good, self._fields)
            if good is None:
                for view in images:
                    view[positions] = 0
            else:
                keys, labels = list(keys), None if labels is None else labels.copy()
                label = None if labels is None else labels[good]
                columns, values = (*images, keys, labels), (*(view[good].clone() for view in images), keys[good], label)
                fill(positions, columns, values)
        label_tensor = None if labels is None else to_device(torch.from_numpy(labels), self.device)
        fields = map_tensors(fields, lambda t: to_device(t, self.device))
        return RawBatch(images, label_tensor, keys, tuple(sorted(skipped.items())), fields=fields, draws=batch.drawn)

    def _retry(self, graph: Graph, reader: BatchReader, failure: IterationFailed, probe: Probe) -> Exception | None:
        """After DALI failed on a batch: finds the samples it fails on — each of the batch's samples
        run alone through the same graph (``_fallback.Probe``) — and decodes them with gpupipe's
        decoder. The batch is fed again (it comes out after the iterations already scheduled,
        which wait for it) with the pixels of those gpupipe reads (as on the torch backend) and,
        with ``skip``, a copy of a good sample in the place of those it refuses. Returns ``None``
        if it was fed again, else what the batch raises when due: the first refused sample's error
        without ``skip``; a device failure; or, if no sample fails alone and gpupipe's decoder
        reads them all, a ``RuntimeError``: the failure is not known to be bad data."""
        from nvidia.dali.tensors import TensorCPU

        batch = failure.batch
        graph.recover()  # the failed iteration is gone: the graph runs on
        if failure.repeat:  # a padding iteration nobody sees
            self._release(graph, batch, None)
            return None
        problem: Exception | None = device_failure(failure.error, batch=batch.b)
        skipped = dict(batch.skipped)
        views, sizes, bad = list(batch.views), batch.sizes.copy(), dict[int, Any]()
        decoded = frozenset[int]()
        if problem is None:
            suspects = [i for i in range(len(views)) if i not in skipped and i not in batch.decoded]
            refused = probe.refused(batch.encoded, batch.feeds, suspects, batch=batch.b)
            if refused:
                decoded = reader.headers.decode_foreign(refused, views, batch.keys, batch.shards, sizes, bad)
            else:  # none fails alone: what gpupipe's decoder refuses (as before the probe existed)
                from ...runtime._decode import verdicts

                found = verdicts([(bytes(views[i]), batch.shards[i], batch.keys[i]) for i in suspects],
                                 max_pixels=self.max_pixels,
                                 sizes=[self._size(batch, i) for i in suspects])  # fmt: skip
                bad = {i: e for i, e in zip(suspects, found, strict=True) if e is not None}
                if not bad:
                    problem = explain_failure(failure.error, (), batch=batch.b, ahead=0)
            if bad and not self.skip:
                problem = bad[min(bad)]
        if problem is not None:
            self._release(graph, batch, None)
            return problem
        bad.update(skipped)
        keys, shards, labels, drawn = list(batch.keys), list(batch.shards), batch.labels, reader.plan.drawn(batch.b)
        fields = batch.fields
        windows = {step: rows.copy() for step, rows in (batch.windows or {}).items()}
        if bad:
            labels, drawn = reader.substitute(bad, drawn, views, batch.labels, keys, shards, sizes)
            good = donor(len(views), bad)
            fields = refill(fields, sorted(bad), good, self._fields)
            for rows in windows.values():  # the donor's box-chosen windows
                fill(bad, (rows,), (rows[good] if good is not None else -1,))
        encoded = [TensorCPU(view) for view in views]
        fixed = batch._replace(keys=keys, shards=shards, labels=labels, encoded=encoded, views=views, sizes=sizes,
                               feeds=reader.feeds(drawn, sizes, windows), skipped=tuple(sorted(bad.items())),
                               decoded=batch.decoded | decoded, fields=fields, windows=windows,
                               drawn=drawn if bad else None)  # fmt: skip
        graph.push(fixed)  # shares the batch's buffer and maps (same token): they stay
        self._release(graph, batch, None)
        return None

    def _size(self, batch: FeedBatch, i: int) -> tuple[int, int] | None:
        """The size sample ``i`` must decode to: its header's, where the graph's geometry is cut from it."""
        return (int(batch.sizes[i, 0]), int(batch.sizes[i, 1])) if self.host_geometry else None

    def _to_torch(self, images: Any) -> torch.Tensor:
        out = to_torch(images.as_tensor(), self.device)
        return out.permute(0, 3, 1, 2) if self.channels_last else out


def to_torch(tensor: Any, device: torch.device) -> torch.Tensor:
    """A DALI tensor as a torch tensor sharing its memory, through DALI's own DLPack capsule.

    Not ``torch.from_dlpack(tensor)``: its protocol path compares DALI's device (a pybind11 enum)
    with torch's ``DLDeviceType``, and pybind11's comparison swallows any exception raised
    meanwhile. A Ctrl-C landing there was lost: the training loop went on (measured with a timer
    signal: 2,204 of 5,000 KeyboardInterrupts lost in that call; none through the capsule). A CUDA
    tensor's capsule is asked for on torch's current stream, as ``torch.from_dlpack`` asks."""
    stream = None
    if device.type == "cuda":
        handle = torch.cuda.current_stream(device).cuda_stream
        stream = 1 if handle == 0 else handle  # DLPack's legacy default stream
    return torch.utils.dlpack.from_dlpack(tensor.__dlpack__(stream=stream))


def consumer_stream(device: torch.device) -> Any:
    """The stream a batch is handed to: torch's current stream on ``device`` in this thread, or
    ``None`` (host-synchronous) for a CPU pipeline."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` current while DALI takes the consumer's stream: torch's default stream is the
    handle 0, which DALI resolves on the current device (a train and a val loader on two GPUs)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
