"""Issue 11, first part: the ``on_error`` policy on every backend — ``"raise"`` names the shard and
the key; ``"skip"`` leaves bad samples out, keeps every rank's batches equal (the bad sample's
place is padding, marked in ``batch.valid``), lists them, caps them, and resumes exactly."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T

from .support.checkers import check_exact_resume
from .support.data import truncated_jpeg, write_webdataset_shards

SIZES = (6, 6)
BAD = {  # sample number -> what is wrong with it
    1: {"jpg": truncated_jpeg(1)},
    3: {"jpg": b""},
    7: {"jpg": b"this is not an image"},
    9: {"cls": b"cat"},
}


def key(n: int) -> str:
    return f"img/{n // 6:02d}/{n:06d}"


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> list[str]:
    """Two shards of 6 samples; samples 1, 3, 7 and 9 are damaged (``BAD``)."""
    return write_webdataset_shards(str(tmp_path_factory.mktemp("damaged")), SIZES, prefix="damaged", patch=BAD)


def pipeline(urls):
    return gp.Pipeline(urls, [T.RandomResizedCrop(16), T.RandomHorizontalFlip()])


def run(loader):
    return [(b.keys, b.valid.cpu().clone(), b.images.cpu().clone(), b.labels.cpu().clone()) for b in loader]


def staged(urls):
    """A tail the stage runs (``Loader(stage=True)``; on a GPU, the default)."""
    return gp.Pipeline(urls, [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.TrivialAugmentWide(),
                              T.ToDtype(torch.float32, scale=True), T.RandomErasing(p=0.5)])  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Buggy(T.ArrayFunction):
    """A user's transform with a bug (a ValueError, as the torch kernels' size refusals were)."""

    def apply(self, image, xp):
        raise ValueError("a bug in my transform")


class TestRaise:
    def test_the_first_bad_sample_raises_naming_shard_and_key(self, backend, damaged):
        with backend.loader(pipeline(damaged), 4, num_workers=1) as loader, pytest.raises(gp.DataError) as info:
            run(loader)
        assert info.value.key == key(1) and info.value.shard == damaged[0]
        assert key(1) in str(info.value) and damaged[0] in str(info.value)


class TestSkip:
    def test_bad_samples_are_left_out_and_batches_stay_equal(self, backend, damaged):
        with backend.loader(pipeline(damaged), 4, num_workers=1, on_error="skip", max_skipped=None) as loader:
            batches = run(loader)
            skipped = loader.skipped
            state = loader.state_dict()
            if backend.backend == "dali":  # DALI failed on three iterations: isolated, never rebuilt
                assert loader._runner.builds == 1
        assert len(batches) == len(loader) == 3 and all(len(k) == 4 for k, *_ in batches)
        delivered = [k for keys, valid, *_ in batches for k, v in zip(keys, valid.tolist(), strict=True) if v]
        assert sorted(delivered) == sorted(key(n) for n in range(12) if n not in BAD)  # each good one once
        invalid = sum(int((~valid).sum()) for _, valid, *_ in batches)
        assert invalid == len(BAD)
        assert sorted(s.key for s in skipped) == sorted(key(n) for n in BAD)
        assert all(
            s.shard == damaged[n // 6]
            for s, n in zip(sorted(skipped, key=lambda s: s.key or ""), sorted(BAD), strict=True)
        )
        assert all(s.epoch == 0 and s.key in s.reason for s in skipped)
        assert sorted(r["key"] for r in state["skipped"]) == sorted(key(n) for n in BAD)
        for keys, valid, images, labels in batches:  # a skipped place holds a copy of a good sample
            for i in (~valid).nonzero().flatten().tolist():
                j = keys.index(keys[i])
                assert bool(valid[j]) and torch.equal(images[i], images[j]) and labels[i] == labels[j]

    def test_with_the_stage_a_left_out_place_is_still_a_copy(self, backend, damaged):
        """The stage runs a skipped place's tail with its donor's draws: still the donor's copy."""
        with backend.loader(staged(damaged), 4, num_workers=1, on_error="skip", max_skipped=None,
                            stage=True) as loader:  # fmt: skip
            batches = run(loader)
        delivered = [k for keys, valid, *_ in batches for k, v in zip(keys, valid.tolist(), strict=True) if v]
        assert sorted(delivered) == sorted(key(n) for n in range(12) if n not in BAD)
        assert batches[0][2].dtype == torch.float32
        for keys, valid, images, labels in batches:
            for i in (~valid).nonzero().flatten().tolist():
                j = keys.index(keys[i])
                assert bool(valid[j]) and torch.equal(images[i], images[j]) and labels[i] == labels[j]

    def test_a_donor_that_fails_a_check_is_not_copied(self, backend, tmp_path):
        """Sample 3 cannot be decoded and takes a copy of the first decodable sample, which is too
        small for the crop: every left-out place then holds the first sample that passes both."""
        urls = write_webdataset_shards(str(tmp_path), (6,), prefix="donor", patch={3: {"jpg": truncated_jpeg(3)}})
        with backend.loader(gp.Pipeline(urls, [T.RandomCrop(80)]), 6, num_workers=0, on_error="skip",
                            max_skipped=None) as loader:  # fmt: skip
            (keys, valid, images, labels), *_ = run(loader)
        assert not valid[3] and valid.sum() >= 1
        good = int(valid.nonzero()[0])
        for i in (~valid).nonzero().flatten().tolist():
            assert keys[i] == keys[good] and labels[i] == labels[good] and torch.equal(images[i], images[good])

    def test_a_bad_sample_is_logged_once(self, backend, damaged, caplog):
        with (
            backend.loader(pipeline(damaged), 4, num_workers=0, on_error="skip", max_skipped=None) as loader,
            caplog.at_level("WARNING", logger="gpupipe"),
        ):
            for epoch in range(2):
                loader.set_epoch(epoch)
                run(loader)
        logged = [r for r in caplog.records if "skipped a sample" in r.getMessage()]
        assert len(logged) == len(BAD) and len(loader.skipped) == len(BAD)

    @pytest.mark.parametrize("cap", [2, 0.2])
    def test_more_bad_samples_than_the_cap_is_an_error(self, backend, damaged, cap):
        with (
            backend.loader(pipeline(damaged), 4, num_workers=0, on_error="skip", max_skipped=cap) as loader,
            pytest.raises(gp.DataError, match="max_skipped"),
        ):
            run(loader)

    def test_resume_is_exact(self, backend, damaged):
        def make():
            return backend.loader(pipeline(damaged), 4, num_workers=1, seed=5, shuffle=True, on_error="skip",
                                  max_skipped=None)  # fmt: skip

        states, resumed = check_exact_resume(make, epoch=1)
        assert {s.key for s in resumed.skipped} >= {r["key"] for r in states[0]["skipped"]}

    def test_resume_with_the_stage_is_exact(self, backend, damaged):
        def make():
            return backend.loader(staged(damaged), 4, num_workers=1, seed=5, shuffle=True, on_error="skip",
                                  max_skipped=None, stage=True)  # fmt: skip

        check_exact_resume(make, epoch=1)

    def test_a_batch_of_only_bad_samples(self, backend, tmp_path):
        bad = {n: {"jpg": b"not an image"} for n in range(4)}
        urls = write_webdataset_shards(str(tmp_path), (4, 4), prefix="allbad", patch=bad)
        with backend.loader(pipeline(urls), 4, num_workers=0, on_error="skip", max_skipped=None) as loader:
            batches = run(loader)
        assert [int(v.sum()) for _, v, *_ in batches] == [0, 4]
        assert all(images.shape == (4, 3, 16, 16) for _, _, images, _ in batches)
        with backend.loader(staged(urls), 4, num_workers=0, on_error="skip", max_skipped=None, stage=True) as loader:
            batches = run(loader)  # the blanks go through the tail too
        assert all(images.shape == (4, 3, 16, 16) and images.dtype == torch.float32 for _, _, images, _ in batches)

    def test_a_shard_truncated_after_indexing_keeps_the_samples_before_the_cut(self, backend, damaged, tmp_path):
        urls = [shutil.copy(u, tmp_path / os.path.basename(u)) for u in damaged]
        with backend.loader(pipeline([str(u) for u in urls]), 4, num_workers=0, on_error="skip",
                            max_skipped=None) as loader:  # fmt: skip
            cut = loader.index.shards[1]
            os.truncate(cut.path, int(cut.column("image_range")[4, 0]) + 10)  # samples 10 and 11 cut off
            batches = run(loader)
            reasons = {s.key: s.reason for s in loader.skipped}
        delivered = {k for keys, valid, *_ in batches for k, v in zip(keys, valid.tolist(), strict=True) if v}
        assert delivered == {key(n) for n in range(10) if n not in BAD}
        assert "truncated" in reasons[key(10)] and "truncated" in reasons[key(11)]


