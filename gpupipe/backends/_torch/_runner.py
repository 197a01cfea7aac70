"""Runs a pipeline with the torch backend: a map-style dataset over the index, read in
DataLoader worker processes, batches in the order of the rank's epoch plan."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Generator, Iterator
from typing import Any

from torch.utils.data import DataLoader

from ...core._batch import map_tensors
from ...core._errors import ClosedError, WorkerError
from ...plan._plan import RankPlan
from ...runtime._children import CRASHED, Births, Stacks, death_cause, exit_status, frozen_fork_cause
from ...runtime._sandbox import START_TIMEOUT, STARTS
from .._base import QUEUE_DEPTH, QUEUE_READY, RawBatch, Runs, RunSpec, in_collection
from .._copies import H2D, CopyClock
from .._slots import Slots
from ._persample import Collate, Failure, Item, Sample, Samples, batch_items, culprits

__all__ = ["TorchRunner"]

log = logging.getLogger("gpupipe")


class _Batches:
    """Batch sampler: iterated in the main process each epoch, so it follows the plan even with
    persistent workers."""

    def __init__(self) -> None:
        self.batches: list[list[Item]] = []

    def __iter__(self) -> Iterator[list[Item]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _Stuck(WorkerError):
    """The workers delivered no batch within ``worker_timeout``."""


class TorchRunner:
    """Decode and transforms in ``spec.workers`` processes (in-process when 0), kept alive between
    epochs (``persistent_workers``) and ended by :meth:`close`."""

    def __init__(self, spec: RunSpec) -> None:
        self.channels_last = spec.config.channels_last
        self.device = spec.device
        self._workers, self._rank = spec.workers, spec.rank
        self._batches = _Batches()
        self._dataset = Samples(
            spec.index,
            spec.views,
            max_pixels=spec.config.max_image_pixels,
            exif=spec.config.apply_exif_orientation,
            per_source=spec.per_source,
        )
        self._prefetch = spec.prefetch
        self._births = Births(spec.workers)
        # each worker's batch buffers, reused once this process lets go of a batch (``_slots``):
        # the batches in flight (prefetch) and two held by the training loop
        self._slots = Slots(spec.workers, spec.prefetch + 2) if spec.workers else None
        self._loader: DataLoader[Sample | Failure] | None = DataLoader(
            self._dataset,
            batch_sampler=self._batches,
            # the stage (tails, MixUp/CutMix) where a CPU batch is made (a worker, one thread, as
            # torchvision's reference collate mixes): not on the training thread, whose intra-op
            # threads would contend with the workers; on a GPU, the loader runs it on the device
            collate_fn=Collate(
                spec.skip,
                spec.outputs,
                spec.index.labeled,
                spec.config.channels_last,
                stage=spec.stage,
                fields=spec.index.fields,
                slots=self._slots,
            ),
            num_workers=spec.workers,
            prefetch_factor=spec.prefetch if spec.workers else None,
            persistent_workers=spec.workers > 0,
            pin_memory=self.device.type == "cuda",
            worker_init_fn=self._births,
            timeout=(spec.config.worker_timeout or 0) if spec.workers else 0,
            # forked, whatever the platform's default (Python 3.14's is forkserver): the workers
            # inherit the index and the births' shared memory
            multiprocessing_context="fork" if spec.workers else None,
        )
        self._timeout = spec.config.worker_timeout
        self._stacks = Stacks() if spec.workers else None  # stuck workers' stacks, on request
        self._watching = False  # new workers forked, not all of them born yet
        self._failed_births = 0
        self._runs = Runs()
        self._closed = False
        self._copies = CopyClock(self.device) if self.device.type == "cuda" else None

    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        """Yields batches ``start..plan.num_batches-1`` of the plan."""
        if self._loader is None or self._closed:
            raise ClosedError("the torch runner is closed")
        return self._runs.track(self._run(self._loader, plan, start))

    def _run(self, loader: DataLoader, plan: RankPlan, start: int) -> Generator[RawBatch, None, None]:
        self._batches.batches = [batch_items(plan, b, self._rank) for b in range(start, plan.num_batches)]
        done, unexplained = start, 0
        try:
            batches = self._start(loader, plan, start)
            waiting: float | None = None  # since the loop asked for this batch (or the workers started)
            while True:
                if waiting is None:
                    waiting = time.monotonic()
                ready = _ready(batches)  # the batches made ahead, waiting when the loop asks
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                except RuntimeError as e:  # a worker died or is stuck? PyTorch says neither how nor where
                    if self._closed:
                        raise ClosedError("the torch runner was closed during an epoch") from None
                    waited, timed_out = time.monotonic() - waiting, "timed out after" in str(e)
                    if timed_out and self._watching:  # (DataLoader waits POLL_S at a time)
                        if waited < min(self._timeout or START_TIMEOUT, START_TIMEOUT):
                            continue
                        if self._frozen_at_birth(loader, plan, done):
                            self._batches.batches = self._batches.batches[done - start :]
                            start, batches, waiting = done, self._iterate(loader), time.monotonic()
                        continue  # all were born: the first batch is slow, and gets worker_timeout
                    if timed_out and (not self._timeout or waited < self._timeout):
                        _pin_thread_alive(loader)  # (DataLoader checks it only when it waits without a timeout)
                        continue  # a poll: no worker died (DataLoader checks at each), not yet worker_timeout
                    died = self._worker_died(loader, plan, done) or self._worker_stuck(loader, plan, done, e)
                    if died is None:
                        raise
                    if died.exitcode not in CRASHED and not isinstance(died, _Stuck):  # out of memory, most often
                        raise died from e
                    found = self._culprits(plan, start, done)
                    unexplained += not found
                    if unexplained > 1:  # twice without a sample to blame: the memory, the machine
                        raise died from e
                    log.warning("%s Restarted%s.", died, f"; left out: {found}" if found else
                                " (no sample in flight kills a process: taken as transient)")  # fmt: skip
                    self._batches.batches = self._batches.batches[done - start :]
                    start, batches = done, self._start(loader, plan, done)  # new workers, from the first not yielded
                    waiting = None
                    continue
                done += 1
                waiting = None
                if self._watching and not self._births.unborn():
                    self._watch(loader, False)
                if self._closed:  # closed from another thread while this epoch runs
                    raise ClosedError("the torch runner was closed during an epoch")
                if isinstance(batch, Failure):
                    raise batch.error()
                images, labels = batch.images, batch.labels
                skipped = tuple((i, f.error()) for i, f in batch.skipped)
                fields = batch.fields
                copied = None
                if self.device.type != "cpu":
                    clock = self._copies
                    started = clock.start() if clock is not None else None
                    images = tuple(view.to(self.device, non_blocking=True) for view in images)
                    labels = None if labels is None else labels.to(self.device, non_blocking=True)
                    fields = map_tensors(fields, lambda t: t.to(self.device, non_blocking=True))
                    copied = clock.stop(started) if clock is not None else None  # an earlier batch's
                times = batch.times
                if times is not None and copied is not None:
                    times = {**times, H2D: copied}
                if times is not None and ready is not None:
                    times = {**times, QUEUE_READY: ready, QUEUE_DEPTH: float(self._workers * self._prefetch)}
                yield RawBatch(images, labels, batch.keys, skipped, fields, times=times)
        finally:
            if self._closed:
                self._shutdown()

    def _culprits(self, plan: RankPlan, start: int, done: int) -> list[str]:
        """After a worker crashed: each sample of the batches in flight is run again, alone, in a
        sandbox child (``gpupipe.runtime._sandbox``); those that crash it (or hang) are refused from now
        on, as undecodable, naming the signal. Returns their keys."""
        ahead = max(1, self._workers) * self._prefetch + 1  # what DataLoader had sent to its workers
        items = [item for batch in self._batches.batches[done - start : done - start + ahead] for item in batch]
        return culprits(self._dataset, items, self._timeout)

    def _start(self, loader: DataLoader, plan: RankPlan, batch: int) -> Iterator[Any]:
        """:meth:`_iterate`; where a persistent worker died since the last epoch (found before
        DataLoader resumes them, or as it does), the workers are ended and new ones started."""
        died = self._worker_died(loader, plan, batch)  # (None before the first fork: no workers yet)
        if died is None:
            try:
                return self._iterate(loader)
            except RuntimeError:  # one died as DataLoader resumed them
                died = self._worker_died(loader, plan, batch)
                if died is None or self._closed:
                    raise
        log.warning("%s (while idle, between epochs). Restarted.", died)
        return self._iterate(loader)  # (new workers: forked, nothing to resume)

    def _iterate(self, loader: DataLoader) -> Iterator[Any]:
        """A new iteration of ``loader``: its workers are forked now (the first time, and after
        they were ended), with the stack dump armed and their births watched."""
        if self._stacks is None:
            return iter(loader)
        fork = getattr(loader, "_iterator", None) is None  # (persistent workers: else they are reused)
        if fork:
            self._births.reset()
        # a persistent iterator resumes its workers in iter(), after the batches still queued from
        # an epoch left early (a break): each may take what a batch takes
        self._poll(loader, self._timeout or 0)
        with self._stacks.armed():
            iterator = iter(loader)
        # PyTorch's SIGCHLD check raises "DataLoader worker is killed by signal" wherever this
        # thread is when a worker dies: in the training step, in another loader's loop. Off for
        # these workers: a death is found where this loop waits, at each poll (POLL_S)
        _disown(getattr(loader, "_iterator", None))
        if fork:
            self._watch(loader, True)
        self._poll(loader, min(POLL_S, self._timeout or POLL_S))
        return iterator

    @staticmethod
    def _poll(loader: DataLoader, seconds: float) -> None:
        """DataLoader waits at most ``seconds`` for a batch at a time (it checks its workers
        then); the run's loop keeps waiting up to START_TIMEOUT or worker_timeout."""
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_timeout"):
            iterator._timeout = seconds

    def _watch(self, loader: DataLoader, on: bool) -> None:
        """Until every new worker is born, the run waits at most START_TIMEOUT for a batch
        (``_frozen_at_birth`` then tells a frozen worker from a slow batch); then worker_timeout."""
        self._watching = on
        if not on:
            self._failed_births = 0

    def _frozen_at_birth(self, loader: DataLoader, plan: RankPlan, batch: int) -> bool:
        """After START_TIMEOUT without a batch from new workers: those that never started (frozen
        inside fork: CPython gh-112275 before 3.11.10) are killed and the workers started again,
        no sample blamed, ``True``; ``False`` when every worker was born (the watch ends). Raises
        after STARTS failed starts in a row."""
        unborn = self._births.unborn()
        if not unborn:
            self._watch(loader, False)
            return False
        iterator = getattr(loader, "_iterator", None)
        workers = list(getattr(iterator, "_workers", ()))
        pids = [workers[i].pid for i in unborn if i < len(workers) and workers[i].pid is not None]
        stacks = self._stacks.dump(pids) if self._stacks is not None else ""
        if _disown(iterator):  # SIGKILL: a frozen child may not act on SIGTERM (a handler it inherited)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self._end_workers(loader)
        self._watching = False
        self._failed_births += 1
        message = (f"torch backend: worker process(es) {unborn} (pid {pids}) never started, {START_TIMEOUT:g} s after "
                   f"they were forked (epoch {plan.epoch}, batch {batch}; {self._failed_births} of {STARTS} in a row): "
                   f"{frozen_fork_cause()}")  # fmt: skip
        if self._failed_births >= STARTS:
            raise WorkerError(message + ". Giving up.", pid=pids[0] if pids else None)
        log.warning("%s. Starting new workers; their stacks:\n%s", message, stacks or "(none answered)")
        return True

    def _worker_stuck(self, loader: DataLoader, plan: RankPlan, batch: int, error: RuntimeError) -> _Stuck | None:
        """After DataLoader's ``timeout``: the workers' Python stacks (logged), then the workers
        ended; ``None`` for another error."""
        if self._stacks is None or "timed out after" not in str(error):
            return None
        iterator = getattr(loader, "_iterator", None)
        pids = [w.pid for w in getattr(iterator, "_workers", ()) if w.pid is not None]
        stacks = self._stacks.dump(pids)
        self._end_workers(loader)
        log.warning("torch backend: no batch from the workers in %s s (epoch %d, batch %d); their stacks:\n%s",
                    self._timeout, plan.epoch, batch, stacks or "(none answered)")  # fmt: skip
        return _Stuck(
            f"torch backend: no batch from the worker processes in {self._timeout} s during epoch {plan.epoch}, "
            f"batch {batch} (worker_timeout); they were stuck (stacks in the log). A decoder that never returns on "
            "a file, or a worker frozen as it started (fork), does this."
        )

    def _worker_died(self, loader: DataLoader, plan: RankPlan, batch: int) -> WorkerError | None:
        """The error for a worker found dead (``None`` when none is); the workers are ended: a new
        iteration (the same epoch's rest, or the next epoch) starts new ones."""
        iterator = getattr(loader, "_iterator", None)
        workers = list(getattr(iterator, "_workers", ()))
        dead = [(i, w) for i, w in enumerate(workers) if not w.is_alive()]  # reaps it: its exit code is known
        if not dead:
            return None
        self._end_workers(loader)
        i, worker = dead[0]
        return WorkerError(
            f"torch backend: worker process {i} (pid {worker.pid}) died with {exit_status(worker.exitcode)} "
            f"during epoch {plan.epoch}, batch {batch}. {death_cause(worker.exitcode)}",
            pid=worker.pid,
            exitcode=worker.exitcode,
        )

    def describe(self) -> dict[str, Any]:
        return {"workers": self._workers}

    def close(self) -> None:
        """Stops an unfinished epoch and ends the worker processes (and the pin-memory thread); a
        run executing in another thread stops at its next batch and ends them itself."""
        self._closed = True
        if self._runs.close():
            self._shutdown()

    def _shutdown(self) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:
            self._end_workers(loader)
        if self._stacks is not None:
            self._stacks.close()
        self._births.close()
        if self._slots is not None:
            self._slots.close()

    @staticmethod
    def _end_workers(loader: DataLoader) -> None:
        iterator = getattr(loader, "_iterator", None)  # the persistent workers' iterator
        if iterator is not None and in_collection():
            # the collector runs in whatever thread allocates: inside threading's own locks (the
            # pin-memory thread's exit needs one), or in the pin-memory thread itself. No join:
            # the workers are told to end (SIGTERM), the pin-memory thread told to stop
            _disown(iterator)
            for event in ("_pin_memory_thread_done_event", "_workers_done_event"):
                done = getattr(iterator, event, None)
                if done is not None:
                    done.set()
            for worker in getattr(iterator, "_workers", ()):
                with contextlib.suppress(Exception):
                    worker.terminate()
            iterator._shutdown = True  # (its __del__ would join them)
            loader._iterator = None
        elif iterator is not None:
            iterator._shutdown_workers()
            # PyTorch terminates a worker that does not exit within 5 s and returns without
            # waiting for it: wait, so that close() returns with every worker ended (under load a
            # terminated worker was still there when the next test looked)
            for worker in getattr(iterator, "_workers", ()):
                worker.join(timeout=10)
            loader._iterator = None


