"""Loaders as ranks of a data-parallel job, simulated in one process (explicit rank/world_size), on
every backend: exact-once evaluation, training epochs, padding, and start-up at 10 M samples."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.sources import Index, LocalStorage, ShardIndex, Source
from gpupipe.sources._webdataset import TarReader
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import all_keys, check_epoch_partition, val, yielded
from .support.targets import Target


class TestLoaderRanks:
    """Simulated ranks in one process (explicit rank/world_size), real loaders and backends."""

    @pytest.mark.parametrize("world, batch_size", [(2, 4), (3, 2), (4, 3)])
    def test_eval_counts_every_sample_once(self, backend, uneven_shards, clean_env, world, batch_size):
        loaders = [
            backend.loader(val(uneven_shards), batch_size, rank=r, world_size=world, num_workers=1)
            for r in range(world)
        ]
        assert len({len(lo) for lo in loaders}) == 1
        per_rank = [yielded(lo) for lo in loaders]
        assert [len(batches) for batches in per_rank] == [len(loaders[0])] * world
        check_epoch_partition(
            per_rank, all_keys(loaders[0].index), world_size=world, batch_size=batch_size, drop_last=False
        )

    @pytest.mark.parametrize("world, batch_size", [(2, 4), (3, 2)])
    def test_train_epochs(self, backend, uneven_shards, clean_env, world, batch_size):
        loaders = [
            backend.loader(
                val(uneven_shards),
                batch_size,
                shuffle=True,
                drop_last=True,
                seed=9,
                rank=r,
                world_size=world,
                num_workers=1,
            )
            for r in range(world)
        ]
        seen = []
        for epoch in range(3):
            for lo in loaders:
                lo.set_epoch(epoch)
            per_rank = [yielded(lo) for lo in loaders]
            check_epoch_partition(
                per_rank, all_keys(loaders[0].index), world_size=world, batch_size=batch_size, drop_last=True
            )
            for lo, batches in zip(loaders, per_rank, strict=True):  # the loader yields its plan, on every backend
                plan = lo.plan()
                assert [k for keys, _ in batches for k in keys] == [lo.index.key(int(s)) for s in plan.samples]
            seen.append(per_rank)
        assert seen[0] != seen[1] != seen[2]

    def test_same_keys_on_every_backend(self, backend, uneven_shards, clean_env):
        def keys(target):
            lo = target.loader(val(uneven_shards), 3, shuffle=True, seed=2, rank=1, world_size=2, num_workers=0)
            lo.set_epoch(4)
            return yielded(lo)

        assert keys(backend) == keys(Target("torch", "cpu"))

    def test_valid_marks_the_padding(self, backend, uneven_shards, clean_env):
        # 17 samples on 2 ranks: rank 1 has 8 and repeats its first sample once
        lo = backend.loader(val(uneven_shards), 4, rank=1, world_size=2, num_workers=0)
        batches = list(lo)
        assert [b.valid.tolist() for b in batches] == [[True] * 4, [True] * 4, [False]]
        assert batches[-1].keys == batches[0].keys[:1]
        torch.testing.assert_close(batches[-1].images[0], batches[0].images[0])


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

    def index(self, *, rank: int = 0, world_size: int = 1, on_error: Any = "raise") -> Index:
        shards = [ShardIndex(self.tar, size=int(n), loader=self._loader(s)) for s, n in enumerate(self.sizes)]
        return Index(shards, reader=TarReader(LocalStorage(), labeled=True), sequential=True, labeled=True)


class TestScale:
    def test_ten_thousand_shards_ten_million_samples(self, backend, tmp_path, clean_env):
        with gp.ShardWriter(str(tmp_path / "one-%d.tar")) as w:
            w.write("x", {"jpg": encode_jpeg(synthetic_image(1, size=(32, 32))), "cls": 7})
        real = gp.WebDataset(w.shards).index().shards[0]
        sizes = np.random.default_rng(0).integers(500, 1501, size=10_000)
        assert 9_900_000 < sizes.sum() < 10_100_000
        source = _Simulated(
            w.shards[0], tuple(real.column("image_range")[0]), tuple(real.column("label_range")[0]), sizes
        )
        pipeline = gp.Pipeline(source, [T.CenterCrop(16)])
        loader = backend.loader(pipeline, 256, shuffle=True, seed=1, rank=5, world_size=8, num_workers=0)
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
