"""Remote shards: any URL an fsspec protocol serves (``https://``, ``s3://`` through s3fs, ``gs://``
through gcsfs, ``memory://``, ...), read through a node-local cache of whole shards.

A remote shard is downloaded once into the node-local cache (``_cache.ShardCache``: atomic,
locked, bounded, shared by the node's processes) and every read — the index scan, the torch
workers, DALI's reader threads (``mmap``) — is then a local read of that file, as fast as local
data. Each process keeps the shards it reads pinned (never evicted); the loader has the shards of
its plan downloaded ahead (``_prefetch``). Requests are retried with backoff and jitter.

Options follow fsspec's conventions: ``storage_options`` are the filesystem's keyword arguments,
and the drivers read their usual environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, TypeVar

from ..core._errors import redact
from ._base import LocalStorage, Stat, Storage, compressed
from ._cache import Entry, ShardCache, Span, covers, drop_inherited
from ._counts import count
from ._fsspec import canonical_url, filesystem_for
from ._mapped import MappedFile
from ._transfer import MAX_INFLATION, NoRanges, WrongSize, download, host, retry

__all__ = ["RemoteStorage"]

log = logging.getLogger("gpupipe")
T = TypeVar("T")

_VERSION_FIELDS = ("ETag", "etag", "Content-MD5", "md5Hash", "generation", "Last-Modified", "LastModified", "mtime",
                   "updated", "created")  # fmt: skip
KEEP = 16  # shards a process keeps pinned by default (a loader sets its interleave + shards ahead + 1)
PREFETCH_THREADS = 4  # concurrent background downloads per process
CHANGES = 3  # downloads of a shard that changes under each of them, before giving up


class _Changed(Exception):
    """The shard's version changed while it was being downloaded."""


FAILED_FOR_S = 60.0  # a shard whose fetch failed (after every try) is not tried again for this long


_LIVE: weakref.WeakSet[RemoteStorage] = weakref.WeakSet()


def _drop_inherited_pins() -> None:
    """In a forked child (a torch-backend worker): close the parent's pin descriptors. A ``flock``
    belongs to the open file description, which the child's copies share: kept open, they would
    hold the parent's pins for as long as the child lives, after the parent released them, and
    those shards could never be evicted. Closing the copies leaves the parent's own pins intact."""
    drop_inherited()  # every lock descriptor of the cache: pins, and downloads in flight
    for storage in list(_LIVE):
        storage._init_process_state()


os.register_at_fork(after_in_child=_drop_inherited_pins)