def _pin_thread_alive(loader: DataLoader) -> None:
    """Raises where the pin-memory thread has died (DataLoader checks it only when it waits
    without a timeout)."""
    thread = getattr(getattr(loader, "_iterator", None), "_pin_memory_thread", None)
    if thread is not None and not thread.is_alive():
        raise RuntimeError("Pin memory thread exited unexpectedly")


POLL_S = 5.0  # DataLoader's longest wait for a batch at a time (its check of the workers: PyTorch's own interval)


def _disown(iterator: Any) -> bool:
    """Stops PyTorch's SIGCHLD check on ``iterator``'s workers (it would raise "DataLoader worker
    is killed by signal" in this thread when one is killed), as its own shutdown does first;
    ``False`` where that private API is not there (the workers are then only terminated)."""
    try:
        from torch.utils.data._utils import signal_handling

        if getattr(iterator, "_worker_pids_set", False):
            signal_handling._remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False
        return True
    except (ImportError, AttributeError, RuntimeError):
        return False


def _ready(iterator: Any) -> float | None:
    """The batches a DataLoader iterator's workers made that wait for the loop (in its queue, or
    kept while an earlier one is late); ``None`` without workers, or where the queue cannot say."""
    queue = getattr(iterator, "_data_queue", None)
    if queue is None:
        return None
    try:
        waiting = queue.qsize()
    except (NotImplementedError, OSError):  # (macOS's multiprocessing queues)
        return None
    early = sum(len(info) == 2 for info in getattr(iterator, "_task_info", {}).values())  # (worker, batch)
    return float(waiting + early)
