"""A probe of the shard cache's lock files, for the tests of what a forked child keeps."""

from __future__ import annotations

from gpupipe.storage._cache import ShardCache


def lock_is_free(cache: ShardCache, path: str, kind: str = "dl") -> bool:
    """Whether the ``kind`` lock of entry ``path`` can be taken exclusively now, without waiting
    (a new open file description: a lock held through any other one, in this process or another,
    makes it busy); if it could, it is let go at once."""
    import fcntl

    from gpupipe.storage import _cache

    try:
        fd = cache._lock(path, kind, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    _cache._close(fd)
    return True
