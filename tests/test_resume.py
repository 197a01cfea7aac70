"""Resuming mid-epoch on every backend: state_dict / load_state_dict."""

from __future__ import annotations

import os
import warnings

import pytest

import gpupipe as gp

from .support.checkers import val


class TestResume:
    @pytest.mark.parametrize("drop_last", [False, True])
    def test_resume_at_every_point(self, backend, uneven_shards, clean_env, drop_last):
        def make(**kw):
            return backend.loader(
                val(uneven_shards), 2, shuffle=True, drop_last=drop_last, rank=1, world_size=2, num_workers=0, **kw
            )

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
        run = backend.loader(val(uneven_shards), 3, shuffle=True, num_workers=0)
        batches = iter(run)
        next(batches)
        state = run.state_dict()
        rest = [b.keys for b in batches]
        resumed = backend.loader(val(uneven_shards), 3, shuffle=True, num_workers=0)
        assert resumed.seed != run.seed
        resumed.load_state_dict(state)
        assert resumed.seed == run.seed and [b.keys for b in resumed] == rest

    def test_another_epoch_after_loading_a_state_warns(self, backend, uneven_shards, clean_env):
        """An off-by-one start epoch after load_state_dict would drop the resume silently."""
        run = backend.loader(val(uneven_shards), 3, shuffle=True, seed=0, num_workers=0)
        run.set_epoch(1)
        next(iter(run))
        state = run.state_dict()
        resumed = backend.loader(val(uneven_shards), 3, shuffle=True, seed=0, num_workers=0)
        resumed.load_state_dict(state)
        resumed.set_epoch(1)  # the state's own epoch: kept, no warning
        assert resumed.state_dict()["batches_yielded"] == 1
        with pytest.warns(UserWarning, match=r"set_epoch\(0\) after load_state_dict\(\) of a state in epoch 1 "
                          r"\(batch 1\): the loaded position is dropped"):  # fmt: skip
            resumed.set_epoch(0)
        assert len(list(resumed)) == len(resumed)  # epoch 0, whole
        done = backend.loader(val(uneven_shards), 3, shuffle=True, seed=0, num_workers=0)
        list(done)
        after = backend.loader(val(uneven_shards), 3, shuffle=True, seed=0, num_workers=0)
        after.load_state_dict(done.state_dict())  # saved at the end of epoch 0: going on with 1 drops nothing
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            after.set_epoch(1)

    def test_a_state_of_an_epochs_end_goes_on_with_the_next(self, backend, uneven_shards, clean_env):
        """Iterated without set_epoch, the resumed loader goes on as the saving one would have:
        with the next epoch, not an empty rest of the saved one."""
        run = backend.loader(val(uneven_shards), 4, shuffle=True, seed=0, num_workers=0)
        list(run)
        state = run.state_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the advance's warning)
            expected = [b.keys for b in run]
            resumed = backend.loader(val(uneven_shards), 4, shuffle=True, seed=0, num_workers=0)
            resumed.load_state_dict(state)
            assert [b.keys for b in resumed] == expected and resumed.epoch == run.epoch == 1

    def test_state_after_an_epoch(self, backend, uneven_shards, clean_env):
        run = backend.loader(val(uneven_shards), 4, seed=0, num_workers=0)
        list(run)
        run.set_epoch(1)
        assert (run.state_dict()["epoch"], run.state_dict()["batches_yielded"]) == (1, 0)

    @pytest.mark.parametrize(
        "change, match",
        [
            (dict(interleave=3), "interleave"),
            (dict(seed=8), "seed"),
            (dict(drop_last=True), "drop_last"),
            (dict(shuffle_buffer=7), "shuffle_buffer"),
        ],
    )
    def test_mismatched_state_is_refused(self, backend, uneven_shards, clean_env, change, match):
        """Other plan settings than world size and batch size (those two resume elastically:
        tests/test_elastic.py)."""
        kw = dict(batch_size=2, seed=1, rank=1, world_size=2, drop_last=False, shuffle_buffer=4096)
        state = backend.loader(val(uneven_shards), shuffle=True, num_workers=0, **kw).state_dict()
        other = backend.loader(val(uneven_shards), shuffle=True, num_workers=0, **{**kw, **change})
        with pytest.raises(gp.ConfigError, match=match):
            other.load_state_dict(state)
        with pytest.raises(gp.ConfigError, match="not a gpupipe loader state"):
            other.load_state_dict({"epoch": 1})


