"""A sample's masks and boxes (``gp.fields.Mask``, ``gp.fields.Boxes``) moved with its image, where
its other fields are decoded: the torch and Ray backends' workers, and the DALI backend's reader
threads (from the image's size in its header, before the graph runs). Both call
:func:`move_targets` with the sample's own random factors, so a mask or a box comes out the same
on every backend: torchvision's mask and box kernels, with the image's parameters
(``transforms._masks``), then ``SanitizeBoundingBoxes``'s rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...core._errors import Damage, SampleError
from ...core._fields import Field
from ...core._geometry import TooSmall
from ...core._targets import Boxes, BoxFormat, Mask
from ...transforms import Transform
from ._kernels import boxes_kept, follow_targets

__all__ = ["has_targets", "move_targets"]


def has_targets(fields: Mapping[str, Field] | None) -> bool:
    """Whether ``fields`` hold a mask or boxes (fields that follow the image)."""
    return any(isinstance(field, (Mask, Boxes)) for field in (fields or {}).values())


def move_targets(fields: Mapping[str, Field], values: dict[str, Any], transforms: Sequence[Transform],
                 factors: Sequence[np.ndarray | None], size: tuple[int, int], *, shard: str,
                 key: str) -> list[Any] | None:  # fmt: skip
    """Moves the masks and boxes among a sample's decoded ``values`` (in place, as NumPy arrays)
    through ``transforms`` with the sample's ``factors`` (one per step, ``None`` for a
    deterministic one), its image being ``size`` ``(height, width)`` before the first step; then
    drops the boxes narrower or lower than their field's ``min_size``, with the same rows of its
    ``labels`` field. Returns each step's parameters, for the image (``None``: no target to move:
    draw them as usual). ``SampleError`` (naming the sample) for a mask of another size than the
    image, labels that do not match the boxes, or a step the image cannot take (as the image's)."""
    masks: dict[str, tuple[torch.Tensor, int]] = {}
    boxes: dict[str, tuple[torch.Tensor, str]] = {}
    for name, field in fields.items():
        if values.get(name) is None:
            continue
        if isinstance(field, Mask):
            mask = torch.from_numpy(np.array(values[name]))
            if tuple(mask.shape) != tuple(size):
                raise SampleError(f"the {name!r} mask of sample {key!r} in shard {shard!r} is {mask.shape[0]}x"
                                  f"{mask.shape[1]}, its image {size[0]}x{size[1]}", shard=shard, key=key,
                                  kind=Damage.BAD_FIELD)  # fmt: skip
            masks[name] = (mask, field.fill)
        elif isinstance(field, Boxes):
            boxes[name] = (torch.from_numpy(np.array(values[name], np.float32)), BoxFormat(field.format).value)
    if not masks and not boxes:
        return None
    try:
        moved, params = follow_targets(transforms, factors, size, masks, boxes)
    except TooSmall as e:  # RandomCrop larger than this image; a Resize to nothing
        raise SampleError.at(str(e), shard=shard, key=key, size=size) from e
    values.update((name, value.numpy()) for name, value in moved.items())  # batched as arrays are
    for name in boxes:
        _sanitize(fields, values, name, shard, key)
    return params


def _sanitize(fields: Mapping[str, Field], values: dict[str, Any], name: str, shard: str, key: str) -> None:
    """torchvision's ``SanitizeBoundingBoxes``: the boxes ``name`` (clamped to the image) narrower
    or lower than the field's ``min_size``, or smaller than its ``min_area``, dropped, with the same
    rows of its ``labels`` field."""
    field = fields[name]
    assert isinstance(field, Boxes)
    keep = boxes_kept(values[name], BoxFormat(field.format).value, field.min_size, field.min_area)
    values[name] = values[name][keep]
    if field.labels is None or values.get(field.labels) is None:
        return
    labels = values[field.labels]
    if not isinstance(labels, list) and not (isinstance(labels, np.ndarray) and labels.ndim):
        raise SampleError(f"the {field.labels!r} labels of sample {key!r} in shard {shard!r} are not a list or an "
                          f"array of one row per {name!r} box (got {type(labels).__name__}{_shape(labels)})",
                          shard=shard, key=key, kind=Damage.BAD_FIELD)  # fmt: skip
    if len(labels) != len(keep):
        raise SampleError(f"sample {key!r} in shard {shard!r} has {len(keep)} {name!r} boxes but "
                          f"{len(labels)} {field.labels!r} labels", shard=shard, key=key,
                          kind=Damage.BAD_FIELD)  # fmt: skip
    values[field.labels] = np.asarray(labels)[keep] if isinstance(labels, np.ndarray) else [
        v for v, k in zip(labels, keep.tolist(), strict=True) if k]  # fmt: skip


def _shape(value: Any) -> str:
    return f" of shape {value.shape}" if isinstance(value, np.ndarray) else ""
