"""Loader: the iterator a training loop uses — ``len``, ``set_epoch``, ``for images, labels in loader``."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from . import _dist, backends
from ._errors import ConfigError, PipelineError
from ._pipeline import Pipeline
from ._plan import RankPlan, num_batches, rank_plan
from .transforms._base import is_int

__all__ = ["Loader", "Batch"]

log = logging.getLogger("gpupipe")


class Batch(tuple):
    """One batch: unpacks as ``images, labels`` and carries the sample keys and a validity mask.

    Attributes:
        images: ``[B, C, H, W]`` tensor on the loader's device.
        labels: ``[B]`` int64 tensor on the loader's device; ``None`` for unlabeled sources.
        keys: the ``B`` sample keys (list of str), in batch order.
        valid: ``[B]`` bool tensor on the loader's device, ``False`` for padding: the repeated
            sample that evens out the ranks' lengths when ``drop_last=False`` (see
            :class:`Loader`). Mask it out of metrics: ``correct[batch.valid].sum()``.
    """

    keys: list[str]
    valid: torch.Tensor

    def __new__(cls, images: torch.Tensor, labels: torch.Tensor | None, keys: list[str],
                valid: torch.Tensor) -> Batch:
        self = super().__new__(cls, (images, labels))
        self.keys = keys
        self.valid = valid
        return self

    @property
    def images(self) -> torch.Tensor:
        return self[0]

    @property
    def labels(self) -> torch.Tensor | None:
        return self[1]


STATE_VERSION = 1


class Loader:
    """Iterates over a pipeline's samples in batches, one epoch per ``for`` loop; one loader per
    rank under DDP.

    Args:
        pipeline: the :class:`~gpupipe.Pipeline` to run. Its output must have a fixed size.
        batch_size: samples per batch, per rank.
        shuffle: shuffle each epoch (see below). Default ``False``: shard order, then member order.
        drop_last: drop the samples that do not fill a whole batch on every rank. Default ``False``.
        seed: seed of the shuffle and of the augmentations; ``None`` draws one (on rank 0,
            broadcast to the others through ``torch.distributed``; with ``shuffle=True`` and
            several ranks but no ``torch.distributed``, pass a seed); the run is then not
            reproducible, but :meth:`state_dict` records the seed so that a resume is exact.
        backend: ``"dali"`` (one DALI graph; nvJPEG and GPU operators on ``cuda``, DALI's CPU
            operators on ``cpu``), ``"torch"`` (torchvision kernels in worker processes), or
            ``"auto"`` (default): DALI when installed, else torch.
        device: where batches are delivered: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; ``None``
            picks ``"cuda"`` when available, else ``"cpu"``. ``"cuda"`` means
            ``cuda:<LOCAL_RANK>`` under torchrun (``SLURM_LOCALID`` under srun).
        num_workers: worker processes that decode and transform (torch backend; DALI's CPU
            threads on the dali backend); ``None`` uses one per CPU core, up to 8; ``0`` runs the
            torch backend in the calling process.
        prefetch: batches prepared ahead (per worker on torch; DALI's queue depth). Default 2.
        shuffle_buffer: with ``shuffle=True`` on tar shards, samples are mixed within a window of
            this many samples. Default 4096.
        interleave: with ``shuffle=True`` on tar shards, each rank reads this many shards at once,
            evenly interleaved, before the buffer mixes them. Default 64.
        rank, world_size: this process's place among the data-parallel ranks; ``None`` (default)
            takes them from ``torch.distributed``, else ``RANK``/``WORLD_SIZE``, else
            ``SLURM_PROCID``/``SLURM_NTASKS``, else rank 0 of 1. Pass both or neither.
        memory_format: ``torch.contiguous_format`` (default) or ``torch.channels_last``: NHWC
            storage presented as an ``[B, C, H, W]`` tensor (DALI's layout, no extra copy there).

    Yields:
        :class:`Batch`: unpacks as ``images, labels`` — ``images`` ``[B, C, H, W]`` of the
        pipeline's output dtype and ``labels`` ``[B]`` int64, both on ``device`` (``labels`` is
        ``None`` for ``WebDataset(..., label=None)``) — and carries ``keys`` and ``valid``.

    Epochs: every rank computes its own part of each epoch from ``(seed, epoch, rank,
    world_size)``, without communication:

    - the samples are put in one global order: shard order then member order, or, with
      ``shuffle=True``, the shards in an order permuted per epoch (ImageFolder: a permutation of
      the samples);
    - the global order is cut into ``world_size`` contiguous parts whose sizes differ by at most
      one, so a rank reads whole shards plus at most two partial ones;
    - with ``shuffle=True`` each rank reads ``interleave`` of its shards at a time and mixes
      samples within ``shuffle_buffer``;
    - every rank yields ``len(loader)`` batches of the same sizes, so DDP never hangs on uneven
      shards. ``drop_last=False``: each rank has ``ceil(N / world_size)`` slots; a rank one
      sample short repeats one of its samples as padding with ``valid=False``; the valid samples
      of all ranks are every sample exactly once; the last batch may be smaller than
      ``batch_size`` (the same size on every rank). ``drop_last=True``: each rank yields
      ``N // (world_size * batch_size)`` full batches; fewer than ``world_size * batch_size``
      samples are skipped per epoch (different ones each epoch when shuffling).

    Call :meth:`set_epoch` before each epoch. The same ``(seed, epoch, world_size)`` always gives
    every rank the same samples in the same order, on every backend; the torch backend also gives
    the same augmentation parameters, whatever ``num_workers``. The dali backend draws them with
    DALI's generators, seeded from ``(seed, epoch, rank)``.

    Worked example: 10 samples ``s0..s9`` in one shard, ``shuffle=False``, 3 ranks,
    ``batch_size=2``. The parts are ``s0-s3``, ``s4-s6``, ``s7-s9``.

    - ``drop_last=False``: ``len(loader) == 2`` on every rank (4 slots each).
      Rank 0 yields ``[s0 s1] [s2 s3]``; rank 1 ``[s4 s5] [s6 s4*]``; rank 2
      ``[s7 s8] [s9 s7*]``, where ``*`` is padding (``valid`` False): 10 valid samples, each once.
    - ``drop_last=True``: ``len(loader) == 1`` (``10 // (3 * 2)``). Rank 0 yields ``[s0 s1]``,
      rank 1 ``[s4 s5]``, rank 2 ``[s7 s8]``; ``s2 s3 s6 s9`` are skipped this epoch (4 < 3 * 2).

    With one process the same rules give the usual ``DataLoader`` behaviour: 10 samples,
    ``batch_size=4`` → batches of 4, 4 and 2 (``drop_last=False``) or 4 and 4 (``drop_last=True``).

    Resuming: :meth:`state_dict` records the epoch and the batches yielded so far on this rank;
    after :meth:`load_state_dict` (and ``set_epoch`` of that same epoch) the loader yields
    exactly the batches, with the same keys, that the interrupted run would have yielded next.
    """

    def __init__(self, pipeline: Pipeline, batch_size: int, *, shuffle: bool = False, drop_last: bool = False,
                 seed: int | None = None, backend: str = "auto", device: Any = None,
                 num_workers: int | None = None, prefetch: int = 2, shuffle_buffer: int = 4096,
                 interleave: int = 64, rank: int | None = None, world_size: int | None = None,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        if not isinstance(pipeline, Pipeline):
            raise ConfigError(f"Loader: pipeline must be a gp.Pipeline, got {type(pipeline).__name__}")
        if not (is_int(batch_size) and batch_size > 0):
            raise ConfigError(f"Loader: batch_size must be a positive int, got {batch_size!r}")
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(value, bool):
                raise ConfigError(f"Loader: {name} must be True or False, got {value!r}")
        if seed is not None and not is_int(seed):
            raise ConfigError(f"Loader: seed must be an int or None, got {seed!r}")
        if num_workers is not None and not (is_int(num_workers) and num_workers >= 0):
            raise ConfigError(f"Loader: num_workers must be None or an int >= 0, got {num_workers!r}")
        if not (is_int(prefetch) and prefetch >= 1):
            raise ConfigError(f"Loader: prefetch must be an int >= 1, got {prefetch!r}")
        if memory_format not in (torch.contiguous_format, torch.channels_last):
            raise ConfigError(f"Loader: memory_format must be torch.contiguous_format or torch.channels_last, "
                              f"got {memory_format!r}")
        for name, value in (("shuffle_buffer", shuffle_buffer), ("interleave", interleave)):
            if not (is_int(value) and value >= 1):
                raise ConfigError(f"Loader: {name} must be an int >= 1, got {value!r}")
        spec = pipeline.output_spec
        if not spec.fixed_size:
            raise PipelineError(f"the pipeline's output size varies ({spec}); batching needs a fixed size: end it "
                                "with CenterCrop, RandomCrop, RandomResizedCrop or Resize((h, w))")
        topo = _dist.topology(rank, world_size)
        self.pipeline = pipeline
        self.batch_size = batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self.rank, self.world_size = topo.rank, topo.world_size
        self._seed_given = seed is not None
        self.seed = _dist.shared_seed(seed, topo, shuffle=shuffle)
        self.shuffle_buffer, self.interleave = shuffle_buffer, interleave
        self.backend, self.device = backends.resolve(backend, device)
        self.num_workers = min(_cpu_count(), 8) if num_workers is None else num_workers
        self.prefetch = prefetch
        self.channels_last = memory_format == torch.channels_last
        self.epoch = 0
        self._yielded = 0  # batches of self.epoch yielded so far
        self._resume_at: tuple[int, int] | None = None  # (epoch, batch) set by load_state_dict
        self.index = pipeline.source.index(rank=self.rank, world_size=self.world_size)
        self.num_samples = len(self.index)
        if self.num_samples == 0:
            raise ConfigError(f"Loader: the source has no samples: {pipeline.source!r}")
        _dist.check_same(topo, "the loader's plan", {**self._plan_settings(), "seed": self.seed,
                                                       "shards": len(self.index.shards)})
        self._len = num_batches(self.num_samples, world_size=self.world_size, batch_size=batch_size,
                                drop_last=drop_last)
        if self._len == 0:
            warnings.warn(f"Loader: drop_last=True with {self.num_samples} samples, batch_size={batch_size} and "
                          f"world_size={self.world_size}: every epoch is empty", stacklevel=2)
        self._runner = self._make_runner()
        log.info("gpupipe loader: rank %d/%d (%s), %d samples in %d shards, backend=%s, device=%s, %d batches/epoch",
                 self.rank, self.world_size, topo.origin, self.num_samples, len(self.index.shards), self.backend,
                 self.device, self._len)

    def _make_runner(self) -> Any:
        if self.backend == "dali":
            from .backends._dali_loader import DaliRunner

            return DaliRunner(self.index, self.pipeline.transforms, device=self.device, rank=self.rank, seed=self.seed,
                              batch_size=self.batch_size, num_threads=self.num_workers, prefetch=self.prefetch,
                              channels_last=self.channels_last)
        from .backends._torch_loader import TorchRunner

        return TorchRunner(self.index, self.pipeline.transforms, device=self.device, num_workers=self.num_workers,
                           prefetch=self.prefetch, channels_last=self.channels_last)

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank."""
        return self._len

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order (and augmentation) the next iteration yields."""
        if not (is_int(epoch) and epoch >= 0):
            raise ConfigError(f"Loader.set_epoch: epoch must be an int >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self._yielded = 0
        self.epoch = epoch

    def plan(self, epoch: int | None = None) -> RankPlan:
        """This rank's plan for ``epoch`` (default: the current one): the global sample numbers it
        yields, in order, and which are padding. ``loader.index.key(n)`` names sample ``n``."""
        epoch = self.epoch if epoch is None else epoch
        return rank_plan(self.index.shard_sizes, sequential=self.index.sequential, shuffle=self.shuffle,
                         seed=self.seed, epoch=epoch, buffer=self.shuffle_buffer, interleave=self.interleave,
                         rank=self.rank, world_size=self.world_size, batch_size=self.batch_size,
                         drop_last=self.drop_last)

    def __iter__(self) -> Iterator[Batch]:
        epoch, start = self.epoch, 0
        if self._resume_at is not None and self._resume_at[0] == epoch:
            start = self._resume_at[1]
        self._resume_at = None
        self._yielded = start
        plan = self.plan(epoch)
        device = torch.device(self.device)
        for b, (images, labels, keys) in enumerate(self._runner.run(plan, start, epoch, self.seed), start):
            valid = torch.from_numpy(plan.batch(b)[1].copy())
            if device.type != "cpu":
                valid = valid.to(device, non_blocking=True)
            self._yielded = b + 1
            yield Batch(images, labels, keys, valid)

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: the epoch and the batches of it yielded so far, with the settings
        the plan depends on. Save one per rank; call it between batches (after a step)."""
        return {"version": STATE_VERSION, "epoch": self.epoch, "batches_yielded": self._yielded,
                "seed": self.seed, "rank": self.rank, **self._plan_settings()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a position saved by :meth:`state_dict` on the same rank: the next iteration of
        that epoch yields the batches the interrupted run would have yielded next (same keys in
        the same order; on the dali backend the augmentation draws may differ).

        Raises:
            ConfigError: the state is from another rank, or from a loader whose plan differs
                (sample count, world size, batch size, ``drop_last``, shuffle settings, or an
                explicitly different seed).
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ConfigError(f"Loader.load_state_dict: not a gpupipe loader state (version {STATE_VERSION})")
        mine = self._plan_settings()
        diff = [f"{k}={state.get(k)!r} (this loader: {v!r})" for k, v in mine.items() if state.get(k) != v]
        if state.get("rank") != self.rank:
            diff.insert(0, f"rank={state.get('rank')!r} (this loader: {self.rank}); save one state per rank")
        if self._seed_given and state.get("seed") != self.seed:
            diff.append(f"seed={state.get('seed')!r} (this loader: {self.seed})")
        if diff:
            raise ConfigError("Loader.load_state_dict: the state does not match this loader: " + "; ".join(diff))
        epoch, done = state["epoch"], state["batches_yielded"]
        if not (is_int(epoch) and epoch >= 0 and is_int(done) and 0 <= done <= self._len):
            raise ConfigError(f"Loader.load_state_dict: bad position epoch={epoch!r}, batches_yielded={done!r}")
        self.seed = state["seed"]
        self.epoch, self._yielded = epoch, done
        self._resume_at = (epoch, done)

    def _plan_settings(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "world_size": self.world_size, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "shuffle": self.shuffle, "shuffle_buffer": self.shuffle_buffer,
                "interleave": self.interleave}


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1
