"""Remote shards: any URL an fsspec protocol serves (``https://``, ``s3://`` through s3fs, ``gs://``
through gcsfs, ``memory://``, ...), read through a node-local cache of whole shards.

A remote shard is downloaded once into the cache (:class:`ShardCache`) and every read — the index
scan, the torch workers, DALI's reader threads (``mmap``) — is then a local read of that file, as
fast as local data. Downloads are written to a temporary name and renamed when complete and of the
expected size, so a partial download is never read; a file lock beside each cache entry makes the
processes of a node (one per GPU) download a shard once between them. An entry's name holds a hash
of the shard's canonical URL (without credentials or query string: a rotated presigned signature
keeps the cache) and its version (ETag, else modification time), so a shard changed remotely is
fetched again, and no URL or member name can choose a path outside the cache.

Options follow fsspec's conventions: ``storage_options`` are the filesystem's keyword arguments,
and the drivers read their usual environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, TypeVar

from .._errors import ConfigError, redact
from ._mapped import MappedFile
from ._storage import LocalStorage, Stat, Storage

__all__ = ["RemoteStorage", "ShardCache", "canonical_url", "check_driver", "fsspec_protocol", "shard_cache_dir"]

log = logging.getLogger("gpupipe")
T = TypeVar("T")

_VERSION_FIELDS = ("ETag", "etag", "Content-MD5", "md5Hash", "generation", "Last-Modified", "LastModified", "mtime",
                   "updated", "created")  # fmt: skip
CHUNK = 8 << 20  # bytes per read while downloading


def fsspec_protocol(scheme: str) -> bool:
    """Whether fsspec knows the protocol ``scheme`` (installed or not: :func:`filesystem_for`
    says what to install)."""
    try:
        import fsspec
    except ImportError:
        return False
    return scheme in fsspec.available_protocols()


def check_driver(protocol: str) -> None:
    """Imports the fsspec driver of ``protocol``, or raises a ConfigError saying what to install."""
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        raise ConfigError(f"{protocol}:// URLs need a package fsspec uses for them: {e}") from e


def canonical_url(url: str) -> str:
    """``url`` without credentials, query string or fragment: its identity for caches."""
    head, sep, rest = url.partition("://")
    if not sep:
        return url
    rest = rest.split("#", 1)[0].split("?", 1)[0]
    host, slash, path = rest.partition("/")
    return f"{head.lower()}://{host.rpartition('@')[2]}{slash}{path}"


def shard_cache_dir() -> str:
    """The default cache of remote shards: ``$GPUPIPE_CACHE_DIR/shards`` (default
    ``~/.cache/gpupipe/shards``)."""
    root = os.environ.get("GPUPIPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpupipe")
    return os.path.join(root, "shards")


class ShardCache:
    """Whole shards on local disk, one file per (canonical URL, version), shared by the processes
    of a node (see the module docstring)."""

    def __init__(self, root: str | None = None) -> None:
        self.root = os.path.abspath(root or shard_cache_dir())

    def path(self, canonical: str, stat: Stat) -> str:
        digest = hashlib.sha256(f"{canonical}|{stat.size}|{stat.version}".encode()).hexdigest()[:32]
        base = re.sub(r"[^A-Za-z0-9._-]", "_", canonical.rpartition("/")[2])[-80:].lstrip(".") or "shard"
        return os.path.join(self.root, f"{digest}-{base}")

    def fetch(self, canonical: str, stat: Stat, download: Callable[[IO[bytes]], None]) -> str:
        """The cached file of the shard ``canonical`` at ``stat``, downloaded first (by ``download``,
        which writes the shard to the file it is given) unless present. Concurrent callers, in any
        process of the node, wait for one download."""
        path = self.path(canonical, stat)
        if os.path.exists(path):
            _touch(path)
            return path
        import fcntl

        os.makedirs(self.root, exist_ok=True)
        with open(path + ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when this process dies
            if os.path.exists(path):  # another process downloaded it meanwhile
                _touch(path)
                return path
            part = f"{path}.part-{os.getpid()}-{threading.get_ident()}"
            try:
                with open(part, "wb") as f:
                    download(f)
                got = os.path.getsize(part)
                if got != stat.size:
                    raise OSError(f"downloaded {got} bytes of {canonical}, expected {stat.size}")
                os.replace(part, path)  # complete: only now visible
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
        return path


def _touch(path: str) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)  # the entry's last use, for eviction


class RemoteStorage(Storage):
    """The URLs of one fsspec protocol, read through a :class:`ShardCache`.

    Args:
        protocol: fsspec's protocol name (``"https"``, ``"s3"``, ...).
        storage_options: keyword arguments of the fsspec filesystem (``None``: its defaults and
            the driver's environment).
        cache_dir: the shard cache (default :func:`shard_cache_dir`).
        retries: further tries of a failed request or download, with exponential backoff and
            jitter (``backoff`` seconds, doubling, at most 30 s).
    """

    def __init__(
        self,
        protocol: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | None = None,
        retries: int = 5,
        backoff: float = 0.5,
    ) -> None:
        self.protocol = protocol
        self.storage_options = dict(storage_options or {})
        self.cache = ShardCache(cache_dir)
        self.retries, self.backoff = retries, backoff
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._fs: Any = None
        self._local = LocalStorage()
        self._paths: dict[str, str] = {}  # url -> its cached file, in this process
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        keep = ("protocol", "storage_options", "cache", "retries", "backoff")
        return {k: self.__dict__[k] for k in keep}

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
        return canonical_url(url)

    def stat(self, url: str) -> Stat:
        info = self._retry(url, "stat", lambda: self.fs().info(url))
        if info.get("size") is None:
            raise OSError(f"{redact(url)}: the server does not tell the size")
        version = next((str(info[k]) for k in _VERSION_FIELDS if info.get(k) not in (None, "")), "")
        return Stat(int(info["size"]), version.strip('"') or f"size-{info['size']}")

    def open(self, url: str) -> IO[bytes]:
        """The object itself, streamed (small files beside the shards: bad-sample lists)."""
        return self._retry(url, "open", lambda: self.fs().open(url, "rb"))

    def open_shard(self, url: str) -> IO[bytes]:
        return open(self.local_path(url), "rb")

    def read(self, url: str, offset: int, size: int) -> bytes:
        return self._local.read(self.local_path(url), offset, size)

    def read_into(self, url: str, offset: int, out: memoryview) -> int:
        return self._local.read_into(self.local_path(url), offset, out)

    def read_ranges_into(self, url: str, ranges: Sequence[tuple[int, int]], out: memoryview, at: Sequence[int]) -> int:
        return self._local.read_ranges_into(self.local_path(url), ranges, out, at)

    def map(self, url: str) -> MappedFile | None:
        return self._local.map(self.local_path(url))

    def local_path(self, url: str) -> str:
        """The shard's file in the cache, downloaded first if needed."""
        if self._pid != os.getpid():
            self._init_process_state()
        path = self._paths.get(url)
        if path is None or not os.path.exists(path):
            stat = self.stat(url)
            path = self.cache.fetch(self.canonical(url), stat, lambda f: self._download(url, f))
            with self._lock:
                self._paths[url] = path
        return path

    def _download(self, url: str, out: IO[bytes]) -> None:
        def whole() -> None:
            out.seek(0)
            out.truncate()
            started = time.perf_counter()
            # http(s): one streaming GET (no range requests: servers without them work too)
            options = {"block_size": 0} if self.protocol in ("http", "https") else {"block_size": CHUNK}
            with self.fs().open(url, "rb", **options) as src:
                shutil.copyfileobj(src, out, CHUNK)
            out.flush()
            log.debug("gpupipe: downloaded %s in %.2f s", redact(url), time.perf_counter() - started)

        self._retry(url, "download", whole)

    def _retry(self, url: str, what: str, call: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            try:
                return call()
            except (PermissionError, ConfigError):
                raise
            except Exception as e:  # network errors come as many types (aiohttp, botocore, OSError)
                if isinstance(e, FileNotFoundError) and _status(e) in (None, 404, 410) and not _unreachable(e):
                    raise
                if attempt == self.retries:
                    status = _status(e)
                    http = f" (HTTP {status})" if status is not None else ""
                    cause = redact(str(e)) or type(e).__name__
                    raise OSError(f"{what} {redact(url)} failed after {attempt + 1} tries{http}: {cause}") from e
                delay = min(30.0, self.backoff * 2**attempt) * random.uniform(0.5, 1.5)
                log.info("gpupipe: %s %s failed (%s); retrying in %.1f s", what, redact(url), redact(str(e)), delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._local.close()


def _causes(e: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return chain


def _status(e: BaseException) -> int | None:
    """The HTTP status behind an error, where one is known (fsspec's http filesystem reports a
    failed request as ``FileNotFoundError`` caused by the response's error)."""
    for cause in _causes(e):
        status = getattr(cause, "status", None) or getattr(cause, "code", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
    return None


def _unreachable(e: BaseException) -> bool:
    """Whether the error behind ``e`` is a connection that failed (not an answer)."""
    return any(isinstance(c, ConnectionError) or "Connect" in type(c).__name__ for c in _causes(e)[1:])


def filesystem_for(protocol: str, storage_options: Mapping[str, Any]) -> Any:
    """fsspec's filesystem for ``protocol``, or a ConfigError saying what to install."""
    try:
        import fsspec

        return fsspec.filesystem(protocol, **storage_options)
    except ImportError as e:
        raise ConfigError(f"{protocol}:// URLs need a package fsspec uses for them: {e}") from e
    except ValueError as e:
        raise ConfigError(f"fsspec has no filesystem for {protocol}:// URLs: {e}") from e
