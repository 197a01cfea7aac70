"""Resuming mid-epoch on every backend: state_dict / load_state_dict."""

from __future__ import annotations

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
