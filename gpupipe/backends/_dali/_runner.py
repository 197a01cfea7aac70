"""Runs a compiled pipeline with DALI and hands batches to torch through DLPack.

Input: gpupipe reads each batch of the rank's epoch plan itself — the byte ranges of its samples,
with ``pread`` in a few threads, ahead of DALI — and feeds the encoded images to the graph through
``fn.external_source``. DALI therefore yields exactly the samples of the plan, in its order, on
every rank: the same keys as the torch backend, padding and resume included, and each rank reads
only the byte ranges of its own samples. Labels and keys never enter the graph.

Randomness: one DALI pipeline per epoch, seeded from ``(seed, epoch, rank)``. A resumed epoch
starts the generators afresh, so its augmentation draws differ from the interrupted run's.

Hand-off (DALI 2.4, dynamic executor; read in DALI's sources, see README "Running on GPUs"):

- Each batch is asked for on the consumer's stream — torch's current stream on the loader's GPU,
  in the thread that iterates: ``pipe.run(stream)`` makes that stream wait on DALI's work (a
  ``cudaStreamWaitEvent``) and does not block the host; ``torch.from_dlpack`` waits again on the
  batch's ready event (free). Kernels the training step queues on that stream therefore never
  read a batch before it is ready. (Without a stream, ``run()`` waited on the host every batch.)
- The dynamic executor never recycles an output buffer that is still referenced, and
  ``as_tensor()`` + ``torch.from_dlpack`` share it without a copy. When torch frees the tensor,
  DALI returns the memory to its pool only after a device-wide synchronization (its DLPack
  "graveyard" thread), so memory is never reused while queued kernels, on any stream, may read it.
- A batch used on another stream needs ``other.wait_stream(torch.cuda.current_stream())`` first,
  as any tensor produced on one stream and used on another.
- CPU outputs (and labels, keys) are host data; labels are copied to the GPU from pinned memory
  on the same current stream.

Lifecycle: each pipeline's input callback is its own :class:`_Slot`, which holds the running
epoch's feed and nothing else, so no reference cycle runs through a pipeline: a pipeline is shut
down (its threads joined) as soon as the runner drops it, by :meth:`DaliRunner.close` or when
collected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from ..._dist import ranks_per_node
from ..._errors import ClosedError, SampleError
from ..._plan import RankPlan
from ...sources import Index, RawSample
from ...transforms import Transform
from .._base import RawBatch, Runs, RunSpec, to_device
from ._compiler import Ctx, Lowered, lower

__all__ = ["DaliRunner"]

READ_THREADS = 4


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The DALI pipeline seed of one rank's epoch (DALI wants a non-negative 31-bit int)."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, epoch, rank, 0xDA11]).generate_state(1)[0]) >> 1


class _Slot:
    """The graph's ``external_source`` callback: calls the running epoch's feed. It references no
    runner or pipeline, so a pipeline holding it is never part of a reference cycle."""

    def __init__(self) -> None:
        self.feed: Callable[[int], list[np.ndarray]] | None = None

    def __call__(self, i: int) -> list[np.ndarray]:
        if self.feed is None:
            raise StopIteration
        return self.feed(i)


class _Feeder:
    """Reads the plan's batches ahead of DALI in a few threads; ``get(b)`` returns batch ``b``."""

    def __init__(self, index: Index, plan: RankPlan, ahead: int) -> None:
        self.index, self.plan, self.ahead = index, plan, ahead
        self._pool = ThreadPoolExecutor(max_workers=min(READ_THREADS, ahead), thread_name_prefix="gpupipe-read")
        self._pending: dict[int, Future[list[RawSample]]] = {}
        self._next = 0
        self.read: dict[int, list[RawSample]] = {}  # batches handed to DALI, not yet yielded

    def _read(self, b: int) -> list[RawSample]:
        return [self.index.read(int(s)) for s in self.plan.batch(b)[0]]

    def get(self, b: int) -> list[RawSample]:
        self._next = max(self._next, b)
        while self._next < min(b + 1 + self.ahead, self.plan.num_batches):
            self._pending[self._next] = self._pool.submit(self._read, self._next)
            self._next += 1
        future = self._pending.pop(b, None)
        raws = future.result() if future is not None else self._read(b)
        self.read[b] = raws
        return raws

    def close(self) -> None:
        for f in self._pending.values():
            f.cancel()
        self._pool.shutdown(wait=True)


