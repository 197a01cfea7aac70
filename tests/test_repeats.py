"""Repeated augmentation (``Loader(..., repeats=R)``, issue 37): each epoch takes ``1 / R`` of the
samples, each ``R`` times, copies on neighbouring ranks in the same step, each copy its own draws;
the epoch keeps its length, resumes exactly and elastically."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.plan._elastic import elastic_plan, remaining
from gpupipe.plan._plan import PlanSpec, rank_plan

from .support.checkers import check_exact_resume

SIZES = np.array([7, 5, 9, 3, 6])  # 30 samples
KW: dict[str, Any] = dict(sequential=True, seed=3, epoch=1)


def spec(world, batch_size, drop_last, repeats, total=30):
    return PlanSpec(num_samples=total, world_size=world, batch_size=batch_size, drop_last=drop_last, shuffle=True,
                    shuffle_buffer=8, interleave=2, repeats=repeats)  # fmt: skip


def epoch_of(s, **kw):
    return [rank_plan(SIZES, s, rank=r, **{**KW, **kw}) for r in range(s.world_size)]


class TestRepeatedPlan:
    @pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
    @pytest.mark.parametrize("repeats", [2, 3, 4])
    @pytest.mark.parametrize("drop_last", [False, True])
    def test_each_pick_repeats_on_neighbouring_ranks_and_the_length_stays(self, world, repeats, drop_last):
        s = spec(world, 2, drop_last, repeats)
        plans = epoch_of(s)
        plain = epoch_of(dataclasses.replace(s, repeats=1))
        assert [p.num_batches for p in plans] == [p.num_batches for p in plain]  # len(loader) unchanged
        assert all(p.valid.all() and len(p.samples) == len(plans[0].samples) for p in plans)  # no padding
        # the global sequence, position j on rank j % world: picks in runs of R copies
        seq = np.stack([p.samples for p in plans], 1).reshape(-1)
        draws = np.stack([p.draws for p in plans], 1).reshape(-1)
        for start in range(0, len(seq), repeats):
            run = seq[start : start + repeats]
            assert (run == run[0]).all()
            copies = draws[start : start + repeats]
            assert list((copies - run) // 30) == list(range(len(run)))  # copy k draws from s + k * N
        counts = collections.Counter(seq.tolist())
        assert max(counts.values()) <= repeats and len(counts) == -(-len(seq) // repeats)

    def test_it_is_rasamplers_index_rule(self):
        """torchvision's RASampler on the picked samples: repeat each index R times, pad from the
        front, deal ``rank::world``, keep the per-rank count (the epoch's, not its 256-multiple)."""
        world, repeats = 3, 4
        s = spec(world, 2, False, repeats)
        plans = epoch_of(s)
        picks = np.stack([p.samples for p in plans], 1).reshape(-1)[::repeats].tolist()
        count = len(plans[0].samples)
        indices = [e for e in picks for _ in range(repeats)]
        total = world * count
        indices += indices[: total - len(indices)]
        for rank in range(world):
            assert plans[rank].samples.tolist() == indices[rank:total:world][:count]

    def test_every_sample_is_picked_as_often(self):
        """Every R-th of the order from a drawn offset: no shard position is favoured (a prefix of
        the order would pick the ends of long shards a tenth as often)."""
        s = spec(2, 3, False, 3)
        seen: collections.Counter[int] = collections.Counter()
        for epoch in range(300):
            seen.update(set(np.concatenate([p.samples for p in epoch_of(s, epoch=epoch)]).tolist()))
        counts = np.array([seen[i] for i in range(30)])
        expected = counts.sum() / 30
        assert ((counts - expected) ** 2 / expected).sum() < 58.3  # chi-square, 29 d.o.f., p = 0.001

    def test_known_bad_samples_stay_out(self):
        excluded = np.array([0, 8, 9, 29])
        s = spec(2, 3, False, 2, total=26)
        plans = epoch_of(s, excluded=excluded)
        assert not set(np.concatenate([p.samples for p in plans]).tolist()) & set(excluded.tolist())

    def test_an_elastic_plan_numbers_its_batches_on(self):
        """``RankPlan.batch_offset``: an elastic plan's batch 0 is the batch after those yielded
        before the stop (batch transforms draw from the batch's number in its epoch)."""
        first = spec(2, 3, False, 1)
        for done in range(first.num_batches + 1):
            layout = remaining(first, done)
            assert elastic_plan(SIZES, spec(3, 3, False, 1), layout, rank=1, **KW).batch_offset == layout.offset == done
        assert epoch_of(first)[0].batch_offset == 0

    @pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 1), (1, 4), (4, 2)])
    def test_elastic_resume_yields_the_rest_once_with_the_same_draws(self, old, new):
        first = spec(old, 2, False, 3)
        whole = sorted((int(a), int(b)) for p in epoch_of(first) for a, b in zip(p.samples, p.draws, strict=True))
        for done in range(first.num_batches + 1):
            before = [(int(a), int(b)) for p in epoch_of(first)
                      for a, b in zip(p.samples[: done * 2], p.draws[: done * 2], strict=True)]  # fmt: skip
            plans = [elastic_plan(SIZES, spec(new, 3, False, 3), remaining(first, done), rank=r, **KW)
                     for r in range(new)]  # fmt: skip
            after = [(int(a), int(b)) for p in plans
                     for a, b, v in zip(p.samples, p.drawn_all, p.valid, strict=True) if v]  # fmt: skip
            assert sorted(before + after) == whole, (old, new, done)


