"""Datasets that grow between epochs: ``WebDataset(pattern, relist=True)`` is listed again at each
new epoch; a state records the listing its epoch read, so a resume reads exactly those shards."""

from __future__ import annotations

import os

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.storage._schemes import list_urls

from .support.data import write_webdataset_shards


def pipeline(source) -> gp.Pipeline:
    return gp.Pipeline(source, [T.RandomResizedCrop(10), T.ToDtype(torch.float32)])


def add_shard(root, name: str, size: int) -> list[str]:
    """Writes a shard of ``size`` samples elsewhere and renames it into ``root`` (as a producer
    should: never a half-written shard under the pattern); returns its keys."""
    staging = os.path.join(root, "staging")
    os.makedirs(staging, exist_ok=True)
    (path,) = write_webdataset_shards(staging, (size,), prefix=name)
    os.replace(path, os.path.join(root, f"{name}.tar"))
    return [f"img/00/{n:06d}" for n in range(size)]


def keys_of(loader: gp.Loader, epoch: int) -> list[tuple[str, torch.Tensor]]:
    loader.set_epoch(epoch)
    return [(k, image.clone()) for b in loader for k, ok, image in zip(b.keys, b.valid.tolist(), b.images,
                                                                       strict=True) if ok]  # fmt: skip


@pytest.fixture
def growing(tmp_path) -> str:
    root = str(tmp_path / "shards")
    os.makedirs(root)
    add_shard(root, "train-a", 5)
    return root


class TestListing:
    def test_globs_and_braces_over_what_exists(self, tmp_path):
        for name in ("b.tar", "a.tar", "c.txt", "d-1.tar"):
            (tmp_path / name).write_bytes(b"")
        base = str(tmp_path)
        assert list_urls([f"{base}/*.tar"]) == [f"{base}/a.tar", f"{base}/b.tar", f"{base}/d-1.tar"]
        assert list_urls([f"{base}/d-{{0..3}}.tar", f"{base}/b.tar", f"{base}/[ab].tar"]) == [
            f"{base}/d-1.tar", f"{base}/b.tar", f"{base}/a.tar"
        ]  # fmt: skip
        assert list_urls([f"file://{base}/a.tar", f"{base}/missing.tar"]) == [f"{base}/a.tar"]

    def test_a_pattern_with_no_shard_yet_is_a_config_error(self, tmp_path):
        source = gp.WebDataset(str(tmp_path / "*.tar"), relist=True)
        assert source.listing() == ()
        with pytest.raises(gp.ConfigError, match="no shard matches"):
            gp.Loader(pipeline(source), 2, backend="torch", num_workers=0)
        with pytest.raises(gp.ConfigError, match="relist must be"):
            gp.WebDataset(str(tmp_path / "*.tar"), relist="yes")  # type: ignore[arg-type]

    def test_sources_compare_by_pattern(self, growing):
        one = gp.WebDataset(os.path.join(growing, "*.tar"), relist=True)
        add_shard(growing, "train-b", 2)
        assert one == gp.WebDataset(os.path.join(growing, "*.tar"), relist=True)
        assert len(one.listing() or ()) == 2 and one.urls == (os.path.join(growing, "*.tar"),)


class TestGrowingEpochs:
    def test_each_epoch_reads_the_shards_present_at_its_start(self, backend, growing, clean_env):
        source = gp.WebDataset(os.path.join(growing, "train-*.tar"), relist=True, label=None)
        with backend.loader(pipeline(source), 2, shuffle=True, seed=1, num_workers=1) as loader:
            assert len(keys_of(loader, 0)) == 5 and len(loader) == 3
            first_runner = loader._runners.current
            add_shard(growing, "train-b", 4)
            loader.set_epoch(0)  # the same epoch again: not listed again
            assert len(loader) == 3 and loader._runners.current is first_runner
            assert len(keys_of(loader, 1)) == 9 and len(loader) == 5
            assert loader._runners.current is not first_runner and getattr(first_runner, "_closed", True)
            os.remove(os.path.join(growing, "train-a.tar"))  # evicted by the producer between epochs
            assert len(keys_of(loader, 2)) == 4 and len(loader) == 2
            assert loader.stats()["sources"][0]["per_epoch"] == 4

    def test_resume_reads_the_listing_of_its_epoch(self, backend, growing, clean_env):
        """Saved mid-epoch 1 (9 samples); a shard arrives before the job comes back: the resumed
        epoch is the interrupted one's (same keys, same images), the next one has the new shard."""
        source = gp.WebDataset(os.path.join(growing, "train-*.tar"), relist=True, label=None)

        def make() -> gp.Loader:
            return backend.loader(pipeline(source), 2, shuffle=True, seed=1, num_workers=1)

        add_shard(growing, "train-b", 4)
        with make() as loader:
            loader.set_epoch(1)
            iteration = iter(loader)
            first = [next(iteration) for _ in range(2)]
            state = loader.state_dict()
            rest = [(k, im.clone()) for b in iteration for k, im in zip(b.keys, b.images, strict=True)]
        assert len(state["listing"]) == 2 and sum(len(b.keys) for b in first) == 4
        add_shard(growing, "train-c", 3)
        with make() as resumed:
            assert len(resumed) == 6  # built on the 3 shards there now
            resumed.load_state_dict(state)
            resumed.set_epoch(1)
            assert len(resumed) == 5
            again = [(k, im.clone()) for b in resumed for k, im in zip(b.keys, b.images, strict=True)]
            assert [k for k, _ in again] == [k for k, _ in rest]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again, rest, strict=True))
            assert len(keys_of(resumed, 2)) == 12  # the next epoch: listed again

    def test_a_mix_of_a_growing_source_keeps_its_counts(self, backend, growing, shards, clean_env):
        mix = gp.Mix([gp.WebDataset(os.path.join(growing, "*.tar"), relist=True, label=None),
                      gp.WebDataset(shards, label=None)], counts=[6, 4])  # fmt: skip
        with backend.loader(pipeline(mix), 2, shuffle=True, seed=1, num_workers=1) as loader:
            assert len(keys_of(loader, 0)) == 10
            add_shard(growing, "train-b", 30)
            assert len(keys_of(loader, 1)) == 10
            assert [s["per_epoch"] for s in loader.stats()["sources"]] == [6, 4]
            assert len(loader.index) == 5 + 30 + 16
