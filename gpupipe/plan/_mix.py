"""What an epoch of a :class:`~gpupipe.Mix` holds, and its plan per rank.

An epoch of a mix is a list of *entries*: each source's ``count`` samples (``gp.Mix``'s
docstring says which), grouped in *virtual shards* — one per source shard and *pass*. Pass ``p``
holds the samples taken for the ``p``-th time this epoch, so that a sample's copies lie in
different virtual shards (read at different times of the epoch) and draw their own augmentation:
their draw number is ``sample + p * len(index)`` (pass 0: the sample number itself, as unmixed).
The epoch's plan is the ordinary one (``_plan.rank_plan``, ``elastic_plan``) over the virtual
shards' sizes, its positions then mapped to sample numbers. Everything is a pure function of
``(seed, epoch)``, the same on every rank; without replacement a virtual shard's samples are drawn
when a rank reads it, so a rank's plan costs ``O(shards + N / world_size)``.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from ..sources._mix import MixCounts
from ._elastic import Layout, elastic_plan
from ._plan import PlanSpec, RankPlan, good_sizes, rank_plan, unexcluded

__all__ = ["Selection", "select", "spread", "mix_digest", "mixed_plan"]


def _rng(seed: int, epoch: int, *more: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, epoch, 0x6D6978, *more])


def mix_digest(mix: MixCounts, shard_sizes: np.ndarray) -> str:
    """A short digest of what the mix draws from (its shards' sizes) and how many (for
    ``PlanSpec.mix``; the samples left out are ``PlanSpec.mask``'s)."""
    doc = repr((mix.counts, [(r.start, r.stop) for r in mix.shards], mix.replacement))
    digest = hashlib.sha1(doc.encode() + np.ascontiguousarray(shard_sizes, "<i8").tobytes()).hexdigest()[:16]
    return f"{sum(mix.counts)}:{digest}"


_NUMPY_LIMIT = 10**9  # NumPy's hypergeometric draws take populations below this


def spread(rng: np.random.Generator, sizes: np.ndarray, r: int) -> np.ndarray:
    """How many of ``r`` samples drawn without replacement from shards of ``sizes`` fall in each
    (int64 ``[S]``, adding up to ``r``, each at most its size): NumPy's multivariate
    hypergeometric draw; for populations of ``10**9`` samples and more, which it refuses, the same
    split shard range by shard range (halves, top down, vectorized per level), a half's share
    drawn hypergeometric where NumPy can and from its normal approximation (clipped to the
    feasible range) above that, where the two are indistinguishable."""
    sizes = np.asarray(sizes, np.int64)
    if int(sizes.sum()) < _NUMPY_LIMIT:
        return rng.multivariate_hypergeometric(sizes, r, method="marginals").astype(np.int64)
    prefix = np.concatenate([[0], np.cumsum(sizes)])
    lo, hi, take = np.array([0]), np.array([len(sizes)]), np.array([r], np.int64)
    out = np.zeros(len(sizes), np.int64)
    while len(lo):
        single = hi - lo == 1
        out[lo[single]] = take[single]
        lo, hi, take = lo[~single], hi[~single], take[~single]
        mid = (lo + hi) // 2
        left, right = prefix[mid] - prefix[lo], prefix[hi] - prefix[mid]
        first = np.empty(len(lo), np.int64)
        small = left + right < _NUMPY_LIMIT
        if small.any():
            first[small] = rng.hypergeometric(left[small], right[small], take[small])
        big = ~small
        if big.any():
            n, k, a = (left + right)[big].astype(np.float64), take[big].astype(np.float64), left[big]
            p = a / n
            sd = np.sqrt(k * p * (1 - p) * np.maximum(n - k, 0) / np.maximum(n - 1, 1))
            drawn = np.rint(rng.normal(k * p, sd)).astype(np.int64)
            first[big] = np.clip(drawn, np.maximum(0, take[big] - right[big]), np.minimum(take[big], a))
        lo, hi, take = np.concatenate([lo, mid]), np.concatenate([mid, hi]), np.concatenate([first, take - first])
    return out


@dataclasses.dataclass
class Selection:
    """One epoch's entries: virtual shard ``v`` holds ``sizes[v]`` samples of shard ``shard[v]``
    (good-sample numbers within it, sorted), taken for the ``passes[v]``-th time; ``fixed[v]``,
    where set, lists them (else: every good sample of the shard where ``whole[v]``, or a subset
    drawn on first use)."""

    sizes: np.ndarray
    shard: np.ndarray
    passes: np.ndarray
    whole: np.ndarray
    good_sizes: np.ndarray
    good_offsets: np.ndarray
    excluded: np.ndarray
    total: int  # len(index): the draw numbers' stride between passes
    seed: int
    epoch: int
    fixed: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)

    def entries(self, v: int) -> np.ndarray:
        """The good-sample numbers (within its shard) of virtual shard ``v``, sorted."""
        got = self.fixed.get(v)
        if got is None:
            g = int(self.good_sizes[self.shard[v]])
            if self.whole[v]:
                got = np.arange(g, dtype=np.int64)
            else:
                rng = _rng(self.seed, self.epoch, int(self.shard[v]), int(self.passes[v]))
                got = np.sort(rng.choice(g, int(self.sizes[v]), replace=False)).astype(np.int64)
            self.fixed[v] = got
        return got

    def resolve(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample numbers and draw numbers of epoch positions (virtual sample numbers, int64)."""
        positions = np.asarray(positions, np.int64)
        offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        v = np.searchsorted(offsets, positions, side="right") - 1
        good = np.empty(len(positions), np.int64)
        order = np.argsort(v, kind="stable")
        for at in np.split(order, np.flatnonzero(np.diff(v[order])) + 1) if len(order) else []:
            u = int(v[at[0]])
            good[at] = self.entries(u)[positions[at] - offsets[u]] + self.good_offsets[self.shard[u]]
        samples = unexcluded(good, self.excluded)
        return samples, samples + self.passes[v] * self.total


def select(mix: MixCounts, shard_sizes: np.ndarray, excluded: np.ndarray, *, seed: int, epoch: int) -> Selection:
    """The entries of ``epoch``: see the module docstring and ``gp.Mix``."""
    shard_sizes = np.asarray(shard_sizes, np.int64)
    good = good_sizes(shard_sizes, excluded)
    sizes, shard, passes, whole = [], [], [], []  # per pass of a source: one entry per shard of it
    fixed: dict[int, np.ndarray] = {}

    def add(ids: np.ndarray, m: np.ndarray, p: int, complete: np.ndarray) -> None:
        sizes.append(m)
        shard.append(ids)
        passes.append(np.full(len(ids), p))
        whole.append(complete)

    for i, (c, shards) in enumerate(zip(mix.counts, mix.shards, strict=True)):
        if c == 0:
            continue
        ids = np.arange(shards.start, shards.stop, dtype=np.int64)
        g = good[ids]
        rng = _rng(seed, epoch, 1 << 40, i)
        if not mix.replacement:
            q, r = divmod(c, int(g.sum()))
            for p in range(q):
                add(ids, g, p, np.ones(len(ids), bool))
            if r:
                m = spread(rng, g, r)
                add(ids, m, q, m == g)
            continue
        # with replacement: c independent draws; the p-th copy of a sample is in pass p
        drawn = np.sort(rng.integers(0, int(g.sum()), size=c))
        copy = np.arange(c) - np.searchsorted(drawn, drawn, side="left")
        local_offsets = np.concatenate([[0], np.cumsum(g)])
        # every pass at once (a loop over passes, each over the whole draw, is O(count^2 / size)):
        # virtual shard p * S + j holds the p-th copies of the draws in shard j, in drawn order
        n_shards, n_passes = len(ids), int(copy.max()) + 1
        of = (np.searchsorted(local_offsets, drawn, side="right") - 1).astype(np.int64)
        key = copy * n_shards + of
        order = np.argsort(key, kind="stable")  # (drawn is sorted: each virtual shard's entries stay sorted)
        m = np.bincount(key, minlength=n_passes * n_shards).astype(np.int64)
        starts, first = np.concatenate([[0], np.cumsum(m)]), sum(len(s) for s in sizes)
        local = (drawn - local_offsets[of])[order]
        for v in np.flatnonzero(m).tolist():
            fixed[first + v] = local[starts[v] : starts[v + 1]]
        sizes.append(m)
        shard.append(np.tile(ids, n_passes))
        passes.append(np.repeat(np.arange(n_passes), n_shards))
        whole.append(np.zeros(n_passes * n_shards, bool))
    # (a Mix counts at least one sample: sizes is not empty)
    return Selection(np.concatenate(sizes), np.concatenate(shard), np.concatenate(passes), np.concatenate(whole), good,
                     np.concatenate([[0], np.cumsum(good)]), np.asarray(excluded, np.int64), int(shard_sizes.sum()),
                     seed, epoch, fixed)  # fmt: skip


def mixed_plan(selection: Selection, spec: PlanSpec, layout: Layout | None, *, sequential: bool, rank: int) -> RankPlan:
    """``rank``'s plan of the selection's epoch (of what ``layout`` leaves of it, where set): the
    ordinary plan over the virtual shards, its positions mapped to sample and draw numbers."""
    kw = dict(sequential=sequential, seed=selection.seed, epoch=selection.epoch, rank=rank)
    if layout is not None:
        plan = elastic_plan(selection.sizes, spec, layout, **kw)  # type: ignore[arg-type]
    else:
        plan = rank_plan(selection.sizes, spec, **kw)  # type: ignore[arg-type]
    samples, draws = selection.resolve(plan.samples)
    return dataclasses.replace(plan, samples=samples, draws=draws)
