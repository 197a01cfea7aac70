"""Loader: the iterator a training loop uses — ``len``, ``set_epoch``, ``for images, labels in loader``."""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Generator
from typing import Any

import torch

from .. import backends
from ..backends._base import collecting
from ..backends._stage import Stage, candidate_tails, require_staged, stage_for
from ..core._batch import Batch, SkippedSample
from ..core._config import LoaderConfig, valid_options
from ..core._errors import ClosedError, ConfigError, GpupipeError, UnsupportedTransformError
from ..core._validate import valid_int
from ..pipeline._pipeline import Pipeline, require_runnable
from ..plan._indexed import Indexed, index_source, listing_of
from ..plan._plan import RankPlan
from ..plan._prefetch import prefetcher
from ..plan._resume import Cursor, layout_batches
from ..plan._skips import Skips
from ..runtime import _dist
from ..transforms import ColorJitter
from ._meter import Meter
from ._observed import Observed
from ._records import default_share, gpu_capability, tune_key
from ._records import resolve as resolve_tuned
from ._resumable import Resumable
from ._runners import Runners, end_run
from ._switching import Switching
from ._trainers import LoaderAttributes, accelerate_gradient_state
from ._verdict import StageTimes

__all__ = ["Loader", "Batch", "SkippedSample"]  # Batch and SkippedSample: from ._batch

log = logging.getLogger("gpupipe")


