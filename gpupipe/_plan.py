"""The epoch plan: which samples each rank yields in an epoch, in which order. One place for every
backend; a pure function of the shard sizes and ``(seed, epoch, rank, world_size)`` plus the
loader's settings, so every rank computes its own part without talking to the others.

Steps:

1. **Global order.** ``shuffle=False``: shard order, then member order. ``shuffle=True`` on tar
   shards: the shards are permuted (same permutation on every rank, from ``(seed, epoch)``). On
   random-access sources (ImageFolder): a full permutation of the samples.
2. **Rank split.** The global order is cut into ``world_size`` contiguous ranges whose lengths
   differ by at most one: rank ``r`` reads only its range, that is whole shards plus at most two
   partial ones (byte ranges of the shards at its boundaries).
3. **Sample mixing** (``shuffle=True`` on tar shards, per rank): the rank's shards are read
   ``interleave`` at a time, interleaved evenly (each still front to back), then samples are mixed
   within a window of ``buffer`` samples (each moves by less than ``buffer`` positions).
4. **Equal length.** Every rank yields the same number of batches, ``num_batches``:
   ``drop_last=False``: each rank has ``ceil(N / world_size)`` slots; a rank with one sample fewer
   repeats its first sample once as padding, marked ``valid=False``. ``drop_last=True``: each rank
   keeps the first ``batch_size * (N // (world_size * batch_size))`` samples of its range, so an
   epoch drops ``N % (world_size * batch_size)`` samples, fewer than ``world_size * batch_size``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["RankPlan", "rank_plan", "num_batches", "rank_range", "shard_permutation", "sample_seed"]


def _rng(seed: int, epoch: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, epoch, 0x6770, *more])


def shard_permutation(num_shards: int, *, seed: int, epoch: int) -> np.ndarray:
    """The order in which a shuffled epoch reads the shards (the same on every rank)."""
    return _rng(seed, epoch).permutation(num_shards)


def sample_seed(seed: int, epoch: int, sample: int) -> str:
    """The seed of one sample's augmentation (torch backend): the same sample in the same epoch
    always gets the same random parameters, whatever the worker count, rank or position."""
    return f"{seed}/{epoch}/{sample}"


def num_batches(num_samples: int, *, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches every rank yields per epoch."""
    if drop_last:
        return num_samples // (world_size * batch_size)
    return math.ceil(math.ceil(num_samples / world_size) / batch_size)


def rank_range(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank's part of the global order: the first ``N % world_size`` ranks
    get one sample more."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's epoch: ``samples[i]`` (global sample numbers, int64 ``[n]``) in the order they
    are yielded; ``valid[i]`` is False for padding. Batch ``b`` is ``samples[b*B:(b+1)*B]``."""

    samples: np.ndarray
    valid: np.ndarray
    batch_size: int
    num_batches: int

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= b < self.num_batches:
            raise IndexError(f"batch {b} of a {self.num_batches}-batch epoch")
        s = slice(b * self.batch_size, (b + 1) * self.batch_size)
        return self.samples[s], self.valid[s]


def _pieces(shard_sizes: np.ndarray, offsets: np.ndarray, order: np.ndarray, start: int, stop: int) -> list[np.ndarray]:
    """Global sample numbers of positions ``[start, stop)`` of the concatenation of the shards in
    ``order``, one array per (partial) shard; touches only the shards in the range."""
    sizes = shard_sizes[order]
    ends = np.cumsum(sizes)
    first = int(np.searchsorted(ends, start, side="right"))
    pieces = []
    for j in range(first, len(order)):
        begin = int(ends[j] - sizes[j])
        if begin >= stop:
            break
        lo, hi = max(start, begin) - begin, min(stop, int(ends[j])) - begin
        if hi > lo:
            pieces.append(np.arange(lo, hi, dtype=np.int64) + offsets[order[j]])
    return pieces


def _interleave(pieces: list[np.ndarray], interleave: int, rng: np.random.Generator) -> np.ndarray:
    """Reads pieces ``interleave`` at a time, merged evenly: sample ``i`` of a piece of length
    ``L`` is placed at fraction ``(i + u) / L`` of its group (``u`` uniform), so each piece is
    still read front to back."""
    if not pieces:
        return np.zeros(0, np.int64)
    out = []
    for g in range(0, len(pieces), interleave):
        group = pieces[g:g + interleave]
        samples = np.concatenate(group)
        lengths = np.array([len(p) for p in group])
        pos = np.concatenate([np.arange(n) for n in lengths]) + rng.uniform(0.0, 1.0, size=len(samples))
        out.append(samples[np.argsort(pos / np.repeat(lengths, lengths), kind="stable")])
    return np.concatenate(out)


def rank_plan(shard_sizes: np.ndarray, *, sequential: bool, shuffle: bool, seed: int, epoch: int, buffer: int,
              interleave: int, rank: int, world_size: int, batch_size: int, drop_last: bool) -> RankPlan:
    """The plan of ``rank`` for ``epoch`` (see the module docstring)."""
    shard_sizes = np.asarray(shard_sizes, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)
    total = int(offsets[-1])
    start, stop = rank_range(total, rank, world_size)
    if not shuffle:
        mine = np.arange(start, stop, dtype=np.int64)
    elif not sequential:
        mine = _rng(seed, epoch).permutation(total).astype(np.int64)[start:stop]
    else:
        pieces = _pieces(shard_sizes, offsets, shard_permutation(len(shard_sizes), seed=seed, epoch=epoch), start, stop)
        rng = _rng(seed, epoch, world_size, rank)
        mine = _interleave(pieces, interleave, rng)
        if buffer > 1 and len(mine) > 1:
            mine = mine[np.argsort(np.arange(len(mine)) + rng.uniform(0.0, buffer, size=len(mine)), kind="stable")]
    batches = num_batches(total, world_size=world_size, batch_size=batch_size, drop_last=drop_last)
    if drop_last:
        mine = mine[:batches * batch_size]
        return RankPlan(mine, np.ones(len(mine), bool), batch_size, batches)
    slots = math.ceil(total / world_size)
    pad = slots - len(mine)  # 0, or 1 on the ranks with the shorter range
    if pad:
        filler = mine[:1] if len(mine) else np.zeros(1, np.int64)  # fewer samples than ranks: sample 0
        mine = np.concatenate([mine, np.resize(filler, pad)])
    valid = np.arange(len(mine)) < len(mine) - pad
    return RankPlan(mine, valid, batch_size, batches)
