"""The epoch plan: which samples an epoch yields, in which order. One place for every backend.

Order is a pure function of the index's shard sizes and ``(shuffle, seed, epoch)``:

- ``shuffle=False``: shard order, then member order.
- ``shuffle=True`` on sequential sources (tar shards): two levels, as WebDataset — the shards are
  permuted, then samples are mixed within a window of ``buffer`` samples (each sample moves by
  about ``buffer`` positions at most), so readers still stream each shard front to back.
- ``shuffle=True`` on random-access sources (ImageFolder): a full permutation.
"""

from __future__ import annotations

import numpy as np

__all__ = ["epoch_order", "shard_permutation", "sample_seed"]


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, epoch, 0x6770])


def shard_permutation(num_shards: int, *, seed: int, epoch: int) -> np.ndarray:
    """The order in which shuffled epochs read the shards; every backend uses this one."""
    return _rng(seed, epoch).permutation(num_shards)


def epoch_order(shard_sizes: np.ndarray, *, sequential: bool, shuffle: bool, seed: int, epoch: int,
                buffer: int) -> np.ndarray:
    """Global sample numbers of one epoch, in the order they are yielded. int64 ``[N]``."""
    shard_sizes = np.asarray(shard_sizes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(shard_sizes)])
    total = int(offsets[-1])
    if not shuffle:
        return np.arange(total, dtype=np.int64)
    rng = _rng(seed, epoch)
    if not sequential:
        return rng.permutation(total).astype(np.int64)
    perm = rng.permutation(len(shard_sizes))  # == shard_permutation(...): the same first draw
    order = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in perm]) if len(perm) else offsets[:0]
    if buffer > 1 and total > 1:
        jitter = np.arange(total) + rng.uniform(0.0, buffer, size=total)
        order = order[np.argsort(jitter, kind="stable")]
    return order.astype(np.int64)


def sample_seed(seed: int, epoch: int, sample: int) -> str:
    """The seed of one sample's augmentation: the same sample in the same epoch always gets the
    same random parameters, whatever the worker count or its position in the epoch."""
    return f"{seed}/{epoch}/{sample}"