class TestNotTheData:
    def test_a_transforms_own_error_ends_the_epoch_on_every_backend(self, backend, damaged):
        """A user's function raising ``ValueError`` was a skipped ``too-small`` sample on the torch
        backend (its size refusals were ValueErrors) and ended the epoch on DALI (review,
        2026-11-29): the program's error is not the data's, on every backend."""
        pipe = gp.Pipeline(damaged, [T.CenterCrop(16), Buggy()])
        with backend.loader(pipe, 4, num_workers=1, on_error="skip", max_skipped=None) as loader:
            with pytest.raises(Exception, match="a bug in my transform") as info:
                run(loader)
            assert not isinstance(info.value, gp.DataError)
            assert all(s.kind != "too-small" for s in loader.skipped)


class TestConfig:
    @pytest.mark.parametrize("cap", [-1, 1.5, 0.0, True, "1"])
    def test_bad_caps_are_refused(self, cap):
        with pytest.raises(gp.ConfigError, match="max_skipped"):
            gp.LoaderConfig(4, on_error="skip", max_skipped=cap)

    def test_on_error_is_an_enum(self):
        assert gp.LoaderConfig(4, on_error="skip").on_error is gp.OnError.SKIP
        with pytest.raises(gp.ConfigError, match="on_error"):
            gp.LoaderConfig(4, on_error="ignore")

    def test_skip_limit(self):
        assert gp.LoaderConfig(4, max_skipped=0.01).skip_limit(1000) == 10
        assert gp.LoaderConfig(4, max_skipped=3).skip_limit(1000) == 3
        assert gp.LoaderConfig(4, max_skipped=None).skip_limit(1000) is None
