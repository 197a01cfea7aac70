"""The epoch plan: per-rank plans simulated for many world sizes, shuffle quality, and the docs'
worked example on every backend."""

from __future__ import annotations

import functools
import operator
from typing import ClassVar

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.plan._elastic import Layout, elastic_plan, remaining
from gpupipe.plan._plan import PlanSpec, rank_plan, rank_range, shard_permutation
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import check_epoch_partition, val, yielded


def plan_batches(sizes, world, *, sequential, shuffle, seed, epoch, buffer, interleave, batch_size, drop_last):
    """Every rank's plan of one epoch, as the checker wants it (keys are sample numbers)."""
    spec = PlanSpec(
        num_samples=sum(sizes),
        world_size=world,
        batch_size=batch_size,
        drop_last=drop_last,
        shuffle=shuffle,
        shuffle_buffer=buffer,
        interleave=interleave,
    )
    plans = [
        rank_plan(np.array(sizes), spec, sequential=sequential, seed=seed, epoch=epoch, rank=r) for r in range(world)
    ]
    return plans, [
        [([str(s) for s in p.batch(b)[0]], p.batch(b)[1].tolist()) for b in range(p.num_batches)] for p in plans
    ]


class TestRankPlan:
    SIZES = (7, 2, 5, 3, 11, 1, 4, 9, 6, 2, 8)  # 58 samples in 11 uneven shards

    @pytest.mark.parametrize("world", [1, 2, 3, 8])
    @pytest.mark.parametrize("batch_size", [1, 3, 4, 7])
    @pytest.mark.parametrize("drop_last", [False, True])
    @pytest.mark.parametrize("shuffle, sequential", [(False, True), (True, True), (True, False)])
    def test_simulated_ranks(self, world, batch_size, drop_last, shuffle, sequential):
        kw = dict(
            sequential=sequential,
            shuffle=shuffle,
            seed=3,
            epoch=1,
            buffer=4,
            interleave=3,
            batch_size=batch_size,
            drop_last=drop_last,
        )
        _, per_rank = plan_batches(self.SIZES, world, **kw)
        total = sum(self.SIZES)
        counts = check_epoch_partition(
            per_rank, [str(i) for i in range(total)], world_size=world, batch_size=batch_size, drop_last=drop_last
        )
        if drop_last:
            assert counts["batches"] == total // (world * batch_size)
        else:
            assert counts["padding"] == -total % world

    def test_fewer_samples_than_ranks(self):
        _, per_rank = plan_batches(
            (1, 2),
            8,
            sequential=True,
            shuffle=True,
            seed=0,
            epoch=0,
            buffer=4,
            interleave=2,
            batch_size=2,
            drop_last=False,
        )
        counts = check_epoch_partition(per_rank, ["0", "1", "2"], world_size=8, batch_size=2, drop_last=False)
        assert counts == {"batches": 1, "valid": 3, "padding": 5}

    def test_deterministic_in_seed_epoch_and_world_size(self):
        kw = dict(sequential=True, shuffle=True, buffer=8, interleave=2, batch_size=2, drop_last=False)

        def samples(seed, epoch, world):
            return [p.samples.tolist() for p in plan_batches(self.SIZES, world, seed=seed, epoch=epoch, **kw)[0]]

        assert samples(1, 2, 4) == samples(1, 2, 4)
        assert samples(1, 2, 4) != samples(1, 3, 4) != samples(2, 2, 4)
        # another world size splits the same samples differently
        assert (
            set(functools.reduce(operator.iadd, samples(1, 2, 4), []))
            == set(functools.reduce(operator.iadd, samples(1, 2, 3), []))
            == set(range(sum(self.SIZES)))
        )
        assert samples(1, 2, 4)[0] != samples(1, 2, 3)[0]

    def test_each_rank_reads_a_contiguous_part_of_the_shard_order(self):
        sizes = np.array(self.SIZES)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        plans, _ = plan_batches(
            sizes,
            3,
            sequential=True,
            shuffle=True,
            seed=5,
            epoch=0,
            buffer=1,
            interleave=1,
            batch_size=4,
            drop_last=False,
        )
        order = np.concatenate(
            [np.arange(offsets[s], offsets[s + 1]) for s in shard_permutation(len(sizes), seed=5, epoch=0)]
        )
        for r, p in enumerate(plans):
            start, stop = rank_range(len(order), r, 3)
            assert p.samples[p.valid].tolist() == order[start:stop].tolist()  # no mixing: exact range
        shard_sets = [{int(np.searchsorted(offsets, s, "right")) - 1 for s in p.samples[p.valid]} for p in plans]
        shared = [len(a & b) for i, a in enumerate(shard_sets) for b in shard_sets[i + 1 :]]
        assert sum(shared) <= 2  # only the shards cut at the 2 rank boundaries are split (by byte range)

    def test_interleave_reads_each_shard_front_to_back(self):
        sizes = np.array(self.SIZES)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        (p,), _ = plan_batches(
            sizes,
            1,
            sequential=True,
            shuffle=True,
            seed=1,
            epoch=0,
            buffer=1,
            interleave=4,
            batch_size=4,
            drop_last=False,
        )
        shard = np.searchsorted(offsets, p.samples, "right") - 1
        for s in range(len(sizes)):
            assert np.all(np.diff(p.samples[shard == s]) == 1)
        assert len(set(shard[:8].tolist())) >= 3  # the first samples come from several shards


