"""Byte access to shards, behind one small interface, chosen by URL scheme.

A :class:`Storage` answers three questions about a URL: how big is it and which version is it
(:meth:`~Storage.stat`), what are the bytes of a range (:meth:`~Storage.read`), and give me a
seekable stream (:meth:`~Storage.open`). Sources use nothing else to reach their data, so a new
kind of storage (``https://``, ``s3://``) is one :class:`Storage` subclass and one entry in the
scheme table (``_schemes``: :func:`register_storage`).

Storages raise :class:`OSError` (``FileNotFoundError``, ...) and return short reads at the end of
a file as they are: the source that asked knows which shard and sample that was, and says so in
its own error.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import IO, Any

from ._files import open_regular, regular_size
from ._mapped import MappedFile

__all__ = [
    "Stat",
    "Storage",
    "LocalStorage",
    "compressed",
    "beside",
    "write_atomic",
]


@dataclasses.dataclass(frozen=True)
class Stat:
    """What a storage knows of one URL: its ``size`` in bytes and a ``version`` string that
    changes whenever the content does (a local file's modification time, inode and change time;
    an object's ETag)."""

    size: int
    version: str


class Storage(abc.ABC):
    """Byte access to the URLs of some schemes, for one index (one loader).

    Contract for implementations:

    - Thread-safe: reader threads call :meth:`read` at once.
    - Process-safe: the torch backend's worker processes get the instance by ``fork`` (inherited)
      or ``spawn`` (pickled). A storage must never use a file, socket or connection opened by
      another process: pickle without them (``__getstate__``), and after a fork reopen them
      (``LocalStorage`` compares ``os.getpid()`` with the pid that opened them).
    - :meth:`close` releases what this process holds (open files, connections), waiting for reads
      in flight; the storage opens them again on demand.
    """

    @abc.abstractmethod
    def canonical(self, url: str) -> str:
        """The URL's identity for caches: the same data always has the same canonical URL."""

    @abc.abstractmethod
    def stat(self, url: str) -> Stat:
        """Size and version of ``url``; raises OSError."""

    @abc.abstractmethod
    def read(self, url: str, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` (fewer past the end); raises OSError."""

    @abc.abstractmethod
    def open(self, url: str) -> IO[bytes]:
        """A seekable binary stream over ``url``; the caller closes it. Raises OSError."""

    def open_shard(self, url: str) -> IO[bytes]:
        """A seekable binary stream over the shard ``url``, for scanning its tar headers: by
        default :meth:`open`; a remote storage opens its cached copy instead."""
        return self.open(url)

    def read_into(self, url: str, offset: int, out: memoryview) -> int:
        """Reads ``len(out)`` bytes at ``offset`` into ``out``; returns how many were read (fewer
        past the end). The DALI backend reads each batch into a reused buffer this way; the
        default copies :meth:`read`'s bytes, a storage that can read in place overrides it."""
        data = self.read(url, offset, len(out))
        out[: len(data)] = data
        return len(data)

    def read_ranges_into(self, url: str, ranges: Sequence[tuple[int, int]], out: memoryview, at: Sequence[int]) -> int:
        """Reads each ``(offset, size)`` range of ``url`` into ``out[at[i] : at[i] + size]``, in
        order; returns how many ranges were read whole (fewer: the next one came back short).
        The DALI backend reads a batch's samples of one shard with one call."""
        for i, ((offset, size), start) in enumerate(zip(ranges, at, strict=True)):
            if self.read_into(url, offset, out[start : start + size]) != size:
                return i
        return len(ranges)

    def sizes(self, urls: Sequence[str]) -> list[int | OSError]:
        """Each of ``urls``' size in bytes, or the ``OSError`` that :meth:`stat` raised for it."""
        out: list[int | OSError] = []
        for url in urls:
            try:
                out.append(self.stat(url).size)
            except OSError as e:
                out.append(e)
        return out

    def read_files_into(self, urls: Sequence[str], out: memoryview, at: Sequence[int],
                        lengths: Sequence[int]) -> list[int | OSError]:  # fmt: skip
        """Reads the start of each file ``urls[i]`` into ``out[at[i] : at[i] + lengths[i]]``;
        returns how many bytes each gave (fewer than ``lengths[i]``: the file is that short), or
        the ``OSError`` its read raised. The DALI backend reads a batch of whole files (an
        ImageFolder's) into one buffer with one call; the default reads each with
        :meth:`read_into`."""
        got: list[int | OSError] = []
        for url, start, length in zip(urls, at, lengths, strict=True):
            try:
                got.append(self.read_into(url, 0, out[start : start + length]))
            except OSError as e:
                got.append(e)
        return got

    remote: bool = False  # whether reads go over a network (then prefetch() is worth calling)

    def put(self, url: str, data: bytes) -> None:
        """Writes a small file (an index file beside a shard) whole or not at all; raises OSError
        where the storage takes no writes."""
        raise OSError(f"{type(self).__name__} cannot write {url}")

    def prefetch(self, urls: Sequence[str], *, keep: int | None = None) -> None:  # noqa: B027 - a hint
        """A hint: ``urls`` are read next, in this order. A remote storage downloads them ahead
        (keeping at least ``keep`` shards at hand); local storages ignore it."""

    def expect_parts(self, parts: Mapping[str, tuple[int, int]]) -> None:  # noqa: B027 - a hint
        """A hint, until the next call: of each shard in ``parts``, this process reads only the
        bytes ``[start, stop)``. A remote storage that can download part of a shard then fetches
        only those (a byte range); local storages ignore it."""

    def touch(self, url: str) -> None:  # noqa: B027 - a hint
        """A hint: ``url`` is being read (through its :meth:`map`). A remote storage keeps the
        shards it holds at hand by their last use; local storages ignore it."""

    def stop_prefetch(self) -> None:  # noqa: B027 - a hint
        """Drops the queued :meth:`prefetch` work not started."""

    def map(self, url: str) -> MappedFile | None:
        """``url`` memory-mapped under a read lease (:class:`~gpupipe.storage._mapped.MappedFile`),
        or ``None`` where it cannot be (the default: read it with :meth:`read_ranges_into`)."""
        return None

    def close(self) -> None:  # noqa: B027 - storages without resources have nothing to do
        """Releases the storage's open files or connections."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Descriptors:
    """One thread's open files, ``path -> descriptor``. Closed when its thread ends (Python drops
    the thread's local storage) or when the storage is closed; the lock makes a ``close()`` from
    another thread wait for a read in flight, so a descriptor is never closed under a ``pread``
    (whose number could then be reused by another file)."""

    __slots__ = ("__weakref__", "fds", "lock")

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


class LocalStorage(Storage):
    """Local files (paths, ``file://`` URLs).

    Reads use ``pread`` on descriptors kept open per thread (at most :attr:`MAX_OPEN` each, so at
    least the loader's ``interleave``), so reader threads never share a file position. A thread's
    descriptors are closed when the thread ends, and every thread's by :meth:`close`. A forked
    child never uses its parent's descriptors: it opens its own.
    """

    MAX_OPEN = 128

    def __init__(self) -> None:
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._local = threading.local()
        self._lock = threading.Lock()  # guards _holders
        self._holders: weakref.WeakSet[_Descriptors] = weakref.WeakSet()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._init_process_state()

    @staticmethod
    def path(url: str) -> str:
        return url.removeprefix("file://")

    def canonical(self, url: str) -> str:
        return os.path.abspath(self.path(url))

    def stat(self, url: str) -> Stat:
        """The file's size; its version is its modification time, inode and change time: a file
        replaced by another (``cp -p``, ``rsync -a``, ``tar x`` restore the old ``mtime``) or
        rewritten and its ``mtime`` set back is another version (``utime`` sets the change time),
        so that no cached index outlives its shard."""
        st = os.stat(self.path(url))
        return Stat(st.st_size, f"{st.st_mtime_ns}-{st.st_ino}-{st.st_ctime_ns}")

    def open(self, url: str) -> IO[bytes]:
        """The file, read-only; ``NotRegularFile`` (an ``OSError``) for a FIFO, a device, a
        directory or a socket, which could block a reader or never end (``_files``)."""
        return os.fdopen(open_regular(self.path(url)), "rb")

    def read(self, url: str, offset: int, size: int) -> bytes:
        files = self._descriptors()
        with files.lock:
            return os.pread(self._fd(files, url), size, offset)

    def read_into(self, url: str, offset: int, out: memoryview) -> int:
        """``pread`` straight into ``out`` (no intermediate bytes); the GIL is released meanwhile."""
        files = self._descriptors()
        with files.lock:
            return os.preadv(self._fd(files, url), [out], offset)

    def read_ranges_into(self, url: str, ranges: Sequence[tuple[int, int]], out: memoryview, at: Sequence[int]) -> int:
        """One descriptor lookup, then one ``pread`` per range, straight into ``out``."""
        files = self._descriptors()
        preadv = os.preadv
        with files.lock:
            fd = self._fd(files, url)
            for i, ((offset, size), start) in enumerate(zip(ranges, at, strict=True)):
                if preadv(fd, [out[start : start + size]], offset) != size:
                    return i
        return len(ranges)

    def sizes(self, urls: Sequence[str]) -> list[int | OSError]:
        """One ``stat`` per file; ``NotRegularFile`` for one that is not a regular file."""
        out: list[int | OSError] = []
        path = self.path
        for url in urls:
            try:
                out.append(regular_size(path(url)))
            except OSError as e:
                out.append(e)
        return out

    def read_files_into(self, urls: Sequence[str], out: memoryview, at: Sequence[int],
                        lengths: Sequence[int]) -> list[int | OSError]:  # fmt: skip
        """An ``open``, one ``pread`` straight into ``out`` (the GIL released meanwhile) and a
        ``close`` per file: no descriptor is kept (the files of an ImageFolder are many, each
        read once an epoch)."""
        got: list[int | OSError] = []
        preadv, path = os.preadv, self.path
        for url, start, length in zip(urls, at, lengths, strict=True):
            try:
                fd = open_regular(path(url))
            except OSError as e:
                got.append(e)
                continue
            try:
                got.append(preadv(fd, [out[start : start + length]], 0))
            except OSError as e:
                got.append(e)
            finally:
                os.close(fd)
        return got

    def put(self, url: str, data: bytes) -> None:
        """Writes ``data`` to a temporary file beside ``url``, then renames it."""
        write_atomic(self.path(url), data)

    def map(self, url: str) -> MappedFile | None:
        """The file mapped under a read lease where Linux grants one (see ``_mapped``)."""
        return MappedFile.open(self.path(url))

    def _fd(self, files: _Descriptors, url: str) -> int:
        path = self.path(url)
        fd = files.fds.get(path)
        if fd is None:
            if len(files.fds) >= self.MAX_OPEN:
                for old in files.fds.values():
                    os.close(old)
                files.fds.clear()
            fd = files.fds[path] = open_regular(path)
        return fd

    def _descriptors(self) -> _Descriptors:
        if self._pid != os.getpid():  # a forked child: never share the parent's descriptors
            self._init_process_state()
        files: _Descriptors | None = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = _Descriptors()
            with self._lock:
                self._holders.add(files)
        return files

    def forget(self, url: str) -> None:
        """Closes this process's descriptors of ``url`` (every thread's; a read in flight first
        completes): a file deleted meanwhile frees its disk space."""
        path = self.path(url)
        with self._lock:
            holders = list(self._holders)
        for files in holders:
            with files.lock:
                fd = files.fds.pop(path, None)
                if fd is not None:
                    os.close(fd)

    def open_descriptors(self) -> int:
        """How many descriptors this process holds open, all threads together."""
        with self._lock:
            return sum(len(h.fds) for h in self._holders)

    def close(self) -> None:
        """Closes the descriptors this process opened (every thread's; a read in flight first
        completes). Files reopen on the next read."""
        if self._pid != os.getpid():
            return
        with self._lock:
            holders = list(self._holders)
        for files in holders:
            files.close()


def write_atomic(path: str, data: bytes) -> None:
    """Writes a local file whole or not at all: a temporary file beside it, then a rename (the
    temporary file is removed if anything fails). Raises OSError."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


COMPRESSED = (".tar.gz", ".tgz")


def compressed(url: str) -> bool:
    """Whether ``url`` names a gzip-compressed tar shard (``.tar.gz``, ``.tgz``; a query string
    after the name is ignored)."""
    return url.split("?", 1)[0].lower().endswith(COMPRESSED)


def beside(url: str, suffix: str) -> str:
    """The URL of a small file beside shard ``url``: ``suffix`` appended to its name, before a
    query string (``.../a.tar?X=1`` → ``.../a.tar<suffix>?X=1``)."""
    head, sep, query = url.partition("?") if "://" in url else (url, "", "")
    return head + suffix + sep + query
