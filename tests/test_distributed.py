"""Distributed and epoch semantics: rank discovery, per-rank plans, equal lengths, exact-once
evaluation, shuffle quality, resume, scale, and real torchrun jobs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe.testing import encode_jpeg, synthetic_image
from gpupipe import _dist
from gpupipe import transforms as T
from gpupipe._plan import PlanSpec, rank_plan, rank_range, shard_permutation
from gpupipe.sources import Index, ShardIndex, Source
from gpupipe.sources._webdataset import TarReader
from gpupipe.sources import LocalStorage

from .checkers import check_epoch_partition
from .conftest import UNEVEN_SIZES

BACKENDS = ["torch", "dali"]
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def val(source, size=16):
    return gp.Pipeline(source, [T.Resize(24), T.CenterCrop(size), T.ToDtype(torch.float32, scale=True)])


def yielded(loader):
    """One epoch as ``[(keys, valid), ...]``."""
    return [(b.keys, b.valid.tolist()) for b in loader]


def all_keys(index):
    return [index.key(i) for i in range(len(index))]


@pytest.fixture
def clean_env(monkeypatch):
    for name in DIST_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


class TestTopology:
    def test_single_process(self, clean_env):
        assert _dist.topology() == (0, 1, "single process")

    def test_explicit_wins_over_environment(self, clean_env):
        clean_env.setenv("RANK", "1")
        clean_env.setenv("WORLD_SIZE", "4")
        assert _dist.topology(2, 3) == (2, 3, "explicit")

    def test_torchrun_environment(self, clean_env):
        clean_env.setenv("RANK", "3")
        clean_env.setenv("WORLD_SIZE", "4")
        clean_env.setenv("SLURM_PROCID", "0")
        clean_env.setenv("SLURM_NTASKS", "2")
        assert _dist.topology() == (3, 4, "RANK/WORLD_SIZE")

    def test_slurm_environment(self, clean_env):
        clean_env.setenv("SLURM_PROCID", "5")
        clean_env.setenv("SLURM_NTASKS", "8")
        assert _dist.topology() == (5, 8, "SLURM")

    @pytest.mark.parametrize("rank, world, match", [(0, None, "both"), (3, 3, "0 <= rank"), (-1, 2, "0 <= rank"),
                                                    (0, 0, "0 <= rank"), (1.0, 2, "int")])
    def test_invalid_explicit(self, clean_env, rank, world, match):
        with pytest.raises(gp.ConfigError, match=match):
            _dist.topology(rank, world)

    def test_invalid_environment_names_the_variable(self, clean_env):
        clean_env.setenv("RANK", "first")
        clean_env.setenv("WORLD_SIZE", "2")
        with pytest.raises(gp.ConfigError, match="RANK='first'"):
            _dist.topology()

    def test_local_rank_picks_the_gpu(self, clean_env):
        clean_env.setattr(torch.cuda, "device_count", lambda: 4)
        clean_env.setenv("SLURM_LOCALID", "2")
        assert _dist.cuda_device() == "cuda:2"
        clean_env.setenv("LOCAL_RANK", "3")  # torchrun's variable first
        assert _dist.cuda_device() == "cuda:3"
        clean_env.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU bound per task
        assert _dist.cuda_device() == "cuda:0"
        clean_env.setattr(torch.cuda, "device_count", lambda: 2)
        with pytest.raises(gp.ConfigError, match="local rank 3"):
            _dist.cuda_device()

    def test_ranks_that_see_different_data_fail_instead_of_hanging(self, clean_env):
        class FakeDist:  # rank 1 of 2 sees one shard fewer
            def get_rank(self):
                return 0

            def get_world_size(self):
                return 2

            def all_gather_object(self, out, value):
                out[:] = [value, {**value, "shards": value.get("shards", 0) - 1}]

        clean_env.setattr(_dist, "_dist", lambda: FakeDist())
        topo = _dist.topology()
        assert topo == (0, 2, "torch.distributed")
        _dist.check_same(topo, "the plan", {"samples": 10})  # the same everywhere: fine
        with pytest.raises(gp.ConfigError, match=r"the plan differs between ranks \(shards: 4 here, 3 on rank 1\)"):
            _dist.check_same(topo, "the plan", {"samples": 10, "shards": 4})

    def test_random_seed_needs_torch_distributed(self, clean_env, shards):
        clean_env.setenv("RANK", "0")
        clean_env.setenv("WORLD_SIZE", "2")
        with pytest.raises(gp.ConfigError, match="pass seed=<int>"):
            gp.Loader(val(shards), 2, shuffle=True, backend="torch", device="cpu", num_workers=0)
        gp.Loader(val(shards), 2, backend="torch", device="cpu", num_workers=0)  # unshuffled: any seed will do
        loader = gp.Loader(val(shards), 2, seed=4, backend="torch", device="cpu", num_workers=0)
        assert (loader.rank, loader.world_size, loader.seed) == (0, 2, 4)


def plan_batches(sizes, world, *, sequential, shuffle, seed, epoch, buffer, interleave, batch_size, drop_last):
    """Every rank's plan of one epoch, as the checker wants it (keys are sample numbers)."""
    spec = PlanSpec(num_samples=sum(sizes), world_size=world, batch_size=batch_size, drop_last=drop_last,
                    shuffle=shuffle, shuffle_buffer=buffer, interleave=interleave)
    plans = [rank_plan(np.array(sizes), spec, sequential=sequential, seed=seed, epoch=epoch, rank=r)
             for r in range(world)]
    return plans, [[([str(s) for s in p.batch(b)[0]], p.batch(b)[1].tolist()) for b in range(p.num_batches)]
                   for p in plans]


