"""What a loader yields and records: :class:`Batch` (unpacks as ``images, labels``) and
:class:`SkippedSample`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Batch", "SkippedSample", "map_tensors"]


@dataclasses.dataclass(eq=False)
class Batch:
    """One batch: unpacks as ``images, labels`` (``batch[0]``, ``batch[1]``, ``len(batch) == 2``)
    and carries the sample keys and a validity mask.

    Attributes:
        images: ``[B, C, H, W]`` tensor on the loader's device; for a pipeline of views
            (``Pipeline(source, views=[...])``), a tuple of such tensors, one per view.
        labels: ``[B]`` int64 tensor on the loader's device; ``None`` for unlabeled sources. With a
            pipeline's ``batch_transform`` (MixUp, CutMix), float32 soft targets ``[B,
            num_classes]``.
        keys: the ``B`` sample keys (list of str), in batch order.
        valid: ``[B]`` bool tensor on the loader's device, ``False`` for padding: the repeated
            sample that evens out the ranks' lengths when ``drop_last=False`` (see
            :class:`Loader`) and the places of skipped samples. Mask it out of metrics and of the
            batch size you log: ``correct[batch.valid].sum()``, ``batch.valid.sum()``.
        views: the images as a tuple, one ``[B, C, H, W]`` per view, whichever the pipeline.
        fields: the sample's other fields by name (a source's ``fields=``; empty otherwise), each
            batched as its kind says: a list of ``B`` values (text, JSON), or a tensor with the
            batch first. ``batch["text"]`` reads one.

    Trainers handle it whole: it is a dataclass, so Lightning's and Accelerate's collection
    functions (``apply_to_collection``, ``move_data_to_device``, ``send_to_device``) rebuild it
    with every field, as do ``copy``, ``pickle`` and ``torch.utils._pytree``; :meth:`to` moves it.
    """

    images: Any
    labels: torch.Tensor | None
    keys: list[str]
    valid: torch.Tensor
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __iter__(self) -> Iterator[Any]:
        yield self.images
        yield self.labels

    def __getitem__(self, index: int | str) -> Any:
        """``batch[0]``, ``batch[1]``: the images and labels (as unpacked); ``batch["name"]``: a
        field (``KeyError`` naming the fields there are)."""
        if isinstance(index, str):
            try:
                return self.fields[index]
            except KeyError:
                there = ", ".join(map(repr, self.fields)) or "none: the source gives none (fields=)"
                raise KeyError(f"the batch has no field {index!r}; its fields: {there}") from None
        return (self.images, self.labels)[index]

    def __len__(self) -> int:
        return 2

    @property
    def views(self) -> tuple[torch.Tensor, ...]:
        """The images as a tuple of ``[B, C, H, W]`` tensors, one per view: ``(images,)`` for a
        single transform list. Code that handles both kinds of pipeline reads this."""
        return self.images if isinstance(self.images, tuple) else (self.images,)

    def to(self, device: Any, *, non_blocking: bool = False) -> Batch:
        """The batch with its tensors on ``device`` (images, labels, ``valid`` and the fields'
        tensors; keys, text and JSON as they are).
        Trainers move a batch with this method (Lightning's ``batch_to_device``)."""

        def move(x: Any) -> Any:
            return map_tensors(x, lambda t: t.to(device, non_blocking=non_blocking))

        return Batch(move(self.images), move(self.labels), self.keys, move(self.valid), move(self.fields))

    def __repr__(self) -> str:
        shapes = [tuple(v.shape) for v in self.views if v is not None]
        images = None if not shapes else shapes[0] if len(shapes) == 1 else shapes
        fields = f", fields={list(self.fields)}" if self.fields else ""
        return f"Batch(images={images}, keys={len(self.keys)}, valid={int(self.valid.sum())}{fields})"


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x`` with ``fn`` applied to every tensor in it: a batch's images (a tensor or a tuple of
    views) and its fields' values (a dict of tensors, lists of tensors, ``Padded`` named tuples;
    lists of str or dicts, and other values, as they are). How batches and their fields are
    moved to a device, by the runners and by :meth:`Batch.to`."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {name: map_tensors(v, fn) for name, v in x.items()}
    if isinstance(x, tuple):  # views; a field's Padded (a named tuple) stays one
        mapped = [map_tensors(v, fn) for v in x]
        return type(x)(*mapped) if hasattr(x, "_fields") else tuple(mapped)
    if isinstance(x, list) and any(isinstance(v, torch.Tensor) for v in x):  # a field's list of tensors
        return [map_tensors(v, fn) for v in x]
    return x


def _flatten(batch: Batch) -> tuple[list[Any], Any]:
    names = tuple(batch.fields)
    return [batch.images, batch.labels, batch.valid, *(batch.fields[n] for n in names)], (batch.keys, names)


def _unflatten(children: Any, context: Any) -> Batch:
    keys, names = context
    images, labels, valid, *values = children
    return Batch(images, labels, keys, valid, dict(zip(names, values, strict=True)))


try:  # torch.utils._pytree: tree_map and friends see through a Batch, keeping its keys
    from torch.utils import _pytree

    _pytree.register_pytree_node(Batch, _flatten, _unflatten, serialized_type_name="gpupipe.Batch")
except (ImportError, AttributeError, ValueError):  # pragma: no cover - an older torch without it
    pass


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