@pytest.fixture(scope="module")
def twelve(tmp_path_factory):
    from .support.data import write_webdataset_shards

    return write_webdataset_shards(tmp_path_factory.mktemp("rep"), [5, 4, 3])


def pipeline(shards):
    return gp.Pipeline(gp.WebDataset(shards), [T.RandomResizedCrop(24), T.RandomHorizontalFlip()])


class TestRepeatsInTheLoader:
    def test_copies_in_one_batch_are_augmented_apart(self, twelve, clean_env):
        with gp.Loader(pipeline(twelve), 4, repeats=2, shuffle=True, seed=1, backend="torch", device="cpu",
                       num_workers=0) as loader:  # fmt: skip
            assert len(loader) == 3  # as without repeats
            batches = list(loader)
        keys = [k for b in batches for k in b.keys]
        assert len(set(keys)) == 6 and all(keys[i] == keys[i + 1] for i in range(0, 12, 2))
        for b in batches:
            for i in range(0, 4, 2):
                assert not torch.equal(b.images[i], b.images[i + 1])  # each copy its own crop

    def test_dali_draws_what_torch_draws(self, twelve, clean_env):
        pytest.importorskip("nvidia.dali")
        got = {}
        for backend in ("torch", "dali"):
            with gp.Loader(pipeline(twelve), 4, repeats=3, shuffle=True, seed=2, backend=backend, device="cpu",
                           num_workers=1) as loader:  # fmt: skip
                got[backend] = [(b.keys, b.images.float()) for b in loader]
        for (k1, i1), (k2, i2) in zip(got["torch"], got["dali"], strict=True):
            assert k1 == k2 and float((i1 - i2).abs().mean()) < 2.0

    def test_exact_resume(self, twelve, clean_env):
        def make():
            return gp.Loader(pipeline(twelve), 2, repeats=3, shuffle=True, seed=5, backend="torch", device="cpu",
                             num_workers=0)  # fmt: skip

        check_exact_resume(make, epoch=2, at=2)

    def test_a_state_under_other_repeats_is_refused(self, twelve, clean_env):
        options = dict(shuffle=True, seed=5, backend="torch", device="cpu", num_workers=0)
        with gp.Loader(pipeline(twelve), 2, repeats=3, **options) as loader:
            next(iter(loader))
            state = loader.state_dict()
        with gp.Loader(pipeline(twelve), 2, **options) as other, pytest.raises(gp.ConfigError, match="repeats"):
            other.load_state_dict(state)

    @pytest.mark.parametrize("repeats", [0, 1.5, True])
    def test_invalid(self, twelve, repeats):
        with pytest.raises(gp.ConfigError, match="repeats"):
            gp.Loader(pipeline(twelve), 2, repeats=repeats)

    def test_not_with_a_mix(self, twelve, clean_env):
        mixed = gp.Pipeline(gp.Mix([gp.WebDataset(twelve[:2]), gp.WebDataset(twelve[2:])]), [T.CenterCrop(16)])
        with pytest.raises(gp.ConfigError, match="Mix"):
            gp.Loader(mixed, 2, repeats=2, backend="torch", device="cpu", num_workers=0)
