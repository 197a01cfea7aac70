"""Reading a serialized DALI pipeline (``Pipeline.serialize()``: DALI's ``dali_proto.PipelineDef``
protobuf, ``dali/pipeline/proto/dali.proto``) without protobuf installed, and checking where a
GPU graph runs each operator. The GPU graph is defined and serialized on a machine without a GPU
(``device_id=None``): DALI then checks operator names, argument names and types, and device
placement; argument values are checked here."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from typing import Any

from gpupipe.backends._dali._proto import fields as _fields
from gpupipe.backends._dali._proto import varint as _varint


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _argument(buf: bytes) -> tuple[str, Any]:
    """``Argument``: name 1, floats 3, ints 4, strings 5, bools 6, extra_args 7 (a vector's
    elements, one Argument each), is_vector 8."""
    name, values, vector = "", [], False
    for field, wire, v in _fields(buf):
        if field == 1:
            name = v.decode()
        elif field == 3:
            values += list(struct.unpack(f"<{len(v) // 4}f", v)) if wire == 2 else [struct.unpack("<f", v)[0]]
        elif field in (4, 6):
            raw = [_varint(v, j)[0] for j in _offsets(v)] if wire == 2 else [v]
            values += [_signed(x) for x in raw] if field == 4 else [bool(x) for x in raw]
        elif field == 5:
            values.append(v.decode())
        elif field == 7:
            values.append(_argument(v)[1])
        elif field == 8:
            vector = bool(v)
    return name, values if vector else (values[0] if values else None)


def _offsets(buf: bytes) -> Iterator[int]:
    i = 0
    while i < len(buf):
        yield i
        _, i = _varint(buf, i)


@dataclasses.dataclass
class Port:
    name: str
    device: str
    argument: str | None  # the argument it feeds, for an argument input


@dataclasses.dataclass
class Op:
    schema: str
    device: str
    inputs: list[Port]
    outputs: list[Port]
    args: dict[str, Any]


def _port(buf: bytes) -> Port:
    name = device = ""
    argument = None
    is_argument = False
    for field, _, v in _fields(buf):
        if field == 1:
            name = v.decode()
        elif field == 2:
            device = v.decode()
        elif field == 3:
            is_argument = bool(v)
        elif field == 4:
            argument = v.decode()
    return Port(name, device, argument if is_argument else None)


def parse(serialized: bytes | str) -> tuple[list[Op], list[Port]]:
    """The operators (in the pipeline's order) and the pipeline outputs of a serialized pipeline."""
    buf = serialized.encode("latin-1") if isinstance(serialized, str) else serialized
    ops, outputs = [], []
    for field, _, v in _fields(buf):
        if field == 5:  # OpDef: name 1, input 2, output 3, args 4
            schema, inputs, outs, args = "", [], [], {}
            for f, _, w in _fields(v):
                if f == 1:
                    schema = w.decode()
                elif f == 2:
                    inputs.append(_port(w))
                elif f == 3:
                    outs.append(_port(w))
                elif f == 4:
                    key, value = _argument(w)
                    args[key] = value
            ops.append(Op(schema, args.get("device", ""), inputs, outs, args))
        elif field == 7:
            outputs.append(_port(v))
    return ops, outputs


METADATA_OPS = {"_Shape", "Shapes"}  # read a GPU tensor's shape, not its data


def check_gpu_placement(ops: list[Op], outputs: list[Port], *, views: int = 1) -> Op:
    """The GPU graph's placement: one ``mixed`` decoder; everything the image flows through after
    it on the GPU; no CPU operator reads GPU data (shapes are metadata); the images (one output
    per view) come out on the GPU and the per-sample checks on the CPU. Returns the decoder."""
    decoders = [op for op in ops if op.schema.startswith("decoders__")]
    assert len(decoders) == 1 and decoders[0].device == "mixed", [(op.schema, op.device) for op in decoders]
    producer = {port.name: op for op in ops for port in op.outputs}
    on_gpu = {port.name for port in decoders[0].outputs}
    for op in ops:  # in the pipeline's (topological) order
        data_inputs = [p for p in op.inputs if p.argument is None]
        if op.device == "cpu":
            gpu_reads = [p.name for p in data_inputs if p.device == "gpu"]
            assert not gpu_reads or op.schema in METADATA_OPS, f"{op.schema} (cpu) reads GPU data: {gpu_reads}"
        assert all(p.device == "cpu" for p in op.inputs if p.argument is not None), op
        if any(p.name in on_gpu for p in data_inputs) and op.schema not in METADATA_OPS:
            assert op.device == "gpu", f"{op.schema} runs on {op.device} after the decoder"
            on_gpu |= {p.name for p in op.outputs}
    images, checks = outputs[:views], outputs[views:]
    assert all(i.device == "gpu" and i.name in on_gpu for i in images), images
    assert all(c.device == "cpu" for c in checks), checks
    assert producer  # every output has a producer
    return decoders[0]
