"""Runs a pipeline with the torch backend: a map-style dataset over the index, read in
DataLoader worker processes, batches in the order of the rank's epoch plan."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .._decode import decode_rgb
from .._errors import SampleError
from .._plan import RankPlan, sample_seed
from ..sources import Index
from ..transforms import Transform
from ._torch import apply_pipeline, check_pipeline

__all__ = ["TorchRunner"]


class _Samples(Dataset):
    def __init__(self, index: Index, transforms: Sequence[Transform]) -> None:
        self.index, self.transforms = index, tuple(transforms)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item: tuple[int, int, int]) -> tuple[torch.Tensor, int | None, str]:
        sample, seed, epoch = item
        raw = self.index.read(sample)
        image = decode_rgb(raw.data, shard=raw.shard, key=raw.key)
        try:
            image = apply_pipeline(self.transforms, image, random.Random(sample_seed(seed, epoch, sample)))
        except ValueError as e:  # e.g. RandomCrop larger than this image
            raise SampleError(f"sample {raw.key!r} in shard {raw.shard!r} ({image.shape[-2]}x{image.shape[-1]}): "
                              f"{e}", shard=raw.shard, key=raw.key) from e
        return image, raw.label, raw.key


def _collate(items: list[tuple[torch.Tensor, int | None, str]]) -> tuple[torch.Tensor, torch.Tensor | None, list[str]]:
    images = torch.stack([i[0] for i in items])
    labels = None if items[0][1] is None else torch.tensor([i[1] for i in items], dtype=torch.int64)
    return images, labels, [i[2] for i in items]


class _Batches:
    """Batch sampler: iterated in the main process each epoch, so it follows the plan even with
    persistent workers."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int, int]]] = []

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class TorchRunner:
    """Decode and transforms in ``num_workers`` processes (in-process when 0)."""

    def __init__(self, index: Index, transforms: Sequence[Transform], *, device: str, num_workers: int,
                 prefetch: int, channels_last: bool = False) -> None:
        check_pipeline(transforms)
        self.channels_last = channels_last
        self.device = torch.device(device)
        self._batches = _Batches()
        self._loader = DataLoader(
            _Samples(index, transforms), batch_sampler=self._batches, collate_fn=_collate,
            num_workers=num_workers, prefetch_factor=prefetch if num_workers else None,
            persistent_workers=num_workers > 0, pin_memory=self.device.type == "cuda",
        )

    def run(self, plan: RankPlan, start: int, epoch: int, seed: int
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, list[str]]]:
        """Yields batches ``start..plan.num_batches-1`` of the plan."""
        self._batches.batches = [[(int(s), seed, epoch) for s in plan.batch(b)[0]]
                                 for b in range(start, plan.num_batches)]
        for images, labels, keys in self._loader:
            if self.device.type != "cpu":
                images = images.to(self.device, non_blocking=True)
                labels = None if labels is None else labels.to(self.device, non_blocking=True)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            yield images, labels, keys
