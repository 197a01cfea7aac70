"""Transfers from remote storage: requests tried again with backoff and jitter, and downloads of
whole shards (decompressed where compressed) or of byte ranges of them, each complete or raising.

Network libraries raise many types (aiohttp's, botocore's, ``OSError``); :func:`retry` sorts them
into what is worth another try (a dropped connection, a 5xx) and what is not (404, 401/403, a
damaged gzip stream), and words the last error with the URL (redacted) and the HTTP status.
"""

from __future__ import annotations

import errno
import gzip
import logging
import random
import threading
import time
import zlib
from collections.abc import Callable
from typing import IO, Any, TypeVar

from ..core._errors import ConfigError, redact
from ._base import compressed

__all__ = ["CHUNK", "MAX_INFLATION", "MIN_RATE", "Closed", "NoRanges", "Inflated", "WrongSize", "retry", "download",
           "host"]  # fmt: skip

log = logging.getLogger("gpupipe")
T = TypeVar("T")
CHUNK = 8 << 20  # bytes per read while downloading
MAX_INFLATION = 100  # the most a gzip shard may inflate, times its compressed size (+ INFLATION_SLACK)
INFLATION_SLACK = 1 << 20  # what any gzip shard may inflate to, however small (a tar's headers are zeros)
# The slowest a download may run: at least MIN_RATE bytes in every RATE_WINDOW_S seconds. A server
# that trickles (a byte every few seconds) never trips a read's stall timeout, and would hold the
# shard's download, and every process of the node waiting for it, for hours.
MIN_RATE = 1 << 20
RATE_WINDOW_S = 60.0
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class Closed(Exception):
    """A download stopped by its storage's ``close()``."""


class NoRanges(Exception):
    """The server answers range requests with the whole object (or cannot seek at all)."""


class Inflated(OSError):
    """A gzip shard inflates past its bound (``max_inflation``): not tried again."""


class WrongSize(OSError):
    """The server sent more or fewer bytes than the shard's size: the shard changed since its size
    was asked, or the server lies. Not tried again by :func:`retry`: the caller asks the size
    again first (``RemoteStorage._fetch``)."""


class Slow(OSError):
    """A transfer that ran slower than :data:`MIN_RATE` over :data:`RATE_WINDOW_S`."""


def host(url: str) -> str:
    """``url``'s host (without credentials)."""
    return url.partition("://")[2].split("/", 1)[0].rpartition("@")[2]


def retry(url: str, what: str, call: Callable[[], T], *, retries: int, backoff: float, stopping: threading.Event) -> T:
    """``call()``, tried again ``retries`` more times after errors worth it, waiting ``backoff``
    seconds doubling (at most 30 s) with jitter; ``stopping`` ends the waits at once. Raises
    ``FileNotFoundError`` for a missing object, else ``OSError`` naming the URL and HTTP status;
    ``NoRanges`` goes through."""
    for attempt in range(retries + 1):
        try:
            return call()
        except PermissionError as e:
            raise PermissionError(f"{what} {redact(url)} was refused: {redact(str(e))}") from None
        except (ConfigError, NoRanges, Inflated, WrongSize):
            raise
        except Closed:
            raise OSError(f"{what} {redact(url)}: the storage was closed") from None
        except (gzip.BadGzipFile, zlib.error) as e:  # tried again, no different
            raise OSError(f"{what} {redact(url)}: a damaged gzip stream ({redact(str(e))})") from None
        except Exception as e:  # network errors come as many types (aiohttp, botocore, OSError)
            if isinstance(e, OSError) and e.errno in _DISK_FULL:  # this node's disk, not the network
                raise OSError(f"{what} {redact(url)}: the shard cache's disk is full ({e.strerror}): give the "
                              "cache a disk with room (GPUPIPE_CACHE_DIR) or a smaller bound (cache_size=)"
                              ) from None  # fmt: skip
            status = _status(e)
            if isinstance(e, FileNotFoundError) and status in (None, 404, 410) and not _transient(e):
                raise FileNotFoundError(f"{redact(url)} does not exist") from None
            if status in (401, 403):  # refused: asking again changes nothing
                raise OSError(f"{what} {redact(url)} was refused (HTTP {status}): {redact(str(e))}") from None
            if stopping.is_set():
                raise OSError(f"{what} {redact(url)}: the storage was closed") from None
            if attempt == retries:
                http = f" (HTTP {status})" if status is not None else ""
                cause = redact(_reason(e, url))
                # (not chained: the cause's text, and its traceback, hold the URL's credentials)
                raise OSError(f"{what} {redact(url)} failed after {attempt + 1} tries{http}: {cause}") from None
            delay = min(30.0, backoff * 2**attempt) * random.uniform(0.5, 1.5)
            log.info("gpupipe: %s %s failed (%s); retrying in %.1f s", what, redact(url), redact(str(e)), delay)
            if stopping.wait(delay):
                raise OSError(f"{what} {redact(url)}: the storage was closed") from None
    raise AssertionError("unreachable")


