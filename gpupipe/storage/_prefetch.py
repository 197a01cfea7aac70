"""Shards downloaded ahead, by URL: :class:`ShardPrefetch` asks a remote storage for the shards
an epoch needs next, in the order it first needs them, before each batch (constant time, no I/O;
the storage downloads them in background threads into the node-local cache, ``_remote``).

What the URLs are, and how many each batch needs, comes from the epoch's plan, which this layer
does not know: ``gpupipe.plan._prefetch`` makes a :class:`ShardPrefetch` from a plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ._base import Storage

__all__ = ["ShardPrefetch"]


class ShardPrefetch:
    """One epoch's prefetching (see the module docstring).

    Args:
        storage: the remote storage.
        urls: the shards in the order the epoch first needs them.
        needed: int ``[num_batches]``, how many of ``urls`` batches ``0..b`` need.
        ahead: shards asked for beyond those.
    """

    def __init__(self, storage: Storage, urls: list[str], needed: np.ndarray, ahead: int) -> None:
        self.storage, self.urls, self.needed, self.ahead = storage, urls, needed, ahead
        self.sent = 0

    def advance(self, batch: int) -> None:
        """Batch ``batch`` (counted from the epoch's first yielded batch) is next."""
        if not len(self.needed):
            return
        target = min(len(self.urls), int(self.needed[min(batch, len(self.needed) - 1)]) + self.ahead)
        if target > self.sent:
            self.storage.prefetch(self.urls[self.sent : target])
            self.sent = target

    def close(self) -> None:
        """The epoch ended (or stopped): queued downloads not started are dropped."""
        self.storage.stop_prefetch()
