"""WebDataset tar shards: the source, its tar scanner and index cache, and its sample reader."""

from __future__ import annotations

import dataclasses
import logging
import os
import tarfile
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ..core._config import OnError
from ..core._errors import (
    ConfigError,
    Damage,
    DataError,
    Problem,
    SampleError,
    ShardError,
    counted,
    redact,
    truncated,
    unreadable,
)
from ..core._validate import check_bytes, check_enum
from ..sidefiles._indexfile import Samples, index_file_url, read_index_file
from ..sidefiles._mask import read_mask
from ..storage._base import Stat, Storage, compressed
from ..storage._schemes import expand_urls, list_urls, storage_for
from . import _wdsindex
from ._index import NO_LABEL, Index, RawSample, ShardDetail, ShardIndex, Source

log = logging.getLogger("gpupipe")

__all__ = [
    "WebDataset",
    "split_key",
    "parse_label",
    "scan_tar",
    "cached_scan",
    "shard_samples",
]


def split_key(member: str) -> tuple[str, str]:
    """``"img/00/000123.seg.png"`` → ``("img/00/000123", "seg.png")``: WebDataset's (and DALI's)
    rule, the key ends at the first dot of the file name; the extension is lower-cased."""
    member = member[2:] if member.startswith("./") else member
    head, _, name = member.rpartition("/")
    stem, dot, ext = name.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower() if dot else ""


_INT64 = (-(1 << 63) + 1, (1 << 63) - 1)  # the lowest int64 is NO_LABEL


def parse_label(raw: bytes, *, shard: str, key: str) -> int:
    """A ``.cls`` member's ASCII integer (an int64); SampleError naming shard and key otherwise."""
    try:
        value = int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise SampleError(
            f"label of sample {key!r} in shard {shard!r} is not an ASCII integer: {raw[:40]!r}",
            shard=shard,
            key=key,
            kind=Damage.BAD_LABEL,
        ) from None
    if not _INT64[0] <= value <= _INT64[1]:
        raise SampleError(
            f"label of sample {key!r} in shard {shard!r} is out of the int64 range: {raw[:40]!r}",
            shard=shard,
            key=key,
            kind=Damage.BAD_LABEL,
        )
    return value


