"""Reading a serialized DALI pipeline (``Pipeline.serialize()``: DALI's ``dali_proto.PipelineDef``
protobuf, ``dali/pipeline/proto/dali.proto``) without protobuf installed: the wire format's fields,
and the count of operators a graph runs per iteration."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["varint", "fields", "operator_count"]


def varint(buf: bytes, i: int) -> tuple[int, int]:
    """The base-128 integer at ``buf[i]`` and the position after it."""
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, raw value) of each field of one message."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        field, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, i = varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 2:
            n, i = varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        else:  # groups: not used by dali.proto
            raise ValueError(f"wire type {wire}")
        yield field, wire, value


def operator_count(pipe: Any) -> int:
    """The operators of a defined or built DALI pipeline: the ``OpDef`` entries (field 5) of its
    ``PipelineDef`` — every operator DALI runs per iteration, ``external_source`` inputs included.
    A graph with a ``python_function`` cannot be serialized: ``-1``."""
    try:
        buf = pipe.serialize()
    except Exception:  # python_function: not serializable
        return -1
    buf = buf.encode("latin-1") if isinstance(buf, str) else buf
    return sum(1 for field, wire, _ in fields(buf) if field == 5 and wire == 2)