def test_batch_counts_are_exact_past_a_floats_precision():
    """ceil(n / w) of floats is off past 2**53 samples: integer arithmetic throughout."""
    from gpupipe.plan._plan import num_batches

    n = 2**60 + 1
    assert num_batches(n, world_size=1, batch_size=1, drop_last=False) == n
    per_rank = (n + 2) // 3
    assert num_batches(n, world_size=3, batch_size=7, drop_last=False) == (per_rank + 6) // 7


class TestShuffleQuality:
    """One class per shard: how many classes does a batch hold? gpupipe's two-level shuffle against
    DALI's reader shuffling with the same buffer (no shard permutation, no interleave), and against
    a perfect shuffle. ``bench/shuffle_quality.py`` reports the same at ImageNet proportions."""

    SHARDS, PER_SHARD, BATCH, BUFFER, INTERLEAVE = 64, 32, 16, 128, 16  # 4 groups of 16 shards

    @pytest.fixture
    def one_class_per_shard(self, tmp_path):
        root = tmp_path
        jpg = encode_jpeg(synthetic_image(0, size=(16, 16)))
        with gp.ShardWriter(str(root / "c-%06d.tar"), max_count=self.PER_SHARD) as w:
            for c in range(self.SHARDS):
                for i in range(self.PER_SHARD):
                    w.write(f"c{c:03d}_{i:03d}", {"jpg": jpg, "cls": c})
        return w.shards

    def classes_per_batch(self, labels):
        labels = np.asarray(labels)
        n = len(labels) // self.BATCH
        return float(np.mean([len(set(labels[i * self.BATCH : (i + 1) * self.BATCH].tolist())) for i in range(n)]))

    def dali_buffer_only(self, shards, epoch):
        from nvidia.dali import Pipeline, fn

        index = gp.WebDataset(shards).index()  # writes the DALI index files
        pipe = Pipeline(batch_size=self.BATCH, num_threads=1, device_id=None, seed=epoch + 1)
        with pipe:
            _, cls = fn.readers.webdataset(  # type: ignore[misc]
                paths=shards,
                index_paths=[str(s.dali_index) for s in index.shards],
                ext=["jpg", "cls"],
                random_shuffle=True,
                initial_fill=self.BUFFER,
            )
            pipe.set_outputs(cls)
        pipe.build()
        labels = []
        for _ in range(len(index) // self.BATCH):
            (cls,) = pipe.run()
            labels += [int(bytes(np.asarray(cls[i]))) for i in range(self.BATCH)]
        return self.classes_per_batch(labels)

    def test_two_level_beats_buffer_only(self, one_class_per_shard):
        pytest.importorskip("nvidia.dali")
        loader = gp.Loader(
            gp.Pipeline(one_class_per_shard, [T.CenterCrop(8)]),
            self.BATCH,
            shuffle=True,
            drop_last=True,
            seed=0,
            shuffle_buffer=self.BUFFER,
            interleave=self.INTERLEAVE,
            backend="torch",
            device="cpu",
            num_workers=0,
        )
        ours, dali, perfect = [], [], []
        n = self.SHARDS * self.PER_SHARD
        for epoch in range(3):
            loader.set_epoch(epoch)
            ours.append(self.classes_per_batch(torch.cat([labels for _, labels in loader]).tolist()))
            dali.append(self.dali_buffer_only(one_class_per_shard, epoch))
            perfect.append(self.classes_per_batch(np.random.default_rng(epoch).permutation(n) // self.PER_SHARD))
        ours, dali, perfect = np.mean(ours), np.mean(dali), np.mean(perfect)
        print(
            f"classes per batch of {self.BATCH}: gpupipe {ours:.1f}, DALI buffer-only {dali:.1f}, "
            f"perfect shuffle {perfect:.1f}"
        )
        assert ours >= 1.25 * dali
        assert ours >= 0.7 * perfect


class TestWorkedExample:
    """The worked example of docs/guide/distributed.md, exactly, on every
    backend."""

    @pytest.fixture
    def ten(self, tmp_path):
        jpg = encode_jpeg(synthetic_image(0, size=(24, 24)))
        with gp.ShardWriter(str(tmp_path / "ten-%d.tar")) as w:
            for i in range(10):
                w.write(f"s{i}", {"jpg": jpg, "cls": i})
        return w.shards

    @pytest.mark.parametrize(
        "drop_last, expected",
        [
            (
                False,
                [
                    [(["s0", "s1"], [1, 1]), (["s2", "s3"], [1, 1])],
                    [(["s4", "s5"], [1, 1]), (["s6", "s4"], [1, 0])],
                    [(["s7", "s8"], [1, 1]), (["s9", "s7"], [1, 0])],
                ],
            ),
            (True, [[(["s0", "s1"], [1, 1])], [(["s4", "s5"], [1, 1])], [(["s7", "s8"], [1, 1])]]),
        ],
    )
    def test_three_ranks_batch_two(self, ten, clean_env, backend, drop_last, expected):
        loaders = [
            backend.loader(val(ten), 2, drop_last=drop_last, rank=r, world_size=3, num_workers=0) for r in range(3)
        ]
        assert [len(lo) for lo in loaders] == [len(expected[0])] * 3
        got = [[(keys, [int(v) for v in valid]) for keys, valid in yielded(lo)] for lo in loaders]
        assert got == expected

    @pytest.mark.parametrize("drop_last, sizes", [(False, [4, 4, 2]), (True, [4, 4])])
    def test_one_process(self, ten, clean_env, drop_last, sizes):
        loader = gp.Loader(val(ten), 4, drop_last=drop_last, backend="torch", device="cpu", num_workers=0)
        assert [len(keys) for keys, _ in yielded(loader)] == sizes == [4, 4, 2][: len(loader)]


def _spec(total, world, batch_size, drop_last, shuffle=True):
    return PlanSpec(num_samples=total, world_size=world, batch_size=batch_size, drop_last=drop_last,
                    shuffle=shuffle, shuffle_buffer=8, interleave=2)  # fmt: skip


def _whole_epoch(sizes, spec, **kw):
    """The valid samples of the epoch over all ranks (what an uninterrupted run yields)."""
    plans = [rank_plan(sizes, spec, rank=r, **kw) for r in range(spec.world_size)]
    return sorted(int(s) for p in plans for s in p.samples[p.valid])


def _yielded(plans, batches):
    """The valid samples each plan yields in its first ``batches`` batches."""
    out = []
    for p in plans:
        n = batches * p.batch_size
        out += [int(s) for s in p.samples[:n][p.valid[:n]]]
    return out


class TestElastic:
    """An epoch interrupted at one world size and finished at another: every sample of the epoch
    exactly once over the two runs, equal batch counts on the new ranks."""

    SIZES = np.array([7, 5, 9, 3, 6])
    KW: ClassVar[dict] = dict(sequential=True, seed=3, epoch=1)

    @pytest.mark.parametrize("drop_last", [False, True])
    @pytest.mark.parametrize("old", [1, 2, 3, 4])
    @pytest.mark.parametrize("new", [1, 2, 3, 4])
    def test_every_sample_once_across_world_sizes(self, old, new, drop_last):
        total = int(self.SIZES.sum())
        first = _spec(total, old, 3, drop_last)
        expected = _whole_epoch(self.SIZES, first, **self.KW)
        for done in range(first.num_batches + 1):
            before = _yielded([rank_plan(self.SIZES, first, rank=r, **self.KW) for r in range(old)], done)
            layout = remaining(first, done)
            assert layout.num_samples == len(expected) - len(before)
            spec = _spec(total, new, 4, drop_last)
            plans = [elastic_plan(self.SIZES, spec, layout, rank=r, **self.KW) for r in range(new)]
            assert len({p.num_batches for p in plans}) == 1 and len({len(p.samples) for p in plans}) == 1
            after = _yielded(plans, plans[0].num_batches)
            assert sorted(before + after) == expected, (old, new, done)
            if drop_last:
                assert all(len(p.samples) == p.num_batches * p.batch_size for p in plans)  # full batches only

    def test_a_second_interruption(self):
        """Interrupted at 3 ranks, resumed at 2, interrupted again, finished at 4."""
        total = int(self.SIZES.sum())
        first = _spec(total, 3, 2, False)
        expected = _whole_epoch(self.SIZES, first, **self.KW)
        got = _yielded([rank_plan(self.SIZES, first, rank=r, **self.KW) for r in range(3)], 2)
        layout = remaining(first, 2)
        second = _spec(total, 2, 3, False)
        got += _yielded([elastic_plan(self.SIZES, second, layout, rank=r, **self.KW) for r in range(2)], 1)
        layout = remaining(second, layout.offset + 1, layout)  # counted on from the first stop
        third = _spec(total, 4, 2, False)
        plans = [elastic_plan(self.SIZES, third, layout, rank=r, **self.KW) for r in range(4)]
        got += _yielded(plans, plans[0].num_batches)
        assert sorted(got) == expected and len(got) == len(set(got))

    def test_known_bad_samples_stay_out(self):
        excluded = np.array([0, 8, 9, 29])
        total = int(self.SIZES.sum()) - len(excluded)
        first = _spec(total, 2, 3, False)
        kw = dict(self.KW, excluded=excluded)
        expected = _whole_epoch(self.SIZES, first, **kw)
        before = _yielded([rank_plan(self.SIZES, first, rank=r, **kw) for r in range(2)], 1)
        plans = [elastic_plan(self.SIZES, _spec(total, 3, 3, False), remaining(first, 1), rank=r, **kw)
                 for r in range(3)]  # fmt: skip
        assert sorted(before + _yielded(plans, plans[0].num_batches)) == expected
        assert not set(expected) & set(excluded.tolist())

    def test_a_rank_reads_only_the_old_plans_its_part_touches(self, monkeypatch):
        """Start-up stays about N / world_size per rank: 64 old ranks, 16 new ones, each new rank
        computes the plans of the ~4-5 old ranks whose remaining samples it takes."""
        from gpupipe.plan import _elastic

        sizes = np.full(128, 50)
        first = _spec(int(sizes.sum()), 64, 5, False)
        layout = remaining(first, 3)
        computed = []
        real = _elastic.rank_plan

        def counted(*args, **kwargs):
            computed.append(kwargs["rank"])
            return real(*args, **kwargs)

        monkeypatch.setattr(_elastic, "rank_plan", counted)
        _elastic.elastic_plan(sizes, _spec(int(sizes.sum()), 16, 5, False), layout, rank=7, **self.KW)
        assert 4 <= len(set(computed)) <= 5 and computed == sorted(set(computed))

    def test_a_layout_round_trips(self):
        layout = remaining(_spec(30, 3, 2, False), 1)
        assert Layout.from_dict(layout.as_dict()) == layout
        for ranges in ([[5, 2]], [[0, 1000]], [[0, 5], [4, 8]], [[6, 8], [0, 2]]):  # backwards, past, overlapping
            with pytest.raises(ValueError):
                Layout.from_dict({**layout.as_dict(), "ranges": ranges})
        with pytest.raises(ValueError):
            Layout.from_dict({**layout.as_dict(), "offset": -1})

    def test_a_scaled_down_cluster(self):
        """bench/elastic.py's case scaled down: 200 shards, 64 ranks stopped at 40% of the epoch,
        48 ranks resume; counted over every rank, each sample exactly once."""
        sizes = np.random.default_rng(0).integers(25, 76, size=200)
        total = int(sizes.sum())
        first, new = _spec(total, 64, 16, False), _spec(total, 48, 16, False)
        done = int(first.num_batches * 0.4)
        seen = np.zeros(total, dtype=np.int64)
        for rank in range(64):
            p = rank_plan(sizes, first, rank=rank, **self.KW)
            np.add.at(seen, p.samples[: done * 16][p.valid[: done * 16]], 1)
        layout = remaining(first, done)
        plans = [elastic_plan(sizes, new, layout, rank=rank, **self.KW) for rank in range(48)]
        for p in plans:
            np.add.at(seen, p.samples[p.valid], 1)
        assert (seen == 1).all() and len({p.num_batches for p in plans}) == 1

    def test_a_rank_with_nothing_left_pads_with_a_good_sample(self):
        """Sample 0 known bad; 7 good samples, one rank of batch 5 stopped after its first batch:
        2 left for 3 ranks, so rank 2 has nothing and pads with the first good sample, not 0."""
        sizes, excluded = np.array([4, 4]), np.array([0])
        left = remaining(_spec(7, 1, 5, False), 1)
        plans = [elastic_plan(sizes, _spec(7, 3, 4, False), left, rank=r, excluded=excluded, **self.KW)
                 for r in range(3)]  # fmt: skip
        assert [int(p.valid.sum()) for p in plans] == [1, 1, 0]
        assert plans[2].samples.tolist() == [1] and plans[2].valid.tolist() == [False]
