"""Runs a pipeline with the torch backend: a map-style dataset over the index, read in
DataLoader worker processes, batches in the order of the rank's epoch plan."""

from __future__ import annotations

import random
from collections.abc import Generator, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from ..._decode import decode_rgb
from ..._errors import ClosedError, SampleError
from ..._plan import RankPlan, sample_seed
from ...sources import Index
from ...transforms import Transform
from .._base import RawBatch, Runs, RunSpec
from ._kernels import apply_pipeline

__all__ = ["TorchRunner"]

Item = tuple[int, int, int]  # (sample, seed, epoch)


class _Samples(Dataset[tuple[torch.Tensor, "int | None", str]]):
    def __init__(self, index: Index, transforms: Sequence[Transform]) -> None:
        self.index, self.transforms = index, tuple(transforms)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item: Item) -> tuple[torch.Tensor, int | None, str]:
        sample, seed, epoch = item
        raw = self.index.read(sample)
        image = decode_rgb(raw.data, shard=raw.shard, key=raw.key)
        try:
            image = apply_pipeline(self.transforms, image, random.Random(sample_seed(seed, epoch, sample)))
        except ValueError as e:  # e.g. RandomCrop larger than this image
            size = (int(image.shape[-2]), int(image.shape[-1]))
            raise SampleError.at(str(e), shard=raw.shard, key=raw.key, size=size) from e
        return image, raw.label, raw.key


def _collate(items: list[tuple[torch.Tensor, int | None, str]]) -> RawBatch:
    images = torch.stack([i[0] for i in items])
    labels = None if items[0][1] is None else torch.tensor([i[1] for i in items], dtype=torch.int64)
    return RawBatch(images, labels, [i[2] for i in items])


class _Batches:
    """Batch sampler: iterated in the main process each epoch, so it follows the plan even with
    persistent workers."""

    def __init__(self) -> None:
        self.batches: list[list[Item]] = []

    def __iter__(self) -> Iterator[list[Item]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class TorchRunner:
    """Decode and transforms in ``spec.workers`` processes (in-process when 0), kept alive between
    epochs (``persistent_workers``) and ended by :meth:`close`."""

    def __init__(self, spec: RunSpec) -> None:
        self.channels_last = spec.channels_last
        self.device = spec.device
        self._batches = _Batches()
        self._loader: DataLoader[tuple[torch.Tensor, int | None, str]] | None = DataLoader(
            _Samples(spec.index, spec.transforms),
            batch_sampler=self._batches,
            collate_fn=_collate,
            num_workers=spec.workers,
            prefetch_factor=spec.prefetch if spec.workers else None,
            persistent_workers=spec.workers > 0,
            pin_memory=self.device.type == "cuda",
        )
        self._runs = Runs()

    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        """Yields batches ``start..plan.num_batches-1`` of the plan."""
        if self._loader is None:
            raise ClosedError("the torch runner is closed")
        return self._runs.track(self._run(self._loader, plan, start))

    def _run(self, loader: DataLoader, plan: RankPlan, start: int) -> Generator[RawBatch, None, None]:
        self._batches.batches = [
            [(int(s), plan.seed, plan.epoch) for s in plan.batch(b)[0]] for b in range(start, plan.num_batches)
        ]
        for images, labels, keys in loader:
            if self.device.type != "cpu":
                images = images.to(self.device, non_blocking=True)
                labels = None if labels is None else labels.to(self.device, non_blocking=True)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            yield RawBatch(images, labels, keys)

    def close(self) -> None:
        """Stops an unfinished epoch and ends the worker processes (and the pin-memory thread)."""
        self._runs.close()
        loader, self._loader = self._loader, None
        iterator = getattr(loader, "_iterator", None)  # the persistent workers' iterator
        if iterator is not None:
            iterator._shutdown_workers()
            loader._iterator = None  # type: ignore[union-attr]
