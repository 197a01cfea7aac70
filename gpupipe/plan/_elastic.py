"""An interrupted epoch resumed on another world size or batch size (elastic): what is left of it
(:class:`Layout`, :func:`remaining`) and each new rank's plan of that (:func:`elastic_plan`). The
contract is in docs/guide/distributed.md; the plan itself is ``_plan``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._plan import PlanSpec, RankPlan, ceil_div, pad_to, per_rank, rank_plan, rank_range

__all__ = ["Layout", "remaining", "elastic_plan", "valid_count"]


# Elastic resume: an epoch interrupted at one world size, finished at another.
#
# The epoch's first layout is its plan at ``world_size`` ranks: rank 0's valid samples in the order
# it yields them, then rank 1's, and so on (positions ``0..T-1``). What is left after an
# interruption is a set of position ranges of that layout; the ranks of the new world split it in
# contiguous parts (``rank_range``), each reading its part in layout order, so every remaining
# sample is yielded exactly once, with the augmentation it had (draws are keyed by sample, not by
# rank). A second interruption leaves ranges of those ranges: still ranges of the first layout.


@dataclasses.dataclass(frozen=True)
class Layout:
    """What remains of an interrupted epoch: ``ranges`` (``[start, stop)`` positions, sorted, apart)
    of the epoch as first planned under ``first`` (a :class:`PlanSpec`: its world size and batch
    size). ``offset``: the batches of the epoch each rank had yielded before (a loader numbers the
    remaining ones on from there, as trainers count on from their checkpoint)."""

    first: PlanSpec
    ranges: tuple[tuple[int, int], ...]
    offset: int = 0

    @property
    def num_samples(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def as_dict(self) -> dict[str, Any]:
        return {"first": self.first.as_dict(), "ranges": [list(r) for r in self.ranges], "offset": self.offset}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Layout:
        """Raises ValueError unless the ranges lie apart, in order, within the first layout."""
        first = PlanSpec.checked(doc["first"])
        ranges = tuple((int(a), int(b)) for a, b in doc["ranges"])
        offset = doc.get("offset", 0)
        total = sum(valid_count(first, r) for r in range(first.world_size))
        stops = [0, *(b for _, b in ranges)]
        if any(not stops[i] <= a < b for i, (a, b) in enumerate(ranges)) or stops[-1] > total:
            raise ValueError(f"ranges not apart, in order, within the epoch's {total} samples: {list(ranges)[:4]}")
        if not (isinstance(offset, int) and offset >= 0):
            raise ValueError(f"offset must be a count, got {offset!r}")
        return cls(first, ranges, offset)


def valid_count(spec: PlanSpec, rank: int) -> int:
    """How many samples (padding excluded) ``rank`` yields in a whole epoch planned by ``spec``."""
    if spec.drop_last or spec.repeats > 1:
        return per_rank(spec)
    start, stop = rank_range(spec.num_samples, rank, spec.world_size)
    return stop - start


def _cut(ranges: tuple[tuple[int, int], ...], ends: np.ndarray, start: int, stop: int) -> list[tuple[int, int]]:
    """Positions ``[start, stop)`` of the concatenation of ``ranges`` (whose cumulative lengths are
    ``ends``), as ranges; touches only the ranges in it."""
    out = []
    j = int(np.searchsorted(ends, start, side="right"))
    while start < stop and j < len(ranges):
        a, b = ranges[j]
        at = int(ends[j]) - (b - a)  # position of a
        hi = min(stop, int(ends[j]))
        if hi > start:
            out.append((a + start - at, a + hi - at))
        start, j = hi, j + 1
    return out


def _merged(parts: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in parts:
        if b > a:
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
    return tuple(out)


def remaining(spec: PlanSpec, batches_yielded: int, layout: Layout | None = None) -> Layout:
    """What is left of an epoch once every rank of ``spec`` yielded ``batches_yielded`` batches of
    its plan: of the whole epoch (``layout`` ``None``) or of a resumed one (``layout``). Ranks
    yield the same number of batches (they step together under DDP), so one count says it."""
    if layout is None:
        done = batches_yielded * spec.batch_size
        counts = [valid_count(spec, r) for r in range(spec.world_size)]
        starts = np.cumsum([0, *counts[:-1]]).tolist()
        parts = [(s + min(done, n), s + n) for s, n in zip(starts, counts, strict=True)]
        return Layout(spec, _merged(parts), batches_yielded)
    done = (batches_yielded - layout.offset) * spec.batch_size  # (counted on from the layout's offset)
    ends = np.cumsum([b - a for a, b in layout.ranges])
    total = int(ends[-1]) if len(ends) else 0
    parts = []
    for rank in range(spec.world_size):
        start, stop = rank_range(total, rank, spec.world_size)
        parts += _cut(layout.ranges, ends, min(start + done, stop), stop)
    return Layout(layout.first, _merged(parts), batches_yielded)


def elastic_plan(
    shard_sizes: np.ndarray,
    spec: PlanSpec,
    layout: Layout,
    *,
    sequential: bool,
    seed: int,
    epoch: int,
    rank: int,
    excluded: np.ndarray | None = None,
) -> RankPlan:
    """The plan of ``rank`` (of ``spec.world_size``) for what ``layout`` leaves of ``epoch``: its
    contiguous part of the remaining positions, read from the first layout's rank plans (only
    those its part touches: about ``N / world_size`` samples). Every rank gets
    ``ceil(remaining / world_size)`` slots, padded as a whole epoch is (the first sample again,
    ``valid`` False); under ``drop_last`` the last batch is padded to a full one, so that no
    remaining sample is dropped and every batch has ``batch_size`` rows."""
    first = layout.first
    counts = np.array([valid_count(first, r) for r in range(first.world_size)], dtype=np.int64)
    rank_ends = np.cumsum(counts)
    ends = np.cumsum([b - a for a, b in layout.ranges])
    total = int(ends[-1]) if len(ends) else 0
    start, stop = rank_range(total, rank, spec.world_size)
    plans: dict[int, RankPlan] = {}
    pieces, drawn = [], []
    for a, b in _cut(layout.ranges, ends, start, stop):
        while a < b:
            r = int(np.searchsorted(rank_ends, a, side="right"))
            base = int(rank_ends[r] - counts[r])
            hi = min(b, int(rank_ends[r]))
            if r not in plans:
                plans[r] = rank_plan(shard_sizes, first, sequential=sequential, seed=seed, epoch=epoch, rank=r,
                                     excluded=excluded)  # fmt: skip
            pieces.append(plans[r].samples[a - base : hi - base])
            drawn.append(plans[r].drawn_all[a - base : hi - base])
            a = hi
    mine = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    batch_size = spec.batch_size
    slots = ceil_div(total, spec.world_size)
    batches = ceil_div(slots, batch_size)
    length = batches * batch_size if spec.drop_last else slots
    padded, valid = pad_to(mine, length, excluded)
    draws = None
    if first.repeats > 1:  # the copies' own draw numbers; the padding draws as its sample
        draws = np.concatenate([np.concatenate(drawn) if drawn else np.zeros(0, np.int64), padded[len(mine) :]])
    return RankPlan(padded, valid, batch_size, batches, seed, epoch, draws, batch_offset=layout.offset)
