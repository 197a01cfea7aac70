"""The Ray backend's runner: each batch of the rank's epoch plan is one Ray task, which decodes,
transforms and collates its samples with the torch backend's code (``backends._torch._persample``) and
returns the batch as NumPy arrays in Ray's object store; the rank maps them as tensors (no copy on
the CPU; one copy to a GPU).

Tasks, not actors: a task whose worker or node dies is run again elsewhere by Ray itself
(``max_retries``), with nothing to restart or re-place; Ray spreads tasks over whatever CPUs the
cluster has, shared by every rank that submits, where actors would hold a fixed share of CPUs per
rank for the loader's life (and wait, placed nowhere, when a node is lost and no CPU is free). What
an actor would keep — the index, the transforms — is put in the object store once per runner and
kept by each worker process the first time one of its tasks needs it (a few cached jobs per
process), so a task carries only its batch's sample numbers. Measured (bench/scale_out.py, 2
cores, bench/results/2026-11-25-scale-out.md): a pool of actors gave 0.98-1.08x the tasks'
throughput over three recipes (1.13x at most in a run on shorter epochs).

Each view's closing ``ToDtype`` / ``Normalize`` can run on the rank instead (``split_finish``,
``RayOptions.normalize_on_rank``): the batch then crosses as uint8. A batch whose task crashes its
worker on every try, or hangs, has its samples probed in a sandbox, as the torch backend does
(``culprits``): the culprit is refused, the batch run again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
import warnings
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import ray
import torch

from ...core._batch import map_tensors
from ...core._errors import ClosedError, ConfigError, WorkerError
from ...pipeline._pipeline import Pipeline
from ...plan._plan import RankPlan
from ...runtime._dist import default_workers
from ...sources import Index
from ...transforms import ImageSpec, Normalize, ToDtype, Transform
from .._base import QUEUE_DEPTH, QUEUE_READY, RawBatch, Runs, RunSpec
from .._copies import H2D, CopyClock
from .._torch._kernels import LOWERINGS
from .._torch._persample import Collate, Failure, Item, Samples, batch_items, culprits
from . import _cluster

__all__ = ["RayRunner", "Job", "run_batch", "split_finish", "normalizes_on_rank"]

log = logging.getLogger("gpupipe")

CACHED_JOBS = 4  # jobs (indexes and transforms) a worker process keeps
TASK_PINS = 2  # remote shards a worker process keeps pinned in the node's cache
WAIT_SLICE = 0.1  # seconds a rank waits for a batch between looks at whether the runner was closed
CLOSE_WAIT = 10.0  # seconds close() waits for another thread to leave its Ray call before detaching


FINISHING = (ToDtype, Normalize)  # pointwise and deterministic: as cheap on the rank's batch


def split_finish(
    views: tuple[tuple[Transform, ...], ...], per_source: bool
) -> tuple[tuple[tuple[Transform, ...], ...], tuple[tuple[Transform, ...], ...]]:
    """Each view's steps split in two: what its tasks run, and its closing ``ToDtype`` /
    ``Normalize`` steps from the last point where the image is still uint8, which the rank runs on
    the batch (``RayOptions.normalize_on_rank``). Their draws are unchanged: the steps moved are
    the last ones and draw nothing. ``per_source`` lists are split only where all close alike
    (the rank does not know each sample's source)."""
    tasks, finish = [], []
    for steps in views:
        specs = Pipeline._specs(steps, "")
        cut = len(steps)
        while cut and isinstance(steps[cut - 1], FINISHING):
            cut -= 1
        cuts = [c for c in range(cut, len(steps)) if specs[c].dtype == torch.uint8]
        cut = cuts[0] if cuts and specs[-1].dtype != torch.uint8 else len(steps)
        tasks.append(steps[:cut])
        finish.append(steps[cut:])
    if per_source and len(set(finish)) > 1:
        return views, tuple(() for _ in views)
    return tuple(tasks), tuple(finish)


def normalizes_on_rank(option: bool | None, device: torch.device) -> bool:
    """``RayOptions.normalize_on_rank``: ``None`` means on a GPU device only."""
    return option if option is not None else device.type != "cpu"


class Job:
    """What every task of one runner needs: the index, the transforms and how to collate."""

    def __init__(self, spec: RunSpec, views: tuple[tuple[Transform, ...], ...]) -> None:
        self.index: Index = spec.index
        self.views = views  # the tasks' part of each view (``split_finish``)
        self.max_pixels, self.exif = spec.config.max_image_pixels, spec.config.apply_exif_orientation
        self.per_source, self.skip = spec.per_source, spec.skip
        self.outputs: tuple[ImageSpec, ...] | None = spec.outputs
        if spec.outputs:  # what the tasks' part ends in (none: a source of fields alone)
            self.outputs = tuple(
                dataclasses.replace(out, dtype=Pipeline._specs(steps, "")[-1].dtype)
                for out, steps in zip(spec.outputs, views[:1] if spec.per_source else views, strict=True)
            )
        self.channels_last = spec.config.channels_last

    def samples(self) -> Samples:
        """The torch backend's dataset of the job's samples (in the rank: to probe a batch whose
        task crashed, in a sandbox)."""
        return Samples(self.index, self.views, max_pixels=self.max_pixels, exif=self.exif, per_source=self.per_source)

    def make(self) -> tuple[Samples, Collate]:
        """The torch backend's pieces, in a worker process. A remote storage there pins only the
        shards of the batch at hand (``TASK_PINS``): a node's many worker processes would
        otherwise keep the whole node cache pinned, beyond its bound."""
        storage = getattr(self.index.reader, "storage", None)
        if storage is not None and storage.remote:
            storage.keep = TASK_PINS
        return self.samples(), Collate(self.skip, self.outputs, self.index.labeled, self.channels_last,
                                       fields=self.index.fields)  # fmt: skip


_jobs: collections.OrderedDict[str, tuple[Samples, Collate]] = collections.OrderedDict()


def run_batch(token: str, job: list[Any], items: list[Item], poisoned: dict[int, Failure] | None = None) -> Any:
    """One batch, in a Ray worker: ``(images, labels, keys, failed, fields, times)`` — images as NumPy
    arrays (``[B, C, H, W]``, or ``[B, H, W, C]`` for channels_last), labels int64 ``[B]`` or
    None, the source's other fields as the torch backend batches them (``Batch.fields``) or None,
    the task's seconds per stage (``RawBatch.times``: read, decode, transform, collate) —
    or the ``Failure`` of a sample that cannot be used (``on_error="raise"``). ``job`` holds the
    runner's :class:`Job` reference, in a list so that Ray does not fetch it for every task.
    ``poisoned``: the batch's samples found to crash (or hang) their process, refused unread."""
    made = _jobs.get(token)
    if made is None:
        made = _jobs[token] = ray.get(job[0]).make()
        while len(_jobs) > CACHED_JOBS:
            _jobs.popitem(last=False)
    _jobs.move_to_end(token)
    samples, collate = made
    samples.poisoned = poisoned or {}
    fetched = samples.__getitems__(items)
    started = time.perf_counter()
    batch = collate(fetched)
    if isinstance(batch, Failure):
        return batch
    # the task's stages (the verdict's), with its reads of remote shards (Collate's, from a batch's items)
    times = dict(batch.times) if batch.times else {**samples.clocks, "collate": time.perf_counter() - started}
    images = tuple(
        (view.permute(0, 2, 3, 1) if collate.channels_last and view.dim() == 4 else view).numpy() for view in batch[0]
    )
    labels = None if batch.labels is None else batch.labels.numpy()
    return images, labels, batch.keys, batch.skipped, batch.fields, times


class _Lost(WorkerError):
    """A batch's task gave nothing: its worker or node died on every try, or it took longer than
    ``RayOptions.timeout`` (``hung``)."""

    def __init__(self, message: str, *, hung: bool) -> None:
        super().__init__(message)
        self.hung = hung


class RayRunner:
    """Runs ``spec``'s batches as Ray tasks, at most ``in_flight`` at a time per rank."""

    def __init__(self, spec: RunSpec) -> None:
        self.options = spec.config.ray
        self.device, self.channels_last = spec.device, spec.config.channels_last
        self._closed = False
        # the threads inside a Ray call now: close() detaches (a local Ray's ray.shutdown) only after
        # they left it; a ray.shutdown() under another thread's ray.get raises SystemExit(0) there
        self._calls = threading.Condition()
        self._in_ray: collections.Counter[int] = collections.Counter()
        _cluster.attach(self.options)
        self._attached = True
        try:
            here = _cluster.local_cpus()
            if here is not None and self.options.num_cpus > here:  # (else the first batch waits RayOptions.timeout)
                raise ConfigError(f"RayOptions: num_cpus={self.options.num_cpus:g} per task is more than the "
                                  f"{here:g} CPUs of the local Ray this process started: no task could run (raise "
                                  "local_cpus, or join a cluster with RayOptions.address)")  # fmt: skip
            # the tasks run on the cluster: a default num_workers (a rank's share of this node) is not their measure
            workers = spec.workers if spec.config.num_workers is not None else default_workers(ranks=1)
            self.in_flight = self.options.in_flight or max(2, 2 * workers)
            views = spec.views
            self._finish: tuple[tuple[Transform, ...], ...] = tuple(() for _ in spec.views)
            if normalizes_on_rank(self.options.normalize_on_rank, spec.device):
                views, self._finish = split_finish(spec.views, spec.per_source)
            if spec.per_source:  # one output: every list closes alike
                self._finish = self._finish[:1]
            self._local = Job(spec, views)
            self._job = [ray.put(self._local)]
            self._poisoned: dict[int, Failure] = {}  # samples that crashed (or hung) their task: refused unread
            self._probe: Samples | None = None
            self._token = uuid.uuid4().hex
            self._task = ray.remote(run_batch).options(
                num_cpus=self.options.num_cpus, max_retries=self.options.max_retries, retry_exceptions=False
            )
        except BaseException:
            self.close()
            raise
        self._runs = Runs()
        self._copies = CopyClock(self.device) if self.device.type == "cuda" else None  # the copies to the GPU

    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        if self._closed:
            raise ClosedError("the ray runner is closed")
        return self._runs.track(self._run(plan, start))

    def _run(self, plan: RankPlan, start: int) -> Generator[RawBatch, None, None]:
        pending: collections.deque[tuple[Any, frozenset[int]]] = collections.deque()
        submitted = start
        try:
            for b in range(start, plan.num_batches):
                while submitted < plan.num_batches and len(pending) < self.in_flight:
                    pending.append(self._submit(plan, submitted))
                    submitted += 1
                ready = self._ready([r for r, _ in pending])  # how full the queue ran when the loop asked
                ref, sent = pending.popleft()
                if submitted < plan.num_batches:  # in_flight tasks run while the loop has this batch
                    pending.append(self._submit(plan, submitted))
                    submitted += 1
                while True:
                    try:
                        result = self._get(ref, plan, b)
                        break
                    except _Lost as lost:
                        if not self._blame(plan, b, sent, lost):
                            raise WorkerError(f"{lost}; run alone in a sandbox, none of its samples crashes or hangs "
                                              "its process") from lost.__cause__  # fmt: skip
                        if lost.hung:  # stuck on a sample the sandbox saw hang: its worker is ended
                            with self._calling():
                                ray.cancel(ref, force=True)
                        ref, sent = self._submit(plan, b)
                if self._closed:  # closed from another thread while this epoch runs
                    raise ClosedError("the ray runner was closed during an epoch")
                if isinstance(result, Failure):
                    raise result.error()
                images, labels, keys, failed, fields, times = result
                blank = len(failed) == len(keys)  # no good sample: zeros, as the torch backend's
                clock = self._copies
                started = clock.start() if clock is not None else None
                views = tuple(  # (none: a source of fields alone)
                    self._finished(self._tensor(a), steps, blank)
                    for a, steps in zip(images, self._finish if images else (), strict=True)
                )
                label_tensor = None if labels is None else self._tensor(labels)
                if fields is not None and self.device.type != "cpu":
                    fields = map_tensors(fields, lambda t: t.to(self.device))
                copied = clock.stop(started) if clock is not None else None  # an earlier batch's
                if times is not None:
                    times = {**times, QUEUE_READY: ready, QUEUE_DEPTH: float(self.in_flight),
                             **({H2D: copied} if copied is not None else {})}  # fmt: skip
                yield RawBatch(views, label_tensor, list(keys), tuple((i, f.error()) for i, f in failed),
                               fields=fields, times=times)  # fmt: skip
        finally:
            # An epoch left unfinished drops its tasks in flight (at most in_flight batches, freed as
            # they end) without ray.cancel: Ray 2.60 aborts the process that cancels a task as it
            # completes ("Tried to complete task that was not pending", ray-project/ray#54846), a
            # race the full test suite met.
            pending.clear()

    def _ready(self, refs: list[Any]) -> float:
        """How many of ``refs`` (the batches in flight, the one asked for first) are done: one
        ``ray.wait`` that does not wait (4-6 µs for 2-16 tasks on the 2-core machine, 2026-11-29)."""
        with self._calling():
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return float(len(done))

    def _submit(self, plan: RankPlan, batch: int) -> tuple[Any, frozenset[int]]:
        """Batch ``batch``'s task, and which of its samples it was told are poisoned."""
        items = batch_items(plan, batch)
        poisoned = {s: self._poisoned[s] for s, *_ in items if s in self._poisoned}
        with self._calling():
            return self._task.remote(self._token, self._job, items, poisoned or None), frozenset(poisoned)

    def _blame(self, plan: RankPlan, batch: int, sent: frozenset[int], lost: _Lost) -> bool:
        """After a batch's task crashed its worker on every try, or hung: whether to run it again
        because some of its samples are now refused. Each sample is run again alone in a sandbox
        child of this process (``culprits``, the torch backend's way): those that crash it or hang
        are refused from now on (skipped or raised, by ``on_error``), as on the torch backend."""
        items = batch_items(plan, batch)
        if any(s in self._poisoned and s not in sent for s, *_ in items):  # found since it was sent
            return True
        if self._probe is None:
            self._probe = self._local.samples()
            self._probe.poisoned = self._poisoned
        found = culprits(self._probe, items, self.options.timeout)
        if found:
            log.warning("%s; run alone in a sandbox, %s crashed or hung its process: left out, the batch is run again",
                        lost, ", ".join(found))  # fmt: skip
        return bool(found)

    def _get(self, ref: Any, plan: RankPlan, batch: int) -> Any:
        from ray import exceptions as rex

        try:
            with self._calling():  # in slices: a close() from another thread ends the wait
                deadline = time.monotonic() + self.options.timeout
                while not ray.wait([ref], timeout=max(0.0, min(WAIT_SLICE, deadline - time.monotonic())))[0]:
                    if self._closed:
                        raise ClosedError("the ray runner was closed during an epoch")
                    if time.monotonic() >= deadline:
                        raise rex.GetTimeoutError()
                return ray.get(ref)
        except rex.GetTimeoutError:
            raise _Lost(
                f"ray backend: no batch in {self.options.timeout} s (epoch {plan.epoch}, batch {batch}): the cluster "
                f"has no free CPUs for its tasks (each reserves num_cpus={self.options.num_cpus}; cluster: "
                f"{ray.cluster_resources().get('CPU', 0)} CPUs), or lost the node that ran them",
                hung=True,
            ) from None
        except rex.RayTaskError as e:  # the task raised: its own error
            cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
            raise cause from None
        except (rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError, rex.RayError) as e:
            keys = [str(s) for s in plan.batch(batch)[0].tolist()]
            raise _Lost(
                f"ray backend: the task of epoch {plan.epoch}, batch {batch} failed {self.options.max_retries + 1} "
                f"times ({type(e).__name__}): its worker or node died each time; samples {', '.join(keys[:8])}"
                f"{' ...' if len(keys) > 8 else ''}",
                hung=False,
            ) from e

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A tensor over ``array`` (read-only memory of the object store: no copy on the CPU; one
        copy to a GPU). channels_last images come as ``[B, H, W, C]`` and are viewed as NCHW."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            out = torch.from_numpy(array)
        if out.dim() == 4 and self.channels_last:
            out = out.permute(0, 3, 1, 2)
        return out if self.device.type == "cpu" else out.to(self.device)

    @staticmethod
    def _finished(view: torch.Tensor, steps: tuple[Transform, ...], blank: bool) -> torch.Tensor:
        """``view`` after the closing steps its tasks left to the rank (``split_finish``)."""
        if not steps:
            return view
        for t in steps:
            view = LOWERINGS.lookup(t)(t, view, None)
        return torch.zeros_like(view) if blank else view

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """A Ray call of this thread's, which close() lets end before it detaches."""
        me = threading.get_ident()
        with self._calls:
            if self._closed:
                raise ClosedError("the ray runner was closed during an epoch")
            self._in_ray[me] += 1
        try:
            yield
        finally:
            with self._calls:
                self._in_ray[me] -= 1
                if not self._in_ray[me]:
                    del self._in_ray[me]
                self._calls.notify_all()

    def describe(self) -> dict[str, Any]:
        on_rank = sorted({type(t).__name__ for steps in self._finish for t in steps})
        return {"in_flight": self.in_flight, "task_cpus": self.options.num_cpus, "on_rank": ", ".join(on_rank) or None}

    def close(self) -> None:
        """Stops a running epoch (its tasks in flight end on their own), drops the job from the object
        store and detaches from Ray (a local Ray gpupipe started ends with its last loader)."""
        self._closed = True
        runs = getattr(self, "_runs", None)
        if runs is not None:
            runs.close()
        calls = getattr(self, "_calls", None)
        if calls is not None:  # another thread's ray.get ends within WAIT_SLICE (a ClosedError there)
            me = threading.get_ident()
            with calls:
                calls.wait_for(lambda: not set(self._in_ray) - {me}, timeout=CLOSE_WAIT)
        self._job = []
        if getattr(self, "_attached", False):
            self._attached = False
            _cluster.detach()
