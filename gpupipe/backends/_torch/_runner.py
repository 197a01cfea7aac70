"""Runs a pipeline with the torch backend: a map-style dataset over the index, read in
DataLoader worker processes, batches in the order of the rank's epoch plan."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ...core._errors import ClosedError, Damage, DataError, SampleError, WorkerError
from ...core._random import factors
from ...plan._plan import RankPlan
from ...runtime._children import CRASHED, Births, Stacks, death_cause, exit_status, frozen_fork_cause
from ...runtime._decode import decode_rgb
from ...runtime._sandbox import START_TIMEOUT, STARTS
from ...sources import Index
from ...transforms import ImageSpec, Transform
from .._base import RawBatch, Runs, RunSpec, donor, fill
from ._kernels import apply_pipeline, sample_factors

__all__ = ["TorchRunner"]

log = logging.getLogger("gpupipe")

Item = tuple[int, int, int, int]  # (sample, the number its augmentation is drawn from, seed, epoch)


Sample = tuple[tuple[torch.Tensor, ...], "int | None", str]  # (one image per view, label, key)


@dataclasses.dataclass(frozen=True)
class _Failure:
    """A sample's DataError carried out of a worker process as data, so that the main process
    raises it as it was, ``.shard`` and ``.key`` included (DataLoader's re-raise of a worker's
    exception keeps only a message), and the same with or without workers."""

    kind: type[DataError]
    message: str
    shard: str | None
    key: str | None
    damage: Damage | None = None

    def error(self) -> DataError:
        return self.kind(self.message, shard=self.shard, key=self.key, kind=self.damage)


def batch_items(plan: RankPlan, b: int) -> list[Item]:
    """What the workers get of batch ``b`` of ``plan``: each sample's number, draw number, seed and epoch."""
    samples, draws = plan.batch(b)[0].tolist(), plan.drawn(b).tolist()
    return [(s, d, plan.seed, plan.epoch) for s, d in zip(samples, draws, strict=True)]


class _Samples(Dataset["Sample | _Failure"]):
    def __init__(
        self,
        index: Index,
        views: Sequence[Sequence[Transform]],
        *,
        max_pixels: int | None,
        exif: bool,
        per_source: bool = False,
    ) -> None:
        self.index, self.views, self.per_source = index, tuple(tuple(v) for v in views), per_source
        self.max_pixels, self.exif = max_pixels, exif
        self.poisoned: dict[int, _Failure] = {}  # samples that killed a worker: refused from then on

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item: Item) -> Sample | _Failure:
        sample, draw, seed, epoch = item
        drawn = [sample_factors(steps, seed, epoch, draw, view) for view, steps in enumerate(self.views)]
        return self._guarded(sample, drawn)

    def __getitems__(self, items: list[Item]) -> list[Sample | _Failure]:
        """A batch's samples (DataLoader's batched fetch): the random factors of the whole batch
        drawn at once, vectorized (``gpupipe.core._random``), then each sample decoded and transformed."""
        draws = np.array([item[1] for item in items], dtype=np.int64)
        seed, epoch = items[0][2], items[0][3]
        drawn = [factors(steps, seed, epoch, draws, view) for view, steps in enumerate(self.views)]
        return [
            self._guarded(item[0], [[None if f is None else f[i] for f in view] for view in drawn])
            for i, item in enumerate(items)
        ]

    def probe(self, item: Item) -> bool:
        """Whether ``item`` comes out (a sample) or is refused (in a sandbox child: whether it kills
        its process is what matters)."""
        return not isinstance(self[item], _Failure)

    def _guarded(self, sample: int, drawn: list[list[np.ndarray | None]]) -> Sample | _Failure:
        poisoned = self.poisoned.get(sample)
        if poisoned is not None:
            return poisoned
        try:
            return self._sample(sample, drawn)
        except DataError as e:
            return _Failure(type(e), str(e), e.shard, e.key, e.kind)

    def _sample(self, sample: int, drawn: list[list[np.ndarray | None]]) -> Sample:
        """``drawn[view][step]``: this sample's factors of each step of each view."""
        raw = self.index.read(sample)
        image = decode_rgb(
            raw.data, shard=raw.shard, key=raw.key, max_pixels=self.max_pixels, apply_exif_orientation=self.exif
        )
        try:  # each view from the same decoded image, with its own draws
            if self.per_source:  # one output: the sample's source's list (a gp.Mix's per_source)
                source = int(self.index.source_of(np.array([sample]))[0])  # type: ignore[attr-defined]
                outputs: tuple[torch.Tensor, ...] = (apply_pipeline(self.views[source], image, drawn[source]),)
            else:
                outputs = tuple(apply_pipeline(steps, image, drawn[view]) for view, steps in enumerate(self.views))
        except ValueError as e:  # e.g. RandomCrop larger than this image
            size = (int(image.shape[-2]), int(image.shape[-1]))
            raise SampleError.at(str(e), shard=raw.shard, key=raw.key, size=size) from e
        return outputs, raw.label, raw.key


