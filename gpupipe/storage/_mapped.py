"""Memory-mapped shards that can never raise SIGBUS: maps guarded by read leases.

Reading a memory-mapped file past its end raises SIGBUS, which kills the process; a shard
truncated by another process while it is mapped would do that. Linux has one kernel mechanism
against it, the *read lease* (``fcntl(F_SETLEASE, F_RDLCK)``): while a process holds one on a
file, any other process that opens the file for writing or truncates it is blocked, the lease
holder is told (its lease reads back as "breaking"), and the writer goes on only once the holder
releases the lease — or after ``/proc/sys/fs/lease-break-time`` seconds (45 by default).

:class:`MappedFile` maps a whole file only with a read lease held, for as long as anything may
read the mapping:

- :meth:`MappedFile.acquire` is called before each batch's views are handed out: it counts a use
  and answers ``False`` once the lease is breaking (a writer waits), so that the caller falls
  back to ``pread`` (whose short reads are clean errors) for everything after;
- :meth:`MappedFile.valid` is called again right before views are handed to the reader (DALI),
  which reads them at once: views prepared ahead of time are never read after the kernel broke
  the lease on its own (a consumer paused for ``lease-break-time``);
- :meth:`MappedFile.give` ends a use; the lease is released (the writer unblocks) once the file
  is retired, or its lease is breaking, and no use is left. The DALI runner retires every map at
  the end of an epoch, checks the leases of its maps at every batch, and ends a batch's uses
  only once DALI has produced its iteration's outputs, so no mapped byte is read after the
  lease is gone. A writer waits until the loader's next batch (milliseconds while training
  runs; at most ``lease-break-time`` while the training loop is paused).

A lease needs: Linux, a file the process owns (or ``CAP_LEASE``), a file system that supports
leases (local ones; not NFS), no writer already holding the file open, and a lease-break signal
nobody else uses — the kernel sends the holder a signal when a lease breaks; ``SIGURG`` (default:
ignored) is used, and only while no handler is installed for it. Without any of these
:meth:`MappedFile.open` returns ``None`` and the caller reads with ``pread``: slower, never unsafe.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import signal
import threading

import numpy as np

from ._files import open_regular

__all__ = ["MappedFile"]

log = logging.getLogger("gpupipe")

_F_SETSIG = 10  # Linux's fcntl command: which signal announces a lease break (not in Python's fcntl)


def _signal_is_free() -> bool:
    """SIGURG announces our leases' breaks: usable only while nobody handles it (its default
    disposition ignores it). ``None`` means a handler installed outside Python: not free."""
    sigurg = getattr(signal, "SIGURG", None)
    return sigurg is not None and signal.getsignal(sigurg) in (signal.SIG_DFL, signal.SIG_IGN)


_NOTHING = np.zeros(0, np.uint8)


class MappedFile:
    """A whole file mapped read-only under a read lease (see the module's docstring).

    ``array`` is the mapping as ``uint8`` (length :attr:`size`, the file's size when mapped);
    slices of it are valid while a use is held (:meth:`acquire` … :meth:`give`).
    """

    def __init__(self, path: str, fd: int, size: int, region: mmap.mmap) -> None:
        self.path, self.size = path, size
        self.array = np.frombuffer(region, np.uint8)
        self._fd: int | None = fd
        self._pid = os.getpid()  # a forked child shares the lease: only this process releases it
        self._uses = 0
        self._retired = False
        self.dropped = False  # retired by its owner (drop): readers forget it
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str) -> MappedFile | None:
        """``path`` mapped under a read lease, or ``None`` where no lease can be had (then read it
        with ``pread``). Raises ``OSError`` only for a file that cannot be opened at all."""
        if not hasattr(os, "O_CLOEXEC") or not _signal_is_free():
            return None
        import fcntl

        fd = open_regular(path)
        try:
            fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as e:  # not the owner, NFS, leases disabled, a writer has it open: pread
            os.close(fd)
            log.debug("gpupipe: no read lease on %s (%s): reading it with pread", path, e)
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise OSError("empty file")
            region = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            _unlease(fd)
            log.debug("gpupipe: cannot map %s (%s): reading it with pread", path, e)
            return None
        return cls(path, fd, size, region)

    def acquire(self) -> bool:
        """Counts a use of the mapping and says whether it may be read: ``False`` (and no use
        counted) once retired or once the lease is breaking, for good."""
        with self._lock:
            if self._retired or not self._stands():
                return False
            self._uses += 1
            return True

    def give(self) -> None:
        """Ends a use; the last use of a retired mapping — or of one whose lease is breaking —
        releases the lease."""
        with self._lock:
            self._uses -= 1
            if self._uses == 0:
                if self._retired:
                    self._release()
                else:
                    self._stands()  # a breaking lease goes now

    def valid(self) -> bool:
        """Whether views of the mapping may still be handed to a reader now: the lease stands and
        no writer waits on it. A breaking lease retires the mapping (released once unused)."""
        with self._lock:
            return self._stands()

    def retire(self) -> None:
        """No new use; the lease goes as soon as no use is left (now, if none is)."""
        with self._lock:
            self._retire()

    def drop(self) -> None:
        """Retires the mapping for good, its owner (the storage) having let the file go: readers
        forget it (:attr:`dropped`) and map the file again if they read it again."""
        with self._lock:
            self.dropped = True
            self._retire()

    @property
    def leased(self) -> bool:
        """Whether the lease is still held (for tests and diagnostics)."""
        return self._fd is not None

    def _stands(self) -> bool:
        """Under the lock: whether the lease stands. A breaking one retires the mapping (its lease
        goes once no use is left): the one check behind acquire, give and valid."""
        if self._fd is None:
            return False
        if not _lease_held(self._fd):
            if not self._retired:
                log.info("gpupipe: %s is being written or truncated: reading it with pread from now on", self.path)
            self._retire()
            return False
        return True

    def _retire(self) -> None:
        self._retired = True
        if self._uses == 0:
            self._release()

    def _release(self) -> None:
        if self._fd is not None:
            if os.getpid() == self._pid:
                _unlease(self._fd)
            else:  # a forked child: closing its copy leaves the parent's lease alone
                os.close(self._fd)
        self._fd = None
        # The mapping itself is unmapped when the last view of `array` is collected (this object's
        # own reference goes now): nothing reads it any more, a truncated file's pages are never
        # touched again, and a deleted file's disk space is freed.
        self.array = _NOTHING

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self._release()


def _lease_held(fd: int) -> bool:
    """True while our read lease stands; a breaking lease reads back as ``F_UNLCK``."""
    import fcntl

    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK)
    except OSError:
        return False


def _unlease(fd: int) -> None:
    import fcntl

    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    os.close(fd)
