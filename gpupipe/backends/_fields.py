"""A sample's fields beyond the image and the label (``WebDataset(..., fields=)``), as the
backends that read them (torch, DALI) decode and batch them: the same values on both."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..core._fields import Array, Field, Label

__all__ = ["field_values", "batch_fields", "empty_values", "refill"]


def field_values(fields: Mapping[str, Field], stored: Mapping[str, bytes | None] | None, *, shard: str,
                 key: str) -> dict[str, Any] | None:  # fmt: skip
    """The values of a sample's ``fields`` (``Index.fields``) from its members' bytes
    (``stored``, by name), decoded safely (``gpupipe.core._fields``); a field without a member
    gets its empty value. ``None`` for a source without fields."""
    if not fields:
        return None
    stored = stored or {}
    out = {}
    for name, field in fields.items():
        data = stored.get(name)
        out[name] = field.empty() if data is None else field.decode(data, shard=shard, key=key)
    return out


def batch_fields(fields: Mapping[str, Field], values: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """A batch's field values by name: a ``Label`` field's as an int64 ``[B]`` tensor, an
    ``Array`` field's as one ``[B, ...]`` tensor where every sample's has the same shape and dtype
    (else a list of tensors), text and JSON values as lists. Arrays are copied out of the shard's
    bytes (torch wants writable memory)."""
    out: dict[str, Any] = {}
    for name, field in fields.items():
        column = [v[name] if v is not None else field.empty() for v in values]
        if isinstance(field, Label) and all(isinstance(v, int) for v in column):
            out[name] = torch.tensor(column, dtype=torch.int64)
        elif isinstance(field, Array):
            same = all(v.shape == column[0].shape and v.dtype == column[0].dtype for v in column)
            try:
                out[name] = (
                    torch.from_numpy(np.stack(column)) if same else [torch.from_numpy(np.array(v)) for v in column]
                )
            except TypeError:  # a dtype torch has no tensor of: NumPy arrays, as read
                out[name] = [np.array(v) for v in column]
        else:
            out[name] = column
    return out


def empty_values(fields: Mapping[str, Field]) -> dict[str, Any]:
    """Every field's empty value: a sample that stands in for none (a batch with no good sample)."""
    return {name: field.empty() for name, field in fields.items()}


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
        if isinstance(column, torch.Tensor):
            column = column.clone()
            column[at] = 0 if good is None else column[good]
        else:
            column = list(column)
            for p in at:
                column[p] = specs[name].empty() if good is None else column[good]
        out[name] = column
    return out
