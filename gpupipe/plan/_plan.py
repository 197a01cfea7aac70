"""The epoch plan: which samples each rank yields in an epoch, in which order, for every backend.

The contract — global order, rank split, sample mixing, equal length on every rank, and the
worked example (10 samples, 3 ranks, batch 2) — is written once, in docs/guide/distributed.md
(pinned by ``tests/test_plan.py::TestWorkedExample``). This
module implements it as a pure function of the shard sizes, a :class:`PlanSpec` and ``(seed,
epoch, rank)``, so that every rank computes its own part without talking to the others.

Random streams: the shard permutation and the ImageFolder permutation come from ``(seed,
epoch)`` (the same on every rank); the interleave offsets and the mixing window from ``(seed,
epoch, world_size, rank)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core._validate import is_int

__all__ = [
    "PlanSpec",
    "RankPlan",
    "rank_plan",
    "num_batches",
    "rank_range",
    "shard_permutation",
    "mask_digest",
    "unexcluded",
    "good_sizes",
    "repeated_plan",
    "per_rank",
    "pad_to",
    "first_good",
]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` of ints, exact at any size (a float's is not past 2**53)."""
    return -(-a // b)


def _rng(seed: int, epoch: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, epoch, 0x6770, *more])


def shard_permutation(num_shards: int, *, seed: int, epoch: int) -> np.ndarray:
    """The order in which a shuffled epoch reads the shards (the same on every rank)."""
    return _rng(seed, epoch).permutation(num_shards)


def num_batches(num_samples: int, *, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches every rank yields per epoch."""
    if drop_last:
        return num_samples // (world_size * batch_size)
    return ceil_div(ceil_div(num_samples, world_size), batch_size)


def rank_range(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank's part of the global order: the first ``N % world_size`` ranks
    get one sample more."""
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


MAX_WORLD_SIZE = 1 << 20  # the most ranks a saved state may name (an elastic resume walks them all)
_COUNTS = {"num_samples": 0, "world_size": 1, "batch_size": 1, "shuffle_buffer": 0, "interleave": 1, "repeats": 1}


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """Everything a rank's epoch plan depends on besides ``(seed, epoch, rank)``: the dataset's
    size and the loader's settings. Ranks of one job must agree on it (checked when
    ``torch.distributed`` is initialized), and a saved loader state resumes only under an equal
    one.

    ``num_samples`` counts the samples the plan draws from: the index's, less those ``excluded``
    (known bad); ``mask`` is a digest of the excluded sample numbers (``""``: none), so that ranks
    with different bad-sample lists, or a state saved under another list, are told apart.
    ``mix`` is a digest of a :class:`~gpupipe.Mix`'s per-epoch counts (``""``: no mix); its
    epochs then draw ``num_samples`` entries of those counts. ``repeats``: repeated augmentation
    (:func:`repeated_plan`).
    """

    num_samples: int
    world_size: int
    batch_size: int
    drop_last: bool
    shuffle: bool
    shuffle_buffer: int
    interleave: int
    mask: str = ""
    mix: str = ""
    repeats: int = 1

    @property
    def num_batches(self) -> int:
        """Batches every rank yields per epoch."""
        return num_batches(
            self.num_samples, world_size=self.world_size, batch_size=self.batch_size, drop_last=self.drop_last
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def checked(cls, doc: Any) -> PlanSpec:
        """A spec from a saved state's dict, checked (a state may come from anywhere): counts
        are ints in range, flags bools, digests strings. Raises ``ValueError`` or ``TypeError``."""
        if not isinstance(doc, Mapping):
            raise TypeError("a plan must be a mapping")
        spec = cls(**doc)
        for name, low in _COUNTS.items():
            value = getattr(spec, name)
            if not (is_int(value) and value >= low):
                raise ValueError(f"{name}={value!r} is not a count of at least {low}")
        if spec.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"world_size={spec.world_size} is more than {MAX_WORLD_SIZE} ranks")
        if not (isinstance(spec.drop_last, bool) and isinstance(spec.shuffle, bool)):
            raise ValueError("drop_last and shuffle must be booleans")
        if not (isinstance(spec.mask, str) and isinstance(spec.mix, str)):
            raise ValueError("mask and mix must be digests (strings)")
        return spec

    def _others(self, other: Mapping[str, Any]) -> dict[str, Any]:
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.default is not dataclasses.MISSING}
        return {k: other.get(k, defaults.get(k)) for k in self.as_dict()}

    def changed(self, other: Mapping[str, Any]) -> frozenset[str]:
        """The fields where ``other`` (a spec as a dict) differs."""
        theirs = self._others(other)
        return frozenset(k for k, v in self.as_dict().items() if theirs[k] != v)

    def differences(self, other: Mapping[str, Any]) -> list[str]:
        """``"name=<other's> (this loader: <mine>)"`` for each field where ``other`` differs."""
        theirs = self._others(other)
        return [f"{k}={theirs[k]!r} (this loader: {v!r})" for k, v in self.as_dict().items() if theirs[k] != v]