class _Graph(NamedTuple):
    """One built DALI pipeline with its own input slot and the lowering's outputs."""

    pipe: Any
    slot: _Slot
    lowered: Lowered


def define_graph(
    transforms: Sequence[Transform],
    *,
    gpu: bool,
    device_id: int | None,
    batch_size: int,
    num_threads: int,
    prefetch: int,
    seed: int,
    channels_last: bool,
    decoder_args: dict[str, Any],
) -> _Graph:
    """The DALI pipeline of ``transforms``, defined but not built. With ``gpu`` and
    ``device_id=None`` it is the GPU graph, defined (and serializable) on a machine without a GPU:
    the tests check its operators and their placement that way."""
    from nvidia.dali import Pipeline, fn, types

    pipe = Pipeline(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=prefetch,
        exec_dynamic=True,
    )
    slot = _Slot()  # one per pipeline: a run feeds only its own
    with pipe:
        encoded = fn.external_source(source=slot, batch=True, dtype=types.UINT8, ndim=1, name="encoded")
        ctx = Ctx("gpu" if gpu else "cpu", seed, decoder_args=decoder_args if gpu else {})
        lowered = lower(transforms, encoded, ctx, channels_last=channels_last)
        pipe.set_outputs(*lowered.outputs())
    return _Graph(pipe, slot, lowered)


