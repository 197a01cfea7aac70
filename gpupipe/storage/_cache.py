"""The node-local cache of remote shards: shards (whole, or the byte range of a shard a rank
reads) on local disk, shared by the processes of a node, within a size bound.

A download is written to a temporary name and renamed when complete and of the expected size, so
a partial download is never read; a download lock beside each entry makes the processes of a node
(one per GPU) download a shard once between them. An entry's name holds a hash of the shard's
canonical URL (without credentials or query string: a rotated presigned signature keeps the cache)
and its version (ETag, else modification time), so a shard changed remotely is fetched again, and
no URL or member name can choose a path outside the cache.

Parts of shards (``<digest>+<start>-<stop>-<name>``) hold the bytes ``[start, stop)`` of the shard;
a process that reads only part of a shard announces it (``.parts/``), so that its worker
processes, which read the samples, download that part and not the whole shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import IO, NamedTuple

from ..core._paths import cache_root
from ._base import Stat

__all__ = ["ShardCache", "Entry", "Span", "covers", "shard_cache_dir", "human_bytes", "drop_inherited"]

log = logging.getLogger("gpupipe")
_ANNOUNCED = re.compile(r"(?P<digest>[0-9a-f]{32})\+(?P<start>[0-9]+)-(?P<stop>[0-9]+)\.(?P<pid>[0-9]+)")
_PART = re.compile(r"(?P<digest>[0-9a-f]{32})\+(?P<start>[0-9]+)-(?P<stop>[0-9]+)-(?P<base>.+)")
_LOCK_POLL_S = 0.1  # how often a wait for another process's download looks whether the storage was closed


def shard_cache_dir() -> str:
    """The default cache of remote shards: ``$GPUPIPE_CACHE_DIR/shards`` (default
    ``~/.cache/gpupipe/shards``)."""
    root = cache_root()
    return os.path.join(root, "shards")


Span = tuple[int, int]  # [start, stop) bytes of a shard


class Entry(NamedTuple):
    """A cached shard held by this process: its file, the descriptor of its lock file on which
    this process holds a shared lock (no process evicts it meanwhile), and, for a part of the
    shard, the bytes ``[start, stop)`` of the shard the file holds (byte ``start`` of the shard
    is byte 0 of the file); ``None`` for the whole shard."""

    path: str
    fd: int
    span: Span | None = None
    waited: bool = False  # not there when asked for: downloaded then, by this process or another

    @property
    def start(self) -> int:
        """Where the file starts in the shard."""
        return 0 if self.span is None else self.span[0]


def covers(span: Span | None, need: Span | None) -> bool:
    """Whether a file holding ``span`` (``None``: the whole shard) holds ``need`` (``None``: the
    whole shard)."""
    if span is None:
        return True
    return need is not None and span[0] <= need[0] and need[1] <= span[1]


class ShardCache:
    """Shards on local disk, one file per (canonical URL, version) — or per part of one — shared
    by the processes of a node (see the module docstring), within ``max_bytes``.

    Every shard a process uses is *pinned*: a shared ``flock`` on its lock file, held until the
    process lets it go (:meth:`release`). After each download the least recently used entries
    that no process pins are deleted until the cache fits ``max_bytes`` (pinned ones are never
    deleted: the bound is exceeded, with a warning, rather than a shard read from disappearing).

    Args:
        root: the folder (default :func:`shard_cache_dir`).
        max_bytes: the bound (default: 80% of what the cache could use when first asked, its
            entries plus the free space of its filesystem).
    """

    def __init__(self, root: str | None = None, max_bytes: int | None = None) -> None:
        self.root = os.path.abspath(root or shard_cache_dir())
        self.max_bytes = max_bytes
        self._warned = False

    def bound(self) -> int:
        """``max_bytes``, or the default computed now (once)."""
        if self.max_bytes is None:
            os.makedirs(self.root, exist_ok=True)
            st = os.statvfs(self.root)
            self.max_bytes = int(0.8 * (st.f_bavail * st.f_frsize + sum(size for _, size, _ in self._entries())))
        return self.max_bytes

    def _lock_path(self, path: str, kind: str) -> str:
        """The pin (``"pin"``) or download (``"dl"``) lock file of entry ``path``, kept apart from
        the entries (so that no shard name can pass for one)."""
        return os.path.join(self.root, ".locks", f"{os.path.basename(path)}.{kind}")

    def _lock(self, path: str, kind: str, how: int) -> int:
        """Opens the ``kind`` lock file of entry ``path`` and locks it (``flock`` ``how``; a
        non-blocking one may raise ``BlockingIOError``); returns its descriptor.

        Lock files are deleted by whoever holds them exclusively (an evictor with the entry, a
        downloader when done): a lock taken on a file deleted meanwhile is on a name nobody else
        uses, so it is dropped and the lock taken again on the file now there."""
        import fcntl

        where = self._lock_path(path, kind)
        while True:
            os.makedirs(os.path.dirname(where), exist_ok=True)
            fd = _open_held(where)
            try:
                fcntl.flock(fd, how)
                if os.stat(where).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            except BaseException:
                _close(fd)
                raise
            _close(fd)

    def _wait_lock(self, path: str, kind: str, stopping: threading.Event | None) -> int:
        """:meth:`_lock` exclusively, waiting as long as another holds it, until ``stopping`` is set
        (then ``OSError``): a wait for another process's download ends with this storage's
        ``close()``."""
        import fcntl

        if stopping is None:
            return self._lock(path, kind, fcntl.LOCK_EX)
        while True:
            try:
                return self._lock(path, kind, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if stopping.wait(_LOCK_POLL_S):
                    raise OSError("the storage was closed while waiting for another download of the shard") from None

    def _unlock_and_delete(self, fd: int, path: str, kind: str) -> None:
        """Deletes a lock file this process holds exclusively, then lets it go."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._lock_path(path, kind))
        _close(fd)

    def path(self, canonical: str, stat: Stat, span: Span | None = None) -> str:
        """The entry of the shard ``canonical`` at ``stat``: ``<digest>-<name>``, or for the part
        ``span`` of it, ``<digest>+<start>-<stop>-<name>``."""
        digest = hashlib.sha256(
            f"{canonical}|{stat.size}|{stat.version}".encode("utf-8", "surrogateescape")
        ).hexdigest()[:32]
        base = re.sub(r"[^A-Za-z0-9._-]", "_", canonical.rpartition("/")[2])[-80:].lstrip(".") or "shard"
        part = "-" if span is None else f"+{span[0]}-{span[1]}-"
        return os.path.join(self.root, f"{digest}{part}{base}")

    def fetch(
        self,
        canonical: str,
        stat: Stat,
        download: Callable[[IO[bytes], Span | None], None],
        *,
        need: Span | None = None,
        span: Span | None = None,
        stopping: threading.Event | None = None,
    ) -> Entry:
        """A cached file holding the bytes ``need`` (``None``: all) of the shard ``canonical`` at
        ``stat``, pinned: the whole shard, or a part of it that holds ``need``, when one is there;
        else downloaded first, by ``download(file, span)``, which writes the part ``span`` of the
        shard (``None``: the whole shard) to ``file``, whole, or raises. Concurrent callers, in any
        process of the node, wait for one download of a shard at a time (``stopping``, once set,
        ends the wait: ``OSError``). Room for the download is made first: least recently used
        entries no process pins are evicted until it fits the bound. The caller releases the entry
        (:meth:`release`)."""
        import fcntl

        if span is not None and not covers(span, need):
            raise ValueError(f"ShardCache.fetch: the part {span} does not hold the bytes {need}")
        whole = self.path(canonical, stat)
        os.makedirs(self.root, exist_ok=True)
        found = self._present(whole, need)
        if found is not None:
            return found
        path = whole if span is None else self.path(canonical, stat, span)
        # Pinned first, even before it exists: an evictor (the only one to lock it exclusively,
        # never waiting) cannot then delete it between the download and its use.
        pin = self._lock(path, "pin", fcntl.LOCK_SH)  # released when closed, or when this process dies
        try:
            mutex = self._wait_lock(whole, "dl", stopping)  # one download per shard; the others wait here
            try:
                found = self._present(whole, need)  # downloaded meanwhile, by another process
                if found is not None:
                    _close(pin)
                    return found._replace(waited=True)  # (this one waited for it)
                if not os.path.exists(path):
                    self.evict(room=stat.size if span is None else span[1] - span[0])  # (a full disk fails it)
                    self._download(path, lambda f: download(f, span))
                    self.evict(keep=path)
            finally:
                self._unlock_and_delete(mutex, whole, "dl")
            _touch(path)
            return Entry(path, pin, span, waited=True)
        except BaseException:
            _close(pin)
            raise

    def _present(self, whole: str, need: Span | None) -> Entry | None:
        """The entry of the whole shard, else (for ``need``) a part that holds it, pinned, where
        one is there; ``None`` otherwise."""
        import fcntl

        candidates: list[tuple[str, Span | None]] = [(whole, None)]
        if need is not None and not os.path.exists(whole):
            digest, _, base = os.path.basename(whole).partition("-")
            with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
                for e in it:
                    m = _PART.fullmatch(e.name)
                    if m and m["digest"] == digest and m["base"] == base:
                        span = (int(m["start"]), int(m["stop"]))
                        if covers(span, need):
                            candidates.append((e.path, span))
        for path, part in candidates:
            if not os.path.exists(path):
                continue
            pin = self._lock(path, "pin", fcntl.LOCK_SH)
            if os.path.exists(path):  # not evicted before the pin
                _touch(path)
                return Entry(path, pin, part)
            _close(pin)
        return None

    @staticmethod
    def release(entry: Entry) -> None:
        """Unpins an entry (it may be evicted from now on)."""
        _close(entry.fd)

    def _download(self, path: str, download: Callable[[IO[bytes]], None]) -> None:
        partial = os.path.join(self.root, ".partial")
        os.makedirs(partial, exist_ok=True)
        part = os.path.join(partial, f"{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}")
        try:
            with open(part, "wb") as f:
                download(f)  # raises unless the shard is complete
            os.replace(part, path)  # complete: only now visible
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)

    def _clean_partial(self) -> None:
        """Deletes the partial downloads and the announced parts of processes that died."""
        with contextlib.suppress(FileNotFoundError), os.scandir(os.path.join(self.root, ".partial")) as it:
            for e in it:
                pid = e.name.rsplit(".", 2)[-2] if e.name.count(".") >= 2 else ""
                if pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
        with contextlib.suppress(FileNotFoundError), os.scandir(os.path.join(self.root, ".parts")) as it:
            for e in it:
                m = _ANNOUNCED.fullmatch(e.name)
                if m is None or not _alive(int(m["pid"])):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)

    def announce(self, parts: Mapping[str, Span]) -> None:
        """Records that this process reads only ``parts`` (``{canonical URL: span}``) of those
        shards, replacing what it announced before; its child processes (:meth:`announced`) then
        download those parts rather than whole shards. Gone with the process (evict cleans up)."""
        where = os.path.join(self.root, ".parts")
        os.makedirs(where, exist_ok=True)
        mine = f".{os.getpid()}"
        with os.scandir(where) as it:
            old = [e.path for e in it if e.name.endswith(mine)]
        for path in old:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for canonical, (start, stop) in parts.items():
            open(os.path.join(where, f"{_url_digest(canonical)}+{start}-{stop}{mine}"), "w").close()

    def announced(self, canonical: str, need: Span, *, by: int) -> Span | None:
        """The smallest part of the shard ``canonical`` that process ``by`` announced and that holds
        ``need``; ``None`` if none."""
        digest, best = _url_digest(canonical), None
        with contextlib.suppress(FileNotFoundError), os.scandir(os.path.join(self.root, ".parts")) as it:
            for e in it:
                m = _ANNOUNCED.fullmatch(e.name)
                if m and m["digest"] == digest and int(m["pid"]) == by:
                    span = (int(m["start"]), int(m["stop"]))
                    if covers(span, need) and (best is None or span[1] - span[0] < best[1] - best[0]):
                        best = span
        return best

    def _clean_locks(self, entries: set[str]) -> None:
        """Deletes the lock files of entries that are gone (evicted by an older gpupipe, deleted by
        hand, a download that failed), where nobody holds them."""
        import fcntl

        names: list[str] = []  # (none: no lock taken yet)
        with contextlib.suppress(FileNotFoundError), os.scandir(os.path.join(self.root, ".locks")) as it:
            names = [e.name for e in it]
        for name in names:
            entry, dot, kind = name.rpartition(".")
            if not dot or kind not in ("pin", "dl") or entry in entries:
                continue
            path = os.path.join(self.root, entry)
            try:
                fd = self._lock(path, kind, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # in use: a download, or a pin taken before its download
                continue
            if os.path.exists(path):  # downloaded meanwhile: its pin lock stays
                _close(fd)
            else:
                self._unlock_and_delete(fd, path, kind)

    def _entries(self) -> list[tuple[float, int, str]]:
        """``(last use, size, path)`` of every complete entry."""
        found = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root) as it:
            for e in it:
                if e.name.startswith("."):  # .locks/, .partial/: no entry's name starts with a dot
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    found.append((st.st_mtime, st.st_size, e.path))
        return found

    def usage(self) -> int:
        """Bytes of the complete entries."""
        return sum(size for _, size, _ in self._entries())

    def evict(self, *, keep: str | None = None, room: int = 0) -> int:
        """Deletes least recently used entries that no process pins until the cache fits its
        bound, with ``room`` bytes to spare (a download about to start); returns how many.
        ``keep`` is never deleted."""
        import fcntl

        self._clean_partial()
        entries = sorted(self._entries())
        self._clean_locks({os.path.basename(path) for _, _, path in entries})
        total, bound, evicted = sum(size for _, size, _ in entries), self.bound() - room, 0
        for _, size, path in entries:
            if total <= bound:
                break
            if path == keep:
                continue
            try:
                fd = self._lock(path, "pin", fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # pinned by some process
                continue
            try:
                os.unlink(path)
                total, evicted = total - size, evicted + 1
            except FileNotFoundError:
                pass
            finally:
                self._unlock_and_delete(fd, path, "pin")
        if total > bound and not room and not self._warned:
            self._warned = True
            log.warning(
                "gpupipe: the shard cache %s holds %s of shards in use, over its bound of %s: "
                "give it more room (cache_size=) or read fewer shards at once (interleave=, fewer ranks per node)",
                self.root, human_bytes(total), human_bytes(bound),
            )  # fmt: skip
        return evicted


def _url_digest(canonical: str) -> str:
    return hashlib.sha256(canonical.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def human_bytes(n: float) -> str:
    """``1.5 GB``, ``340 MB``, ``12 kB``: decimal units, as disks are sold."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


# lock descriptors this process holds (pins, a download's mutex), each with its file's identity
_HELD: dict[int, tuple[int, int]] = {}
_OPENING = threading.Lock()  # held from a lock file's open to its entry in _HELD: a fork waits for it


def _open_held(where: str) -> int:
    """Opens a lock file and records its descriptor in ``_HELD`` as one step for ``fork``: a thread
    that forks while another is inside ``os.open`` (which releases the GIL) would otherwise give
    the child a copy that ``drop_inherited`` does not know of — and the child would hold that lock
    for its whole life."""
    with _OPENING:
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        _HELD[fd] = (st.st_dev, st.st_ino)
    return fd


os.register_at_fork(before=_OPENING.acquire, after_in_parent=_OPENING.release, after_in_child=_OPENING.release)


def _close(fd: int) -> None:
    _HELD.pop(fd, None)
    with contextlib.suppress(OSError):
        os.close(fd)


def drop_inherited() -> None:
    """In a forked child: closes the copies of the parent's lock descriptors. A ``flock`` belongs to
    the open file description, which the copies share: kept open, they would hold the parent's
    pins and download locks for the child's whole life (a shard never evictable; a download the
    child itself would wait for forever). The parent's own locks stay.

    A number whose file is no longer the lock file opened under it (closed by a path that did not
    go through ``_close``, its number reused: a DataLoader's queue) is forgotten, not closed."""
    for fd, identity in list(_HELD.items()):
        try:
            st = os.fstat(fd)
        except OSError:
            _HELD.pop(fd, None)
            continue
        if (st.st_dev, st.st_ino) == identity:
            _close(fd)
        else:
            _HELD.pop(fd, None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _touch(path: str) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)  # the entry's last use, for eviction
