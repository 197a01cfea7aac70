"""The node-local cache of remote shards: whole shards on local disk, shared by the processes of
a node, within a size bound.

A download is written to a temporary name and renamed when complete and of the expected size, so
a partial download is never read; a download lock beside each entry makes the processes of a node
(one per GPU) download a shard once between them. An entry's name holds a hash of the shard's
canonical URL (without credentials or query string: a rotated presigned signature keeps the cache)
and its version (ETag, else modification time), so a shard changed remotely is fetched again, and
no URL or member name can choose a path outside the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import IO, NamedTuple

from ._storage import Stat

__all__ = ["ShardCache", "Entry", "shard_cache_dir", "human_bytes", "drop_inherited"]

log = logging.getLogger("gpupipe")


def shard_cache_dir() -> str:
    """The default cache of remote shards: ``$GPUPIPE_CACHE_DIR/shards`` (default
    ``~/.cache/gpupipe/shards``)."""
    root = os.environ.get("GPUPIPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpupipe")
    return os.path.join(root, "shards")


class Entry(NamedTuple):
    """A cached shard held by this process: its file, and the descriptor of its lock file on
    which this process holds a shared lock (no process evicts it meanwhile)."""

    path: str
    fd: int


class ShardCache:
    """Whole shards on local disk, one file per (canonical URL, version), shared by the processes
    of a node (see the module docstring), within ``max_bytes``.

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

    def _open_lock(self, path: str, kind: str) -> int:
        where = self._lock_path(path, kind)
        os.makedirs(os.path.dirname(where), exist_ok=True)
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _HELD.add(fd)
        return fd

    def path(self, canonical: str, stat: Stat) -> str:
        digest = hashlib.sha256(f"{canonical}|{stat.size}|{stat.version}".encode()).hexdigest()[:32]
        base = re.sub(r"[^A-Za-z0-9._-]", "_", canonical.rpartition("/")[2])[-80:].lstrip(".") or "shard"
        return os.path.join(self.root, f"{digest}-{base}")

    def fetch(self, canonical: str, stat: Stat, download: Callable[[IO[bytes]], None]) -> Entry:
        """The cached file of the shard ``canonical`` at ``stat``, pinned; downloaded first (by
        ``download``, which writes the whole shard to the file it is given, or raises) unless
        present. Concurrent
        callers, in any process of the node, wait for one download. The caller releases the
        entry (:meth:`release`)."""
        import fcntl

        path = self.path(canonical, stat)
        os.makedirs(self.root, exist_ok=True)
        pin = self._open_lock(path, "pin")
        try:
            # Pinned first, even before it exists: an evictor (the only one to lock it exclusively,
            # never waiting) cannot then delete it between the download and its use.
            fcntl.flock(pin, fcntl.LOCK_SH)  # released when closed, or when this process dies
            if not os.path.exists(path):
                mutex = self._open_lock(path, "dl")
                try:
                    fcntl.flock(mutex, fcntl.LOCK_EX)  # one downloader; the others wait for it here
                    if not os.path.exists(path):  # nobody downloaded it meanwhile
                        self._download(path, download)
                        self.evict(keep=path)
                finally:
                    _close(mutex)
            _touch(path)
            return Entry(path, pin)
        except BaseException:
            _close(pin)
            raise

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
        """Deletes the partial downloads of processes that died (killed mid-download)."""
        with contextlib.suppress(FileNotFoundError), os.scandir(os.path.join(self.root, ".partial")) as it:
            for e in it:
                pid = e.name.rsplit(".", 2)[-2] if e.name.count(".") >= 2 else ""
                if pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)

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

    def evict(self, *, keep: str | None = None) -> int:
        """Deletes least recently used entries that no process pins until the cache fits its
        bound; returns how many. ``keep`` is never deleted."""
        import fcntl

        self._clean_partial()
        entries = sorted(self._entries())
        total, bound, evicted = sum(size for _, size, _ in entries), self.bound(), 0
        for _, size, path in entries:
            if total <= bound:
                break
            if path == keep:
                continue
            fd = self._open_lock(path, "pin")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # pinned by some process
                _close(fd)
                continue
            try:
                os.unlink(path)
                total, evicted = total - size, evicted + 1
            except FileNotFoundError:
                pass
            finally:
                _close(fd)
        if total > bound and not self._warned:
            self._warned = True
            log.warning(
                "gpupipe: the shard cache %s holds %s of shards in use, over its bound of %s: "
                "give it more room (cache_size=) or read fewer shards at once (interleave=, fewer ranks per node)",
                self.root, human_bytes(total), human_bytes(bound),
            )  # fmt: skip
        return evicted


def human_bytes(n: float) -> str:
    """``1.5 GB``, ``340 MB``, ``12 kB``: decimal units, as disks are sold."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


_HELD: set[int] = set()  # lock descriptors this process holds (pins, a download's mutex)


def _close(fd: int) -> None:
    _HELD.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def drop_inherited() -> None:
    """In a forked child: closes the copies of the parent's lock descriptors. A ``flock`` belongs to
    the open file description, which the copies share: kept open, they would hold the parent's
    pins and download locks for the child's whole life (a shard never evictable; a download the
    child itself would wait for forever). The parent's own locks stay."""
    for fd in list(_HELD):
        _close(fd)


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