def download(
    fs: Any, url: str, out: IO[bytes], *, size: int, span: tuple[int, int] | None, stream: bool,
    stopping: threading.Event, max_inflation: float | None = MAX_INFLATION,
) -> None:  # fmt: skip
    """One try at writing the shard ``url`` of ``size`` bytes to ``out`` (from its start): whole
    (decompressed where compressed; ``stream``: one streaming request, for http(s) servers with
    or without ranges), or the bytes ``span`` of it by range requests. Raises unless complete:
    ``NoRanges`` where the server sends more than a range, ``Closed`` once ``stopping`` is set,
    ``Inflated`` as soon as a compressed shard has inflated past ``max_inflation`` times ``size``
    (plus ``INFLATION_SLACK``; ``None``: no bound) — its rest is never inflated."""
    out.seek(0)
    out.truncate()
    started = time.perf_counter()
    if span is not None:
        _part(fs, url, out, span, stopping)
    else:
        with fs.open(url, "rb", block_size=0 if stream else CHUNK) as src:
            if compressed(url):  # stored decompressed: tar members need random access
                bound = None if max_inflation is None else int(max_inflation * size) + INFLATION_SLACK
                with gzip.GzipFile(fileobj=src, mode="rb") as tar:
                    _copy(tar, out, stopping, bound)  # a cut stream raises EOFError: tried again
                    if bound is not None and out.tell() > bound:
                        raise Inflated(
                            f"{redact(url)} inflates past {max_inflation:g} times its {size} bytes (a decompression "
                            "bomb, or data that compresses unusually well: WebDataset(..., max_inflation=) raises "
                            "the bound)"
                        )
            else:  # never more than its size on disk: a server may send a body without end
                _copy(src, out, stopping, size)
                if out.tell() > size:
                    raise WrongSize(f"the server sent more than the {size} bytes the shard has (a body without end, "
                                    "or a shard rewritten meanwhile): the transfer was stopped there")  # fmt: skip
                if out.tell() != size:
                    raise WrongSize(f"the transfer ended after {out.tell()} of {size} bytes")
    out.flush()
    log.debug("gpupipe: downloaded %s%s in %.2f s", redact(url), f" {span}" if span else "",
              time.perf_counter() - started)  # fmt: skip


def _part(fs: Any, url: str, out: IO[bytes], span: tuple[int, int], stopping: threading.Event) -> None:
    start, stop = span
    if _http(fs):
        from fsspec.asyn import sync

        sync(fs.loop, _http_part, fs, url, out, span, stopping)
    else:
        # cache_type "none": each read asks for exactly its bytes (no read-ahead past `stop`)
        with fs.open(url, "rb", block_size=CHUNK, cache_type="none") as src:
            try:
                if not src.seekable():
                    raise NoRanges
                src.seek(start)
                while out.tell() < stop - start:
                    want = min(CHUNK, stop - start - out.tell())
                    chunk = src.read(want)
                    if len(chunk) > want:  # the whole object (or more than asked): no ranges here
                        raise NoRanges
                    if len(chunk) < want:  # the range lies inside the shard: a short answer is not it
                        raise OSError(f"bytes {start + out.tell()}-{start + out.tell() + want} were answered "
                                      f"with {len(chunk)} bytes")  # fmt: skip
                    if stopping.is_set():
                        raise Closed
                    out.write(chunk)
            except ValueError as e:  # "doesn't appear to support range requests", ...
                raise NoRanges from e
    if out.tell() != stop - start:
        raise OSError(f"the transfer of bytes {start}-{stop} ended after {out.tell()} bytes")


def _http(fs: Any) -> bool:
    """Whether ``fs`` is fsspec's http(s) filesystem (aiohttp underneath)."""
    return type(fs).__name__ == "HTTPFileSystem" and hasattr(fs, "set_session")