class TestRankPlan:
    SIZES = (7, 2, 5, 3, 11, 1, 4, 9, 6, 2, 8)  # 58 samples in 11 uneven shards

    @pytest.mark.parametrize("world", [1, 2, 3, 8])
    @pytest.mark.parametrize("batch_size", [1, 3, 4, 7])
    @pytest.mark.parametrize("drop_last", [False, True])
    @pytest.mark.parametrize("shuffle, sequential", [(False, True), (True, True), (True, False)])
    def test_simulated_ranks(self, world, batch_size, drop_last, shuffle, sequential):
        kw = dict(sequential=sequential, shuffle=shuffle, seed=3, epoch=1, buffer=4, interleave=3,
                  batch_size=batch_size, drop_last=drop_last)
        _, per_rank = plan_batches(self.SIZES, world, **kw)
        total = sum(self.SIZES)
        counts = check_epoch_partition(per_rank, [str(i) for i in range(total)], world_size=world,
                                       batch_size=batch_size, drop_last=drop_last)
        if drop_last:
            assert counts["batches"] == total // (world * batch_size)
        else:
            assert counts["padding"] == -total % world

    def test_fewer_samples_than_ranks(self):
        _, per_rank = plan_batches((1, 2), 8, sequential=True, shuffle=True, seed=0, epoch=0, buffer=4,
                                   interleave=2, batch_size=2, drop_last=False)
        counts = check_epoch_partition(per_rank, ["0", "1", "2"], world_size=8, batch_size=2, drop_last=False)
        assert counts == {"batches": 1, "valid": 3, "padding": 5}

    def test_deterministic_in_seed_epoch_and_world_size(self):
        kw = dict(sequential=True, shuffle=True, buffer=8, interleave=2, batch_size=2, drop_last=False)

        def samples(seed, epoch, world):
            return [p.samples.tolist() for p in plan_batches(self.SIZES, world, seed=seed, epoch=epoch, **kw)[0]]

        assert samples(1, 2, 4) == samples(1, 2, 4)
        assert samples(1, 2, 4) != samples(1, 3, 4) != samples(2, 2, 4)
        # another world size splits the same samples differently
        assert set(sum(samples(1, 2, 4), [])) == set(sum(samples(1, 2, 3), [])) == set(range(sum(self.SIZES)))
        assert samples(1, 2, 4)[0] != samples(1, 2, 3)[0]

    def test_each_rank_reads_a_contiguous_part_of_the_shard_order(self):
        sizes = np.array(self.SIZES)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        plans, _ = plan_batches(sizes, 3, sequential=True, shuffle=True, seed=5, epoch=0, buffer=1,
                                interleave=1, batch_size=4, drop_last=False)
        order = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in shard_permutation(
            len(sizes), seed=5, epoch=0)])
        for r, p in enumerate(plans):
            start, stop = rank_range(len(order), r, 3)
            assert p.samples[p.valid].tolist() == order[start:stop].tolist()  # no mixing: exact range
        shard_sets = [{int(np.searchsorted(offsets, s, "right")) - 1 for s in p.samples[p.valid]} for p in plans]
        shared = [len(a & b) for i, a in enumerate(shard_sets) for b in shard_sets[i + 1:]]
        assert sum(shared) <= 2  # only the shards cut at the 2 rank boundaries are split (by byte range)

    def test_interleave_reads_each_shard_front_to_back(self):
        sizes = np.array(self.SIZES)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        (p,), _ = plan_batches(sizes, 1, sequential=True, shuffle=True, seed=1, epoch=0, buffer=1, interleave=4,
                               batch_size=4, drop_last=False)
        shard = np.searchsorted(offsets, p.samples, "right") - 1
        for s in range(len(sizes)):
            assert np.all(np.diff(p.samples[shard == s]) == 1)
        assert len(set(shard[:8].tolist())) >= 3  # the first samples come from several shards


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
        return float(np.mean([len(set(labels[i * self.BATCH:(i + 1) * self.BATCH].tolist())) for i in range(n)]))

    def dali_buffer_only(self, shards, epoch):
        from nvidia.dali import Pipeline, fn

        index = gp.WebDataset(shards).index()  # writes the DALI index files
        pipe = Pipeline(batch_size=self.BATCH, num_threads=1, device_id=None, seed=epoch + 1)
        with pipe:
            _, cls = fn.readers.webdataset(paths=shards, index_paths=[s.dali_index for s in index.shards],
                                           ext=["jpg", "cls"], random_shuffle=True, initial_fill=self.BUFFER)
            pipe.set_outputs(cls)
        pipe.build()
        labels = []
        for _ in range(len(index) // self.BATCH):
            (cls,) = pipe.run()
            labels += [int(bytes(np.asarray(cls[i]))) for i in range(self.BATCH)]
        return self.classes_per_batch(labels)

    def test_two_level_beats_buffer_only(self, one_class_per_shard):
        pytest.importorskip("nvidia.dali")
        loader = gp.Loader(gp.Pipeline(one_class_per_shard, [T.CenterCrop(8)]), self.BATCH, shuffle=True,
                           drop_last=True, seed=0, shuffle_buffer=self.BUFFER, interleave=self.INTERLEAVE,
                           backend="torch", device="cpu", num_workers=0)
        ours, dali, perfect = [], [], []
        n = self.SHARDS * self.PER_SHARD
        for epoch in range(3):
            loader.set_epoch(epoch)
            ours.append(self.classes_per_batch(torch.cat([labels for _, labels in loader]).tolist()))
            dali.append(self.dali_buffer_only(one_class_per_shard, epoch))
            perfect.append(self.classes_per_batch(np.random.default_rng(epoch).permutation(n) // self.PER_SHARD))
        ours, dali, perfect = np.mean(ours), np.mean(dali), np.mean(perfect)
        print(f"classes per batch of {self.BATCH}: gpupipe {ours:.1f}, DALI buffer-only {dali:.1f}, "
              f"perfect shuffle {perfect:.1f}")
        assert ours >= 1.25 * dali
        assert ours >= 0.7 * perfect


@pytest.mark.parametrize("backend", BACKENDS)
class TestLoaderRanks:
    """Simulated ranks in one process (explicit rank/world_size), real loaders and backends."""

    @pytest.mark.parametrize("world, batch_size", [(2, 4), (3, 2), (4, 3)])
    def test_eval_counts_every_sample_once(self, backend, uneven_shards, clean_env, world, batch_size):
        loaders = [gp.Loader(val(uneven_shards), batch_size, rank=r, world_size=world, backend=backend, device="cpu",
                             num_workers=1) for r in range(world)]
        assert len({len(lo) for lo in loaders}) == 1
        per_rank = [yielded(lo) for lo in loaders]
        assert [len(batches) for batches in per_rank] == [len(loaders[0])] * world
        check_epoch_partition(per_rank, all_keys(loaders[0].index), world_size=world, batch_size=batch_size,
                              drop_last=False)

    @pytest.mark.parametrize("world, batch_size", [(2, 4), (3, 2)])
    def test_train_epochs(self, backend, uneven_shards, clean_env, world, batch_size):
        loaders = [gp.Loader(val(uneven_shards), batch_size, shuffle=True, drop_last=True, seed=9, rank=r,
                             world_size=world, backend=backend, device="cpu", num_workers=1) for r in range(world)]
        seen = []
        for epoch in range(3):
            for lo in loaders:
                lo.set_epoch(epoch)
            per_rank = [yielded(lo) for lo in loaders]
            check_epoch_partition(per_rank, all_keys(loaders[0].index), world_size=world, batch_size=batch_size,
                                  drop_last=True)
            for lo, batches in zip(loaders, per_rank):  # the loader yields its plan, on every backend
                plan = lo.plan()
                assert [k for keys, _ in batches for k in keys] == [lo.index.key(int(s)) for s in plan.samples]
            seen.append(per_rank)
        assert seen[0] != seen[1] != seen[2]

    def test_same_keys_on_every_backend(self, backend, uneven_shards, clean_env):
        def keys(b):
            lo = gp.Loader(val(uneven_shards), 3, shuffle=True, seed=2, rank=1, world_size=2, backend=b,
                           device="cpu", num_workers=0)
            lo.set_epoch(4)
            return yielded(lo)

        assert keys(backend) == keys("torch")

    def test_valid_marks_the_padding(self, backend, uneven_shards, clean_env):
        # 17 samples on 2 ranks: rank 1 has 8 and repeats its first sample once
        lo = gp.Loader(val(uneven_shards), 4, rank=1, world_size=2, backend=backend, device="cpu", num_workers=0)
        batches = list(lo)
        assert [b.valid.tolist() for b in batches] == [[True] * 4, [True] * 4, [False]]
        assert batches[-1].keys == batches[0].keys[:1]
        torch.testing.assert_close(batches[-1].images[0], batches[0].images[0])


def test_dali_augmentation_depends_only_on_seed_epoch_and_rank(shards, clean_env):
    pipeline = gp.Pipeline(shards, [T.RandomResizedCrop(16), T.RandomHorizontalFlip()])

    def epoch0(first_run_epoch1):
        loader = gp.Loader(pipeline, 4, shuffle=True, seed=3, backend="dali", device="cpu", num_workers=1)
        if first_run_epoch1:  # epoch 0 then runs on a rebuilt pipeline, not the one built with the loader
            loader.set_epoch(1)
            list(loader)
            loader.set_epoch(0)
        return torch.cat([images for images, _ in loader])

    pytest.importorskip("nvidia.dali")
    torch.testing.assert_close(epoch0(False), epoch0(True), atol=0, rtol=0)


class TestWorkedExample:
    """The README's and the Loader docstring's worked example, exactly."""

    @pytest.fixture
    def ten(self, tmp_path):
        jpg = encode_jpeg(synthetic_image(0, size=(24, 24)))
        with gp.ShardWriter(str(tmp_path / "ten-%d.tar")) as w:
            for i in range(10):
                w.write(f"s{i}", {"jpg": jpg, "cls": i})
        return w.shards

    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize("drop_last, expected", [
        (False, [[(["s0", "s1"], [1, 1]), (["s2", "s3"], [1, 1])],
                 [(["s4", "s5"], [1, 1]), (["s6", "s4"], [1, 0])],
                 [(["s7", "s8"], [1, 1]), (["s9", "s7"], [1, 0])]]),
        (True, [[(["s0", "s1"], [1, 1])], [(["s4", "s5"], [1, 1])], [(["s7", "s8"], [1, 1])]]),
    ])
    def test_three_ranks_batch_two(self, ten, clean_env, backend, drop_last, expected):
        loaders = [gp.Loader(val(ten), 2, drop_last=drop_last, rank=r, world_size=3, backend=backend, device="cpu",
                             num_workers=0) for r in range(3)]
        assert [len(lo) for lo in loaders] == [len(expected[0])] * 3
        got = [[(keys, [int(v) for v in valid]) for keys, valid in yielded(lo)] for lo in loaders]
        assert got == expected

    @pytest.mark.parametrize("drop_last, sizes", [(False, [4, 4, 2]), (True, [4, 4])])
    def test_one_process(self, ten, clean_env, drop_last, sizes):
        loader = gp.Loader(val(ten), 4, drop_last=drop_last, backend="torch", device="cpu", num_workers=0)
        assert [len(keys) for keys, _ in yielded(loader)] == sizes == [4, 4, 2][:len(loader)]


class _Simulated(Source):
    """10,000 shards, 10 M samples, indexes in memory: every shard points at the same real tar,
    so samples can be read; records which shards' indexes get loaded."""

    def __init__(self, tar: str, image: tuple[int, int], label: tuple[int, int], sizes: np.ndarray) -> None:
        self.tar, self.image, self.label, self.sizes = tar, image, label, sizes
        self.loaded: list[int] = []

    def _loader(self, s: int):
        def load():
            self.loaded.append(s)
            n = int(self.sizes[s])
            keys = [f"s{s:05d}/{i:05d}" for i in range(n)]
            return keys, {"image_range": np.tile(self.image, (n, 1)), "label_range": np.tile(self.label, (n, 1))}
        return load

    def index(self, *, rank: int = 0, world_size: int = 1) -> Index:
        shards = [ShardIndex(self.tar, size=int(n), loader=self._loader(s)) for s, n in enumerate(self.sizes)]
        return Index(shards, reader=TarReader(LocalStorage(), labeled=True), sequential=True, labeled=True)


@pytest.mark.parametrize("backend", BACKENDS)
class TestScale:
    def test_ten_thousand_shards_ten_million_samples(self, backend, tmp_path, clean_env):
        with gp.ShardWriter(str(tmp_path / "one-%d.tar")) as w:
            w.write("x", {"jpg": encode_jpeg(synthetic_image(1, size=(32, 32))), "cls": 7})
        real = gp.WebDataset(w.shards).index().shards[0]
        sizes = np.random.default_rng(0).integers(500, 1501, size=10_000)
        assert 9_900_000 < sizes.sum() < 10_100_000
        source = _Simulated(w.shards[0], tuple(real.column("image_range")[0]), tuple(real.column("label_range")[0]), sizes)
        pipeline = gp.Pipeline(source, [T.CenterCrop(16)])
        loader = gp.Loader(pipeline, 256, shuffle=True, seed=1, rank=5, world_size=8, backend=backend,
                           device="cpu", num_workers=0)
        assert source.loaded == []  # start-up reads no per-sample index
        assert len(loader) == math.ceil(math.ceil(int(sizes.sum()) / 8) / 256)
        plan = loader.plan()
        mine = {loader.index.locate(int(s))[0] for s in plan.samples}
        assert len(mine) < 10_000 // 8 + 3  # its part of the shard order, boundaries included
        batches = iter(loader)
        for _ in range(3):
            batch = next(batches)
            assert batch.labels.tolist() == [7] * 256
        batches.close()
        assert set(source.loaded) <= mine and len(source.loaded) <= loader.interleave


@pytest.mark.parametrize("backend", BACKENDS)
class TestResume:
    @pytest.mark.parametrize("drop_last", [False, True])
    def test_resume_at_every_point(self, backend, uneven_shards, clean_env, drop_last):
        def make(**kw):
            return gp.Loader(val(uneven_shards), 2, shuffle=True, drop_last=drop_last, rank=1, world_size=2,
                             backend=backend, device="cpu", num_workers=0, **kw)

        run = make(seed=11)
        run.set_epoch(3)
        states, keys = [run.state_dict()], []
        for batch in run:
            keys.append(batch.keys)
            states.append(run.state_dict())
        assert [s["batches_yielded"] for s in states] == list(range(len(run) + 1))
        for k in (0, 1, len(run) // 2, len(run) - 1, len(run)):
            resumed = make(seed=11)
            resumed.load_state_dict(states[k])
            resumed.set_epoch(3)  # the training loop's usual call keeps the resume point
            assert [b.keys for b in resumed] == keys[k:]
            resumed.set_epoch(4)  # the epoch after is whole again
            assert len(list(resumed)) == len(run)

    def test_random_seed_is_restored(self, backend, uneven_shards, clean_env):
        run = gp.Loader(val(uneven_shards), 3, shuffle=True, backend=backend, device="cpu", num_workers=0)
        batches = iter(run)
        next(batches)
        state = run.state_dict()
        rest = [b.keys for b in batches]
        resumed = gp.Loader(val(uneven_shards), 3, shuffle=True, backend=backend, device="cpu", num_workers=0)
        assert resumed.seed != run.seed
        resumed.load_state_dict(state)
        assert resumed.seed == run.seed and [b.keys for b in resumed] == rest

    def test_state_after_an_epoch(self, backend, uneven_shards, clean_env):
        run = gp.Loader(val(uneven_shards), 4, seed=0, backend=backend, device="cpu", num_workers=0)
        list(run)
        run.set_epoch(1)
        assert (run.state_dict()["epoch"], run.state_dict()["batches_yielded"]) == (1, 0)

    @pytest.mark.parametrize("change, match", [
        (dict(rank=0), "rank=1"), (dict(batch_size=3), "batch_size"), (dict(world_size=3, rank=1), "world_size"),
        (dict(seed=8), "seed"), (dict(drop_last=True), "drop_last"), (dict(shuffle_buffer=7), "shuffle_buffer"),
    ])
    def test_mismatched_state_is_refused(self, backend, uneven_shards, clean_env, change, match):
        kw = dict(batch_size=2, seed=1, rank=1, world_size=2, drop_last=False, shuffle_buffer=4096)
        state = gp.Loader(val(uneven_shards), shuffle=True, backend=backend, device="cpu", num_workers=0,
                          **kw).state_dict()
        other = gp.Loader(val(uneven_shards), shuffle=True, backend=backend, device="cpu", num_workers=0,
                          **{**kw, **change})
        with pytest.raises(gp.ConfigError, match=match):
            other.load_state_dict(state)
        with pytest.raises(gp.ConfigError, match="not a gpupipe loader state"):
            other.load_state_dict({"epoch": 1})


class TestTorchrun:
    """Real ``torchrun --nproc_per_node=2`` jobs (gloo, CPU) over uneven shards, both backends."""

    def test_two_ranks(self, uneven_shards, tmp_path):
        pytest.importorskip("nvidia.dali")
        env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="error::DeprecationWarning:gpupipe")
        worker = os.path.join(os.path.dirname(__file__), "dist_worker.py")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               worker, str(tmp_path), *uneven_shards], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        keys = all_keys(gp.WebDataset(uneven_shards).index())
        assert len(keys) == sum(UNEVEN_SIZES) == 17
        for backend in BACKENDS:
            res = [r[backend] for r in ranks]
            assert res[0]["eval_len"] == res[1]["eval_len"] == len(res[0]["eval"]) == len(res[1]["eval"]) == 3
            check_epoch_partition([r["eval"] for r in res], keys, world_size=2, batch_size=4, drop_last=False)
            assert res[0]["eval_counted"] == res[1]["eval_counted"] == 17  # all_reduce of valid counts
            assert res[0]["train_seed"] == res[1]["train_seed"]  # seed=None: rank 0's, broadcast
            for epoch in range(2):
                per_rank = [r["train"][epoch]["batches"] for r in res]
                check_epoch_partition(per_rank, keys, world_size=2, batch_size=2, drop_last=True)
                train_keys = [{k for b, _ in batches for k in b} for batches in per_rank]
                assert not train_keys[0] & train_keys[1]
                shards = [set(r["train"][epoch]["shards"]) for r in res]
                assert len(shards[0] & shards[1]) <= 1  # at most the boundary shard, split by byte range
