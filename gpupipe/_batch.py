"""What a loader yields and records: :class:`Batch` (unpacks as ``images, labels``) and
:class:`SkippedSample`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["Batch", "SkippedSample"]


class Batch(tuple):
    """One batch: unpacks as ``images, labels`` and carries the sample keys and a validity mask.

    Attributes:
        images: ``[B, C, H, W]`` tensor on the loader's device; for a pipeline of views
            (``Pipeline(source, views=[...])``), a tuple of such tensors, one per view.
        labels: ``[B]`` int64 tensor on the loader's device; ``None`` for unlabeled sources.
        keys: the ``B`` sample keys (list of str), in batch order.
        views: the images as a tuple, one ``[B, C, H, W]`` per view, whichever the pipeline.
        valid: ``[B]`` bool tensor on the loader's device, ``False`` for padding: the repeated
            sample that evens out the ranks' lengths when ``drop_last=False`` (see
            :class:`Loader`). Mask it out of metrics: ``correct[batch.valid].sum()``.
    """

    keys: list[str]
    valid: torch.Tensor

    def __new__(
        cls,
        images: torch.Tensor | tuple[torch.Tensor, ...],
        labels: torch.Tensor | None,
        keys: list[str],
        valid: torch.Tensor,
    ) -> Batch:
        self = super().__new__(cls, (images, labels))
        self.keys = keys
        self.valid = valid
        return self

    @property
    def images(self) -> Any:
        """``[B, C, H, W]``, or a tuple of them for a pipeline of views (typed ``Any`` so that both
        unpack without casts)."""
        return self[0]

    @property
    def views(self) -> tuple[torch.Tensor, ...]:
        """The images as a tuple of ``[B, C, H, W]`` tensors, one per view: ``(images,)`` for a
        single transform list. Code that handles both kinds of pipeline reads this."""
        images = self[0]
        return images if isinstance(images, tuple) else (images,)

    @property
    def labels(self) -> torch.Tensor | None:
        return self[1]


@dataclasses.dataclass(frozen=True)
class SkippedSample:
    """A sample (or a whole shard: ``key`` ``None``) a loader left out: where it is, why, what
    kind of damage (a :class:`~gpupipe.Damage` value, ``None`` where unclassified), and the first
    epoch it was skipped in, ``None`` for those left out of every epoch before the loader ran
    (damage found when indexing, samples listed by ``gpupipe check``). ``str()`` is the error's
    message."""

    key: str | None
    shard: str | None
    reason: str
    epoch: int | None
    kind: str | None = None

    def __str__(self) -> str:
        return self.reason