def mask_digest(excluded: np.ndarray) -> str:
    """A short digest of sorted excluded sample numbers; ``""`` for none."""
    if not len(excluded):
        return ""
    import hashlib

    return f"{len(excluded)}:" + hashlib.sha1(np.ascontiguousarray(excluded, dtype="<i8").tobytes()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's epoch: ``samples[i]`` (global sample numbers, int64 ``[n]``) in the order they
    are yielded; ``valid[i]`` is False for padding. Batch ``b`` is ``samples[b*B:(b+1)*B]``.
    ``seed`` and ``epoch`` are those the plan was drawn for (backends seed augmentation from them).
    ``draws`` (int64 ``[n]``, or ``None``: the sample numbers themselves) are the numbers each
    position's augmentation is drawn from (``gpupipe.core._random``): a mix that takes a sample twice in
    an epoch (``gp.Mix``) gives each copy its own. ``batch_offset``: the number in its epoch of the
    plan's batch 0 (an elastic resume's batches count on from those yielded before the stop): batch
    transforms draw from ``(seed, epoch, rank, batch_offset + b)``.
    """

    samples: np.ndarray
    valid: np.ndarray
    batch_size: int
    num_batches: int
    seed: int = 0
    epoch: int = 0
    draws: np.ndarray | None = None
    batch_offset: int = 0

    def _slice(self, b: int) -> slice:
        if not 0 <= b < self.num_batches:
            raise IndexError(f"batch {b} of a {self.num_batches}-batch epoch")
        return slice(b * self.batch_size, (b + 1) * self.batch_size)

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        s = self._slice(b)
        return self.samples[s], self.valid[s]

    def drawn(self, b: int) -> np.ndarray:
        """The numbers batch ``b``'s augmentation is drawn from (see ``draws``)."""
        return self.drawn_all[self._slice(b)]

    @property
    def drawn_all(self) -> np.ndarray:
        """The draw numbers of every position (see ``draws``)."""
        return self.samples if self.draws is None else self.draws


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
        group = pieces[g : g + interleave]
        samples = np.concatenate(group)
        lengths = np.array([len(p) for p in group])
        pos = np.concatenate([np.arange(n) for n in lengths]) + rng.uniform(0.0, 1.0, size=len(samples))
        out.append(samples[np.argsort(pos / np.repeat(lengths, lengths), kind="stable")])
    return np.concatenate(out)


def rank_plan(
    shard_sizes: np.ndarray,
    spec: PlanSpec,
    *,
    sequential: bool,
    seed: int,
    epoch: int,
    rank: int,
    excluded: np.ndarray | None = None,
) -> RankPlan:
    """The plan of ``rank`` for ``epoch`` (the contract: docs/guide/distributed.md, "Epochs, distributed training and
    resuming"). ``sequential`` sources (tar shards) are shuffled in two levels, shards then a
    window of samples; others (ImageFolder) get a full permutation.

    ``excluded`` (sorted global sample numbers, known bad) are left out without renumbering: the
    plan is drawn over the remaining samples, shard by shard, as if each shard held only those,
    and its positions are then mapped back to the index's sample numbers."""
    shard_sizes = np.asarray(shard_sizes, dtype=np.int64)
    if spec.repeats > 1:
        return repeated_plan(shard_sizes, spec, sequential=sequential, seed=seed, epoch=epoch, rank=rank,
                             excluded=excluded)  # fmt: skip
    if excluded is not None and len(excluded):
        excluded = np.asarray(excluded, dtype=np.int64)
        plan = rank_plan(good_sizes(shard_sizes, excluded), spec, sequential=sequential, seed=seed, epoch=epoch,
                         rank=rank)  # fmt: skip
        return dataclasses.replace(plan, samples=unexcluded(plan.samples, excluded))
    offsets = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)
    total = int(offsets[-1])
    if total != spec.num_samples:
        raise ValueError(f"rank_plan: the shards hold {total} samples, the spec says {spec.num_samples}")
    world_size, batch_size = spec.world_size, spec.batch_size
    start, stop = rank_range(total, rank, world_size)
    if not spec.shuffle:
        mine = np.arange(start, stop, dtype=np.int64)
    elif not sequential:
        mine = _rng(seed, epoch).permutation(total).astype(np.int64)[start:stop]
    else:
        pieces = _pieces(shard_sizes, offsets, shard_permutation(len(shard_sizes), seed=seed, epoch=epoch), start, stop)
        rng = _rng(seed, epoch, world_size, rank)
        mine = _interleave(pieces, spec.interleave, rng)
        buffer = spec.shuffle_buffer
        if buffer > 1 and len(mine) > 1:
            mine = mine[np.argsort(np.arange(len(mine)) + rng.uniform(0.0, buffer, size=len(mine)), kind="stable")]
    batches = spec.num_batches
    if spec.drop_last:
        mine = mine[: batches * batch_size]
        return RankPlan(mine, np.ones(len(mine), bool), batch_size, batches, seed, epoch)
    # padded by 0, or 1 on the ranks with the shorter range; fewer samples than ranks: sample 0 (mapped
    # past the excluded ones by the caller)
    mine, valid = pad_to(mine, ceil_div(total, world_size), None)
    return RankPlan(mine, valid, batch_size, batches, seed, epoch)


