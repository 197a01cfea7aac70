"""Remote shards downloaded ahead of the plan, so that training does not wait on the network in
steady state, and a cache too small for what a node reads at once reported when a loader starts.

The loader knows each epoch's plan; :func:`prefetcher` turns it into the order in which the
rank first needs its shards and, per batch, how many of them it has needed so far. Before each
batch the loader calls :meth:`~ShardPrefetch.advance` (constant time, no I/O): the storage is asked
for the shards up to ``ahead`` beyond those, and downloads them in background threads into the
node-local cache (``storage._remote``). With ``shuffle=True`` a rank reads ``interleave`` shards at once and
moves to the next group when they run out: the default ``ahead`` is therefore ``interleave``, so the
next group is in the cache before it is needed.

A shard the plan splits between ranks (at most the two at the ends of a rank's part of the shard
order) is read partly by each: where the shard's index is known without reading it (cached, or
from the index files beside the shards) and the rank's part is at most 90% of the shard (a nearly
whole shard is downloaded whole: another rank of the node, or a later epoch, may read it all), the
storage is told (``Storage.expect_parts``) and downloads only that byte range.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from ..storage._base import compressed
from ..storage._prefetch import ShardPrefetch

if TYPE_CHECKING:
    from ..sources._index import Index

__all__ = ["prefetcher", "prepare_remote", "parts"]

log = logging.getLogger("gpupipe")


def prefetcher(index: Index, samples: np.ndarray, batch_size: int, ahead: int) -> ShardPrefetch | None:
    """A :class:`ShardPrefetch` for reading ``samples`` (global numbers, in order) in batches of
    ``batch_size``; ``None`` where the index's storage is local."""
    storage = getattr(index.reader, "storage", None)
    if storage is None or not storage.remote or not len(samples):
        return None
    shard_of = np.searchsorted(index.offsets, samples, side="right") - 1
    shards, first, counts = np.unique(shard_of, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    urls = [index.shards[int(s)].path for s in shards[order]]
    storage.expect_parts(parts(index, samples, shard_of, shards[counts < index.shard_sizes[shards]]))
    num_batches = -(-len(samples) // batch_size)
    needed = np.searchsorted(first[order], np.arange(1, num_batches + 1) * batch_size, side="left")
    return ShardPrefetch(storage, urls, needed, ahead)


PART_AT_MOST = 0.9  # a shard is downloaded whole unless the part a rank reads is at most this fraction of it


def parts(index: Index, samples: np.ndarray, shard_of: np.ndarray, partly: np.ndarray) -> dict[str, tuple[int, int]]:
    """``{url: (start, stop)}``: the bytes of each shard of ``partly`` (shard numbers) that
    ``samples`` (global numbers; ``shard_of``, their shards) need — their image and label
    members — where that is at most ``PART_AT_MOST`` of the shard and its index is known without
    reading it. An epoch's plan splits at most the shards at both ends of a rank's part of the
    shard order between ranks (and shards with samples left out as bad, read nearly whole)."""
    found: dict[str, tuple[int, int]] = {}
    for s in partly.tolist():
        shard = index.shards[s]
        if shard.detail_needs_data or not shard.nbytes or compressed(shard.path):
            continue
        detail = index.shard(s).detail()[1]
        rows = samples[shard_of == s] - index.offsets[s]
        ranges = [detail["image_range"][rows]]
        if "label_range" in detail:
            ranges.append(detail["label_range"][rows])
        members = np.concatenate(ranges)
        members = members[members[:, 1] >= 0]  # (unlabeled samples have no label range: -1)
        start, stop = int(members[:, 0].min()), int((members[:, 0] + members[:, 1]).max())
        if 0 < stop - start <= PART_AT_MOST * shard.nbytes:  # (0: empty members only, nothing to fetch)
            found[shard.path] = (start, stop)
    return found


def prepare_remote(index: Index, *, at_once: int, ahead: int, local_ranks: int) -> None:
    """For a remote index: every process of the loader keeps ``at_once + ahead + 1`` shards pinned
    in the cache (set before the runner starts its workers, which inherit it), and a warning is
    logged when the cache cannot hold what the ranks of the node keep at hand:
    ``local_ranks * (at_once + ahead)`` shards of the dataset's mean size."""
    storage = getattr(index.reader, "storage", None)
    cache = getattr(storage, "cache", None)
    if storage is None or not storage.remote or cache is None:
        return
    storage.keep = at_once + ahead + 1
    sizes = [s.nbytes for s in index.shards if s.nbytes]
    if not sizes:
        return
    shards = local_ranks * (min(at_once, len(sizes)) + ahead)
    need = int(shards * (sum(sizes) / len(sizes)))
    bound = cache.bound()
    if need > bound:
        from ..storage._cache import human_bytes

        log.warning(
            "gpupipe: the shard cache %s (%s) is smaller than what %d rank(s) of this node keep at hand: "
            "%d shards of %s (%d read at once and %d ahead, per rank) = %s. Shards will be downloaded again, "
            "or the cache will exceed its bound: give it cache_size >= %s, or lower interleave",
            cache.root, human_bytes(bound), local_ranks, shards, human_bytes(need / shards), at_once, ahead,
            human_bytes(need), human_bytes(need),
        )  # fmt: skip
