"""A tar shard read by its headers: members grouped into samples by WebDataset's key rule, the
labels parsed, and the damage found listed, not raised (the source decides)."""

from __future__ import annotations

import functools
import os
import tarfile
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from ..core._errors import Damage, Problem, SampleError, unreadable
from ..core._fields import Label, ascii_int
from ..storage._base import Storage, compressed
from ._shard import NO_LABEL, FieldMembers, ShardIndex, field_column
from ._tarwalk import Unusual, reader, walk

__all__ = [
    "split_key",
    "parse_label",
    "require_label_size",
    "scan_tar",
    "label_values",
    "empty_shard",
    "missing_field",
    "HEADER_LIMIT",
    "LABEL_LIMIT",
]

HEADER_LIMIT = 1 << 20  # the largest pax or GNU long-name record read while scanning (real ones: bytes to KB)
LABEL_LIMIT = Label.default_max_bytes  # the largest .cls member read: an int64 in ASCII, whitespace around it


class HeaderTooLarge(tarfile.ReadError):
    """A header record (pax, GNU long name) claims more than :data:`HEADER_LIMIT` bytes."""


class _Bounded:
    """A shard's stream as :mod:`tarfile` scans it, refusing any read over :data:`HEADER_LIMIT`:
    tarfile reads a pax or GNU long-name record whole, of the size its header claims (a 15 KB
    shard claiming 2**62 bytes would be a ``MemoryError``); a member's data it seeks past."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > HEADER_LIMIT:
            raise HeaderTooLarge(f"a header record of {n} bytes, over the {HEADER_LIMIT} gpupipe reads")
        return self._f.read(n)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


def split_key(member: str) -> tuple[str, str]:
    """``"img/00/000123.seg.png"`` → ``("img/00/000123", "seg.png")``: WebDataset's (and DALI's)
    rule, the key ends at the first dot of the file name; the extension is lower-cased."""
    member = member[2:] if member.startswith("./") else member
    head, _, name = member.rpartition("/")
    stem, dot, ext = name.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower() if dot else ""


def parse_label(raw: bytes, *, shard: str, key: str) -> int:
    """A ``.cls`` member's ASCII integer (an int64, the lowest excepted: it is ``NO_LABEL``);
    SampleError naming shard and key otherwise."""
    try:
        return ascii_int(raw, low=NO_LABEL + 1)
    except ValueError as e:
        raise SampleError(f"label of sample {key!r} in shard {shard!r} {e}: {raw[:40]!r}", shard=shard, key=key,
                          kind=Damage.BAD_LABEL) from None  # fmt: skip


def require_label_size(size: int, *, shard: str, key: str) -> None:
    """Raises the bad label's SampleError where a label member of ``size`` bytes is over
    :data:`LABEL_LIMIT`: checked before it is read."""
    if size > LABEL_LIMIT:
        raise SampleError(f"label of sample {key!r} in shard {shard!r} is {size} bytes, more than an int64 takes "
                          f"({LABEL_LIMIT}): not read", shard=shard, key=key, kind=Damage.BAD_LABEL)  # fmt: skip


def _label_value(raw: bytes) -> int:
    """The label, or NO_LABEL where ``parse_label`` refuses it (it names the problem when the
    sample is read)."""
    try:
        return parse_label(raw, shard="", key="")
    except SampleError:
        return NO_LABEL


def label_values(storage: Storage, url: str, keys: list[str], ranges: np.ndarray) -> np.ndarray:
    labels = np.empty(len(keys), np.int64)
    for i, (offset, size) in enumerate(ranges.tolist()):
        try:
            labels[i] = NO_LABEL if size > LABEL_LIMIT else _label_value(storage.read(url, offset, size))
        except OSError as e:
            raise unreadable(url, keys[i], e) from e
    return labels


def empty_shard(url: str, problem: Problem, fields: tuple[FieldMembers, ...] = ()) -> ShardIndex:
    none = np.zeros((0, 2), np.int64)
    columns = {"image_range": none, "label_range": none, "label": np.zeros(0, np.int64)}
    columns.update({field_column(f.name): none for f in fields})
    return ShardIndex(url, [], columns, problems=(problem,))


def _gzip(storage: Storage, url: str) -> bool:
    """Whether the shard starts as a gzip stream does (a compressed tar under a .tar name)."""
    try:
        with storage.open_shard(url) as f:
            return bool(f.read(2) == b"\x1f\x8b")
    except OSError:
        return False


def _unended(f: Any, end: int, groups: list[tuple[str, dict[str, tuple[int, int]]]]) -> str | None:
    """Why a tar that :mod:`tarfile` read to its end did not end properly, or ``None``. tarfile
    stops without a word at a header it cannot read past the first (cut short in a header, or
    garbage) and at the end of the file; a whole tar goes on with a zero block (its end)."""
    after = f"after sample {groups[-1][0]!r}" if groups else "after its first header"
    f.seek(end)
    block = f.read(tarfile.BLOCKSIZE)
    if len(block) == tarfile.BLOCKSIZE and block.count(0) == tarfile.BLOCKSIZE:
        return None
    if not block:
        return f"ends {after} without the tar's end-of-archive block (at byte {end}): cut at a member boundary?"
    if len(block) < tarfile.BLOCKSIZE:
        return f"ends inside the header {after} (at byte {end} + {len(block)})"
    return f"has a header that cannot be read {after} (at byte {end})"


def _read_tarfile(raw: IO[bytes], size: int | None, add: Callable[[str, int, int, Callable[[], bytes]], None],
                  groups: list[tuple[str, dict[str, tuple[int, int]]]]) -> str | None:  # fmt: skip
    """The shard's members read by :mod:`tarfile` (each passed to ``add``); why it ends early,
    or ``None``. Raises tarfile's errors where its first header cannot be read."""
    f = _Bounded(raw)
    with tarfile.open(fileobj=f, mode="r:") as tar:  # type: ignore[call-overload]
        try:
            for m in tar:
                if not m.isfile():
                    continue
                if size is not None and m.offset_data + m.size > size:
                    end = m.offset_data + m.size
                    return f"ends inside member {m.name!r} (the file has {size} bytes, the member ends at {end})"
                add(m.name, m.offset_data, m.size, functools.partial(_extracted, tar, m))
        except tarfile.TarError as e:  # a header past the first cannot be read: cut short, or damaged
            return f"is damaged after its last readable member ({e})"
        return _unended(f, tar.offset, groups)  # tarfile's offset: where it read the header that ended the members