def _split_exts(value: str | Sequence[str] | None, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    parts = value.split(";") if isinstance(value, str) else list(value)
    exts = tuple(p.strip().lower().lstrip(".") for p in parts if isinstance(p, str) and p.strip())
    if not exts or not all(isinstance(p, str) for p in parts):
        raise ConfigError(f"WebDataset: {name} must be extensions separated by ';' (e.g. 'jpg;png'), got {value!r}")
    return exts


@dataclasses.dataclass(frozen=True)
class WebDataset(Source):
    """WebDataset tar shards.

    Args:
        urls: a path or URL pattern with brace ranges (``"data/train-{000000..000127}.tar"``,
            ``"https://host/data/train-{000000..000127}.tar"``, ``"s3://bucket/train-{0..9}.tar"``;
            several braces allowed) or a list of them. Remote URLs: any protocol fsspec knows,
            read through the node-local shard cache.
        image: accepted image extensions, in order of preference, separated by ``;``.
            Default ``"jpg;jpeg;png"``.
        label: the extension of the label member, an ASCII integer (``"cls"``), or ``None`` for
            unlabeled data (the loader then yields images only).
        storage_options: remote URLs only: keyword arguments of the fsspec filesystem
            (``{"endpoint_url": ...}`` for s3fs, headers for https); default: the driver's own
            configuration and environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
        cache_dir: remote URLs only: where whole shards are cached on this node (default
            ``$GPUPIPE_CACHE_DIR/shards``, ``~/.cache/gpupipe/shards``).
        cache_size: remote URLs only: the cache's bound, in bytes or as ``"500GB"``, ``"1.5TB"``,
            ``"800MiB"``; least recently used shards no
            process of the node reads are deleted to stay within it. Default: 80% of what the
            cache could use when first asked (its shards plus the free space of its disk).
        relist: a dataset that grows between epochs: ``urls`` are patterns of what may exist
            (globs ``"data/train-*.tar"``, ``"s3://bucket/shards/*.tar"``, or brace ranges
            over shards not all written yet), listed again by the loader at each new epoch, so
            that the epoch reads the shards present then (``Source.listing``). Default ``False``:
            the shards are fixed when the source is made. Write each shard under another name and
            rename it when complete (a half-written shard matching the pattern is read as
            damaged). See docs/guide/growing.md.

    A sample is a run of consecutive members sharing a key: the member path up to the first dot of
    its file name (``img/00/000123.jpg`` → ``img/00/000123``). Members of other extensions are
    ignored. A sample without an accepted image, or without its label, is an error that names the
    shard and the key.
    """

    urls: str | Sequence[str]
    _: dataclasses.KW_ONLY
    image: str = "jpg;jpeg;png"
    label: str | None = "cls"
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    cache_dir: str | None = None
    cache_size: int | str | None = None
    relist: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_size", check_bytes("WebDataset", self.cache_size, "cache_size"))
        if not isinstance(self.relist, bool):
            raise ConfigError(f"WebDataset: relist must be True or False, got {self.relist!r}")
        if self.relist:  # patterns, listed when asked (checked now: schemes served, no pipe:)
            expand_urls(self.urls)
            patterns = [self.urls] if isinstance(self.urls, (str, os.PathLike)) else list(self.urls)
            object.__setattr__(self, "urls", tuple(os.fspath(u) for u in patterns))
        else:
            object.__setattr__(self, "urls", tuple(expand_urls(self.urls)))
        _split_exts(self.image, "image")
        if self.label is not None:
            _split_exts(self.label, "label")

    def listing(self) -> tuple[str, ...] | None:
        """With ``relist=True``: the shards that match ``urls`` now (``None`` otherwise)."""
        if not self.relist:
            return None
        return tuple(list_urls(self.urls, storage_options=self.storage_options))

    def with_listing(self, listing: Any) -> WebDataset:
        if not self.relist:
            return self
        if not listing:
            raise ConfigError(f"WebDataset: no shard matches {list(self.urls)} yet")
        return dataclasses.replace(self, urls=tuple(listing), relist=False)

    def storage(self) -> Storage:
        """A new storage for the shards (the caller closes it)."""
        return storage_for(
            self.urls,
            storage_options=self.storage_options,
            cache_dir=self.cache_dir,
            cache_size=self.cache_size,  # type: ignore[arg-type]  # an int after __post_init__
        )

    def extensions(self) -> tuple[tuple[str, ...], str | None]:
        """The image extensions, in order of preference, and the label extension (``None``)."""
        return _split_exts(self.image, "image"), (self.label.lstrip(".").lower() if self.label else None)

    def index(self, *, rank: int = 0, world_size: int = 1, on_error: OnError | str = OnError.RAISE) -> Index:
        """Indexes the shards. Cached shards cost one header line each (their details load when
        first read); the others are scanned and cached. Rank ``r`` of ``world_size`` starts
        scanning at shard ``r * n // world_size``, so that ranks sharing a cache directory scan a
        new dataset's shards in parallel rather than all in the same order.

        Damage (a missing, unreadable, empty or truncated shard; a sample without image or label,
        or with a repeated key) is recorded in the cache with the index. ``on_error="raise"``
        raises the first (after indexing every shard); ``"skip"`` returns the index without those
        samples and shards, listed in ``Index.problems``. With ``relist=True``: of the shards
        present now."""
        if self.relist:
            return self.with_listing(self.listing()).index(rank=rank, world_size=world_size, on_error=on_error)
        image_exts, label_ext = self.extensions()
        storage = self.storage()
        n = len(self.urls)
        first = rank * n // max(1, world_size)
        shards: list[ShardIndex | None] = [None] * n
        for i in range(n):
            s = (first + i) % n
            shards[s] = cached_scan(storage, self.urls[s], image_exts, label_ext)
        labeled = label_ext is not None
        index = Index(shards, reader=TarReader(storage, labeled=labeled), sequential=True, labeled=labeled)  # type: ignore[arg-type]
        try:
            policy = check_enum("WebDataset.index", on_error, "on_error", OnError)
            _none_missing_all(self.urls, index.problems)  # whatever the policy: skipping all leaves nothing
            if policy is OnError.RAISE:
                raise_first(index.problems)
        except BaseException:
            index.close()
            raise
        return index


def _none_missing_all(urls: Sequence[str], problems: list[DataError]) -> None:
    """Raises when not one of ``urls`` exists: a wrong path or pattern, not damage to skip."""
    missing = [e for e in problems if e.kind is Damage.MISSING_SHARD]
    if not urls or len(missing) < len(urls):
        return
    first = urls[0]
    where = "" if "://" in first or os.path.isabs(first) else f", relative to the working directory {os.getcwd()}"
    shards = f"none of the {len(urls)} shards exists" if len(urls) > 1 else "the shard does not exist"
    hint = ""
    if any(c in (urlsplit(u).path if "://" in u else u) for u in urls for c in "*?["):  # (not a URL's query)
        hint = (
            "; globs are listed with WebDataset(..., relist=True), or give a brace range "
            "('train-{000000..000099}.tar') or a list of paths"
        )
    raise ShardError(f"WebDataset: {shards}: {first!r}{where}{hint}", shard=first, kind=Damage.MISSING_SHARD)


def raise_first(problems: list[DataError]) -> None:
    """Raises the first of ``problems`` (if any), saying how many more there are."""
    if not problems:
        return
    first = problems[0]
    more = (
        f" ({counted(len(problems) - 1, 'more problem')} in this dataset: `python -m gpupipe check` lists them all; "
        "Loader(on_error='skip') leaves them out)"
        if len(problems) > 1
        else ""
    )
    raise type(first)(f"{first}{more}", shard=first.shard, key=first.key, kind=first.kind)


class TarReader:
    """Reads a sample's image and label members by the byte ranges in its shard's index."""

    def __init__(self, storage: Storage, *, labeled: bool) -> None:
        self.storage, self.labeled = storage, labeled

    def _read(self, shard: ShardIndex, offset: int, size: int, key: str) -> bytes:
        try:
            data = self.storage.read(shard.path, offset, size)
        except OSError as e:
            raise unreadable(shard.path, key, e) from e
        if len(data) != size:
            raise truncated(shard.path, key)
        return data

    def read(self, shard: ShardIndex, i: int) -> RawSample:
        key = shard.keys[i]
        offset, size = shard.column("image_range")[i]
        data = self._read(shard, int(offset), int(size), key)
        label = None
        if self.labeled:
            parsed = shard.detail()[1].get("label")  # parsed when indexed
            label = NO_LABEL if parsed is None else int(parsed[i])
            if label == NO_LABEL:  # not parsed, or not an integer: read it (again, for the error's detail)
                offset, size = shard.column("label_range")[i]
                label = parse_label(self._read(shard, int(offset), int(size), key), shard=shard.path, key=key)
        return RawSample(key, shard.path, data, label)

    def close(self) -> None:
        self.storage.close()


def cached_scan(
    storage: Storage, url: str, image_exts: tuple[str, ...], label_ext: str | None, *, index_files: bool = True
) -> ShardIndex:
    """The index of one shard: from its cache file when there is one (details loaded lazily),
    else (remote shards, ``index_files``) from its index file beside it, else scanned from the tar
    headers and cached, with the damage found (``problems``)."""
    try:
        stat = storage.stat(url)
    except FileNotFoundError:
        return _empty_shard(url, Problem(Damage.MISSING_SHARD, None, "does not exist"))
    except OSError as e:
        return _empty_shard(url, Problem(Damage.UNREADABLE_SHARD, None, f"cannot be read: {e}"))
    idx_path = _wdsindex.index_path(storage.canonical(url), stat, image_exts, label_ext)
    size = _wdsindex.count(idx_path)
    problems = _wdsindex.load_problems(idx_path) if size is not None else None
    if size is not None and problems is not None:
        loader = _CachedDetail(storage, url, idx_path, image_exts, label_ext)
        shard = ShardIndex(url, size=size, loader=loader, dali_index=idx_path, problems=problems)
    elif index_files and storage.remote and (found := read_index_file(
            storage, url, size=stat.size, image_exts=image_exts, label_ext=label_ext)) is not None:  # fmt: skip
        shard = _from_index_file(storage, url, idx_path, found.detail, found.problems, image_exts, label_ext)
    else:
        if storage.remote and "://" in url:  # (local compressed shards are decompressed, not downloaded)
            _say_what_indexing_costs(url)
        shard = _scan_and_cache(storage, url, idx_path, stat, image_exts, label_ext)
    shard.nbytes = stat.size
    shard.bad = read_mask(storage, url, size=stat.size, samples=len(shard), image_exts=image_exts, label_ext=label_ext)
    return shard


def _scan_and_cache(
    storage: Storage, url: str, idx_path: str, stat: Stat, image_exts: tuple[str, ...], label_ext: str | None
) -> ShardIndex:
    labeled = label_ext is not None
    shard, exts = scan_tar(storage, url, image_exts, label_ext, size=stat.size)
    ranges = shard.column("label_range") if labeled else None
    if any(p.kind is Damage.UNREADABLE_SHARD for p in shard.problems):
        return shard  # perhaps a passing I/O error: not cached
    if _wdsindex.save_problems(idx_path, shard.problems) and _wdsindex.save(
        idx_path, shard.keys, exts, shard.column("image_range"), ranges
    ):
        shard.dali_index = idx_path
        if labeled:
            _wdsindex.save_labels(idx_path, shard.column("label"))
    return shard


def _from_index_file(
    storage: Storage, url: str, idx_path: str, detail: Samples, problems: tuple[Problem, ...],
    image_exts: tuple[str, ...], label_ext: str | None,
) -> ShardIndex:  # fmt: skip
    """A shard known from its index file, kept in the index cache like a scanned shard's."""
    n = len(detail.keys)
    label_range = detail.label if detail.label is not None else np.full((n, 2), -1, np.int64)
    if detail.labels is not None:  # before the index: a reader that finds it finds the labels
        _wdsindex.save_labels(idx_path, detail.labels)
    if _wdsindex.save_problems(idx_path, problems) and _wdsindex.save(
        idx_path, detail.keys, detail.exts, detail.image, detail.label
    ):
        loader = _CachedDetail(storage, url, idx_path, image_exts, label_ext)
        return ShardIndex(url, size=n, loader=loader, dali_index=idx_path, problems=problems)
    columns = {"image_range": detail.image, "label_range": label_range}
    if detail.labels is not None:
        columns["label"] = detail.labels
    return ShardIndex(url, detail.keys, columns, problems=problems)


def shard_samples(
    storage: Storage, url: str, image_exts: tuple[str, ...], label_ext: str | None
) -> tuple[ShardIndex, Samples | None]:
    """The index of one shard, from the node's index cache or scanned — never from an index file
    beside it, which may be stale (:func:`cached_scan`) — and its samples as an index file lists
    them (``None`` for a shard that is missing or cannot be read)."""
    shard = cached_scan(storage, url, image_exts, label_ext, index_files=False)
    if shard.nbytes is None:
        return shard, None
    cached = _wdsindex.load(shard.dali_index, labeled=label_ext is not None) if shard.dali_index else None
    if cached is not None and cached[0] == shard.keys:
        exts = cached[1]
    else:  # not cached (keys with whitespace, say): scanned again for each sample's extension
        exts = scan_tar(storage, url, image_exts, label_ext, size=shard.nbytes)[1]
    labeled = label_ext is not None
    samples = Samples(
        shard.keys,
        exts,
        shard.column("image_range"),
        shard.column("label_range") if labeled else None,
        shard.column("label") if labeled else None,
    )
    return shard, samples


_told = False


def _say_what_indexing_costs(url: str) -> None:
    global _told
    if not _told:
        _told = True
        log.warning(
            "gpupipe: remote shards without index files beside them (%s and others): each is downloaded once, "
            "through the shard cache, to count its samples. `python -m gpupipe index 'URLS' --beside` writes the "
            "index files once, so that nodes start without downloading.",
            redact(index_file_url(url)),
        )


class _CachedDetail:
    """Loads a shard's details from its cache file (or scans the shard again if the file went away
    or was damaged). A class, not a closure, so that an index pickles into spawned workers."""

    def __init__(
        self, storage: Storage, url: str, idx_path: str, image_exts: tuple[str, ...], label_ext: str | None
    ) -> None:
        self.storage, self.url, self.idx_path = storage, url, idx_path
        self.image_exts, self.label_ext = image_exts, label_ext

    def __call__(self) -> ShardDetail:
        labeled = self.label_ext is not None
        cached = _wdsindex.load(self.idx_path, labeled=labeled)
        if cached is None:
            size = self.storage.stat(self.url).size
            return scan_tar(self.storage, self.url, self.image_exts, self.label_ext, size=size)[0].detail()
        keys, _, image, label_range = cached
        columns = {"image_range": image, "label_range": label_range}
        if labeled:
            labels = _wdsindex.load_labels(self.idx_path, len(keys))
            if labels is None:  # its labels file is gone or damaged: parse the labels once
                labels = _read_labels(self.storage, self.url, keys, label_range)
                _wdsindex.save_labels(self.idx_path, labels)
            columns["label"] = labels
        return keys, columns


def _label_value(raw: bytes) -> int:
    """The label, or NO_LABEL where ``parse_label`` refuses it (it names the problem when the
    sample is read)."""
    try:
        return parse_label(raw, shard="", key="")
    except SampleError:
        return NO_LABEL


def _read_labels(storage: Storage, url: str, keys: list[str], ranges: np.ndarray) -> np.ndarray:
    labels = np.empty(len(keys), np.int64)
    for i, (offset, size) in enumerate(ranges.tolist()):
        try:
            labels[i] = _label_value(storage.read(url, offset, size))
        except OSError as e:
            raise unreadable(url, keys[i], e) from e
    return labels


def _empty_shard(url: str, problem: Problem) -> ShardIndex:
    none = np.zeros((0, 2), np.int64)
    columns = {"image_range": none, "label_range": none, "label": np.zeros(0, np.int64)}
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


def scan_tar(
    storage: Storage, url: str, image_exts: tuple[str, ...], label_ext: str | None, *, size: int | None = None
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
    try:
        with storage.open_shard(url) as f:
            if compressed(url):  # the cache holds it decompressed: the tar's own size counts
                size = f.seek(0, os.SEEK_END)
                f.seek(0)
            with tarfile.open(fileobj=f, mode="r:") as tar:
                try:
                    for m in tar:
                        if not m.isfile():
                            continue
                        if size is not None and m.offset_data + m.size > size:
                            end = m.offset_data + m.size
                            cut = f"ends inside member {m.name!r} (the file has {size} bytes, the member ends at {end})"
                            break
                        key, ext = split_key(m.name)
                        if not groups or groups[-1][0] != key or ext in groups[-1][1]:
                            groups.append((key, {}))
                        groups[-1][1][ext] = (m.offset_data, m.size)
                        if ext == label_ext:
                            member = tar.extractfile(m)
                            values[len(groups) - 1] = _label_value(member.read() if member else b"")
                except tarfile.TarError as e:  # a header past the first cannot be read: cut short, or damaged
                    cut = f"is damaged after its last readable member ({e})"
                if cut is None:  # tarfile's offset: where it read the header that ended the members
                    cut = _unended(f, tar.offset, groups)
    except tarfile.TarError as e:
        kind = Damage.EMPTY_SHARD if size == 0 else Damage.UNREADABLE_SHARD
        gzipped = "; it is gzip-compressed: name it .tar.gz (or .tgz)" if _gzip(storage, url) else ""
        detail = "is empty (0 bytes)" if size == 0 else f"is not a tar file: {e}{gzipped}"
        return _empty_shard(url, Problem(kind, None, detail)), []
    except OSError as e:
        return _empty_shard(url, Problem(Damage.UNREADABLE_SHARD, None, f"cannot be read: {e}")), []
    problems: list[Problem] = []
    if cut is not None and groups and not _complete(groups[-1][1], image_exts, label_ext):
        groups.pop()  # the sample the cut went through
    keys: list[str] = []
    exts: list[str] = []
    kept: list[int] = []
    seen: dict[str, int] = {}
    for g, (key, members) in enumerate(groups):
        chosen = next((e for e in image_exts if e in members), None)
        if key in seen:
            detail = f"repeats the key of sample {seen[key]} of the shard; the first is used"
            problems.append(Problem(Damage.DUPLICATE_KEY, key, detail))
        elif chosen is None:
            detail = f"has no image ({'/'.join(image_exts)}); it has {sorted(members) or 'no members'}"
            problems.append(Problem(Damage.NO_IMAGE, key, detail))
        elif label_ext is not None and label_ext not in members:
            detail = f"has no .{label_ext} label; pass label=None for unlabeled data"
            problems.append(Problem(Damage.NO_LABEL, key, detail))
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
    image = np.array([groups[g][1][exts[i]] for i, g in enumerate(kept)], np.int64).reshape(n, 2)
    label = (
        np.array([groups[g][1][label_ext] for g in kept], np.int64).reshape(n, 2)
        if label_ext is not None
        else np.full((n, 2), -1, np.int64)
    )
    columns = {"image_range": image, "label_range": label}
    if label_ext is not None:
        columns["label"] = np.array([values.get(g, NO_LABEL) for g in kept], dtype=np.int64)
    return ShardIndex(url, keys, columns, problems=tuple(problems)), exts


def _complete(members: dict[str, tuple[int, int]], image_exts: tuple[str, ...], label_ext: str | None) -> bool:
    return any(e in members for e in image_exts) and (label_ext is None or label_ext in members)
