"""Writing WebDataset shards (``python -m gpupipe make-shards``, the demo, the benchmarks, the tests)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import weakref
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
        self.max_count = valid_int("ShardWriter", max_count, "max_count", minimum=1)
        self.next_shard = valid_int("ShardWriter", start, "start", minimum=0)
        try:  # one field, numbering the shards ('%%' for a literal '%')
            distinct = "%" in pattern and pattern % 0 != pattern % 1
        except (TypeError, ValueError):
            distinct = False
        if not distinct:
            raise ConfigError(f"ShardWriter: pattern needs one %d field for the shard number (write a literal % as "
                              f"%%), got {pattern!r}")  # fmt: skip
        self.pattern = pattern
        self.shards: list[str] = []
        self._tar: tarfile.TarFile | None = None
        self._closer: weakref.finalize | None = None
        self._count = 0
        self._keys: set[str] = set()  # the open shard's
        self.samples = 0

    def write(self, key: str, members: Mapping[str, Any]) -> None:
        """Writes one sample, whole or not at all: every member is checked and encoded before the
        first is written (a refused sample leaves nothing of it in the shard)."""
        if not isinstance(key, str) or not key or "." in key.rpartition("/")[2]:
            raise ConfigError(f"ShardWriter: key must be non-empty with no '.' in its file name, got {key!r}")
        if not members:
            raise ConfigError(f"ShardWriter: sample {key!r} has no members: nothing would be written")
        new_shard = self._tar is None or self._count >= self.max_count
        if not new_shard and key in self._keys:  # readers refuse it (gpupipe) or fail on it (webdataset)
            raise ConfigError(f"ShardWriter: key {key!r} is already in shard {self.shards[-1]!r}: keys name one "
                              "sample each")  # fmt: skip
        encoded = [self._member(key, ext, value) for ext, value in members.items()]
        exts = [ext.lower() for ext in members]
        if len(set(exts)) < len(exts):
            raise ConfigError(
                f"ShardWriter: sample {key!r} repeats an extension (readers lower-case them): {list(members)}"
            )
        tar = self._open_next() if new_shard else self._tar
        assert tar is not None
        for info, value in encoded:
            tar.addfile(info, io.BytesIO(value))
        self._keys.add(key)
        self._count += 1
        self.samples += 1

    @staticmethod
    def _member(key: str, ext: Any, value: Any) -> tuple[tarfile.TarInfo, bytes]:
        if not isinstance(ext, str) or not ext or "/" in ext:
            raise ConfigError(f"ShardWriter: member {key}.{ext} needs an extension, a non-empty str without '/'")
        if isinstance(value, (bool, np.bool_)):
            raise ConfigError(f"ShardWriter: member {key}.{ext} is a bool")
        if isinstance(value, (int, np.integer)):
            value = str(int(value)).encode("ascii")
        elif isinstance(value, str):
            value = value.encode("utf-8")
        elif isinstance(value, np.ndarray) and ext.endswith("npy"):
            value = _npy(value, key, ext)
        elif isinstance(value, (dict, list)) and ext.endswith("json"):
            try:
                value = json.dumps(value, ensure_ascii=False).encode("utf-8")
            except (TypeError, ValueError) as e:
                raise ConfigError(f"ShardWriter: member {key}.{ext} is not JSON: {e}") from None
        elif not isinstance(value, (bytes, bytearray, memoryview)):
            raise ConfigError(
                f"ShardWriter: member {key}.{ext} must be bytes, int or str (a NumPy array under an "
                f"extension ending in npy, a dict or list under one ending in json), got {type(value).__name__}"
            )
        data = bytes(value)
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size, info.mode, info.mtime = len(data), 0o444, 0
        try:
            info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")  # what addfile will write
        except ValueError as e:  # a name over ustar's 100 (+155 of folders) bytes
            raise ConfigError(f"ShardWriter: member name {info.name!r} does not fit a tar header: {e}") from None
        return info, data

    def _open_next(self) -> tarfile.TarFile:
        self.close()
        path = self.pattern % self.next_shard
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 - closed by close()
        # a writer dropped (or left at exit) unclosed still ends its shard: readers refuse a tar without its end
        self._closer = weakref.finalize(self, self._tar.close)
        self._keys = set()
        self.shards.append(path)
        self.next_shard += 1
        self._count = 0
        return self._tar

    def write_all(self, samples: Iterable[tuple[str, Mapping[str, Any]]]) -> list[str]:
        for key, members in samples:
            self.write(key, members)
        return self.shards

    def close(self) -> None:
        if self._closer is not None:
            self._closer()  # (closes the open shard once)
            self._closer = None
        self._tar = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