def per_rank(spec: PlanSpec) -> int:
    """Positions each rank's epoch holds: ``num_batches * batch_size`` under ``drop_last``, else
    ``ceil(num_samples / world_size)`` (the padded length)."""
    if spec.drop_last:
        return spec.num_batches * spec.batch_size
    return ceil_div(spec.num_samples, spec.world_size)


def repeated_plan(
    shard_sizes: np.ndarray,
    spec: PlanSpec,
    *,
    sequential: bool,
    seed: int,
    epoch: int,
    rank: int,
    excluded: np.ndarray | None = None,
) -> RankPlan:
    """Repeated augmentation (``Loader(..., repeats=R)``, torchvision's ``RASampler``): the epoch
    keeps its length (:func:`per_rank` positions on each rank, ``T`` in all) and takes
    ``ceil(T / R)`` samples, every ``R``-th of the unrepeated epoch's order (its plan at one rank)
    from a drawn offset, each ``R`` times in a row; position ``j`` of that sequence goes to rank
    ``j % world_size``, so that a sample's copies land on ``R`` neighbouring ranks in the same
    step (with one rank: side by side in one batch). Copy ``k`` of sample ``s`` draws its
    augmentation from ``s + k * N`` (``N``: the index's samples): each copy its own. Every
    position is valid: no padding."""
    repeats, world = spec.repeats, spec.world_size
    single = dataclasses.replace(spec, world_size=1, drop_last=False, repeats=1)
    order = rank_plan(shard_sizes, single, sequential=sequential, seed=seed, epoch=epoch, rank=0,
                      excluded=excluded).samples  # fmt: skip
    count = per_rank(spec)
    total = count * world
    # every R-th of the order from a drawn offset: a prefix would favour the shards read first
    offset = int(_rng(seed, epoch, 0x7265).integers(repeats))
    strided = np.concatenate([order[offset::repeats], np.delete(order, np.s_[offset::repeats])])
    picked = np.resize(strided, ceil_div(total, repeats))  # (short by a few: the next ones)
    samples = np.repeat(picked, repeats)[:total]
    copies = np.arange(total, dtype=np.int64) % repeats
    draws = samples + copies * int(np.sum(shard_sizes))
    mine = slice(rank, total, world)
    return RankPlan(samples[mine], np.ones(count, bool), spec.batch_size, spec.num_batches, seed, epoch,
                    draws[mine])  # fmt: skip


def good_sizes(shard_sizes: np.ndarray, excluded: np.ndarray) -> np.ndarray:
    """Each shard's samples less those of ``excluded`` (sorted global sample numbers) in it."""
    offsets = np.concatenate([[0], np.cumsum(shard_sizes)])
    return shard_sizes - np.bincount(np.searchsorted(offsets, excluded, side="right") - 1, minlength=len(shard_sizes))


def unexcluded(good: np.ndarray, excluded: np.ndarray) -> np.ndarray:
    """The sample numbers of good samples numbered ``good`` (the ``g``-th number not in
    ``excluded``, sorted): ``g`` + the excluded numbers at or below it."""
    if not len(excluded):
        return good
    below = excluded - np.arange(len(excluded), dtype=np.int64)
    return good + np.searchsorted(below, good, side="right")


def pad_to(mine: np.ndarray, length: int, excluded: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``mine`` made ``length`` long with its first sample again (a rank with none: the first
    sample not ``excluded``), and ``valid``, False on the padding."""
    valid = np.arange(length) < len(mine)
    if length > len(mine):
        filler = mine[:1] if len(mine) else first_good(excluded)
        mine = np.concatenate([mine, np.resize(filler, length - len(mine))])
    return mine, valid


def first_good(excluded: np.ndarray | None) -> np.ndarray:
    """``[n]``: the first sample number not ``excluded`` (sorted)."""
    if excluded is None or not len(excluded):
        return np.zeros(1, np.int64)
    gaps = np.flatnonzero(np.asarray(excluded) != np.arange(len(excluded)))
    return np.array([gaps[0] if len(gaps) else len(excluded)], np.int64)
