"""Writing WebDataset shards (``python -m gpupipe make-shards``, the demo, the benchmarks, the tests)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._errors import ConfigError
from ._validate import valid_int

__all__ = ["ShardWriter"]


def _npy(array: np.ndarray, key: str, ext: str) -> bytes:
    """``array`` as an ``.npy`` file, never pickled."""
    if array.dtype.hasobject:
        raise ConfigError(f"ShardWriter: member {key}.{ext} is an array of Python objects, which .npy stores "
                          "pickled: gpupipe never unpickles; store numbers")  # fmt: skip
    out = io.BytesIO()
    np.lib.format.write_array(out, np.asanyarray(array), allow_pickle=False)
    return out.getvalue()


class ShardWriter:
    """Writes samples into numbered tar shards in WebDataset layout.

    Args:
        pattern: output path with one ``%d``-style field for the shard number, e.g.
            ``"data/train-%06d.tar"``.
        max_count: samples per shard. Default 1000.
        start: number of the first shard. Default 0.

    Members are written in sample order, ``key.ext`` each; ``bytes`` are stored as they are,
    ``int`` and ``str`` as ASCII/UTF-8 text (a ``.cls`` label is an ``int``); as webdataset's
    writer encodes them, a NumPy array under an extension ending in ``npy`` as an ``.npy`` file
    (``allow_pickle=False``: object arrays are refused) and a dict or list under one ending in
    ``json`` as UTF-8 JSON. Tar headers carry no time or owner, so the same samples always give
    the same bytes.

    Example:
        >>> with ShardWriter("out/train-%06d.tar", max_count=256) as w:  # doctest: +SKIP
        ...     w.write("000001", {"jpg": jpeg_bytes, "cls": 3, "txt": "a cat", "json": {"w": 500},
        ...                        "npy": np.zeros((4, 4), np.float32)})
        >>> w.shards  # doctest: +SKIP
        ['out/train-000000.tar']
    """

    def __init__(self, pattern: str, *, max_count: int = 1000, start: int = 0) -> None:
        if "%" not in pattern:
            raise ConfigError(f"ShardWriter: pattern needs a %d field for the shard number, got {pattern!r}")
        self.max_count = valid_int("ShardWriter", max_count, "max_count", minimum=1)
        self.next_shard = valid_int("ShardWriter", start, "start", minimum=0)
        self.pattern = pattern
        self.shards: list[str] = []
        self._tar: tarfile.TarFile | None = None
        self._count = 0
        self.samples = 0

    def write(self, key: str, members: Mapping[str, Any]) -> None:
        if not key or "." in key.rpartition("/")[2]:
            raise ConfigError(f"ShardWriter: key must be non-empty with no '.' in its file name, got {key!r}")
        tar = self._tar if self._tar is not None and self._count < self.max_count else self._open_next()
        for ext, value in members.items():
            if isinstance(value, (bool, np.bool_)):
                raise ConfigError(f"ShardWriter: member {key}.{ext} is a bool")
            if isinstance(value, (int, np.integer)):
                value = str(int(value)).encode("ascii")
            elif isinstance(value, str):
                value = value.encode("utf-8")
            elif isinstance(value, np.ndarray) and ext.endswith("npy"):
                value = _npy(value, key, ext)
            elif isinstance(value, (dict, list)) and ext.endswith("json"):
                value = json.dumps(value, ensure_ascii=False).encode("utf-8")
            elif not isinstance(value, (bytes, bytearray, memoryview)):
                raise ConfigError(
                    f"ShardWriter: member {key}.{ext} must be bytes, int or str (a NumPy array under an "
                    f"extension ending in npy, a dict or list under one ending in json), got {type(value).__name__}"
                )
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mode, info.mtime = len(value), 0o444, 0
            tar.addfile(info, io.BytesIO(bytes(value)))
        self._count += 1
        self.samples += 1

    def _open_next(self) -> tarfile.TarFile:
        self.close()
        path = self.pattern % self.next_shard
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 - closed by close()
        self.shards.append(path)
        self.next_shard += 1
        self._count = 0
        return self._tar

    def write_all(self, samples: Iterable[tuple[str, Mapping[str, Any]]]) -> list[str]:
        for key, members in samples:
            self.write(key, members)
        return self.shards

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