class DaliRunner:
    def __init__(self, spec: RunSpec) -> None:
        self.index, self.transforms = spec.index, spec.transforms
        self.num_threads, self.prefetch = max(1, spec.workers), spec.config.prefetch
        self.channels_last = spec.config.channels_last
        self.device, self.rank = spec.device, spec.rank
        self.decoder_args = spec.config.dali.decoder_args(ranks_per_node=ranks_per_node())
        self._runs = Runs()
        self._closed = False
        # Built now so that a graph DALI rejects fails when the loader is built; epoch 0 runs on it.
        self._unused: tuple[Any, _Graph | None] = (
            (spec.seed, 0, spec.config.batch_size),
            self._build(epoch_seed(spec.seed, 0, spec.rank), batch_size=spec.config.batch_size),
        )

    # -------------------------------------------------------------------- graph --
    def _build(self, seed: int, *, batch_size: int) -> _Graph:
        gpu = self.device.type == "cuda"
        graph = define_graph(
            self.transforms,
            gpu=gpu,
            device_id=(self.device.index or 0) if gpu else None,
            batch_size=batch_size,
            num_threads=self.num_threads,
            prefetch=self.prefetch,
            seed=seed,
            channels_last=self.channels_last,
            decoder_args=self.decoder_args,
        )
        graph.pipe.build()
        return graph

    def _graph(self, seed: int, epoch: int, batch_size: int) -> _Graph:
        """A fresh pipeline for one epoch: the one built with the loader if it fits, else a new one
        (a pipeline's generators cannot be re-seeded, and a run leaves them advanced)."""
        key, graph = self._unused
        self._unused = (None, None)
        if graph is not None and key == (seed, epoch, batch_size):
            return graph
        return self._build(epoch_seed(seed, epoch, self.rank), batch_size=batch_size)

    # --------------------------------------------------------------------- run --
    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        """Yields batches ``start..plan.num_batches-1`` of the plan."""
        if self._closed:
            raise ClosedError("the DALI runner is closed")
        return self._runs.track(self._run(plan, start))

    def _run(self, plan: RankPlan, start: int) -> Generator[RawBatch, None, None]:
        if start >= plan.num_batches:
            return
        feeder = _Feeder(self.index, plan, ahead=self.prefetch + 2)

        def feed(i: int) -> list[np.ndarray]:
            b = start + i
            if b >= plan.num_batches:
                raise StopIteration
            return [np.frombuffer(raw.data, np.uint8) for raw in feeder.get(b)]

        graph = None
        try:
            graph = self._graph(plan.seed, plan.epoch, plan.batch_size)
            graph.slot.feed = feed
            for b in range(start, plan.num_batches):
                if self._closed:  # closed from another thread while this epoch runs
                    raise ClosedError("the DALI runner was closed during an epoch")
                try:
                    with on_device(self.device):  # DALI reads torch's default stream (0) as the current device's
                        images, *checks = graph.pipe.run(consumer_stream(self.device))
                except RuntimeError as e:
                    raise self._locate_bad_sample(e, plan, b) from e
                raws = feeder.read.pop(b)
                if checks:
                    self._raise_failed_checks(graph.lowered, checks[0], raws)
                yield RawBatch(self._to_torch(images), self._labels(raws), [r.key for r in raws])
        finally:
            if graph is not None:
                graph.slot.feed = None
            feeder.close()

    def close(self) -> None:
        """Stops an unfinished epoch and drops the pipelines, which shuts them down (a run
        executing in another thread stops at its next batch and drops its own)."""
        self._closed = True
        self._runs.close()
        self._unused = (None, None)

    @staticmethod
    def _raise_failed_checks(lowered: Lowered, checks: Any, raws: list[RawSample]) -> None:
        """Raises the error of the first sample that failed a check the graph computed."""
        for b, size, message in lowered.failures(np.asarray(checks.as_tensor())):
            raise SampleError.at(message, shard=raws[b].shard, key=raws[b].key, size=size)

    def _labels(self, raws: list[RawSample]) -> torch.Tensor | None:
        if not self.index.labeled:
            return None
        labels = torch.tensor([r.label for r in raws], dtype=torch.int64)
        return to_device(labels, self.device)

    def _to_torch(self, images: Any) -> torch.Tensor:
        batch = torch.from_dlpack(images.as_tensor())
        return batch.permute(0, 3, 1, 2) if self.channels_last else batch

    def _locate_bad_sample(self, error: RuntimeError, plan: RankPlan, batch: int) -> Exception:
        """The exception to raise for a DALI failure on ``batch``: the failing sample may be in it
        or in one DALI was already preparing (``prefetch`` ahead)."""
        last = min(plan.num_batches, batch + self.prefetch + 1)
        candidates = (self.index.read(int(s)) for b in range(batch, last) for s in plan.batch(b)[0])
        return explain_failure(error, candidates, batch=batch, ahead=self.prefetch)


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


def explain_failure(error: RuntimeError, candidates: Iterable[RawSample], *, batch: int, ahead: int) -> Exception:
    """What a DALI failure means. DALI's errors name no sample, so:

    - out of memory (GPU or host) is ``torch.OutOfMemoryError``, as torch's own, never bad data;
    - another CUDA failure is a ``RuntimeError`` about the device;
    - otherwise each candidate sample is decoded with gpupipe's own decoder: the first it rejects
      is the ``SampleError``, naming shard and key;
    - if it reads them all, a ``RuntimeError``: not known to be bad data.
    """
    from ..._decode import decode_rgb

    text = str(error)
    lines = text.strip().splitlines() or ["(no message)"]
    detail = next((line for line in reversed(lines) if "failure" in line or "rror" in line), lines[0])[:300]
    lowered = text.lower()
    if any(marker in lowered for marker in _OUT_OF_MEMORY):
        return torch.OutOfMemoryError(f"DALI ran out of memory on batch {batch}: {detail}")
    if any(marker in lowered for marker in _CUDA_FAILURE):
        return RuntimeError(f"DALI failed on the device on batch {batch}: {detail}")
    for raw in candidates:
        try:
            decode_rgb(raw.data, shard=raw.shard, key=raw.key)
        except SampleError as bad:
            return SampleError(f"{bad} (DALI: {detail})", shard=bad.shard, key=bad.key)
    return RuntimeError(
        f"DALI failed on batch {batch} (or one of the {ahead} after it), whose samples gpupipe's decoder reads "
        f"fine, so the failure is not known to be bad data: {detail}"
    )
