"""One validated options object: LoaderConfig, shared argument checks, and versioned loader states."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T

from .support.checkers import check_invalid


def val(source):
    return gp.Pipeline(source, [T.Resize(24), T.CenterCrop(16), T.ToDtype(torch.float32, scale=True)])


class TestLoaderConfig:
    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(batch_size=0), "batch_size must be a positive int"),
            (dict(batch_size=True), "batch_size"),
            (dict(batch_size=2, shuffle=1), "shuffle must be True or False"),
            (dict(batch_size=2, drop_last="no"), "drop_last"),
            (dict(batch_size=2, seed=1.5), "seed must be an int or None"),
            (dict(batch_size=2, seed=2**64), r"seed must be an int64"),  # (it planned as seed=0)
            (dict(batch_size=2, seed=-(2**63) - 1), r"seed must be an int64"),
            (dict(batch_size=2, backend=3), "backend must be a backend's name or 'auto'"),
            (dict(batch_size=2, device="tpu"), "device must be 'cpu' or 'cuda"),
            (dict(batch_size=2, device=3.0), "device"),
            (dict(batch_size=2, num_workers=-1), "num_workers must be None or an int >= 0"),
            (dict(batch_size=2, prefetch=0), "prefetch must be None or an int >= 1"),
            (dict(batch_size=2, shuffle_buffer=0), "shuffle_buffer"),
            (dict(batch_size=2, interleave=True), "interleave"),
            (dict(batch_size=2, shards_ahead=-1), "shards_ahead must be None or an int >= 0"),
            (dict(batch_size=2, rank=True, world_size=2), "rank"),
            (dict(batch_size=2, memory_format=torch.preserve_format), "memory_format"),
        ],
    )
    def test_invalid(self, kwargs, match):
        check_invalid(lambda: gp.LoaderConfig(**kwargs), match)

    def test_loader_reports_the_same_errors(self, shards):
        with pytest.raises(gp.ConfigError, match="Loader: prefetch must be None or an int >= 1, got 0"):
            gp.Loader(val(shards), 2, prefetch=0)
        with pytest.raises(gp.ConfigError, match="Loader: unknown option shufle=True; did you mean shuffle="):
            gp.Loader(val(shards), 2, shufle=True)

    def test_frozen_and_normalised(self):
        config = gp.LoaderConfig(8, device=torch.device("cpu"))
        assert config.device == "cpu" and config.backend == "auto" and not config.channels_last
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.batch_size = 4  # type: ignore[misc]
        assert gp.LoaderConfig(8, memory_format=torch.channels_last).channels_last

    def test_options_are_keyword_only(self):
        with pytest.raises(TypeError):
            gp.LoaderConfig(8, True)  # type: ignore[call-arg]

    def test_loader_from_config(self, shards):
        config = gp.LoaderConfig(4, shuffle=True, seed=3, backend="torch", device="cpu", num_workers=0)
        loader = gp.Loader.from_config(val(shards), config)
        assert loader.config is config and loader.seed == 3 and len(loader) == 4
        assert (loader.shuffle, loader.drop_last, loader.prefetch, loader.shuffle_buffer, loader.interleave) == (
            True,
            False,
            2,
            4096,
            64,
        )
        assert loader.channels_last is False and loader.num_workers == 0 and loader.batch_size == 4
        same = gp.Loader(val(shards), 4, shuffle=True, seed=3, backend="torch", device="cpu", num_workers=0)
        assert same.config == config
        assert [b.keys for b in loader] == [b.keys for b in same]
        evaluation = gp.Loader.from_config(val(shards), dataclasses.replace(config, shuffle=False))
        assert [k for b in evaluation for k in b.keys] == [evaluation.index.key(i) for i in range(16)]
        with pytest.raises(gp.ConfigError, match=r"config must be a gp\.LoaderConfig"):
            gp.Loader.from_config(val(shards), {"batch_size": 4})  # type: ignore[arg-type]


class TestSharedChecks:
    """transforms, rank discovery and the shard writer use the same checks (and messages)."""

    def test_shard_writer(self, tmp_path):
        check_invalid(lambda: gp.ShardWriter(str(tmp_path / "s-%d.tar"), max_count=True), "max_count")
        check_invalid(lambda: gp.ShardWriter(str(tmp_path / "s-%d.tar"), start=-1), "start must be an int >= 0")

    def test_explicit_rank(self):
        from gpupipe.runtime import _dist

        check_invalid(lambda: _dist.topology(True, 2), "rank must be an int")
        check_invalid(lambda: _dist.topology(0, 2.0), "world_size must be an int")  # type: ignore[arg-type]


class TestStateVersions:
    def test_state_names_its_version_and_plan(self, shards):
        loader = gp.Loader(val(shards), 4, seed=1, backend="torch", device="cpu", num_workers=0)
        state = loader.state_dict()
        assert state["version"] == 2
        assert state["plan"] == dict(
            num_samples=16,
            world_size=1,
            batch_size=4,
            drop_last=False,
            shuffle=False,
            shuffle_buffer=4096,
            interleave=64,
            mask="",
            mix="",
            repeats=1,
        )

    def test_a_state_of_another_format_is_refused(self, shards):
        """Only this version's states load (0.1.0 is unreleased: no older format is kept)."""
        old = {"version": 1, "epoch": 2, "batches_yielded": 1, "seed": 7, "rank": 0, "num_samples": 16}
        loader = gp.Loader(val(shards), 4, shuffle=True, backend="torch", device="cpu", num_workers=0)
        for state in (old, {"epoch": 2}, "not a state"):
            with pytest.raises(gp.ConfigError, match="not a gpupipe loader state \\(version 2\\)"):
                loader.load_state_dict(state)  # type: ignore[arg-type]
        loader.close()

    @pytest.mark.parametrize("state", [{"epoch": 1}, {"version": 3, "plan": {}}, {"version": 2}, "state", None])
    def test_not_a_state(self, shards, state):
        loader = gp.Loader(val(shards), 4, backend="torch", device="cpu", num_workers=0)
        with pytest.raises(gp.ConfigError, match="not a gpupipe loader state"):
            loader.load_state_dict(state)