def _given(data: bytes | None, read: Callable[[int, int], bytes], offset: int, length: int) -> bytes:
    return read(offset, length) if data is None else data


def _extracted(tar: tarfile.TarFile, m: tarfile.TarInfo) -> bytes:
    member = tar.extractfile(m)
    return member.read() if member else b""


def missing_field(field: FieldMembers) -> str:
    """The detail of a sample without ``field``'s member (a ``Damage.MISSING_FIELD`` problem)."""
    why = "; missing='skip' leaves such samples out" if field.missing == "skip" else ""
    return f"has no {field.name!r} field ({'/'.join(field.exts)}){why}"


def scan_tar(
    storage: Storage,
    url: str,
    image_exts: tuple[str, ...],
    label_ext: str | None,
    *,
    size: int | None = None,
    fields: tuple[FieldMembers, ...] = (),
) -> tuple[ShardIndex, list[str]]:
    """Reads the headers of one tar shard (not the data) and groups members into samples; returns
    the shard's index and each sample's chosen image extension.

    Damage does not raise here: it is listed in the index's ``problems`` (the source raises it
    under ``on_error="raise"``). A sample without an accepted image or without its label, or
    whose key came earlier in the shard, is left out of the numbering; a shard that ends inside a
    member (``size``: the file's size, known from its stat) keeps its complete samples before the
    cut; a shard that is not a tar file, or holds no samples, has none."""
    groups: list[tuple[str, dict[str, tuple[int, int]]]] = []
    values: dict[int, int] = {}  # group -> parsed label (label members are read: a few bytes each)
    cut: str | None = None  # why the shard ends early

    def add(name: str, offset: int, length: int, label: Callable[[], bytes]) -> None:
        key, ext = split_key(name)
        if not groups or groups[-1][0] != key or ext in groups[-1][1]:
            groups.append((key, {}))
        groups[-1][1][ext] = (offset, length)
        if ext == label_ext and length <= LABEL_LIMIT:  # (a longer one: NO_LABEL, refused when read)
            values[len(groups) - 1] = _label_value(label())

    try:
        with storage.open_shard(url) as raw:
            if compressed(url):  # the cache holds it decompressed: the tar's own size counts
                size = raw.seek(0, os.SEEK_END)
                raw.seek(0)
            try:  # a well-formed tar, walked fast; else tarfile's reading and verdict (_tarwalk)
                walked = walk(raw, size, small=LABEL_LIMIT)
            except Unusual:
                walked = None
            if walked is not None:
                read = reader(raw)
                for name, offset, length, data in walked:
                    add(name, offset, length, functools.partial(_given, data, read, offset, length))
            else:
                raw.seek(0)
                cut = _read_tarfile(raw, size, add, groups)
    except HeaderTooLarge as e:
        detail = f"cannot be scanned: its first header announces {e} (damaged, or crafted)"
        return empty_shard(url, Problem(Damage.UNREADABLE_SHARD, None, detail), fields), []
    except tarfile.TarError as e:
        kind = Damage.EMPTY_SHARD if size == 0 else Damage.UNREADABLE_SHARD
        gzipped = "; it is gzip-compressed: name it .tar.gz (or .tgz)" if _gzip(storage, url) else ""
        detail = "is empty (0 bytes)" if size == 0 else f"is not a tar file: {e}{gzipped}"
        return empty_shard(url, Problem(kind, None, detail), fields), []
    except OSError as e:
        return empty_shard(url, Problem(Damage.UNREADABLE_SHARD, None, f"cannot be read: {e}"), fields), []
    except Exception as e:  # tarfile on headers no rule above foresaw: the shard's damage, never the caller's
        detail = f"cannot be scanned: {type(e).__name__}: {e}"
        return empty_shard(url, Problem(Damage.UNREADABLE_SHARD, None, detail), fields), []
    problems: list[Problem] = []
    if cut is not None and groups and not _complete(groups[-1][1], image_exts, label_ext):
        groups.pop()  # the sample the cut went through
    keys: list[str] = []
    exts: list[str] = []
    kept: list[int] = []
    seen: dict[str, int] = {}
    for g, (key, members) in enumerate(groups):
        chosen = next((e for e in image_exts if e in members), None) if image_exts else ""  # "": no image asked
        if key in seen:
            detail = f"repeats the key of sample {seen[key]} of the shard; the first is used"
            problems.append(Problem(Damage.DUPLICATE_KEY, key, detail))
        elif chosen is None:
            detail = f"has no image ({'/'.join(image_exts)}); it has {sorted(members) or 'no members'}"
            problems.append(Problem(Damage.NO_IMAGE, key, detail))
        elif label_ext is not None and label_ext not in members:
            detail = f"has no .{label_ext} label; pass label=None for unlabeled data"
            problems.append(Problem(Damage.NO_LABEL, key, detail))
        elif (absent := _absent(members, fields)) is not None:
            problems.append(Problem(Damage.MISSING_FIELD, key, missing_field(absent)))
        else:
            seen[key] = len(keys)
            keys.append(key)
            exts.append(chosen)
            kept.append(g)
    n = len(keys)
    if cut is not None:
        detail = f"is truncated: it {cut}; its {n} complete samples before the cut are usable"
        problems.insert(0, Problem(Damage.TRUNCATED_SHARD, None, detail))
    elif not groups:
        problems.append(Problem(Damage.EMPTY_SHARD, None, "holds no samples"))
    image = np.array([groups[g][1][exts[i]] if exts[i] else (-1, -1) for i, g in enumerate(kept)], np.int64).reshape(
        n, 2
    )
    label = (
        np.array([groups[g][1][label_ext] for g in kept], np.int64).reshape(n, 2)
        if label_ext is not None
        else np.full((n, 2), -1, np.int64)
    )
    columns = {"image_range": image, "label_range": label}
    if label_ext is not None:
        columns["label"] = np.array([values.get(g, NO_LABEL) for g in kept], dtype=np.int64)
    for field in fields:
        found = [next((groups[g][1][e] for e in field.exts if e in groups[g][1]), (-1, -1)) for g in kept]
        columns[field_column(field.name)] = np.array(found, np.int64).reshape(n, 2)
    return ShardIndex(url, keys, columns, problems=tuple(problems)), exts


def _absent(members: dict[str, tuple[int, int]], fields: tuple[FieldMembers, ...]) -> FieldMembers | None:
    """The first of ``fields`` the sample must have (``missing`` not ``"empty"``) and has not."""
    return next((f for f in fields if f.missing != "empty" and not any(e in members for e in f.exts)), None)


def _complete(members: dict[str, tuple[int, int]], image_exts: tuple[str, ...], label_ext: str | None) -> bool:
    return (not image_exts or any(e in members for e in image_exts)) and (label_ext is None or label_ext in members)