class TestStatesFromElsewhere:
    """A state handed to ``load_state_dict`` may come from another run, another dataset, or be
    damaged: it is refused with a ConfigError, fast, and a refused state changes nothing (found by
    a review, 2026-11-29: another dataset of the same size was taken, world_size=10**9 ran for
    minutes, a bad skipped record was half taken)."""

    @staticmethod
    def loader(urls, **options) -> gp.Loader:
        return gp.Loader(val(urls), 4, backend="torch", num_workers=0, shuffle=True, seed=1, **options)

    @staticmethod
    def saved(shards) -> dict:
        with TestStatesFromElsewhere.loader(shards) as loader:
            it = iter(loader)
            next(it)
            return loader.state_dict()

    def test_a_state_of_other_data_is_refused(self, shards, tmp_path):
        import shutil

        from .support.data import SHARD_SIZES, write_webdataset_shards

        state = self.saved(shards)
        (tmp_path / "other").mkdir()
        others = write_webdataset_shards(str(tmp_path / "other"), SHARD_SIZES, prefix="other")  # the same counts
        for urls in (others, shards[::-1]):
            with self.loader(urls) as loader, pytest.raises(gp.ConfigError, match="saved over other data"):
                loader.load_state_dict(state)
        moved = []
        for shard in shards:  # the same shards in another folder: the same data
            moved.append(str(tmp_path / os.path.basename(shard)))
            shutil.copy(shard, moved[-1])
        with self.loader(moved) as loader:
            loader.load_state_dict(state)
            assert loader.state_dict()["batches_yielded"] == 1
        old = {k: v for k, v in state.items() if k != "data"}  # a state saved before the digest
        with self.loader(shards) as loader:
            loader.load_state_dict(old)

    @pytest.mark.parametrize(
        "where, value",
        [("world_size", 0), ("world_size", "1"), ("world_size", 10**9), ("batch_size", 0), ("batch_size", 2.5),
         ("drop_last", 1), ("seed", None), ("seed", "abc"), ("seed", 1.5), ("skipped", [1]),
         ("skipped", [{"key": "k", "shard": "s", "reason": "r", "epoch": 0, "bogus": 1}]),
         ("skipped_in_epoch", -1000), ("skipped_in_epoch", "x"), ("layout", "first")],
    )  # fmt: skip
    def test_a_damaged_state_is_refused_and_changes_nothing(self, shards, where, value):
        import time

        state = self.saved(shards)
        if where in ("world_size", "batch_size", "drop_last"):
            state["plan"] = {**state["plan"], where: value}
        elif where == "layout":  # an elastic layout whose first plan names 10**8 ranks
            state["layout"] = {"first": {**state["plan"], "world_size": 10**8}, "ranges": [[0, 4]], "offset": 0}
        else:
            state[where] = value
        with self.loader(shards) as loader:
            before = loader.state_dict()
            started = time.monotonic()
            with pytest.raises(gp.ConfigError):
                loader.load_state_dict(state)
            assert time.monotonic() - started < 5
            assert loader.state_dict() == before

    def test_a_mix_listing_with_a_source_that_does_not_grow_is_urls(self):
        from gpupipe.loader._resumable import _urls

        assert _urls([["a.tar", "b.tar"], None]) and _urls(["a.tar"]) and _urls([])
        assert not _urls("a.tar") and not _urls([1]) and not _urls(None) and not _urls([[[["a.tar"]]]])

    def test_an_image_folder_named_with_a_trailing_slash_is_the_same_data(self, tmp_path):
        from gpupipe.testing import encode_jpeg, synthetic_image

        for c in range(2):
            (tmp_path / "train" / f"c{c}").mkdir(parents=True)
            for i in range(4):
                (tmp_path / "train" / f"c{c}" / f"{i}.jpg").write_bytes(encode_jpeg(synthetic_image(i, size=(24, 32))))
        root = str(tmp_path / "train")
        with self.loader(gp.ImageFolder(root + "/")) as loader:
            next(iter(loader))
            state = loader.state_dict()
        with self.loader(gp.ImageFolder(root)) as loader:
            loader.load_state_dict(state)
            assert loader.state_dict()["batches_yielded"] == 1
