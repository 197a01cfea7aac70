"""A fast walk over a well-formed tar's headers, for the index scan (``_tar.scan_tar``).

:mod:`tarfile` spends about 35 µs of Python per member (a ``TarInfo`` with every field parsed,
two checksums, buffered reads): most of a minute for ImageNet's 1.28 M samples on one core. This
walk reads each header with one ``pread``, parses only what the index needs (the name, the size,
the type) and checks all of a shard's headers at once with numpy, as :mod:`tarfile` would accept
them: the checksum and every number field.

It reads a subset of what :mod:`tarfile` reads — regular files, directories and links; pax
extended headers that carry only a path and times (what ``tarfile``'s and webdataset's writers
add for a long name or a fractional ``mtime``); every header whole and valid; every member inside
the file; the archive ended by a zero block — and raises :class:`Unusual` on anything else: a
damaged or cut header, a member past the end, GNU long names, sparse files, global pax headers,
base-256 numbers, a field that :mod:`tarfile` would parse some other way. The scan then reads the
shard again with :mod:`tarfile`, which gives it its verdict. So a shard gets the same index and
the same problems either way, only sooner (``tests/test_tarwalk.py`` compares the two on
well-formed and on mutated shards).
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Callable
from typing import IO

import numpy as np

__all__ = ["Unusual", "Member", "walk", "reader"]

BLOCK = tarfile.BLOCKSIZE
_CHUNK = 4096  # read per header: a small member's data and the next header often come with it
_PAX_LIMIT = 1 << 16  # a pax record set the walk reads (a larger one: tarfile's, under its bound)
_REGULAR = frozenset(b"07\0")  # tarfile's REGULAR_TYPES, less GNU sparse
_NO_DATA = frozenset(b"125")  # hard link, symlink, directory: tarfile skips no data after them
_PAX = ord("x")
_AREG = 0
_PAX_KEYS = frozenset({b"path", b"mtime", b"atime", b"ctime", b"uid", b"gid", b"uname", b"gname"})
_PAX_RECORD = re.compile(rb"([1-9][0-9]{0,5}) ([a-z]+)=")
# The number fields tarfile parses in every header, (offset, width): mode, uid, gid, size, mtime,
# chksum, devmajor, devminor.
_NUMBERS = ((100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (148, 8), (329, 8), (337, 8))

Member = tuple[str, int, int, bytes | None]  # name, data offset, size, the data where it came with the header
Read = Callable[[int, int], bytes]


class Unusual(Exception):
    """Something the walk does not read the way :mod:`tarfile` would: read the shard with it."""


def reader(f: IO[bytes]) -> Read:
    """``read(offset, size) -> bytes`` over ``f``: ``os.pread`` on its descriptor where it has
    one (no shared position, no buffer refilled), else a seek and a read."""
    try:
        fd = f.fileno()
        os.fstat(fd)
    except (AttributeError, OSError, ValueError, NotImplementedError):
        fd = None
    if fd is not None:
        return lambda offset, size: os.pread(fd, size, offset)

    def read(offset: int, size: int) -> bytes:
        f.seek(offset)
        return f.read(size)

    return read


def _length(f: IO[bytes]) -> int:
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError, NotImplementedError):
        return f.seek(0, os.SEEK_END)


def _text(raw: bytes) -> str:
    """tarfile's ``nts`` with its default encoding and ``surrogateescape``."""
    end = raw.find(0)
    return (raw if end < 0 else raw[:end]).decode(tarfile.ENCODING, "surrogateescape")


