"""A shard's index, by the cheapest way there is: the node's index cache (``_indexcache``), else
the index file beside a remote shard (``_indexfile``), else its tar headers scanned (``_tar``) and
cached; the bad-sample list ``gpupipe check`` wrote beside it applied."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..core._errors import Damage, Problem, problem_error, redact
from ..runtime._children import process_pool
from ..runtime._dist import cores_per_rank
from ..storage._base import LocalStorage, Stat, Storage
from . import _indexcache
from ._indexfile import Samples, index_file_url, read_index_file
from ._mask import read_mask
from ._shard import FieldMembers, ShardDetail, ShardIndex, field_column
from ._tar import empty_shard, label_values, scan_tar

log = logging.getLogger("gpupipe")

__all__ = ["cached_scan", "shard_samples", "scan_ahead", "is_cached", "PARALLEL_SHARDS"]

PARALLEL_SHARDS = 64  # local shards not yet in the index cache from which their scan runs in processes


def cached_scan(
    storage: Storage,
    url: str,
    image_exts: tuple[str, ...],
    label_ext: str | None,
    *,
    index_files: bool = True,
    fields: tuple[FieldMembers, ...] = (),
) -> ShardIndex:
    """The index of one shard: from its cache file when there is one (details loaded lazily),
    else (remote shards, ``index_files``) from its index file beside it, else scanned from the tar
    headers and cached, with the damage found (``problems``). ``fields``: the members beyond image
    and label to index (their ranges are columns, :func:`field_column`); index files beside remote
    shards do not list them, so such shards are scanned."""
    try:
        stat = storage.stat(url)
    except FileNotFoundError:
        return empty_shard(url, Problem(Damage.MISSING_SHARD, None, "does not exist"), fields)
    except OSError as e:
        return empty_shard(url, Problem(Damage.UNREADABLE_SHARD, None, f"cannot be read: {e}"), fields)
    idx_path = _cache_path(storage, url, stat, image_exts, label_ext, fields)
    size = _indexcache.count(idx_path)
    problems = _indexcache.load_problems(idx_path) if size is not None else None
    if size is not None and problems is not None:
        loader = _CachedDetail(storage, url, idx_path, image_exts, label_ext, fields)
        shard = ShardIndex(url, size=size, loader=loader, dali_index=idx_path, problems=problems)
    elif index_files and not fields and storage.remote and (found := read_index_file(
            storage, url, size=stat.size, image_exts=image_exts, label_ext=label_ext, version=stat.version
            )) is not None:  # fmt: skip
        shard = _from_index_file(storage, url, idx_path, found.detail, found.problems, image_exts, label_ext,
                                 found.sizes)  # fmt: skip
    else:
        if storage.remote and "://" in url:  # (local compressed shards are decompressed, not downloaded)
            _say_what_indexing_costs(url)
        shard = _scan_and_cache(storage, url, idx_path, stat, image_exts, label_ext, fields)
    shard.nbytes = stat.size
    shard.bad = read_mask(storage, url, size=stat.size, samples=len(shard), image_exts=image_exts, label_ext=label_ext,
                          fields=fields)  # fmt: skip
    return shard


def _cache_path(storage: Storage, url: str, stat: Stat, image_exts: tuple[str, ...], label_ext: str | None,
                fields: tuple[FieldMembers, ...]) -> str:  # fmt: skip
    """The index cache file of shard ``url`` as it is now (``stat``)."""
    return _indexcache.index_path(storage.canonical(url), stat, image_exts, label_ext, fields)


def _uncached(storage: Storage, url: str, image_exts: tuple[str, ...], label_ext: str | None,
              fields: tuple[FieldMembers, ...]) -> tuple[Stat, str] | None:  # fmt: skip
    """``(stat, cache file)`` of shard ``url`` where its index is not in the cache, else ``None``
    (a missing or unreadable shard too: there is nothing to scan)."""
    try:
        stat = storage.stat(url)
    except OSError:
        return None
    path = _cache_path(storage, url, stat, image_exts, label_ext, fields)
    return (stat, path) if _indexcache.count(path) is None else None


def is_cached(storage: Storage, url: str, image_exts: tuple[str, ...], label_ext: str | None,
              fields: tuple[FieldMembers, ...] = ()) -> bool:  # fmt: skip
    """Whether shard ``url`` (as it is now) has its index in the cache; a missing or unreadable
    shard counts as cached (there is nothing to scan)."""
    return _uncached(storage, url, image_exts, label_ext, fields) is None


def scan_ahead(storage: Storage, urls: Sequence[str], image_exts: tuple[str, ...], label_ext: str | None,
               fields: tuple[FieldMembers, ...] = (), *, workers: int | None = None) -> int:  # fmt: skip
    """A dataset's first index, in parallel: where ``urls`` are local shards, at least
    :data:`PARALLEL_SHARDS` of them, and the first is not in the index cache (a dataset this node
    has not indexed), scans them into the cache in processes, ``workers`` of them (default: this
    rank's cores), in order; :func:`cached_scan` then finds each in the cache. Returns the shards
    scanned (0: it did not run: few shards, one core, remote storage, or the cache warm).

    The processes are forked, as the torch backend's workers are, and ended before it returns. A
    shard that fails in one is left to :func:`cached_scan`, which scans it again and says why."""
    workers = cores_per_rank() if workers is None else workers
    workers = min(workers, len(urls) // (PARALLEL_SHARDS // 4))
    if (type(storage) is not LocalStorage or len(urls) < PARALLEL_SHARDS or workers < 2
            or is_cached(storage, urls[0], image_exts, label_ext, fields)):  # fmt: skip
        return 0
    jobs = [(url, image_exts, label_ext, fields) for url in urls]
    with process_pool(workers, "gpupipe's index scan") as pool:
        scanned = sum(pool.map(_scan_one, jobs, chunksize=max(1, len(jobs) // (8 * workers))))
    log.info("gpupipe: scanned %d shards' headers into the index cache in %d processes", scanned, workers)
    return scanned


def _scan_one(job: tuple[str, tuple[str, ...], str | None, tuple[FieldMembers, ...]]) -> int:
    """Scans one shard into the index cache where it is not there yet (a process of
    :func:`scan_ahead`: nothing else of :func:`cached_scan`, which the rank runs after)."""
    url, image_exts, label_ext, fields = job
    storage = LocalStorage()
    try:
        found = _uncached(storage, url, image_exts, label_ext, fields)
        if found is not None:
            _scan_and_cache(storage, url, found[1], found[0], image_exts, label_ext, fields)
        return 1
    except Exception:  # (the rank's own scan meets it again and says why)
        return 0


def _scan_and_cache(
    storage: Storage, url: str, idx_path: str, stat: Stat, image_exts: tuple[str, ...], label_ext: str | None,
    fields: tuple[FieldMembers, ...] = (),
) -> ShardIndex:  # fmt: skip
    labeled = label_ext is not None
    shard, exts = scan_tar(storage, url, image_exts, label_ext, size=stat.size, fields=fields)
    ranges = shard.column("label_range") if labeled else None
    if any(p.kind is Damage.UNREADABLE_SHARD for p in shard.problems):
        return shard  # perhaps a passing I/O error: not cached
    if _indexcache.save_problems(idx_path, shard.problems) and _indexcache.save(
        idx_path,
        shard.keys,
        exts,
        shard.column("image_range"),
        ranges,
        [(f, shard.column(field_column(f.name))) for f in fields],
    ):
        shard.dali_index = idx_path
        if labeled:
            _indexcache.save_labels(idx_path, shard.column("label"))
    return shard


def _from_index_file(
    storage: Storage, url: str, idx_path: str, detail: Samples, problems: tuple[Problem, ...],
    image_exts: tuple[str, ...], label_ext: str | None, sizes: tuple[str, np.ndarray] | None = None,
) -> ShardIndex:  # fmt: skip
    """A shard known from its index file, kept in the index cache like a scanned shard's (with
    its images' sizes, where the file has them)."""
    n = len(detail.keys)
    label_range = detail.label if detail.label is not None else np.full((n, 2), -1, np.int64)
    if detail.labels is not None:  # before the index: a reader that finds it finds the labels
        _indexcache.save_labels(idx_path, detail.labels)
    if _indexcache.save_problems(idx_path, problems) and _indexcache.save(
        idx_path, detail.keys, detail.exts, detail.image, detail.label
    ):
        if sizes is not None:  # (a failure is logged: the first epoch then reads the headers)
            _indexcache.save_sizes(idx_path, *sizes)
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
    cached = _indexcache.load(shard.dali_index, label_ext is not None) if shard.dali_index else None
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
        self, storage: Storage, url: str, idx_path: str, image_exts: tuple[str, ...], label_ext: str | None,
        fields: tuple[FieldMembers, ...] = (),
    ) -> None:  # fmt: skip
        self.storage, self.url, self.idx_path = storage, url, idx_path
        self.image_exts, self.label_ext, self.fields = image_exts, label_ext, fields

    def __call__(self) -> ShardDetail:
        labeled = self.label_ext is not None
        cached = _indexcache.load(self.idx_path, labeled, self.fields)
        if cached is None:
            try:
                size = self.storage.stat(self.url).size
            except OSError as e:  # the shard went too: its error, not the storage's
                kind = Damage.MISSING_SHARD if isinstance(e, FileNotFoundError) else Damage.UNREADABLE_SHARD
                raise problem_error(
                    self.url, Problem(kind, None, f"cannot be read again to load its index: {e}")
                ) from e
            scanned = scan_tar(self.storage, self.url, self.image_exts, self.label_ext, size=size, fields=self.fields)
            return scanned[0].detail()
        keys, _, image, label_range, ranges = cached
        columns = {"image_range": image, "label_range": label_range}
        columns.update({field_column(name): r for name, r in ranges.items()})
        if labeled:
            labels = _indexcache.load_labels(self.idx_path, len(keys))
            if labels is None:  # its labels file is gone or damaged: parse the labels once
                labels = label_values(self.storage, self.url, keys, label_range)
                _indexcache.save_labels(self.idx_path, labels)
            columns["label"] = labels
        return keys, columns
