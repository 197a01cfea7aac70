"""Shards sorted by label: ``gpupipe check`` reports each shard's label runs, and a shuffled loader
whose first batches hold far fewer labels than a full shuffle's warns once
(``loader.stats()["labels"]``)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.cli._main import main
from gpupipe.pipeline._check import check
from gpupipe.pipeline._labels import batch_mixing, label_order, looks_sorted, summary

from .support.data import write_webdataset_shards

SHARDS, PER_SHARD = 8, 32


@pytest.fixture(scope="module")
def by_class(tmp_path_factory) -> list[str]:
    """8 shards of 32 samples, shard s holding class s alone: an ImageFolder tarred class by class."""
    patch = {n: {"cls": str(n // PER_SHARD).encode()} for n in range(SHARDS * PER_SHARD)}
    return write_webdataset_shards(str(tmp_path_factory.mktemp("sorted")), (PER_SHARD,) * SHARDS, patch=patch)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> list[str]:
    """The same classes, in a shuffled order."""
    labels = np.random.default_rng(0).permutation(np.arange(SHARDS * PER_SHARD) // PER_SHARD)
    patch = {n: {"cls": str(int(c)).encode()} for n, c in enumerate(labels)}
    return write_webdataset_shards(str(tmp_path_factory.mktemp("mixed")), (PER_SHARD,) * SHARDS, patch=patch)


class TestLabelOrder:
    def test_runs_and_counts(self):
        order = label_order(np.array([3, 3, 3, 1, 1, 3, 2]))
        assert (order.samples, order.same, order.longest) == (7, 3, 3) and order.counts == {1: 2, 2: 1, 3: 4}
        assert label_order(np.array([], dtype=np.int64)).samples == 0

    def test_sorted_against_shuffled(self):
        assert looks_sorted(1.0, 0.1) and not looks_sorted(0.12, 0.1) and not looks_sorted(0.6, 0.5)

    def test_the_datasets_summary(self):
        got = summary({"a": label_order(np.zeros(10, np.int64)), "b": label_order(np.arange(10) % 5)})
        assert got is not None and got["classes"] == 5 and got["sorted"] == ["a"] and got["longest"] == 10
        assert got["same"] == pytest.approx(9 / 18) and got["expected"] == pytest.approx(0.6**2 + 4 * 0.1**2)
        assert summary({}) is None

    def test_batches_against_a_full_shuffle(self):
        got = batch_mixing([np.zeros(8, np.int64), np.ones(8, np.int64)])
        assert got is not None and got["distinct"] == 1.0 and got["ratio"] < 0.6
        assert got["expected"] == pytest.approx(2 * (1 - 0.5**8))
        assert batch_mixing([]) is None


class TestCheck:
    def test_sorted_shards_are_reported_not_failed(self, by_class, capsys):
        report = check(by_class, workers=0, write=False)
        assert report.ok and report.labels is not None
        assert len(report.labels["sorted"]) == SHARDS and report.labels["longest"] == PER_SHARD
        assert report.labels["same"] == 1.0 and report.labels["expected"] == pytest.approx(1 / SHARDS)
        assert "8 shards of 8 look sorted by label" in report.summary() and "make-shards" in report.summary()
        assert main(["check", *by_class, "--workers", "0", "--no-write", "--json", "--quiet"]) == 0
        assert json.loads(capsys.readouterr().out)["labels"]["classes"] == SHARDS

    def test_shuffled_shards_say_nothing(self, mixed):
        report = check(mixed, workers=0, write=False)
        assert report.labels is not None and report.labels["sorted"] == [] and "labels:" not in report.summary()

    def test_unlabeled(self, tmp_path):
        (shard,) = write_webdataset_shards(str(tmp_path), (4,), label=False)
        assert check(gp.WebDataset([shard], label=None), workers=0, write=False).labels is None


class TestLoader:
    def run(self, shards: list[str], **options) -> tuple[dict | None, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gp.Loader(gp.Pipeline(shards, [T.CenterCrop(8)]), 16, backend="torch", device="cpu", num_workers=0,
                           shuffle=True, **options) as loader:  # fmt: skip
                for epoch in range(2):
                    loader.set_epoch(epoch)
                    for _ in loader:
                        pass
                labels = loader.stats()["labels"]
        return labels, [str(w.message) for w in caught if "sorted by label" in str(w.message)]

    def test_batches_of_sorted_shards_warn_once(self, by_class):
        """A window of 16 samples over one shard at a time: each batch holds one or two classes of
        the eight (a full shuffle's hold seven)."""
        labels, said = self.run(by_class, shuffle_buffer=16, interleave=1)
        assert labels is not None and labels["ratio"] < 0.5 and labels["expected"] > 6
        assert len(said) == 1 and "gpupipe check reports the label runs" in said[0]

    def test_a_window_that_mixes_them_says_nothing(self, by_class, mixed):
        for shards, options in ((by_class, {}), (mixed, {"shuffle_buffer": 16, "interleave": 1})):
            labels, said = self.run(shards, **options)
            assert labels is not None and labels["ratio"] > 0.5 and not said