async def _http_part(fs: Any, url: str, out: IO[bytes], span: tuple[int, int], stopping: threading.Event) -> None:
    """The bytes ``span`` of ``url`` by one range request, checked as fsspec does not: the answer
    must be a ``206`` for the range asked (its ``Content-Range`` starts there), read a piece at a
    time and never past the range's end. fsspec's file took a ``200`` whose body is no longer than
    the range for the range itself (an error page, a rate limiter's, was cached as the shard's
    bytes) and read any ``206`` whole into memory before its size was looked at."""
    start, stop = span
    kwargs = dict(getattr(fs, "kwargs", None) or {})
    headers = dict(kwargs.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{stop - 1}"
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kwargs) as r:
        if r.status == 200:  # the whole object, or something else: no ranges here
            raise NoRanges
        if r.status in (404, 410):  # (gone since its size was asked: not tried again)
            raise FileNotFoundError(url)
        r.raise_for_status()
        answered = (r.headers.get("Content-Range") or "").removeprefix("bytes ").partition("-")[0]
        if r.status != 206 or (answered.isdigit() and int(answered) != start):
            raise OSError(f"bytes {start}-{stop} were answered with HTTP {r.status}, Content-Range "
                          f"{r.headers.get('Content-Range')!r}")  # fmt: skip
        rate, got = _Rate(), 0
        # (written on fsspec's event-loop thread: an executor for the writes started threads that
        # later forks inherited, and two fork-heavy tests failed in one full run out of two)
        while chunk := await r.content.read(min(CHUNK, stop - start + 1 - got)):
            if stopping.is_set():
                raise Closed
            got += len(chunk)
            if got > stop - start:  # more than asked: not a range
                raise NoRanges
            rate.add(len(chunk))
            out.write(chunk)


class _Rate:
    """Raises :class:`Slow` where fewer than :data:`MIN_RATE` bytes came in a window of
    :data:`RATE_WINDOW_S` seconds (checked as bytes come: a stall is the read timeout's)."""

    def __init__(self) -> None:
        self.since, self.bytes = time.monotonic(), 0

    def add(self, n: int) -> None:
        self.bytes += n
        now = time.monotonic()
        if now - self.since >= RATE_WINDOW_S:
            if self.bytes < MIN_RATE:
                rate = f"{self.bytes / (now - self.since):.0f} bytes/s"
                raise Slow(f"the transfer ran at {rate}, under the {MIN_RATE / RATE_WINDOW_S:.0f} bytes/s gpupipe "
                           "waits for (a server that trickles)")  # fmt: skip
            self.since, self.bytes = now, 0


def _copy(src: Any, out: IO[bytes], stopping: threading.Event, bound: int | None = None) -> None:
    """Copies ``src`` to ``out``; stops once past ``bound`` bytes, at most one byte past it (the
    caller refuses the copy); raises :class:`Slow` for a trickle."""
    rate = _Rate()
    while chunk := src.read(CHUNK if bound is None else min(CHUNK, bound + 1 - out.tell())):
        if stopping.is_set():
            raise Closed
        out.write(chunk)
        if bound is not None and out.tell() > bound:
            return
        rate.add(len(chunk))


def _causes(e: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return chain


def _reason(e: BaseException, url: str) -> str:
    """What went wrong, in words: ``e``'s text, else (fsspec's errors, whose text is the URL alone
    or nothing: a refused connection, a timeout) that of the first cause that says more; else
    ``e``'s type."""
    for cause in _causes(e):
        text = str(cause)
        if text and text != url:
            return text
    return type(e).__name__


def _status(e: BaseException) -> int | None:
    """The HTTP status behind an error, where one is known (fsspec's http filesystem reports a
    failed request as ``FileNotFoundError`` caused by the response's error). aiohttp's parser
    errors (a body cut short of its ``Content-Length``) carry a ``code`` of 400 that no server
    sent: not a status."""
    for cause in _causes(e):
        if any(t.__name__ == "HttpProcessingError" for t in type(cause).__mro__):
            continue
        status = getattr(cause, "status", None) or getattr(cause, "code", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
    return None


_TRANSIENT = ("Connect", "Disconnect", "Timeout", "Payload", "Redirect")  # aiohttp's names, and the like


def _transient(e: BaseException) -> bool:
    """Whether the error behind ``e`` is a request that failed (a connection refused or dropped, a
    stall, a cut body, a redirect loop), not an answer saying the object is missing: fsspec's
    http filesystem raises ``FileNotFoundError`` for any failure of the request that asks an
    object's size."""
    return any(
        isinstance(c, ConnectionError | TimeoutError) or any(word in type(c).__name__ for word in _TRANSIENT)
        for c in _causes(e)[1:]
    )
