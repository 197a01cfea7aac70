"""How the reads of remote shards went, counted per thread: a read the node cache served at once
(``hits``: its shard pinned in the process or present in the cache), and a read that waited for
its shard's download (``misses``: by this thread, another thread of its process, or another
process of the node), with the seconds it waited.

Per thread, so that a runner's thread that reads a batch (a torch worker's, a DALI reader
thread) takes the counts of that batch alone, as a difference of two :func:`snapshot` calls.
Local storage counts nothing.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

__all__ = ["Counts", "count", "snapshot", "CACHE_HITS", "CACHE_MISSES", "WAIT_DOWNLOAD"]

# the names they take in a batch's times (RawBatch.times), beside the seconds per stage
CACHE_HITS, CACHE_MISSES, WAIT_DOWNLOAD = "cache_hits", "cache_misses", "wait_download"

_local = threading.local()


class Counts(NamedTuple):
    """A thread's reads of remote shards so far."""

    hits: int = 0
    misses: int = 0
    waited_s: float = 0.0

    def since(self, before: Counts) -> dict[str, float]:
        """The reads between ``before`` and these, by their names in a batch's times; empty
        where none was counted (local storage)."""
        hits, misses = self.hits - before.hits, self.misses - before.misses
        if not hits and not misses:
            return {}
        return {CACHE_HITS: float(hits), CACHE_MISSES: float(misses), WAIT_DOWNLOAD: self.waited_s - before.waited_s}


def count(*, waited_s: float | None) -> None:
    """One read of a remote shard in this thread: served at once (``waited_s`` ``None``), or
    after waiting ``waited_s`` seconds for its shard's download."""
    now = snapshot()
    if waited_s is None:
        _local.counts = now._replace(hits=now.hits + 1)
    else:
        _local.counts = now._replace(misses=now.misses + 1, waited_s=now.waited_s + waited_s)


def snapshot() -> Counts:
    """This thread's counts so far."""
    counts: Counts = getattr(_local, "counts", None) or Counts()
    return counts
