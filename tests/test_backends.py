"""The backend table and protocol: lookup, the 'auto' choice, availability, lowering registries,
and a third backend added as one module plus one table entry."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import backends
from gpupipe import transforms as T

from .support.checkers import check_epoch_partition, val, yielded


@dataclasses.dataclass(frozen=True)
class Posterize(T.Transform):
    bits: int = 4


class TestTable:
    def test_names_and_lookup(self):
        assert backends.names() == ("dali", "torch", "ray")
        for name in backends.names():
            b = backends.get(name)
            assert isinstance(b, backends.Backend) and b.name == name and backends.get(name) is b
            assert set(b.devices) <= {"cpu", "cuda"} and b.requirement
        with pytest.raises(gp.ConfigError, match=r"backend must be one of .*'auto', 'dali', 'torch'"):
            backends.get("tensorflow")

    def test_auto_prefers_dali_on_the_gpu_and_torch_on_the_cpu(self, shards):
        pytest.importorskip("nvidia.dali")
        cuda = torch.cuda.is_available()
        with gp.Loader(gp.Pipeline(shards, [T.CenterCrop(8)]), 2, num_workers=0) as loader:
            assert loader.backend == ("dali" if cuda else "torch")
            assert torch.device(loader.device).type == ("cuda" if cuda else "cpu")

    def test_auto_falls_back_in_table_order(self, shards, monkeypatch):
        monkeypatch.setattr(type(backends.get("dali")), "available", lambda self: False)
        loader = gp.Loader(gp.Pipeline(shards, [T.CenterCrop(8)]), 2, device="cpu", num_workers=0)
        assert loader.backend == "torch" and loader.chosen == "backend torch: dali not available"

    def test_auto_says_why(self):
        dali = backends.get("dali")
        backend, device = backends.resolve("auto", "cpu")
        expected = ("dali runs slower on the cpu (bench/results/2026-11-26-dali-cpu-kernels.md)" if dali.available()
                    else "dali not available")  # fmt: skip
        assert backends.why("auto", "cpu", backend, device) == f"backend {backend.name}: {expected}"
        assert backends.why("torch", "cpu", backends.get("torch"), device) is None  # both given: nothing to say

    def test_auto_skips_a_backend_that_cannot_run_a_step(self, shards):
        """A step the DALI backend does not take (yet) makes auto the torch backend, and says so;
        asked for by name, the DALI backend still refuses the step."""
        pytest.importorskip("nvidia.dali")
        pipe = gp.Pipeline(shards, [T.CenterCrop(8), T.RandomRotation(30, expand=True), T.CenterCrop(8)])
        with gp.Loader(pipe, 2, device="cpu", num_workers=0) as loader:
            assert loader.backend == "torch"
            assert loader.chosen == ("backend torch: dali cannot run step 1, RandomRotation: expand=True (a size per "
                                     "sample) runs on the torch backend only, for now")  # fmt: skip
            assert next(iter(loader)).images.shape == (2, 3, 8, 8)
        with pytest.raises(gp.UnsupportedTransformError, match=r"pipeline step 1\): expand=True"):
            gp.Loader(pipe, 2, backend="dali", device="cpu")

    def test_auto_passes_over_a_backend_measured_slower(self):
        """``Backend.slower``: DALI's CPU operators run every recipe measured slower than the torch
        backend, so ``auto`` picks torch on the CPU for any pipeline and says why; on the GPU, and
        where no other backend runs the pipeline, DALI stays the choice; named, it is taken."""
        pytest.importorskip("nvidia.dali")
        dali = backends.get("dali")
        for views in ([[T.RandomResizedCrop(8), T.RandomApply([T.TrivialAugmentWide()])]], [[T.CenterCrop(8)]], []):
            backend, device = backends.resolve("auto", "cpu", views)
            assert backend.name == "torch"
            assert backends.why("auto", "cpu", backend, device, views) == (
                "backend torch: dali runs slower on the cpu (bench/results/2026-11-26-dali-cpu-kernels.md)"
            )
            assert dali.slower_step("cuda", views) is None
            assert backends.resolve("dali", "cpu", views)[0] is dali  # named: taken as named

    def test_a_slower_entry_may_name_its_steps(self, monkeypatch):
        """An entry with transform types counts only for pipelines with such a step (a member of a
        composite step included)."""
        pytest.importorskip("nvidia.dali")
        dali = backends.get("dali")
        monkeypatch.setattr(type(dali), "slower", (("cpu", (T.TrivialAugmentWide,), "evidence.md"),))
        views = [[T.RandomResizedCrop(8), T.RandomApply([T.TrivialAugmentWide()])]]
        assert dali.slower_step("cpu", views) == "dali runs TrivialAugmentWide slower on the cpu (evidence.md)"
        assert dali.slower_step("cpu", [[T.CenterCrop(8)]]) is None and dali.slower_step("cuda", views) is None
        assert backends.resolve("auto", "cpu", [[T.CenterCrop(8)]])[0] is dali
        assert backends.resolve("auto", "cpu", views)[0].name == "torch"

    def test_a_slower_backend_is_still_auto_where_it_is_the_only_one(self, monkeypatch):
        pytest.importorskip("nvidia.dali")
        monkeypatch.setattr(type(backends.get("torch")), "available", lambda self: False)
        views = [[T.AugMix()]]
        backend, device = backends.resolve("auto", "cpu", views)
        assert backend.name == "dali" and backends.why("auto", "cpu", backend, device, views) == (
            "backend dali: the first available of dali, torch"
        )

    def test_an_unavailable_backend_says_what_to_install(self, shards, monkeypatch):
        monkeypatch.setattr(type(backends.get("dali")), "available", lambda self: False)
        with pytest.raises(gp.BackendUnavailableError, match=r"backend='dali' needs NVIDIA DALI: pip install"):
            gp.Loader(gp.Pipeline(shards, [T.CenterCrop(8)]), 2, backend="dali", device="cpu")

    def test_a_table_entry_must_name_a_backend(self, monkeypatch):
        monkeypatch.setitem(backends.TABLE, "wrong", "gpupipe.backends._torch")
        with pytest.raises(TypeError, match="must be a gpupipe Backend named 'wrong'"):
            backends.get("wrong")


class TestLowerings:
    def test_a_transform_without_lowering_is_reported_at_build(self, backend, shards):
        pipe = gp.Pipeline(shards, [T.CenterCrop(16), Posterize()])
        with pytest.raises(gp.UnsupportedTransformError, match=r"cannot run Posterize.*step 1.*register_lowering"):
            backend.loader(pipe, 2)

    def test_register_lowering(self, shards, monkeypatch):
        registry = backends.get("torch").lowerings
        monkeypatch.setattr(registry, "_table", dict(registry._table))  # undone after the test

        @dataclasses.dataclass(frozen=True)
        class Posterize2(Posterize):
            pass

        @gp.register_lowering(Posterize2, backend="torch")
        def _posterize(t, image, params):
            return v2.functional.posterize(image, t.bits)

        pipe = gp.Pipeline(shards, [T.CenterCrop(16), Posterize2()])
        batch, _ = next(iter(gp.Loader(pipe, 2, backend="torch", device="cpu")))
        assert torch.all(batch % 16 == 0)
        with pytest.raises(gp.UnsupportedTransformError):  # registered for torch only
            gp.Loader(pipe, 2, backend="dali", device="cpu")

    def test_a_second_lowering_for_a_type_is_refused(self, monkeypatch):
        registry = backends.get("torch").lowerings
        monkeypatch.setattr(registry, "_table", dict(registry._table))
        with pytest.raises(gp.ConfigError, match=r"already has a lowering for Resize.*replace=True"):
            gp.register_lowering(T.Resize, backend="torch")(lambda t, image, params: image)
        mine = gp.register_lowering(T.Resize, backend="torch", replace=True)(lambda t, image, params: image)
        assert registry.lookup(T.Resize(8)) is mine

        @dataclasses.dataclass(frozen=True)
        class MyResize(T.Resize):
            pass

        gp.register_lowering(MyResize, backend="torch")(lambda t, image, params: image)  # a subclass may

    def test_only_transforms(self):
        with pytest.raises(gp.ConfigError, match="must be a gpupipe Transform subclass"):
            gp.register_lowering(v2.Resize, backend="torch")
        with pytest.raises(gp.ConfigError, match="backend must be one of"):
            gp.register_lowering(Posterize, backend="jax")


class TestThirdBackend:
    """tests/support/inline_backend.py is a whole backend; one table entry makes it selectable."""

    @pytest.fixture
    def inline(self, monkeypatch):
        monkeypatch.setitem(backends.TABLE, "inline", "tests.support.inline_backend")
        monkeypatch.delitem(backends._loaded, "inline", raising=False)
        yield
        backends._loaded.pop("inline", None)

    def test_selectable_and_equal_to_torch(self, inline, shards):
        def images(name):
            loader = gp.Loader(val(shards), 4, shuffle=True, seed=5, backend=name, device="cpu", num_workers=0)
            return [(b.keys, b.images, b.labels) for b in loader]

        for (k1, i1, l1), (k2, i2, l2) in zip(images("inline"), images("torch"), strict=True):
            assert k1 == k2 and torch.equal(i1, i2) and torch.equal(l1, l2)

    def test_epoch_contract_and_lifecycle(self, inline, uneven_shards, clean_env):
        loaders = [
            gp.Loader(val(uneven_shards), 2, rank=r, world_size=3, backend="inline", device="cpu") for r in range(3)
        ]
        check_epoch_partition(
            [yielded(lo) for lo in loaders],
            [loaders[0].index.key(i) for i in range(17)],
            world_size=3,
            batch_size=2,
            drop_last=False,
        )
        from .support.inline_backend import InlineRunner

        runner = loaders[0]._runner
        assert isinstance(runner, InlineRunner) and not runner.closed
        loaders[0].close()
        assert runner.closed

    def test_auto_never_picks_a_backend_that_cannot_deliver(self, inline, monkeypatch, shards):
        monkeypatch.setattr(type(backends.get("dali")), "available", lambda self: False)
        monkeypatch.setattr(type(backends.get("torch")), "devices", ("cuda",))
        assert backends.resolve("auto", "cpu")[0].name == "inline"


def test_to_device_copies_from_pinned_memory(monkeypatch):
    """Labels and validity masks reach the GPU from pinned memory, without blocking the host."""
    calls: list[object] = []

    def pin(self):
        calls.append("pin")
        return self

    def to(self, *args, **kwargs):
        calls.append(("to", args, kwargs))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    labels = torch.tensor([1, 2])
    assert backends.to_device(labels, torch.device("cpu")) is labels and calls == []
    backends.to_device(labels, torch.device("cuda:1"))
    assert calls == ["pin", ("to", (torch.device("cuda:1"),), {"non_blocking": True})]
