"""Local files opened for reading only where they are regular files.

A dataset tree may hold a FIFO, a device or a socket under an image's or a shard's name (a link to
``/dev/zero``, a named pipe left by a tool): opening a FIFO that has no writer blocks forever, and
reading a device may never end. Every local read in gpupipe opens through :func:`open_regular`,
which opens without blocking and refuses what is not a regular file, with an :class:`OSError`
(:class:`NotRegularFile`) that the source turns into the sample's or the shard's verdict.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["NotRegularFile", "open_regular", "regular_size"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip


class NotRegularFile(OSError):
    """``path`` is not a regular file (links followed): a directory, a FIFO, a device or a socket."""

    def __init__(self, path: str, mode: int) -> None:
        kind = next((name for test, name in _KINDS if test(mode)), f"of mode {stat.filemode(mode)}")
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", path)


def open_regular(path: str) -> int:
    """A read-only descriptor (close-on-exec) of ``path``, links followed; :class:`NotRegularFile`
    where it is not a regular file. Opened without blocking (a FIFO with no writer returns at
    once), checked with ``fstat``, then set to block again (which a regular file ignores anyway).
    A regular file under another process's write lease refuses such an open (``EAGAIN``) where a
    plain one waits for the lease to be broken: it is opened the plain way, as before."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK)
    except BlockingIOError:  # a write lease another process holds (Samba's oplocks, an NFS delegation)
        regular_size(path)  # a regular file, then, which a plain open waits for while the lease is broken
        fd = os.open(path, flags)
    except OSError as e:  # a socket refuses any open (ENXIO): still "not a regular file", as a FIFO is
        if e.errno == errno.ENXIO:
            regular_size(path)
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def regular_size(path: str) -> int:
    """``path``'s size in bytes (``stat``, links followed); :class:`NotRegularFile` where it is not
    a regular file (a device's or a FIFO's size says nothing of what a read would give)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(path, st.st_mode)
    return st.st_size