def walk(f: IO[bytes], size: int | None = None, *, small: int = 0) -> list[Member]:
    """The regular members of the tar ``f`` in order, as :mod:`tarfile` names them; a member of
    at most ``small`` bytes comes with its data where the header's read brought it (else
    ``None``). ``size``: the shard's size as the scan knows it (members must end within it and
    within the file). Raises :class:`Unusual` (read it with :mod:`tarfile`) or OSError."""
    read = reader(f)
    limit = _length(f) if size is None else min(size, _length(f))
    members: list[Member] = []
    heads: list[bytes] = []
    sizes: list[int] = []
    chunk, at, pos = b"", 0, 0
    pax_name: str | None = None
    after_pax = False
    while True:
        if not at <= pos <= at + len(chunk) - BLOCK:
            chunk, at = read(pos, _CHUNK), pos
        block = chunk[pos - at : pos - at + BLOCK]
        if len(block) < BLOCK:
            raise Unusual("a header cut short")
        if block.count(0) == BLOCK:
            if pos == 0 or after_pax:
                raise Unusual("no member")
            break
        try:
            length = int(block[124:136].split(b"\0", 1)[0] or b"0", 8)
        except ValueError:
            raise Unusual("a size tarfile parses otherwise") from None
        if length < 0:  # ("-0000007205": int() reads it; the walk would go back, and round forever)
            raise Unusual("a negative size")
        kind = block[156]
        heads.append(block)
        sizes.append(length)
        data = pos + BLOCK
        if kind == _PAX:
            if after_pax or length > _PAX_LIMIT or data + length > limit:
                raise Unusual("a pax header the walk does not read")
            padded = -(-length // BLOCK) * BLOCK
            records = chunk[data - at : data - at + padded] if data + padded <= at + len(chunk) else read(data, padded)
            pax_name = _pax_path(records, length)
            after_pax = True
            pos = data + padded
            continue
        name = _text(block[:100])
        if block[345] != 0:  # a ustar prefix
            name = _text(block[345:500]) + "/" + name
        if kind in _NO_DATA or (kind == _AREG and name.endswith("/")):
            pos = data
        elif kind in _REGULAR:
            if data + length > limit:
                raise Unusual("a member past the end")
            if pax_name is not None:
                name = pax_name
            end = data - at + length
            came = length <= small and end <= len(chunk)
            members.append((name, data, length, chunk[data - at : end] if came else None))
            pos = data + -(-length // BLOCK) * BLOCK
        else:
            raise Unusual(f"a member of type {bytes([kind])!r}")
        pax_name, after_pax = None, False
    _check(heads, sizes)
    return members


def _pax_path(records: bytes, length: int) -> str | None:
    """The path of a pax extended header's records (``None``: none), read only where every
    record is well-formed, of the keys the walk knows, and the padding after them is zeros."""
    if len(records) < length or records.count(0, length) != len(records) - length or b"hdrcharset" in records:
        raise Unusual("pax records the walk does not read")
    pos, path = 0, None
    while pos < length:
        match = _PAX_RECORD.match(records, pos)
        end = pos + int(match.group(1)) if match else 0
        if match is None or end > length or records[end - 1] != 10 or match.group(2) not in _PAX_KEYS:
            raise Unusual("pax records the walk does not read")
        if match.group(2) == b"path":
            try:
                path = records[match.end() : end - 1].decode("utf-8").rstrip("/")
            except UnicodeDecodeError:
                raise Unusual("a pax path that is not UTF-8") from None
        pos = end
    return path


def _check(heads: list[bytes], sizes: list[int]) -> None:
    """Every header as :mod:`tarfile` accepts it, at once: each number field spaces, octal digits
    in one run and spaces, up to a NUL (what ``int(s.strip() or "0", 8)`` reads, no more), the
    size as the walk read it, and the unsigned checksum."""
    rows = np.frombuffer(b"".join(heads), np.uint8).reshape(len(heads), BLOCK)
    values = {}
    for start, width in _NUMBERS:
        ok, value = _octal(rows[:, start : start + width])
        if not ok.all():
            raise Unusual("a number field the walk does not read")
        values[start] = value
    if not np.array_equal(values[124], np.asarray(sizes, np.int64)):
        raise Unusual("a size the walk read otherwise")
    total = rows.sum(axis=1, dtype=np.int64) - rows[:, 148:156].sum(axis=1, dtype=np.int64) + 8 * 32
    if not np.array_equal(total, values[148]):
        raise Unusual("a checksum the walk does not accept")


def _octal(field: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``field`` (``[N, W]`` bytes): whether it is spaces, one run of octal digits and
    spaces up to its first NUL (or its end), and the number."""
    width = field.shape[1]
    nul = field == 0
    first_nul = np.where(nul.any(axis=1), nul.argmax(axis=1), width)
    col = np.arange(width)
    before = col[None, :] < first_nul[:, None]
    digit = (field >= 48) & (field <= 55) & before
    space = (field == 32) & before
    count = digit.sum(axis=1)
    first = digit.argmax(axis=1)
    last = width - 1 - digit[:, ::-1].argmax(axis=1)
    ok = ~(before & ~digit & ~space).any(axis=1) & ((count == 0) | (last - first + 1 == count))
    power = np.where(digit, last[:, None] - col[None, :], 0)
    value = np.where(digit, (field.astype(np.int64) - 48) << (3 * power), 0).sum(axis=1)
    return ok, value
