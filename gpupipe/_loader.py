"""Loader: the iterator a training loop uses — ``len``, ``set_epoch``, ``for images, labels in loader``."""

from __future__ import annotations

import logging
import math
import random
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from . import backends
from ._errors import ConfigError, PipelineError
from ._pipeline import Pipeline
from ._plan import epoch_order
from .transforms._base import is_int

__all__ = ["Loader", "Batch"]

log = logging.getLogger("gpupipe")


class Batch(tuple):
    """One batch: unpacks as ``images, labels`` and carries the sample keys.

    Attributes:
        images: ``[B, C, H, W]`` tensor on the loader's device.
        labels: ``[B]`` int64 tensor on the loader's device.
        keys: the ``B`` sample keys, in batch order.
    """

    keys: list[str]

    def __new__(cls, images: torch.Tensor, labels: torch.Tensor, keys: list[str]) -> Batch:
        self = super().__new__(cls, (images, labels))
        self.keys = keys
        return self

    @property
    def images(self) -> torch.Tensor:
        return self[0]

    @property
    def labels(self) -> torch.Tensor:
        return self[1]


class Loader:
    """Iterates over a pipeline's samples in batches, one epoch per ``for`` loop.

    Args:
        pipeline: the :class:`~gpupipe.Pipeline` to run. Its output must have a fixed size.
        batch_size: samples per batch.
        shuffle: shuffle each epoch (see below). Default ``False``: shard order, then member order.
        drop_last: drop the last, incomplete batch. Default ``False``.
        seed: seed of the shuffle and of the augmentations; ``None`` draws one at construction
            (the run is then not reproducible).
        backend: ``"dali"`` (one DALI graph; nvJPEG and GPU operators on ``cuda``, DALI's CPU
            operators on ``cpu``), ``"torch"`` (torchvision kernels in worker processes), or
            ``"auto"`` (default): DALI when installed, else torch.
        device: where batches are delivered: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; ``None``
            picks ``"cuda"`` when available, else ``"cpu"``.
        num_workers: worker processes that decode and transform (torch backend; DALI's CPU
            threads on the dali backend); ``None`` uses one per CPU core, up to 8; ``0`` runs the
            torch backend in the calling process.
        prefetch: batches prepared ahead (per worker on torch; DALI's queue depth). Default 2.
        shuffle_buffer: with ``shuffle=True`` on tar shards, samples are mixed within a window of
            this many samples after the shard order is permuted. Default 4096.
        memory_format: ``torch.contiguous_format`` (default) or ``torch.channels_last``: NHWC
            storage presented as an ``[B, C, H, W]`` tensor (DALI's layout, no extra copy there).

    Yields:
        :class:`Batch`: ``images`` ``[B, C, H, W]`` of the pipeline's output dtype and
        ``labels`` ``[B]`` int64, both on ``device``, and ``keys``. For an unlabeled source
        (``WebDataset(..., label=None)``) the loader yields the images tensor alone.

    Epochs: an epoch yields every sample once (before ``drop_last``). With ``shuffle=True`` the
    order depends only on ``(seed, epoch)``: call :meth:`set_epoch` before each epoch; the same
    seed and epoch give the same order and the same augmentation parameters on the torch
    backend, whatever ``num_workers``. The dali backend reads the shards in the same permuted
    order but mixes samples with DALI's reader buffer and draws augmentations with DALI's
    generators, both seeded from ``(seed, epoch)``.

    End of epoch, worked example: 10 samples, ``batch_size=4``. ``drop_last=False`` → 3 batches
    of 4, 4 and 2 samples, ``len(loader) == 3``; ``drop_last=True`` → 2 batches of 4, the 2 samples
    that would come last in this epoch's order are skipped (with ``shuffle=True`` they are
    different samples each epoch), ``len(loader) == 2``.
    """

    def __init__(self, pipeline: Pipeline, batch_size: int, *, shuffle: bool = False, drop_last: bool = False,
                 seed: int | None = None, backend: str = "auto", device: Any = None,
                 num_workers: int | None = None, prefetch: int = 2, shuffle_buffer: int = 4096,
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
        if not (is_int(shuffle_buffer) and shuffle_buffer >= 1):
            raise ConfigError(f"Loader: shuffle_buffer must be an int >= 1, got {shuffle_buffer!r}")
        spec = pipeline.output_spec
        if not spec.fixed_size:
            raise PipelineError(f"the pipeline's output size varies ({spec}); batching needs a fixed size: end it "
                                "with CenterCrop, RandomCrop, RandomResizedCrop or Resize((h, w))")
        self.pipeline = pipeline
        self.batch_size = batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self.seed = seed if seed is not None else random.SystemRandom().randrange(2**63)
        self.shuffle_buffer = shuffle_buffer
        self.backend, self.device = backends.resolve(backend, device)
        self.num_workers = min(_cpu_count(), 8) if num_workers is None else num_workers
        self.prefetch = prefetch
        self.channels_last = memory_format == torch.channels_last
        self.epoch = 0
        self.index = pipeline.source.index()
        self.num_samples = len(self.index)
        if self.num_samples == 0:
            raise ConfigError(f"Loader: the source has no samples: {pipeline.source!r}")
        if drop_last and self.num_samples < batch_size:
            warnings.warn(f"Loader: drop_last=True with {self.num_samples} samples and batch_size={batch_size}: "
                          "every epoch is empty", stacklevel=2)
        self._runner = self._make_runner()
        log.info("gpupipe loader: %d samples in %d shards, backend=%s, device=%s, %d batches/epoch",
                 self.num_samples, len(self.index.shards), self.backend, self.device, len(self))

    def _make_runner(self) -> Any:
        if self.backend == "dali":
            from .backends._dali_loader import DaliRunner

            return DaliRunner(self.index, self.pipeline.source, self.pipeline.transforms, seed=self.seed,
                              device=self.device, batch_size=self.batch_size, num_threads=self.num_workers,
                              prefetch=self.prefetch, shuffle=self.shuffle, shuffle_buffer=self.shuffle_buffer,
                              channels_last=self.channels_last)
        from .backends._torch_loader import TorchRunner

        return TorchRunner(self.index, self.pipeline.transforms, seed=self.seed, device=self.device,
                           batch_size=self.batch_size, num_workers=self.num_workers, prefetch=self.prefetch,
                           channels_last=self.channels_last)

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = self.num_samples, self.batch_size
        return n // b if self.drop_last else math.ceil(n / b)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order (and augmentation) the next iteration yields."""
        if not (is_int(epoch) and epoch >= 0):
            raise ConfigError(f"Loader.set_epoch: epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """Global sample numbers in the order ``epoch`` (default: the current one) yields them on
        the torch backend (and on dali without shuffling; with shuffling DALI's buffer mixes the
        samples of the same shard order)."""
        epoch = self.epoch if epoch is None else epoch
        return epoch_order(self.index.shard_sizes, sequential=self.index.sequential, shuffle=self.shuffle,
                           seed=self.seed, epoch=epoch, buffer=self.shuffle_buffer)

    def __iter__(self) -> Iterator[Batch | torch.Tensor]:
        labeled = self.index.labeled
        for images, labels, keys in self._runner.run(self.epoch_order(), len(self), self.epoch):
            yield Batch(images, labels, keys) if labeled else images


def _cpu_count() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1
