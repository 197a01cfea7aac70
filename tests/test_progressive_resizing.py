"""Progressive resizing: ``Loader.set_pipeline`` changes the output size between epochs on one
loader (index, plan and position kept; the runner rebuilt only when the transforms change), and
``pipelines/lowres.py``'s schedule and recipes, on every backend."""

from __future__ import annotations

import os

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T

from .support.checkers import val

LOWRES = os.path.join(os.path.dirname(__file__), "..", "pipelines", "lowres.py")


def recipe(name):
    return gp.load_pipeline(f"{LOWRES}:{name}")


class TestSetPipeline:
    def test_the_size_changes_between_epochs(self, backend, shards):
        train = recipe("train")
        with backend.loader(train(shards, size=32), 4, num_workers=1, shuffle=True, seed=1) as loader:
            index, runner = loader.index, loader._runner
            sizes = []
            for epoch, size in enumerate((32, 48, 48, 24)):
                loader.set_pipeline(train(shards, size=size))
                loader.set_epoch(epoch)
                batches = list(loader)
                assert len(batches) == len(loader) == 4
                sizes.append({tuple(b.images.shape[-2:]) for b in batches})
                assert sorted(k for b in batches for k in b.keys) == sorted(loader.index.key(i) for i in range(16))
            assert sizes == [{(32, 32)}, {(48, 48)}, {(48, 48)}, {(24, 24)}]
            assert loader.index is index  # the same index, and a new runner only where the size changed
            assert loader._runner is not runner
            assert "size=(24, 24)" in repr(loader.pipeline)

    def test_the_same_transforms_keep_the_runner(self, shards):
        train = recipe("train")
        with gp.Loader(train(shards, size=32), 4, backend="torch", device="cpu", num_workers=1) as loader:
            list(loader)
            runner = loader._runner
            loader.set_pipeline(train(shards, size=32))
            loader.set_epoch(1)
            list(loader)
            assert loader._runner is runner

    def test_the_old_runner_is_closed(self, shards):
        pytest.importorskip("nvidia.dali")
        with gp.Loader(val(shards), 4, backend="dali", device="cpu") as loader:
            list(loader)
            old = loader._runner
            loader.set_pipeline(val(shards, size=8))
            assert loader._runner is old  # until the next iteration
            assert {tuple(b.images.shape) for b in loader} == {(4, 3, 8, 8)}
            assert old._closed and old._graph is None  # type: ignore[attr-defined]

    def test_a_runner_that_cannot_be_built_fails_at_once_and_changes_nothing(self, shards, monkeypatch):
        from gpupipe import backends

        train = recipe("train")
        with gp.Loader(train(shards, size=32), 4, backend="torch", device="cpu", num_workers=0) as loader:
            runner = loader._runner

            def broken(spec):
                raise gp.PipelineError("cannot build this one")

            monkeypatch.setattr(backends.get("torch"), "runner", broken)
            with pytest.raises(gp.PipelineError, match="cannot build"):
                loader.set_pipeline(train(shards, size=48))
            monkeypatch.undo()
            assert {tuple(b.images.shape[-2:]) for b in loader} == {(32, 32)}  # the old pipeline runs on
            assert loader._runner is runner and not runner._closed  # type: ignore[attr-defined]

    def test_a_pipeline_set_and_replaced_before_running_is_closed(self, shards):
        train = recipe("train")
        with gp.Loader(train(shards, size=32), 4, backend="torch", device="cpu", num_workers=0) as loader:
            loader.set_pipeline(train(shards, size=48))
            never = loader._runners.next
            loader.set_pipeline(train(shards, size=24))
            assert never is not None and never._closed  # type: ignore[attr-defined]
            loader.set_pipeline(train(shards, size=32))  # back to the running one: nothing pending
            assert loader._runners.next is None
            loader.set_pipeline(train(shards, size=40))
            pending = loader._runners.next
            assert pending is not None
        assert pending._closed  # closed with the loader, never run

    def test_a_resumed_epoch_runs_the_pipeline_set_before_it(self, backend, shards):
        train = recipe("train")

        def make():
            loader = backend.loader(train(shards, size=32), 4, num_workers=0, shuffle=True, seed=2)
            loader.set_pipeline(train(shards, size=48))  # the schedule's size for epoch 3
            return loader

        with make() as loader:
            loader.set_epoch(3)
            whole, states = [], []
            for batch in loader:
                whole.append((batch.keys, batch.images.cpu()))
                states.append(loader.state_dict())
        with make() as resumed:
            resumed.load_state_dict(states[1])
            resumed.set_epoch(3)
            rest = [(b.keys, b.images.cpu()) for b in resumed]
        assert len(rest) == 2
        assert all(k1 == k2 and torch.equal(i1, i2) for (k1, i1), (k2, i2) in zip(rest, whole[2:], strict=True))

    def test_another_source_is_refused(self, shards, uneven_shards):
        with gp.Loader(val(shards), 4, backend="torch", device="cpu", num_workers=0) as loader:
            with pytest.raises(gp.ConfigError, match="not this loader's source"):
                loader.set_pipeline(val(uneven_shards))
            with pytest.raises(gp.ConfigError, match=r"must be a gp\.Pipeline"):
                loader.set_pipeline([T.CenterCrop(8)])  # type: ignore[arg-type]
            with pytest.raises(gp.PipelineError, match="output size varies"):
                loader.set_pipeline(gp.Pipeline(shards, [T.Resize(8)]))
            loader.set_pipeline(val(list(shards)))  # an equal source, built again: accepted

    def test_a_transform_the_backend_cannot_run_is_refused_at_once(self, shards):
        pytest.importorskip("nvidia.dali")
        with (
            gp.Loader(val(shards), 4, backend="dali", device="cpu") as loader,
            pytest.raises(gp.UnsupportedTransformError, match="bfloat16"),
        ):
            loader.set_pipeline(gp.Pipeline(shards, [T.CenterCrop(8), T.ToDtype(torch.bfloat16)]))

    def test_views_can_be_set(self, shards):
        """A loader of one output set to a pipeline of two views: its next epoch is that pipeline's,
        as a loader built with it yields it."""
        views = gp.Pipeline(shards, views=[[T.RandomResizedCrop(size), T.ToDtype(torch.float32, scale=True)]
                                           for size in (16, 8)])  # fmt: skip

        def epoch_1(loader):
            loader.set_epoch(1)
            return [(b.keys, b.views) for b in loader]

        with gp.Loader(val(shards), 4, backend="torch", device="cpu", num_workers=0, seed=5) as loader:
            assert all(isinstance(b.images, torch.Tensor) for b in loader)  # one output before
            loader.set_pipeline(views)
            got = epoch_1(loader)
            assert loader.pipeline is views
        with gp.Loader(views, 4, backend="torch", device="cpu", num_workers=0, seed=5) as built:
            want = epoch_1(built)
        assert len(got) == len(want) == 4
        for (keys, two), (want_keys, want_two) in zip(got, want, strict=True):
            assert keys == want_keys and isinstance(two, tuple)
            assert [tuple(v.shape) for v in two] == [(4, 3, 16, 16), (4, 3, 8, 8)]
            assert all(torch.equal(v, w) for v, w in zip(two, want_two, strict=True))

    def test_a_closed_loader_refuses(self, shards):
        loader = gp.Loader(val(shards), 4, backend="torch", device="cpu", num_workers=0)
        loader.close()
        with pytest.raises(gp.ClosedError):
            loader.set_pipeline(val(shards, size=8))


class TestLowresRecipe:
    def test_resolution_is_ffcvs_schedule(self):
        resolution = recipe("resolution")
        assert [resolution(e) for e in (0, 65, 70, 71, 76, 88)] == [160, 160, 160, 192, 192, 192]
        assert [resolution(e, min_res=128, max_res=256, start_ramp=0, end_ramp=4) for e in range(5)] == [
            128, 160, 192, 224, 256,
        ]  # fmt: skip
        with pytest.raises(ValueError, match="min_res <= max_res"):
            resolution(0, min_res=200, max_res=100)

    def test_train_and_val_outputs(self, shards):
        assert str(recipe("train")(shards, size=128).output_spec) == "[3, 128, 128] float32"
        pipe = recipe("val")(shards)
        assert str(pipe.output_spec) == "[3, 256, 256] float32"
        assert pipe.transforms[0] == T.Resize(293)
