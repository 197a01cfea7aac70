"""Cached shard indexes, in DALI's webdataset index format (v1.2), written by gpupipe itself.

One file per shard serves gpupipe's reader (``Index``: both backends read samples by the byte
ranges it lists); being DALI's format, it also works with ``fn.readers.webdataset(index_paths=...)``
for hand-written DALI pipelines, so users never run ``wds2idx``. Files live in
``$GPUPIPE_CACHE_DIR`` (default ``~/.cache/gpupipe``) under ``wds-index/``; a file's name holds a
hash of the shard's canonical URL (a local shard's absolute path) and the extensions asked for, and
the shard's size and version (a local file's modification time), as its storage reports them, so
a changed shard gets a new index and an unchanged one is never re-read.

Format, as DALI reads it: a line ``v1.2 <samples>``, then one line per sample listing its members
as ``<ext> <data offset> <size> <name>``. gpupipe lists only the members it uses: the chosen image
and the label. The labels, parsed once when the shard is scanned, sit beside it in
``<name>.labels.npy`` (int64 ``[N]``, ``NO_LABEL`` where a label is not an integer; loaded with
``allow_pickle=False``), so that no epoch reads a label member again. Damage found in the scan
(``Problem``: a truncated shard, samples without image or label, repeated keys; those samples are
not in the index) sits in ``<name>.problems.json``, written only for damaged shards and before the
index file itself, so that a cached index raises (or skips) exactly what a fresh scan would.
The images' sizes, as the DALI runner checked their headers in an epoch, sit in
``<name>.sizes-<rules>.npy`` (int32 ``[N, 2]``, zeros where not known), ``<rules>`` naming the
checks they passed (``backends/_dali/_headers``): a later epoch, run or rank on the node reads no
header twice.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
from collections.abc import Sequence

import numpy as np

from ..core import _npy as npy
from ..core._errors import Damage, Problem
from ..core._paths import cache_root
from ..storage._base import Stat, write_atomic
from ._shard import FieldMembers, fields_id

__all__ = [
    "cache_dir",
    "index_path",
    "count",
    "load",
    "save",
    "labels_path",
    "save_labels",
    "load_labels",
    "save_problems",
    "load_problems",
    "sizes_path",
    "save_sizes",
    "load_sizes",
]

log = logging.getLogger("gpupipe")
VERSION = "v1.2"
# In the file name's hash: 2 records damage (problems.json); 3 checks a tar's end (a cut in a header, at
# a member boundary, garbage after a member). Indexes of an older schema are rescanned once.
SCHEMA = 3
_NO_IMAGE = "none"  # a sample's image member in the index of a source without images (its range: -1 -1)


def cache_dir() -> str:
    root = cache_root()
    return os.path.join(root, "wds-index")


def index_path(canonical: str, stat: Stat, image_exts: tuple[str, ...], label_ext: str | None,
               fields: tuple[FieldMembers, ...] = ()) -> str:  # fmt: skip
    """The cache file of the shard ``canonical`` (its storage's canonical URL) at ``stat``: one
    per set of members asked for (image and label extensions, the fields and their policies)."""
    asked = f"|{fields_id(fields)}" if fields else ""
    # (surrogateescape: a path that is not UTF-8, as the file system gives it, hashes as its bytes)
    ident = f"{canonical}|{';'.join(image_exts)}|{label_ext}|{SCHEMA}{asked}".encode("utf-8", "surrogateescape")
    digest = hashlib.sha1(ident).hexdigest()[:20]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", canonical.rpartition("/")[2].rpartition(".")[0]) or "shard"
    version = (
        stat.version
        if re.fullmatch(r"[A-Za-z0-9._-]{1,64}", stat.version)
        else hashlib.sha1(stat.version.encode()).hexdigest()[:16]
    )
    return os.path.join(cache_dir(), f"{name}-{digest}-{stat.size}-{version}.idx")


def save(path: str, keys: list[str], image_exts: list[str], image: np.ndarray, label: np.ndarray | None,
         fields: Sequence[tuple[FieldMembers, np.ndarray]] = ()) -> bool:  # fmt: skip
    # image, label, each field's ranges: [N, 2] offset and size of each sample's member ((-1, -1): none)
    """Writes an index atomically; returns False (and logs why) where it cannot. A field's
    member is listed under the field's first extension."""
    if any(any(c.isspace() for c in k) for k in keys):
        log.warning(
            "gpupipe: %s has sample keys with whitespace, which DALI's index format cannot hold; "
            "its index is not cached",
            path,
        )
        return False
    if not all(k.isascii() or _utf8(k) for k in keys):
        log.warning(
            "gpupipe: %s has sample keys that are not UTF-8 (member names in another encoding), which DALI's "
            "index format cannot hold; its index is not cached",
            path,
        )
        return False
    lines = [f"{VERSION} {len(keys)}\n"]
    for i, key in enumerate(keys):
        ext = image_exts[i] or _NO_IMAGE
        line = f"{ext} {image[i, 0]} {image[i, 1]} {key}.{ext}"
        if label is not None:
            line += f" cls {label[i, 0]} {label[i, 1]} {key}.cls"
        for field, ranges in fields:
            if ranges[i, 1] >= 0:
                line += f" {field.exts[0]} {ranges[i, 0]} {ranges[i, 1]} {key}.{field.exts[0]}"
        lines.append(line + "\n")
    return _write_atomic(path, "".join(lines).encode())


def _utf8(key: str) -> bool:
    """Whether ``key`` is text UTF-8 can hold (not a name of undecodable bytes, kept as surrogate
    escapes)."""
    try:
        key.encode()
    except UnicodeEncodeError:
        return False
    return True


def count(path: str) -> int | None:
    """The number of samples in an index file, from its first line alone; ``None`` if absent."""
    try:
        with open(path, "rb") as f:
            header = f.readline(64).split()
    except OSError:
        return None
    if len(header) != 2 or header[0] != VERSION.encode() or not header[1].isdigit():
        return None
    return int(header[1])


def load(
    path: str, labeled: bool, fields: tuple[FieldMembers, ...] = ()
) -> tuple[list[str], list[str], np.ndarray, np.ndarray, dict[str, np.ndarray]] | None:
    """Reads an index written by :func:`save`: keys, image extensions, image and label ranges
    (``[N, 2]``) and each field's (by name, ``(-1, -1)`` where absent); ``None`` if absent or
    unreadable, or if it lists a member it should not."""
    try:
        with open(path) as f:
            header = f.readline().split()
            if len(header) != 2 or header[0] != VERSION:
                return None
            n = int(header[1])
            rows = [line.split() for line in f]
    except (OSError, ValueError):
        return None
    fixed = 8 if labeled else 4
    if (
        len(rows) != n
        or any(len(r) < fixed or len(r) % 4 for r in rows)
        or (labeled and any(r[4] != "cls" for r in rows))
    ):
        return None
    keys = [r[3][: -len(r[0]) - 1] for r in rows]
    exts = ["" if r[0] == _NO_IMAGE else r[0] for r in rows]
    column = {f.exts[0]: i for i, f in enumerate(fields)}
    ranges = np.full((len(fields), n, 2), -1, np.int64)
    try:  # (a number that is not one, or past int64: a damaged file, scanned again)
        image = np.array([[int(r[1]), int(r[2])] for r in rows], dtype=np.int64).reshape(n, 2)
        label = (
            np.array([[int(r[5]), int(r[6])] for r in rows], dtype=np.int64).reshape(n, 2)
            if labeled
            else np.full((n, 2), -1, np.int64)
        )
        for s, row in enumerate(rows):
            for g in range(fixed, len(row), 4):
                i = column.get(row[g])
                if i is None:
                    return None
                ranges[i, s] = (int(row[g + 1]), int(row[g + 2]))
    except (ValueError, OverflowError):
        return None
    return keys, exts, image, label, {f.name: ranges[i] for i, f in enumerate(fields)}


def labels_path(path: str) -> str:
    return path.removesuffix(".idx") + ".labels.npy"


def save_labels(path: str, labels: np.ndarray) -> None:
    """Writes the parsed labels of the index ``path`` atomically (a failure is logged)."""
    out = io.BytesIO()
    np.save(out, np.asarray(labels, dtype=np.int64), allow_pickle=False)
    _write_atomic(labels_path(path), out.getvalue())


def load_labels(path: str, n: int) -> np.ndarray | None:
    """The parsed labels of the index ``path``; ``None`` if absent or not ``n`` int64 values."""
    try:
        labels = npy.load(labels_path(path))  # (its header parsed one thread at a time: core._npy)
    except (OSError, ValueError, EOFError):
        return None
    if labels.dtype != np.int64 or labels.shape != (n,):
        return None
    return labels


def problems_path(path: str) -> str:
    return path.removesuffix(".idx") + ".problems.json"


def _write_atomic(target: str, data: bytes) -> bool:
    """Writes a cache file whole or not at all (a temporary file, then a rename); returns False
    (and logs why) where it cannot."""
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        write_atomic(target, data)
        return True
    except OSError as e:
        log.warning("gpupipe: cannot write the index cache %s: %s", target, e)
        return False


def save_problems(path: str, problems: tuple[Problem, ...]) -> bool:
    """Records the damage found in the shard of the index ``path`` (nothing for a sound shard);
    False where it cannot (the index must then not be cached either)."""
    if not problems:
        return True
    rows = [{"kind": p.kind.value, "key": p.key, "detail": p.detail} for p in problems]
    return _write_atomic(problems_path(path), json.dumps({"problems": rows}, indent=1).encode())


def load_problems(path: str) -> tuple[Problem, ...] | None:
    """The damage recorded for the index ``path``: ``()`` where none is, ``None`` where the record
    cannot be read (the shard is then scanned again)."""
    try:
        with open(problems_path(path)) as f:
            rows = json.load(f)["problems"]
        return tuple(Problem(Damage(r["kind"]), r["key"], str(r["detail"])) for r in rows)
    except FileNotFoundError:
        return ()
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def sizes_path(path: str, rules: str) -> str:
    return f"{path.removesuffix('.idx')}.sizes-{rules}.npy"


def load_sizes(path: str, rules: str, n: int) -> np.ndarray | None:
    """The images' ``(height, width)`` recorded for the index ``path`` under ``rules`` (int32
    ``[n, 2]``, zeros where not known); ``None`` if absent or not such an array."""
    try:
        sizes = npy.load(sizes_path(path, rules))
    except (OSError, ValueError, EOFError):
        return None
    if sizes.dtype != np.int32 or sizes.shape != (n, 2) or (sizes < 0).any():
        return None
    return sizes


def save_sizes(path: str, rules: str, sizes: np.ndarray) -> bool:
    """Records ``sizes`` (int32 ``[N, 2]``, zeros where not known) for the index ``path``, with
    the sizes already recorded there that ``sizes`` does not know (another rank's): written
    whole, a concurrent writer's sizes may be lost, never mixed. False (logged) where it cannot."""
    sizes = np.array(sizes, np.int32, copy=True)
    recorded = load_sizes(path, rules, len(sizes))
    if recorded is not None:
        unknown = sizes[:, 0] == 0
        sizes[unknown] = recorded[unknown]
    out = io.BytesIO()
    np.save(out, sizes, allow_pickle=False)
    return _write_atomic(sizes_path(path, rules), out.getvalue())