def culprits(samples: _Samples, items: list[Item], timeout: float | None) -> list[str]:
    """Each of ``items`` run again, alone, in a sandbox child (``gpupipe.runtime._sandbox``), after a
    process running them died: those that crash it (or hang past ``timeout``, at most 60 s) are
    refused from now on (``samples.poisoned``), as undecodable, naming the signal. Returns their
    keys. The torch backend's workers and the ray backend's tasks share it, so a file gets the
    same verdict on both."""
    from ...runtime._sandbox import guarded_map

    found = []
    limit = min(timeout or 60.0, 60.0)  # a sample that takes longer alone is hung
    for (sample, *_), outcome in zip(items, guarded_map(samples.probe, items, timeout=limit), strict=True):
        if outcome.ok or (outcome.crashed is not None and outcome.crashed not in CRASHED):
            continue
        raw = samples.index.read(sample)  # readable: the reading happened before the crash
        message = f"the image of sample {raw.key!r} in shard {raw.shard!r} cannot be decoded: {outcome.reason()}"
        samples.poisoned[sample] = _Failure(SampleError, message, raw.shard, raw.key, Damage.UNDECODABLE)
        found.append(raw.key)
    return found


class _Collate:
    """Stacks a batch's samples, view by view. A sample that failed raises (its ``_Failure`` is
    the batch), or, with ``skip``, is replaced by a copy of the first good sample of the batch
    (zeros of the outputs' shapes, label 0, if none is good) and listed by position."""

    def __init__(self, skip: bool, outputs: tuple[ImageSpec, ...] | None, labeled: bool,
                 channels_last: bool = False) -> None:  # fmt: skip
        self.skip, self.outputs, self.labeled, self.channels_last = skip, outputs, labeled, channels_last

    def __call__(self, items: list[Sample | _Failure]) -> RawBatch | _Failure:
        failed = [(i, item) for i, item in enumerate(items) if isinstance(item, _Failure)]
        if failed and not self.skip:
            return failed[0][1]
        samples: list = list(items)
        if failed:
            good = donor(len(items), dict(failed))
            fill(dict(failed), (samples,), (self._blank(failed[0][1]) if good is None else items[good],))
        images = tuple(self._stack(view) for view in zip(*(s[0] for s in samples), strict=True))
        labels = None if samples[0][1] is None else torch.tensor([s[1] for s in samples], dtype=torch.int64)
        return RawBatch(images, labels, [s[2] for s in samples], tuple(failed))  # type: ignore[arg-type]

    def _stack(self, view: Sequence[torch.Tensor]) -> torch.Tensor:
        """The view's images as one ``[B, C, H, W]`` tensor, in the memory format asked for. In a
        worker process it is written straight into shared memory, as DataLoader's own collate
        does: the batch then crosses to the training process without another copy."""
        first = view[0]
        shape = (len(view), *first.shape)
        fmt = torch.channels_last if self.channels_last and first.dim() == 3 else torch.contiguous_format
        out = torch.empty(shape, dtype=first.dtype, memory_format=fmt)
        if get_worker_info() is not None:
            out.share_memory_()
        for i, image in enumerate(view):
            out[i].copy_(image)
        return out

    def _blank(self, failure: _Failure) -> Sample:
        if self.outputs is None or not all(spec.fixed_size for spec in self.outputs):
            raise failure.error()
        images = tuple(
            torch.zeros(spec.channels, spec.height, spec.width, dtype=spec.dtype)  # type: ignore[arg-type]
            for spec in self.outputs
        )
        return images, 0 if self.labeled else None, failure.key or ""


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
        self._workers = spec.workers
        self._batches = _Batches()
        self._dataset = _Samples(
            spec.index,
            spec.views,
            max_pixels=spec.config.max_image_pixels,
            exif=spec.config.apply_exif_orientation,
            per_source=spec.per_source,
        )
        self._prefetch = spec.prefetch
        self._births = Births(spec.workers)
        self._loader: DataLoader[Sample | _Failure] | None = DataLoader(
            self._dataset,
            batch_sampler=self._batches,
            collate_fn=_Collate(spec.skip, spec.outputs, spec.index.labeled, spec.config.channels_last),
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

    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        """Yields batches ``start..plan.num_batches-1`` of the plan."""
        if self._loader is None or self._closed:
            raise ClosedError("the torch runner is closed")
        return self._runs.track(self._run(self._loader, plan, start))

    def _run(self, loader: DataLoader, plan: RankPlan, start: int) -> Generator[RawBatch, None, None]:
        self._batches.batches = [batch_items(plan, b) for b in range(start, plan.num_batches)]
        batches = self._iterate(loader)
        done, unexplained = start, 0
        try:
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                except RuntimeError as e:  # a worker died or is stuck? PyTorch says neither how nor where
                    if self._watching and "timed out after" in str(e):
                        if self._frozen_at_birth(loader, plan, done):
                            self._batches.batches = self._batches.batches[done - start :]
                            start, batches = done, self._iterate(loader)
                        continue  # all were born: the first batch is slow, and gets worker_timeout
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
                    start, batches = done, self._iterate(loader)  # new workers, from the first batch not yielded
                    continue
                done += 1
                if self._watching and not self._births.unborn():
                    self._watch(loader, False)
                if self._closed:  # closed from another thread while this epoch runs
                    raise ClosedError("the torch runner was closed during an epoch")
                if isinstance(batch, _Failure):
                    raise batch.error()
                images, labels, keys, failed = batch
                skipped = tuple((i, f.error()) for i, f in failed)
                if self.device.type != "cpu":
                    images = tuple(view.to(self.device, non_blocking=True) for view in images)
                    labels = None if labels is None else labels.to(self.device, non_blocking=True)
                yield RawBatch(images, labels, keys, skipped)
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

    def _iterate(self, loader: DataLoader) -> Iterator[Any]:
        """A new iteration of ``loader``: its workers are forked now (the first time, and after
        they were ended), with the stack dump armed and their births watched."""
        if self._stacks is None:
            return iter(loader)
        fork = getattr(loader, "_iterator", None) is None  # (persistent workers: else they are reused)
        if fork:
            self._births.reset()
        with self._stacks.armed():
            iterator = iter(loader)
        if fork:
            self._watch(loader, True)
        return iterator

    def _watch(self, loader: DataLoader, on: bool) -> None:
        """Until every new worker is born, DataLoader waits at most START_TIMEOUT for a batch
        (``_frozen_at_birth`` then tells a frozen worker from a slow batch); then worker_timeout."""
        self._watching = on
        if not on:
            self._failed_births = 0
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_timeout"):
            timeout = self._timeout or 0  # (0: DataLoader waits forever)
            iterator._timeout = timeout if not on else min(timeout or START_TIMEOUT, START_TIMEOUT)

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

    @staticmethod
    def _end_workers(loader: DataLoader) -> None:
        iterator = getattr(loader, "_iterator", None)  # the persistent workers' iterator
        if iterator is not None:
            iterator._shutdown_workers()
            loader._iterator = None


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
