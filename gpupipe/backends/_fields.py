"""A sample's fields beyond the image and the label (``WebDataset(..., fields=)``), as the
backends that read them (torch, DALI) decode and batch them: the same values on both."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..core._errors import DataError
from ..core._fields import Field, Label, Padded, field_values
from ..core._targets import Mask

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # an uninitialised tensor of (shape, dtype)

__all__ = ["field_values", "batch_fields", "empty_values", "refill"]


def batch_fields(fields: Mapping[str, Field], values: Sequence[dict[str, Any] | None], *,
                 alloc: Alloc | None = None) -> dict[str, Any]:  # fmt: skip
    """A batch's field values by name: a ``Label`` field's as an int64 ``[B]`` tensor, an
    ``Array`` field's as one ``[B, ...]`` tensor where every sample's has the same shape and dtype
    (else a list of tensors; arrays of the other byte order in this machine's), text and JSON
    values as lists. Arrays are copied out of the shard's bytes (torch wants writable memory),
    once, into ``alloc(shape, dtype)`` where given (a worker process's shared memory, as the
    images are, ``_slots``: the batch crosses to the training process without another copy)."""
    out: dict[str, Any] = {}
    for name, field in fields.items():
        column = [v[name] if v is not None else field.empty() for v in values]
        if field.arrays:
            column = [_native(v) for v in column]
        if isinstance(field, Label) and all(isinstance(v, int) for v in column):
            out[name] = torch.tensor(column, dtype=torch.int64)
        elif field.arrays and getattr(field, "pad", None) is not None:  # Array, Boxes, tokenized Text
            out[name] = _padded(name, field.pad, column)  # type: ignore[attr-defined]
        elif field.arrays:  # Array, Mask (as the pipeline left it, [H, W]), Boxes, tokenized Text
            same = all(v.shape == column[0].shape and v.dtype == column[0].dtype for v in column)
            try:
                out[name] = _stacked(column, alloc) if same else [torch.from_numpy(np.array(v)) for v in column]
            except TypeError:  # a dtype torch has no tensor of: NumPy arrays, as read
                out[name] = [np.array(v) for v in column]
        else:
            out[name] = column
    return out


def _native(value: Any) -> Any:
    """An array in the machine's byte order (a ``.npy`` of ``>f8`` read on x86, say: torch holds
    no other), the same values; anything else as it is."""
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        return value.astype(value.dtype.newbyteorder("="))
    return value


def _stacked(column: Sequence[np.ndarray], alloc: Alloc | None) -> torch.Tensor:
    """Arrays of one shape and dtype in one ``[B, ...]`` tensor (``alloc``'s where given), each
    copied once. ``TypeError`` for a dtype torch has no tensor of."""
    dtype = torch.from_numpy(np.empty(0, column[0].dtype)).dtype
    shape = (len(column), *column[0].shape)
    out = alloc(shape, dtype) if alloc is not None else torch.empty(shape, dtype=dtype)
    rows = out.numpy()
    for i, v in enumerate(column):
        rows[i] = v
    return out


def _padded(name: str, pad: float, column: Sequence[np.ndarray]) -> Padded:
    """A batch's arrays in one tensor (:class:`Padded`): each at the start of its row, ``pad``
    beyond. An empty array (a missing field's) takes the others' rank."""
    ndim = max(v.ndim for v in column)
    column = [v.reshape((0,) * ndim) if v.size == 0 and v.ndim != ndim else v for v in column]
    if any(v.ndim != ndim for v in column):
        raise DataError(f"the {name!r} field's arrays have different ranks in one batch "
                        f"({sorted({v.ndim for v in column})}): they cannot be padded into one tensor")  # fmt: skip
    largest = tuple(max(v.shape[d] for v in column) for d in range(ndim))
    data = np.full((len(column), *largest), pad, dtype=np.result_type(*column))
    for i, v in enumerate(column):
        where: tuple[Any, ...] = (i, *(slice(0, n) for n in v.shape))
        data[where] = v
    lengths = np.array([v.shape for v in column], np.int64).reshape(len(column), ndim)
    return Padded(torch.from_numpy(data), torch.from_numpy(lengths))


def empty_values(fields: Mapping[str, Field], size: tuple[int, int] | None = None) -> dict[str, Any]:
    """Every field's empty value: a sample that stands in for none (a batch with no good sample);
    a mask's, zeros of ``size`` (the batch's images' ``(height, width)``, as its image is zeros)."""
    return {name: field.blank(size or (0, 0)) if isinstance(field, Mask) else field.empty()
            for name, field in fields.items()}  # fmt: skip


def refill(fields: dict[str, Any] | None, positions: Sequence[int], good: int | None,
           specs: Mapping[str, Field]) -> dict[str, Any] | None:  # fmt: skip
    """A batch's fields (:func:`batch_fields`) with each of ``positions`` holding the value at
    ``good`` (a copy; ``None``: the field's empty value, zeros for a tensor): samples left out
    under ``on_error="skip"`` stand in as their donor, as their image and label do."""
    if not fields or not positions:
        return fields
    at = list(positions)
    out: dict[str, Any] = {}
    for name, column in fields.items():
        if isinstance(column, Padded):
            data, lengths = column.data.clone(), column.lengths.clone()
            data[at] = 0 if good is None else data[good]
            lengths[at] = 0 if good is None else lengths[good]
            column = Padded(data, lengths)
        elif isinstance(column, torch.Tensor):
            column = column.clone()
            column[at] = 0 if good is None else column[good]
        else:
            column = list(column)
            for p in at:
                column[p] = specs[name].empty() if good is None else column[good]
        out[name] = column
    return out
