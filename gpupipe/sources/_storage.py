"""Byte access to shards, behind one small interface, chosen by URL scheme.

A :class:`Storage` answers three questions about a URL: how big is it and which version is it
(:meth:`~Storage.stat`), what are the bytes of a range (:meth:`~Storage.read`), and give me a
seekable stream (:meth:`~Storage.open`). Sources use nothing else to reach their data, so a new
kind of storage (``https://``, ``s3://``) is one :class:`Storage` subclass and one entry in the
scheme table (:func:`register_storage`).

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
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from .._errors import ConfigError, redact
from ._mapped import MappedFile

__all__ = [
    "Stat",
    "Storage",
    "LocalStorage",
    "register_storage",
    "scheme_of",
    "storage_for",
    "expand_urls",
    "compressed",
    "beside",
    "write_atomic",
]


@dataclasses.dataclass(frozen=True)
class Stat:
    """What a storage knows of one URL: its ``size`` in bytes and a ``version`` string that
    changes whenever the content does (a local file's modification time; an object's ETag)."""

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
        """``url`` memory-mapped under a read lease (:class:`~gpupipe.sources._mapped.MappedFile`),
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
        st = os.stat(self.path(url))
        return Stat(st.st_size, str(st.st_mtime_ns))

    def open(self, url: str) -> IO[bytes]:
        return open(self.path(url), "rb")

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
            fd = files.fds[path] = os.open(path, os.O_RDONLY)
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


_SCHEMES: dict[str, Callable[[], Storage]] = {"": LocalStorage, "file": LocalStorage}


def register_storage(scheme: str, factory: Callable[[], Storage], *, replace: bool = False) -> None:
    """Serves URLs ``scheme://...`` with storages made by ``factory``."""
    if scheme in _SCHEMES and not replace:
        raise ConfigError(f"register_storage: scheme {scheme!r} is already served; pass replace=True to replace it")
    _SCHEMES[scheme] = factory


def scheme_of(url: str) -> str:
    """``"s3"`` for ``"s3://bucket/a.tar"``, ``""`` for a local path."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep and head.isidentifier() else ""


def storage_for(
    urls: Sequence[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_size: int | None = None,
) -> Storage:
    """A new storage for ``urls``, which must share one scheme: a registered one (local paths,
    ``file://``), else any fsspec protocol (``https``, ``s3``, ``gs``, ``memory``, ...) read
    through the node-local shard cache (``sources._remote``) with fsspec's ``storage_options``."""
    schemes = sorted({scheme_of(u) for u in urls})
    if len(schemes) > 1:
        raise ConfigError(f"one source cannot mix URL schemes, got {schemes}")
    scheme = schemes[0] if schemes else ""
    if scheme in ("", "file") and any(compressed(u) for u in urls):
        from ._remote import RemoteStorage

        # compressed local shards: decompressed once into the shard cache, read from there
        return RemoteStorage("file", cache_dir=cache_dir, cache_size=cache_size)
    if scheme in _SCHEMES:
        if storage_options:
            raise ConfigError(f"storage_options apply to remote URLs only, not to {scheme or 'local'} paths")
        return _SCHEMES[scheme]()
    from ._remote import RemoteStorage, fsspec_protocol

    if not fsspec_protocol(scheme):
        raise ConfigError(_unserved(scheme))
    return RemoteStorage(scheme, storage_options=storage_options, cache_dir=cache_dir, cache_size=cache_size)


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


def _served(scheme: str) -> bool:
    """Whether a storage serves ``scheme``; a ConfigError naming the package to install where
    fsspec knows the protocol but its driver is missing (``s3fs`` for ``s3://``)."""
    from ._remote import check_driver, fsspec_protocol

    if scheme in _SCHEMES:
        return True
    if not fsspec_protocol(scheme):
        return False
    check_driver(scheme)
    return True


def _unserved(scheme: str) -> str:
    served = ", ".join(f"{s}://" for s in _SCHEMES if s)
    return (
        f"no storage serves {scheme}:// URLs (served: local paths, {served}, and the protocols fsspec knows: "
        "https://, s3:// with s3fs, gs:// with gcsfs, ...)"
    )


def expand_urls(urls: str | os.PathLike[str] | Sequence[str], *, owner: str = "WebDataset") -> list[str]:
    """Brace-expands a pattern (several braces allowed) or each entry of a list of patterns, checks
    that a storage serves the URLs' scheme, and turns ``file://`` URLs into paths."""
    import braceexpand

    if isinstance(urls, (str, os.PathLike)):
        urls = [urls]  # type: ignore[list-item]
    out: list[str] = []
    for u in urls:
        u = os.fspath(u)
        if u.startswith("pipe:"):
            raise ConfigError(
                f"{owner}: 'pipe:' URLs are not supported: gpupipe never runs a shell command from a URL "
                f"({redact(repr(u))})"
            )
        if not _served(scheme_of(u)):
            raise ConfigError(f"{owner}: {_unserved(scheme_of(u))}: {redact(repr(u))}")
        out.extend(p.removeprefix("file://") for p in braceexpand.braceexpand(u))
    if not out:
        raise ConfigError(f"{owner}: no shard given")
    return out