class Loader(LoaderAttributes, Observed, Resumable, Switching):
    """Iterates over a pipeline's samples in batches, one epoch per ``for`` loop; one loader per
    rank under DDP.

    Args:
        pipeline: the :class:`~gpupipe.Pipeline` to run. Its output must have a fixed size.
        batch_size: samples per batch, per rank.
        **options: keyword-only options, validated together as a :class:`~gpupipe.LoaderConfig`
            (its docstring describes each): ``shuffle``, ``drop_last``, ``seed``, ``backend``,
            ``device``, ``num_workers``, ``prefetch``, ``shuffle_buffer``, ``interleave``,
            ``repeats``, ``shards_ahead``, ``rank``, ``world_size``, ``memory_format``, ``dali``, ``ray``,
            ``on_error``, ``max_skipped``, ``max_image_pixels``, ``max_image_bytes``,
            ``apply_exif_orientation``, ``worker_timeout``, ``stage``.

    Batches: iterating yields :class:`Batch` objects, which unpack as ``images, labels``
    (``images`` ``[B, C, H, W]`` of the pipeline's output dtype and ``labels`` ``[B]`` int64, both
    on ``device``; ``labels`` is ``None`` for ``WebDataset(..., label=None)``) and carry ``keys``
    and ``valid``. For a pipeline of views, ``images`` is a tuple with one ``[B, C, H, W]`` tensor
    per view, as in ``for (global1, global2, *local), labels in loader``.

    Epochs: call :meth:`set_epoch` before each. Every rank computes its own part of each epoch
    from ``(seed, epoch, rank, world_size)`` without communication, and every rank yields
    ``len(loader)`` batches of the same sizes, padding marked in ``batch.valid``. The contract,
    with a worked example of what each rank yields at the end of an epoch for both ``drop_last``
    settings, is in docs/guide/distributed.md. The same ``(seed,
    epoch, world_size)`` gives every rank the same samples in the same order on every backend,
    and the same augmentation parameters per sample: drawn from ``(seed, epoch, sample)``
    (``gpupipe.core._random``), whatever the backend, ``num_workers`` or rank.

    Resuming: :meth:`state_dict` records the epoch and the batches yielded so far on this rank;
    after :meth:`load_state_dict` (and ``set_epoch`` of that same epoch) the loader yields
    exactly the batches, with the same keys and the same augmentation, that the interrupted run
    would have yielded next.

    Lifecycle: :meth:`close` (or ``with gp.Loader(...) as loader:``) ends the loader's worker
    processes, threads and DALI pipeline and closes its files; a loader that is garbage collected
    or still open at interpreter exit is closed then. One epoch runs at a time: ``iter(loader)``
    ends an unfinished earlier iteration. ``close()`` from another thread stops a running epoch at
    its next batch, which raises :class:`~gpupipe.ClosedError` in the iterating thread.
    """

    def __init__(self, pipeline: Pipeline, batch_size: int, **options: Any) -> None:
        valid_options("Loader", options)
        self._init(pipeline, LoaderConfig(batch_size, **options))

    @classmethod
    def from_config(cls, pipeline: Pipeline, config: LoaderConfig) -> Loader:
        """A loader of ``pipeline`` with the options of ``config``."""
        if not isinstance(config, LoaderConfig):
            raise ConfigError(f"Loader.from_config: config must be a gp.LoaderConfig, got {type(config).__name__}")
        loader = cls.__new__(cls)
        loader._init(pipeline, config)
        return loader

    def _init(self, pipeline: Pipeline, config: LoaderConfig) -> None:
        if not isinstance(pipeline, Pipeline):
            raise ConfigError(f"Loader: pipeline must be a gp.Pipeline, got {type(pipeline).__name__}")
        self.config = config
        topo = _dist.topology(config.rank, config.world_size)
        self.pipeline = pipeline
        self.rank, self.world_size = topo.rank, topo.world_size
        fields, images, targets = pipeline.fields, pipeline.has_image, pipeline.targets  # what the source asks
        backend, device = backends.resolve(config.backend, config.device, pipeline.views, fields=fields, images=images,
                                           targets=targets, pipeline=pipeline, stage=config.stage)  # fmt: skip
        self.chosen = backends.why(config.backend, config.device, backend, device, pipeline.views, fields=fields,
                                   images=images, targets=targets, pipeline=pipeline,
                                   stage=config.stage)  # auto's reasons  # fmt: skip
        require_runnable(pipeline, backend)
        if config.apply_exif_orientation and targets:
            raise UnsupportedTransformError(
                f"Loader: the source's {', '.join(map(repr, targets))} (masks and boxes) are in the pixels of the "
                "image as stored: not with apply_exif_orientation=True, which may turn the image and leave them behind"
            )
        self.seed = _dist.shared_seed(config.seed, topo, shuffle=config.shuffle, random_steps=pipeline.random,
                                      device=device)  # fmt: skip
        self.backend, self.device = backend.name, str(device)
        # Options left unset take what `gpupipe tune` recorded for this machine and pipeline, else defaults.
        key = tune_key(pipeline.views, config.batch_size, backend.name, device)
        hw_default = default_share(gpu_capability(device))[0]
        self._run_config, workers, self.tuned = resolve_tuned(config, key, hw_default=hw_default)
        self.num_workers = _dist.default_workers() if workers is None else workers
        self._at = Cursor()  # the position: epoch, batches yielded, resume point, layout
        self._meter = Meter()  # the data stall: the loop's waits in next() against its steps
        self._times = StageTimes()  # the epoch's seconds per stage, for the verdict
        self._mixing: dict[str, float] | None = None  # the first shuffled epoch's label mixing
        self._warned_advance = False
        self._current: weakref.ref[Generator[Batch, None, None]] | None = None  # the running iteration
        self._skips = Skips(config, self.rank)
        self._topo, self._device = topo, device
        self._use(index_source(pipeline.source, listing_of(pipeline.source, topo, device), config, topo, seed=self.seed,
                               device=device, skips=self._skips))  # fmt: skip
        if pipeline.batch_transform is not None and not self.index.labeled:
            raise ConfigError(f"Loader: {type(pipeline.batch_transform).__name__} mixes labels: the source has none")
        if self._len == 0:
            warnings.warn(
                f"Loader: drop_last=True with {len(self.index)} samples, batch_size={config.batch_size} "
                f"and world_size={self.world_size}: every epoch is empty",
                stacklevel=3,
            )
        self._next_pipeline: Pipeline | None = None  # set_pipeline's, run from the next iteration
        self._runners = Runners(self.index)
        # Releases the runners and the index when the loader is collected, or at exit (close(): now).
        self._finalizer = weakref.finalize(self, _collected, self._runners)
        try:
            self._runners.current = backend.runner(self._run_spec(pipeline))
        except BaseException:
            self.close()  # the index, now
            raise
        log.info("gpupipe loader: rank %d/%d (%s), %d samples in %d shards, backend=%s, device=%s, %d batches/epoch, "
                 "%s", self.rank, self.world_size, topo.origin, len(self.index), len(self.index.shards), self.backend,
                 self.device, self._len, ", ".join(f"{k}={v}" for k, v in self._runner.describe().items()))  # fmt: skip
        if self.tuned is not None:
            log.info("gpupipe loader: settings left unset are gpupipe tune's: %s", self.tuned)

    def _use(self, indexed: Indexed) -> None:
        """Takes ``indexed`` as the loader's index and plan settings."""
        self._indexed = indexed
        self.index, self.plan_spec, self._listing = indexed.index, indexed.spec, indexed.listing
        self.index.num_classes = self.pipeline.num_classes  # (a label outside: a bad sample)
        self._len = self.plan_spec.num_batches

    def _stage(self, pipeline: Pipeline) -> Stage | None:
        """``pipeline``'s stage: where its views hand their tails to it (``LoaderConfig.stage``),
        and its batch transform (``backends._stage``)."""
        device = torch.device(self.device)
        pays = backends.get(self.backend).stage_default(device.type, candidate_tails(pipeline)) is not None
        sources = getattr(self.index, "sources", None) if pipeline.per_source else None  # (a gp.Mix's)
        return stage_for(pipeline, device, self.config.stage, channels_last=self.config.channels_last, pays=pays,
                         sources=sources)  # fmt: skip

    def _own_stage(self, pipeline: Pipeline) -> Stage | None:
        """``pipeline``'s stage where the loader runs it, on each delivered batch; ``None`` where
        it has none, or where the runner runs it as it makes each batch (``Backend.batches_stage``)."""
        stage = self._stage(pipeline)
        return None if torch.device(self.device).type in backends.get(self.backend).batches_stage else stage

    def _run_spec(self, pipeline: Pipeline) -> backends.RunSpec:
        stage = self._stage(pipeline)  # the backend runs each view up to its tail, if it has one
        require_staged(pipeline, stage, backends.get(self.backend), self.config.stage)
        twisted = stage.first_staged(ColorJitter) if stage is not None and self.backend == "dali" else None
        if twisted is not None and self.config.dali.color_twist:  # the option acts where DALI's graph runs it
            warnings.warn(f"Loader: DaliOptions(color_twist=True) does not apply to {twisted}: the stage runs it, "
                          "with torchvision's kernels; pass stage=False to run it as DALI's color_twist",
                          stacklevel=3)  # fmt: skip
        return backends.RunSpec(
            index=self.index,
            views=stage.cut() if stage is not None and stage.tails else pipeline.views,
            config=self._run_config,
            device=torch.device(self.device),
            workers=self.num_workers,
            rank=self.rank,
            seed=self.seed,
            outputs=pipeline.output_specs if stage is None or not stage.tails else stage.cut_specs(pipeline.view_specs),
            per_source=pipeline.per_source,
            stage=None if self._own_stage(pipeline) is not None else stage,  # run by the loader, or the runner
        )

    @property
    def _runner(self) -> backends.Runner:
        runner = self._runners.current
        if runner is None:
            raise ClosedError("this gp.Loader is closed")
        return runner

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields (:meth:`set_epoch`)."""
        return self._at.epoch

    def __repr__(self) -> str:
        """The backend and device the loader runs on and what its runner chose (workers or
        threads; on DALI the decode strategy and the graph's operators)."""
        parts = [f"backend={self.backend!r}", f"device={self.device!r}", f"batch_size={self.batch_size}"]
        if not self.closed:
            parts += [f"{name}={value!r}" for name, value in self._runner.describe().items()]
        if self.tuned is not None:
            parts.append(f"tuned={self.tuned.date!r}")
        if self.chosen is not None:
            parts.append(f"auto={self.chosen!r}")
        parts += [f"rank={self.rank}/{self.world_size}", f"batches={len(self)}", f"epoch={self.epoch}"]
        return f"<gpupipe.Loader {' '.join(parts)}{' closed' if self.closed else ''}>"

    def close(self) -> None:
        """Ends the loader's worker processes, threads and DALI pipeline, stops an unfinished
        epoch and closes its shard files. Idempotent; iterating a closed loader raises
        :class:`~gpupipe.ClosedError`."""
        if self._finalizer.alive:
            self._record_verdict()  # an epoch stopped early: what it measured, for gpupipe doctor
        if self._finalizer.detach() is not None:
            self._runners.close()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank (of an epoch resumed on another world size:
        the batches left of it, see :meth:`load_state_dict`)."""
        layout = self._at.layout
        return self._len if layout is None else layout.offset + layout_batches(self.plan_spec, layout)

    @property
    def skipped(self) -> list[SkippedSample]:
        """The samples left out so far (``on_error="skip"``), each once, in the order they were
        first met; kept across epochs and in :meth:`state_dict`."""
        return list(self._skips.records.values())

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order (and augmentation) the next iteration yields. For a source
        that grows (``WebDataset(..., relist=True)``), a new epoch lists its shards again: the
        epoch reads those present now, and ``len(loader)`` follows (docs/guide/growing.md)."""
        valid_int("Loader.set_epoch", epoch, "epoch", minimum=0)
        at = self._at
        if at.start is not None and at.epoch != epoch and 0 < at.start < len(self):
            # a mid-epoch position dropped (one at an epoch's start or end drops nothing)
            warnings.warn(
                f"Loader.set_epoch({epoch}) after load_state_dict() of a state in epoch {at.epoch} "
                f"(batch {at.start}): the loaded position is dropped and epoch {epoch} starts from its "
                f"first batch. To resume, call set_epoch({at.epoch}) (or none) before iterating",
                UserWarning,
                stacklevel=2,
            )
        if self._listing is not None and epoch != at.listed and not self.closed:  # a growing source
            self._relist(listing_of(self.pipeline.source, self._topo, self._device))
            at.listed = epoch
        if epoch != at.epoch:
            self._skips.in_epoch = 0
        at.go_to(epoch)  # (another epoch drops the position in this one; said explicitly: iterate it)

    def plan(self, epoch: int | None = None) -> RankPlan:
        """This rank's plan for ``epoch`` (default: the current one): the global sample numbers it
        yields, in order, and which are padding. ``loader.index.key(n)`` names sample ``n``."""
        epoch = self.epoch if epoch is None else epoch
        return self._indexed.planner.plan(self.plan_spec, seed=self.seed, epoch=epoch, rank=self.rank,
                                          layout=self._at.layout_of(epoch))  # fmt: skip

    def __iter__(self) -> Generator[Batch, None, None]:
        """An iterator over this epoch's batches. One epoch runs at a time: starting a new
        iteration ends an unfinished earlier one (its iterator stops)."""
        if self.closed:
            raise ClosedError("this gp.Loader is closed")
        previous = self._current() if self._current is not None else None
        if previous is not None:
            try:
                previous.close()
            except ValueError:  # it is executing right now, in another thread
                raise GpupipeError(
                    "this gp.Loader is being iterated in another thread: a loader runs one epoch at a time"
                ) from None
        if self._at.finished:  # iterated again after a whole epoch, without set_epoch
            self._advance()
        self._switch_pipeline()
        iteration = self._iterate()
        self._current = weakref.ref(iteration)
        return iteration

    def _iterate(self) -> Generator[Batch, None, None]:
        meter, times, spent = self._meter, self._times, [0.0]
        meter.begin(self._at.epoch, self.config.batch_size)  # (first_batch_s: from here, planning included)
        at = self._at
        epoch, start = at.epoch, at.begin()
        if start == 0:
            self._skips.in_epoch = 0
        plan = self.plan(epoch)
        shift = plan.batch_offset  # a resumed epoch's batches count on from the saved
        start -= shift
        device = torch.device(self.device)
        limit = self.config.skip_limit(int(plan.valid.sum()))
        size = self.config.batch_size
        fetch = prefetcher(self.index, plan.samples[start * size :], size, self.config.remote_ahead())
        stage = self._own_stage(self.pipeline)
        times.begin()
        produced: Any = None
        run: Any = None
        self.end_of_dataloader = False
        accelerate = accelerate_gradient_state()
        if accelerate is not None:  # its gradient accumulation syncs at this epoch's last batch
            accelerate._add_dataloader(self)
        try:
            if fetch is not None:
                fetch.advance(0)
            produced = self._runner.run(plan, start)
            batches = enumerate(produced, start)
            # each batch after the stage (ahead, on a GPU), or as it came (none, or the runner's)
            run = (
                ((b, raw, raw.images, raw.labels) for b, raw in batches)
                if stage is None
                else stage.batches(batches, plan, device, rank=self.rank, spent=spent)
            )
            while True:
                try:
                    b, raw, staged, labels = next(run)
                except StopIteration:
                    break
                except ValueError as e:  # close() in another thread is ending the run right now
                    if self.closed and "already executing" in str(e):
                        break  # (ClosedError below)
                    raise
                if self.closed:  # a batch made before close() (the stage's one ahead): not handed on
                    break
                times.add(raw.times, None if stage is None else spent[0],
                          clock="stage" if stage is None or stage.tails else "mix")  # fmt: skip
                spent[0] = 0.0
                if fetch is not None:
                    fetch.advance(b - start + 1)
                valid = plan.batch(b)[1].copy()
                if raw.skipped:
                    self._skips.mark(raw.skipped, valid, epoch, limit)
                at.yielded = shift + b + 1
                self.end_of_dataloader = at.yielded == shift + plan.num_batches
                images = staged if self.pipeline.has_views else staged[0] if staged else None
                mask = backends.to_device(torch.from_numpy(valid), device)
                if self._mixing is None and self.config.shuffle:  # once, with a first batch (the start-up's)
                    self._judge_mixing(plan)
                meter.ready(int(valid.sum()))  # (the images handed over: padding and skipped samples left out)
                yield Batch(images, labels, raw.keys, mask, dict(raw.fields or {}))
                meter.resumed()
                if at.epoch != epoch:
                    raise GpupipeError(
                        f"Loader.set_epoch({at.epoch}) was called while epoch {epoch} was being iterated (after "
                        f"{shift + b + 1} of its {shift + plan.num_batches} batches): this iteration ends here. Call "
                        "set_epoch before iterating, or break out of the loop first"
                    )
        finally:
            if accelerate is not None:
                accelerate._remove_dataloader(self)
            if fetch is not None:
                fetch.close()
            # the runner's run ended now, not when this frame goes (a traceback kept, as IPython keeps
            # the last, held it open: the next epoch's run then took its queued batches)
            for generator in (run, produced):
                end_run(generator)
        if at.yielded == shift + plan.num_batches and not self.closed and at.epoch == epoch:
            at.finished = True  # ran to its end: a new iteration without set_epoch is the next epoch
            self._record_verdict()  # for gpupipe doctor
        if self.closed and at.yielded < shift + plan.num_batches:
            raise ClosedError(
                f"this gp.Loader was closed during an epoch, after {at.yielded} of its {shift + plan.num_batches} "
                "batches"
            )


def _collected(runners: Runners) -> None:
    """A loader dropped without ``close()``, collected (or alive at exit): its runners and index
    closed without waiting for threads (``backends._base.collecting``)."""
    with collecting():
        runners.close()
