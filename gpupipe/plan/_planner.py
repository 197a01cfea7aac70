"""Each index kind's planner: what an epoch of it holds and each rank's plan of it, behind one
``plan(spec, seed=, epoch=, rank=, layout=)``. A source's shards (:class:`ShardPlanner`: the
ordinary plan over its shards, ``_plan``) and a :class:`~gpupipe.Mix` (:class:`MixPlanner`: the
plan over the virtual shards of each epoch's selection, ``_mix``). :func:`planner_for` is the one
place that tells the kinds apart; the loader and its settings ask the planner.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..sources import Index, Source
from ..sources._mix import MixIndex
from ._elastic import Layout, elastic_plan
from ._mix import Selection, mix_digest, mixed_plan, select
from ._plan import PlanSpec, RankPlan, rank_plan

__all__ = ["Planner", "ShardPlanner", "MixPlanner", "planner_for"]


class Planner:
    """An index's planner. ``num_samples``: the samples of an epoch over all ranks; ``digest``:
    what else the plan depends on, for :class:`~gpupipe.plan._plan.PlanSpec` (``""``: nothing)."""

    num_samples: int
    digest: str = ""

    def __init__(self, index: Index, excluded: np.ndarray) -> None:
        self.index, self.excluded = index, excluded

    def plan(self, spec: PlanSpec, *, seed: int, epoch: int, rank: int, layout: Layout | None) -> RankPlan:
        """``rank``'s plan of ``epoch`` (of what ``layout`` leaves of it, where set)."""
        raise NotImplementedError

    def per_source(self, source: Source, plan: RankPlan, done: int) -> list[dict[str, Any]]:
        """``Loader.stats()``'s ``sources``: for each source (a mix's, or the one), its samples per
        epoch, those in ``plan`` (padding left out) and those of its first ``done`` positions."""
        return _counted([repr(source)], [self.num_samples], np.zeros(len(plan.valid), np.int64), plan, done)


class ShardPlanner(Planner):
    """The ordinary plan over the source's shards, its known-bad samples left out."""

    def __init__(self, index: Index, excluded: np.ndarray) -> None:
        super().__init__(index, excluded)
        self.num_samples = len(index) - len(excluded)

    def plan(self, spec: PlanSpec, *, seed: int, epoch: int, rank: int, layout: Layout | None) -> RankPlan:
        kw: dict[str, Any] = dict(sequential=self.index.sequential, seed=seed, epoch=epoch, rank=rank,
                                  excluded=self.excluded)  # fmt: skip
        if layout is not None:
            return elastic_plan(self.index.shard_sizes, spec, layout, **kw)
        return rank_plan(self.index.shard_sizes, spec, **kw)


class MixPlanner(Planner):
    """A mix's epochs: each epoch's selection (the last one kept), planned over its virtual shards."""

    index: MixIndex

    def __init__(self, index: MixIndex, excluded: np.ndarray) -> None:
        super().__init__(index, excluded)
        self.num_samples = sum(index.mix.counts)
        self.digest = mix_digest(index.mix, index.shard_sizes)
        self._selection: Selection | None = None

    def plan(self, spec: PlanSpec, *, seed: int, epoch: int, rank: int, layout: Layout | None) -> RankPlan:
        return mixed_plan(self._select(seed, epoch), spec, layout, sequential=self.index.sequential, rank=rank)

    def per_source(self, source: Source, plan: RankPlan, done: int) -> list[dict[str, Any]]:
        names = [repr(s) for s in source.sources]  # type: ignore[attr-defined]
        return _counted(names, list(self.index.mix.counts), self.index.source_of(plan.samples), plan, done)

    def _select(self, seed: int, epoch: int) -> Selection:
        sel = self._selection
        if sel is None or (sel.seed, sel.epoch) != (seed, epoch):
            sel = self._selection = select(self.index.mix, self.index.shard_sizes, self.excluded, seed=seed,
                                           epoch=epoch)  # fmt: skip
        return sel


def planner_for(index: Index, excluded: np.ndarray) -> Planner:
    """The planner of ``index``'s kind, ``excluded`` (sorted sample numbers) left out."""
    if isinstance(index, MixIndex):
        return MixPlanner(index, excluded)
    return ShardPlanner(index, excluded)


def _counted(names: list[str], per_epoch: list[int], of: np.ndarray, plan: RankPlan, done: int) -> list[dict[str, Any]]:
    valid = plan.valid
    taken = valid & (np.arange(len(valid)) < max(done, 0))
    planned, yielded = (np.bincount(of[mask], minlength=len(names)) for mask in (valid, taken))
    return [
        {"source": n, "per_epoch": int(e), "planned": int(p), "yielded": int(y)}
        for n, e, p, y in zip(names, per_epoch, planned, yielded, strict=True)
    ]