class RemoteStorage(Storage):
    """The URLs of one fsspec protocol, read through a :class:`ShardCache`.

    Args:
        protocol: fsspec's protocol name (``"https"``, ``"s3"``, ...).
        storage_options: keyword arguments of the fsspec filesystem (``None``: its defaults and
            the driver's environment).
        cache_dir: the shard cache (default ``$GPUPIPE_CACHE_DIR/shards``).
        cache_size: its bound in bytes (default: see :class:`ShardCache`).
        max_inflation: the most a gzip shard (``.tar.gz``, ``.tgz``) may inflate to, times its
            compressed size (plus 1 MiB); past it the download stops and the shard cannot be read
            (``OSError``). Default 100; ``None``: no bound.
        retries: further tries of a failed request or download, with exponential backoff and
            jitter (``backoff`` seconds, doubling, at most 30 s).
    """

    remote = True

    def __init__(
        self,
        protocol: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
        cache_size: int | None = None,
        max_inflation: float | None = MAX_INFLATION,
        retries: int = 5,
        backoff: float = 0.5,
    ) -> None:
        self.protocol = protocol
        self.max_inflation = max_inflation
        self.storage_options = dict(storage_options or {})
        self.cache = ShardCache(cache_dir, cache_size)
        self.keep = KEEP
        self.retries, self.backoff = retries, backoff
        self._init_process_state()

    def _init_process_state(self) -> None:
        _LIVE.add(self)
        self._pid = os.getpid()
        self._fs: Any = None
        self._local = LocalStorage()
        self._pins: collections.OrderedDict[str, Entry] = collections.OrderedDict()  # url -> entry, LRU last
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # prefetch threads of this process
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._stopping = threading.Event()  # close(): prefetch threads and downloads stop
        self._fetching: dict[str, threading.Lock] = {}  # url -> the lock of its fetch, in this process
        self._failed: dict[str, tuple[float, str]] = {}  # url -> when and why its last fetch failed
        self._parts: dict[str, Span] = {}  # url -> the bytes this process reads of it (expect_parts)
        self._maps: dict[str, weakref.WeakSet[MappedFile]] = {}  # cached file -> its maps, retired when let go
        self._whole_only: set[str] = set()  # hosts that ignore range requests: their parts are fetched whole
        self._announced = False  # whether this process announced parts (expect_parts): it reads, its workers too

    def __getstate__(self) -> dict[str, Any]:
        # Every option travels; what this process made (``_init_process_state``: threads, locks,
        # connections, pins) does not. Options are public names, process state starts with "_".
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    def fs(self) -> Any:
        """The fsspec filesystem, made in this process (never a parent's connections)."""
        if self._fs is None or self._pid != os.getpid():
            if self._pid != os.getpid():
                self._init_process_state()
            self._fs = filesystem_for(self.protocol, self.storage_options)
        return self._fs

    def canonical(self, url: str) -> str:
        return canonical_url(url) if "://" in url else os.path.abspath(url)

    def stat(self, url: str, *, fresh: bool = False) -> Stat:
        """The object's size and version (``fresh``: asked of the server, not a listing fsspec
        cached)."""
        if fresh:
            with contextlib.suppress(Exception):
                self.fs().invalidate_cache(url)
        info = self._retry(url, "stat", lambda: self.fs().info(url))
        if info.get("size") is None:
            raise OSError(f"{redact(url)}: the server does not tell the size")
        version = next((str(info[k]) for k in _VERSION_FIELDS if info.get(k) not in (None, "")), "")
        return Stat(int(info["size"]), version.strip('"') or f"size-{info['size']}")

    def open(self, url: str) -> IO[bytes]:
        """The object itself, streamed (small files beside the shards: bad-sample lists)."""
        return self._retry(url, "open", lambda: self.fs().open(url, "rb"))

    def put(self, url: str, data: bytes) -> None:
        """Uploads a small file (one request: whole or not at all on object stores)."""
        self._retry(url, "upload", lambda: self.fs().pipe_file(url, data))

    def open_shard(self, url: str) -> IO[bytes]:
        """The cached copy, opened (downloaded first if needed) and not kept pinned: indexing a
        dataset larger than the cache goes through it shard by shard (the open file stays
        readable if the entry is evicted meanwhile)."""
        if self._pid != os.getpid():
            self._init_process_state()
        entry = self._pins.get(url)
        if entry is not None and entry.span is None:
            return open(entry.path, "rb")
        entry = self._fetch(url)
        try:
            return open(entry.path, "rb")
        finally:
            ShardCache.release(entry)

    def read(self, url: str, offset: int, size: int) -> bytes:
        return self._cached(url, (offset, offset + size), lambda path, at: self._local.read(path, offset - at, size))

    def read_into(self, url: str, offset: int, out: memoryview) -> int:
        need = (offset, offset + out.nbytes)
        return self._cached(url, need, lambda path, at: self._local.read_into(path, offset - at, out))

    def read_ranges_into(self, url: str, ranges: Sequence[tuple[int, int]], out: memoryview, at: Sequence[int]) -> int:
        if not len(ranges):
            return 0
        need = (min(o for o, _ in ranges), max(o + n for o, n in ranges))

        def read(path: str, start: int) -> int:
            shifted = [(o - start, n) for o, n in ranges] if start else ranges
            return self._local.read_ranges_into(path, shifted, out, at)

        return self._cached(url, need, read)

    def map(self, url: str) -> MappedFile | None:
        """The cached shard mapped; ``None`` (read it) where this process reads a part of it."""
        entry = self._pins.get(url)
        if (entry is None or entry.span is not None) and url in self._parts:
            return None
        path = self._entry(url, None, read=True).path
        mapped = self._local.map(path)
        if mapped is not None:
            with self._lock:
                pinned = any(e.path == path for e in self._pins.values())
                if pinned:
                    self._maps.setdefault(path, weakref.WeakSet()).add(mapped)
            if not pinned:  # let go meanwhile (by another thread): not to be read through a map
                mapped.drop()
                return None
        return mapped

    def touch(self, url: str) -> None:
        with self._lock:
            if url in self._pins:
                self._pins.move_to_end(url)  # recently used: unpinned last

    def expect_parts(self, parts: Mapping[str, tuple[int, int]]) -> None:
        checked = {url: (int(start), int(stop)) for url, (start, stop) in parts.items() if not compressed(url)}
        wrong = [(url, part) for url, part in checked.items() if not 0 <= part[0] < part[1]]
        if wrong:
            raise ValueError(f"expect_parts: {redact(wrong[0][0])}: {wrong[0][1]} is not [start, stop) bytes")
        if self._pid != os.getpid():
            self._init_process_state()
        self._parts = checked
        self._announced = True
        try:  # for this process's workers (torch backend), which read the samples
            self.cache.announce({self.canonical(url): part for url, part in checked.items()})
        except OSError as e:
            log.debug("gpupipe: cannot announce the parts of shards read (%s): workers download them whole", e)

    def local_path(self, url: str, *, remember_failure: bool = True) -> str:
        """The whole shard's file in the cache, downloaded first if needed, and pinned in this
        process (see :meth:`_entry`)."""
        return self._entry(url, None, remember_failure=remember_failure).path

    def _cached(self, url: str, need: Span, read: Callable[[str, int], T]) -> T:
        """``read(path, start)`` of a cached file holding the bytes ``need`` of the shard, which
        starts at byte ``start`` of the shard; again (fetched again) if the file went away."""
        entry = self._entry(url, need, read=True)
        try:
            return read(entry.path, entry.start)
        except FileNotFoundError:  # evicted between another thread's unpinning and this read
            self._drop_pin(url, entry)
            entry = self._entry(url, need)
            return read(entry.path, entry.start)

    def _entry(self, url: str, need: Span | None, *, remember_failure: bool = True, read: bool = False) -> Entry:
        """A cached file holding the bytes ``need`` (``None``: all) of the shard, downloaded first
        if needed — only the part :meth:`expect_parts` announced, where it holds ``need`` — and
        pinned in this process (its :attr:`keep` most recently used shards are). A fetch that
        fails after every try is remembered for ``FAILED_FOR_S`` (reads of that shard then fail at
        once), unless ``remember_failure`` is false (a prefetch: the read that needs the shard
        tries itself). ``read``: for a read, counted in this thread (``_counts``): served at
        once, or after waiting for the shard's download (here, by another thread, or by another
        process of the node)."""
        if self._pid != os.getpid():
            self._init_process_state()
        entry = self._pins.get(url)
        if entry is not None and covers(entry.span, need):
            with self._lock:
                if url in self._pins:
                    self._pins.move_to_end(url)  # recently used: unpinned last
            if read:
                count(waited_s=None)
            return entry  # pinned: still there
        started = time.perf_counter()
        with self._lock:
            fetching = self._fetching.setdefault(url, threading.Lock())
        blocked = fetching.locked()  # another thread of this process fetches it (for the counts only)
        with fetching:  # one thread of this process fetches a shard; the others wait for it
            entry = self._pins.get(url)
            if entry is not None and covers(entry.span, need):
                if read:  # a miss where this thread waited for another's download of it
                    count(waited_s=time.perf_counter() - started if blocked and entry.waited else None)
                return entry
            failed = self._failed.get(url)
            if failed is not None and time.monotonic() - failed[0] < FAILED_FOR_S:
                raise OSError(f"{failed[1]} (failed {time.monotonic() - failed[0]:.0f} s ago; not tried again yet)")
            part = self._parts.get(url)
            if part is None and need is not None and not self._announced:  # a worker: its parent's parts
                part = self.cache.announced(self.canonical(url), need, by=os.getppid())
            if part is None or not covers(part, need) or host(url) in self._whole_only or compressed(url):
                part = None
            try:
                entry = self._fetch(url, need=need, span=part)
            except OSError as e:  # after every try: every sample of the shard fails fast for a while
                if remember_failure:
                    self._failed[url] = (time.monotonic(), redact(str(e)))
                raise
            self._failed.pop(url, None)
            released = []
            with self._lock:
                old = self._pins.pop(url, None)  # a part that does not hold `need`
                if old is not None:
                    released.append(old)
                self._pins[url] = entry
                while len(self._pins) > self.keep:
                    released.append(self._pins.popitem(last=False)[1])
            for old in released:
                self._unpin(old)
            if read:
                count(waited_s=time.perf_counter() - started if entry.waited else None)
            return entry

    def _drop_pin(self, url: str, entry: Entry) -> None:
        with self._lock:
            if self._pins.get(url) is entry:
                del self._pins[url]
            else:
                return
        self._unpin(entry)

    def _fetch(self, url: str, *, need: Span | None = None, span: Span | None = None) -> Entry:
        """A cache entry of the shard at its current version holding ``need`` (``None``: all),
        pinned; downloaded first if needed: the part ``span`` (``None``: the whole shard).

        The shard's size and version are asked again once a download is complete: a shard
        replaced meanwhile is downloaded again, at its new version (at most :data:`CHANGES`
        times), so that no cache entry mixes the bytes of two versions (a part's range requests,
        or a whole download that the version behind the size changed under)."""
        for _ in range(CHANGES):
            stat = self.stat(url)

            def download(f: IO[bytes], part: Span | None, stat: Stat = stat) -> None:
                for attempt in range(self.retries + 1):
                    try:
                        self._download(url, f, stat.size, part)
                        break
                    except WrongSize as e:  # more or fewer bytes than the size asked before: changed since?
                        now = self.stat(url, fresh=True)
                        if now != stat:
                            raise _Changed(f"{redact(url)} changed during its download ({stat} -> {now})") from None
                        if attempt == self.retries or self._stopping.wait(min(30.0, self.backoff * 2**attempt)):
                            raise OSError(f"download {redact(url)}: {e} (its size, asked again, is still "
                                          f"{stat.size}; {attempt + 1} tries)") from None  # fmt: skip
                now = self.stat(url, fresh=True)
                if now != stat:
                    raise _Changed(f"{redact(url)} changed during its download ({stat} -> {now})")

            try:
                try:
                    return self.cache.fetch(self.canonical(url), stat, download, need=need, span=span,
                                            stopping=self._stopping)  # fmt: skip
                except NoRanges:
                    log.info("gpupipe: %s ignores range requests: shards are downloaded whole", redact(url))
                    self._whole_only.add(host(url))
                    return self.cache.fetch(self.canonical(url), stat, download, need=need, stopping=self._stopping)
            except _Changed as e:
                log.warning("gpupipe: %s; downloading it again", e)
        raise OSError(f"{redact(url)} changed during each of {CHANGES} downloads: it is being rewritten")

    def _unpin(self, entry: Entry) -> None:
        """Lets an entry go: its pin, and this process's descriptors of it (an evicted file kept
        open would hold its disk space)."""
        ShardCache.release(entry)
        self._local.forget(entry.path)
        with self._lock:
            maps = list(self._maps.pop(entry.path, ()))
        for mapped in maps:
            mapped.drop()  # its lease goes once the batches using it are done

    def prefetch(self, urls: Sequence[str], *, keep: int | None = None) -> None:
        """Queues ``urls`` for download into the cache in the background, in order, by
        ``PREFETCH_THREADS`` daemon threads (ended by :meth:`close`, or with the process), pinned;
        ``keep``: pin at least that many shards. A failed prefetch is left to the read that needs
        the shard (which tries again and reports)."""
        if self._pid != os.getpid():
            self._init_process_state()
        with self._lock:
            if keep is not None:
                self.keep = max(self.keep, keep)
            if not self._threads:
                self._stopping.clear()
                self._threads = [
                    threading.Thread(target=self._prefetch_loop, name="gpupipe-prefetch", daemon=True)
                    for _ in range(PREFETCH_THREADS)
                ]
                for thread in self._threads:
                    thread.start()
        for url in urls:
            self._queue.put(url)

    def stop_prefetch(self) -> None:
        """Drops the queued downloads not started (those running finish)."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()

    def _prefetch_loop(self) -> None:
        while not self._stopping.is_set():
            url = self._queue.get()
            if url is None or self._stopping.is_set():
                return
            try:
                self._entry(url, self._parts.get(url), remember_failure=False)
            except Exception as e:  # the read that needs it tries again and reports
                log.info("gpupipe: prefetching %s failed: %s", redact(url), redact(str(e)))

    def _download(self, url: str, out: IO[bytes], size: int, span: Span | None = None) -> None:
        """Writes the shard (decompressed where it is compressed) to ``out``, whole, or the bytes
        ``span`` of it (range requests), tried again until complete (:func:`_transfer.download`)."""
        stream = self.protocol in ("http", "https")
        self._retry(url, "download", lambda: download(self.fs(), url, out, size=size, span=span, stream=stream,
                                                       stopping=self._stopping,
                                                       max_inflation=self.max_inflation))  # fmt: skip

    def _retry(self, url: str, what: str, call: Callable[[], T]) -> T:
        return retry(url, what, call, retries=self.retries, backoff=self.backoff, stopping=self._stopping)

    def close(self) -> None:
        """Stops prefetching, unpins every shard and closes the cached files this process opened."""
        if self._pid != os.getpid():
            return
        self._stopping.set()  # a download in flight stops at its next chunk, a retry's wait at once
        self.stop_prefetch()
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join(timeout=30.0)
        with self._lock:
            pins, self._pins = list(self._pins.values()), collections.OrderedDict()
            maps, self._maps = [m for ms in self._maps.values() for m in ms], {}
        for entry in pins:
            ShardCache.release(entry)
        for mapped in maps:
            mapped.drop()
        self._local.close()
        if self._announced:
            self._announced = False
            with contextlib.suppress(OSError):
                self.cache.announce({})
