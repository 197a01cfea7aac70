"""Pipelines of several views (multi-crop): one decoded image, several transform lists, one output
tensor per view, each view with its own draws — on every backend of the table, with the same draws
per backend, exact resume, skipped samples replaced in every view, and the DALI graph decoding
once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T

from .support.checkers import check_exact_resume
from .support.data import truncated_jpeg, write_webdataset_shards

FLOAT = T.ToDtype(torch.float32, scale=True)


def crops(global_size: int = 32, local_size: int = 16, local: int = 2) -> list[list[T.Transform]]:
    """2 global and ``local`` local crops, as a multi-crop recipe (small sizes)."""
    glob = [T.RandomResizedCrop(global_size, scale=(0.4, 1.0)), T.RandomHorizontalFlip(), FLOAT]
    loc = [T.RandomResizedCrop(local_size, scale=(0.05, 0.4)), T.RandomHorizontalFlip(), FLOAT]
    return [glob, glob, *([loc] * local)]


def views_by_key(loader) -> dict[str, tuple[torch.Tensor, ...]]:
    out = {}
    for batch in loader:
        for i, key in enumerate(batch.keys):
            out[key] = tuple(view[i].cpu() for view in batch.views)
    return out


class TestPipelineOfViews:
    def test_output_specs(self, shards):
        pipe = gp.Pipeline(shards, views=crops(local=3))
        assert pipe.has_views and len(pipe.views) == 5
        assert [str(s) for s in pipe.output_specs] == ["[3, 32, 32] float32"] * 2 + ["[3, 16, 16] float32"] * 3
        assert "views=[" in repr(pipe)

    def test_a_single_list_keeps_its_api(self, shards):
        pipe = gp.Pipeline(shards, crops()[0])
        assert not pipe.has_views and pipe.views == (pipe.transforms,)
        assert pipe.output_specs == (pipe.output_spec,)

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(views=[]), "non-empty list of transform lists"),
            (dict(views=T.CenterCrop(4)), "non-empty list of transform lists"),
            (dict(views=[[T.CenterCrop(4)], T.CenterCrop(4)]), r"views\[1\] must be a list"),
            (dict(views=[[T.CenterCrop(4)], [T.CenterCrop(4), "flip"]]), r"views\[1\] step 1 is a str"),
            (dict(transforms=[T.CenterCrop(4)], views=[[T.CenterCrop(4)]]), "not both"),
        ],
    )
    def test_invalid(self, shards, kwargs, match):
        with pytest.raises(gp.ConfigError, match=match):
            gp.Pipeline(shards, **kwargs)

    def test_each_view_is_checked_and_named(self, shards):
        with pytest.raises(gp.PipelineError, match=r"views\[1\] step 0: Normalize"):
            gp.Pipeline(shards, views=[[FLOAT], [T.Normalize([0.5] * 3, [0.2] * 3)]])

    def test_the_single_list_attributes_refuse_views(self, shards):
        pipe = gp.Pipeline(shards, views=crops())
        for attribute in ("transforms", "output_spec", "specs"):
            with pytest.raises(gp.PipelineError, match="views"):
                getattr(pipe, attribute)

    def test_every_view_needs_a_fixed_size(self, shards):
        pipe = gp.Pipeline(shards, views=[[T.CenterCrop(8)], [T.Resize(8)]])
        with pytest.raises(gp.PipelineError, match="view 1's output size varies"):
            gp.Loader(pipe, 2, backend="torch", device="cpu")


class TestViewsOnEveryBackend:
    def test_batches_hold_one_tensor_per_view(self, backend, shards):
        with backend.loader(
            gp.Pipeline(shards, views=crops()), 4, num_workers=1, memory_format=torch.channels_last
        ) as ld:
            batches = list(ld)
        assert len(batches) == len(ld) == 4
        for batch in batches:
            views, labels = batch
            assert isinstance(views, tuple) and batch.views is views and len(views) == 4
            assert [tuple(v.shape[1:]) for v in views] == [(3, 32, 32)] * 2 + [(3, 16, 16)] * 2
            assert all(v.dtype == torch.float32 and len(v) == len(labels) == len(batch.keys) for v in views)
            assert all(v.is_contiguous(memory_format=torch.channels_last) for v in views)
            assert all(str(v.device).startswith(backend.device) for v in views)

    def test_views_draw_independently(self, backend, shards):
        """Two views of one transform list draw each its own: view k flips a sample where the
        draw of ``(seed, epoch, sample, view k)`` says so, and the two views are flipped alike for
        some samples, not for others. A third view, never flipped, shows each flip exactly."""
        from gpupipe.core._random import factors

        flip = [T.CenterCrop(16), T.RandomHorizontalFlip(), FLOAT]
        with backend.loader(gp.Pipeline(shards, views=[flip, flip, [T.CenterCrop(16), FLOAT]]), 4, num_workers=0,
                            seed=11) as loader:  # fmt: skip
            got = views_by_key(loader)
            samples = {loader.index.key(i): i for i in range(len(loader.index))}
        assert got.keys() == samples.keys()
        flipped = {}
        for key, (*views, plain) in got.items():
            assert not torch.equal(plain, plain.flip(-1))  # (a flip shows)
            assert all(torch.equal(v, plain) or torch.equal(v, plain.flip(-1)) for v in views)
            flipped[key] = tuple(torch.equal(v, plain.flip(-1)) for v in views)
        drawn = {key: tuple(bool(factors(flip, 11, 0, [i], v)[1][0, 0]) for v in (0, 1)) for key, i in samples.items()}
        assert flipped == drawn
        assert {first == second for first, second in flipped.values()} == {True, False}

    def test_view_0_is_the_pipeline_of_its_list(self, backend, shards):
        """View 0 draws as a pipeline of its transform list alone; later views change nothing."""
        with backend.loader(gp.Pipeline(shards, views=crops()), 4, num_workers=0, seed=3) as loader:
            several = views_by_key(loader)
        with backend.loader(gp.Pipeline(shards, crops()[0]), 4, num_workers=0, seed=3) as loader:
            single = views_by_key(loader)
        assert several.keys() == single.keys()
        assert all(torch.equal(several[k][0], single[k][0]) for k in single)

    def test_resume_is_exact(self, backend, shards):
        check_exact_resume(
            lambda: backend.loader(gp.Pipeline(shards, views=crops()), 4, num_workers=1, seed=4, shuffle=True),
            epoch=2,
            at=2,
        )

    def test_a_skipped_sample_is_replaced_in_every_view(self, backend, tmp_path):
        urls = write_webdataset_shards(str(tmp_path), (6,), prefix="views", patch={2: {"jpg": truncated_jpeg(2)}})
        with backend.loader(
            gp.Pipeline(urls, views=crops()), 6, num_workers=0, on_error="skip", max_skipped=None
        ) as loader:
            batch = next(iter(loader))
            assert [s.key for s in loader.skipped] == ["img/00/000002"]
        assert batch.valid.tolist() == [True, True, False, True, True, True]
        assert batch.keys[2] == batch.keys[0]  # the donor: the first good sample
        assert all(torch.equal(view[2], view[0]) for view in batch.views)


class TestSameDrawsOnEveryBackend:
    def test_dali_views_match_torch_views(self, shards):
        pytest.importorskip("nvidia.dali")
        got = {}
        for name in ("torch", "dali"):
            with gp.Loader(gp.Pipeline(shards, views=crops()), 4, backend=name, device="cpu", seed=7) as loader:
                loader.set_epoch(1)
                got[name] = views_by_key(loader)
        assert got["torch"].keys() == got["dali"].keys()
        for view in range(4):  # mean absolute difference per image, 0-255 units
            errors = [float((got["torch"][k][view] - got["dali"][k][view]).abs().mean()) * 255 for k in got["torch"]]
            assert np.mean(errors) <= 1.0 and max(errors) <= 2.5, (view, errors)


class TestDaliGraph:
    def test_several_views_decode_once(self):
        pytest.importorskip("nvidia.dali")
        from .support.dali_graph import check_gpu_placement, parse
        from .test_gpu_graph import define

        views = crops(local=3)
        graph = define(None, views=views)
        ops, outputs = parse(graph.pipe.serialize())
        decoder = check_gpu_placement(ops, outputs, views=5)
        assert decoder.schema == "decoders__Image"  # one whole decode, no region of interest per view
        assert len(outputs) == 5 and len(graph.lowered.images) == 5
        assert graph.lowered.draws == {(v, s) for v in range(5) for s in (0, 1)}

    def test_one_view_keeps_the_fused_decode(self):
        pytest.importorskip("nvidia.dali")
        from .support.dali_graph import parse
        from .test_gpu_graph import define

        ops, _ = parse(define(None, views=crops()[:1]).pipe.serialize())
        assert [op.schema for op in ops if op.schema.startswith("decoders__")] == ["decoders__ImageSlice"]
