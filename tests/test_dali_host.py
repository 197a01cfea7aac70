"""The DALI backend's small graph: geometry computed on the host from the images' headers and fed
(the same pixels as the graph's own arithmetic), the ImageNet recipes' operator counts, and the
GPU decode strategy (region-of-interest decode where nvJPEG can, whole-image GPU decode where it
cannot), chosen from the nvJPEG version and checked without a GPU."""

from __future__ import annotations

import os
import time

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import run_dali
from .support.dali_graph import check_gpu_placement, parse
from .test_gpu_graph import MATRIX, define, staged_only

pytest.importorskip("nvidia.dali")

ROOT = os.path.join(os.path.dirname(__file__), "..")
# Steps whose per-sample arguments only the host computes (from the image's size).
HOST_ONLY = (T.RandomRotation, T.RandomAffine, T.RandomResize, T.RandomShortestSize, T.RandomZoomOut)
SIZES = [(375, 500), (500, 375), (120, 160), (200, 200), (120, 400), (31, 700), (64, 9)]


def recipe(name: str) -> gp.Pipeline:
    return gp.load_pipeline(os.path.join(ROOT, "pipelines", f"imagenet.py:{name}"))(["unused.tar"])


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [encode_jpeg(synthetic_image(20 + i, size=s)) for i, s in enumerate(SIZES)]


def _cases():
    for name, pipelines in MATRIX.items():
        for i, steps in enumerate(pipelines):
            if not any(t.uses_boxes for t in steps) and not staged_only(steps):  # (windows chosen by boxes:
                # test_targets_torchvision; the policies run in the stage only)
                yield pytest.param(steps, id=f"{name}-{i}")
    for name in ("train", "val"):
        yield pytest.param(list(recipe(name).transforms), id=f"imagenet-{name}")


class TestHostGeometry:
    @pytest.mark.parametrize("steps", list(_cases()))
    def test_the_host_computes_what_the_graph_computed(self, steps, images):
        """Sizes, windows, anchors, flips and factors fed from the host give exactly the pixels
        (and refuse exactly the samples, with the same message) of the same geometry computed in
        the graph on shape nodes — the path EXIF orientation still takes."""
        host = run_dali(steps, images, seed=3)
        if any(isinstance(t, HOST_ONLY) for t in steps) and not isinstance(steps[0], T.CenterCrop):
            # A warp's matrices are computed on the host from the size: without the headers'
            # sizes (EXIF applied) the DALI backend refuses the step, and says how to fix it.
            with pytest.raises(gp.BackendUnavailableError, match="needs the image's size known outside"):
                run_dali(steps, images, seed=3, host_geometry=False)
            return
        graph = run_dali(steps, images, seed=3, host_geometry=False)
        for i, (a, b) in enumerate(zip(host, graph, strict=True)):
            if isinstance(a, str) or isinstance(b, str):
                assert a == b, (i, SIZES[i])
            else:
                assert a.shape == b.shape and torch.equal(a, b), (i, SIZES[i])

    def test_no_geometry_is_left_in_the_graph(self):
        """The train recipe's graph holds no arithmetic and no shape reading: only the fed
        arguments, the decoder, resize and crop_mirror_normalize."""
        for gpu in (False, True):
            ops, _ = parse(define(list(recipe("train").transforms), gpu=gpu).pipe.serialize())
            schemas = [op.schema for op in ops]
            assert not [s for s in schemas if "Arithmetic" in s or s in ("PeekImageShape", "_Shape", "Shapes")]
            assert schemas.count("ExternalSource") == 4  # encoded, crop start, crop shape, flip

    def test_exif_orientation_keeps_the_geometry_in_the_graph(self):
        """The headers' sizes are before orientation: with EXIF applied, sizes are the decoders'."""
        from gpupipe.backends._dali._graph import define_graph

        steps = list(recipe("train").transforms)
        graph = define_graph([steps], gpu=False, device_id=None, batch_size=2, num_threads=1, prefetch=1,
                             seed=0, channels_last=False, decoder_args={}, exif=True)  # fmt: skip
        assert not graph.lowered.host_geometry
        assert "PeekImageShape" in [op.schema for op in parse(graph.pipe.serialize())[0]]

    def test_a_header_without_a_size_is_a_bad_sample_named(self, tmp_path):
        """An image whose header gives no size is refused before DALI sees it (the rule of every
        backend for a JPEG without a frame header), naming the sample; skipped under ``skip``."""
        with gp.ShardWriter(str(tmp_path / "h-%d.tar")) as w:
            w.write("good", {"jpg": encode_jpeg(synthetic_image(0, size=(40, 50))), "cls": 0})
            w.write("headless", {"jpg": b"\xff\xd8\xff\xda" + bytes(200), "cls": 1})  # a scan before any frame
        pipe = gp.Pipeline(w.shards, [T.RandomResizedCrop(16)])
        with pytest.raises(gp.SampleError, match=r"'headless'.*a JPEG without a frame header") as info:
            list(gp.Loader(pipe, 2, backend="dali", device="cpu"))
        assert info.value.kind == gp.Damage.UNDECODABLE and info.value.shard == w.shards[0]
        with gp.Loader(pipe, 2, backend="dali", device="cpu", on_error="skip", max_skipped=None) as loader:
            batches = list(loader)
        assert [s.key for s in loader.skipped] == ["headless"] and batches[0].valid.tolist() == [True, False]

    def test_a_sample_whose_pixels_are_not_its_headers_size_is_refused(self):
        """After DALI failed on a batch, a sample whose decoded size is not its header's (the
        windows were computed from the header) is the bad one."""
        from gpupipe.runtime._decode import verdicts

        data = encode_jpeg(synthetic_image(1, size=(30, 40)))
        assert verdicts([(data, "s.tar", "k")], max_pixels=None, sizes=[(30, 40)]) == [None]
        error = verdicts([(data, "s.tar", "k")], max_pixels=None, sizes=[(31, 40)])[0]
        assert error is not None and "declares 31x40 pixels in its header but decodes to 30x40" in str(error)
        assert error.kind == gp.Damage.UNDECODABLE


class TestGraphSize:
    """The ImageNet recipes' graphs: a handful of operators, as a hand-written DALI pipeline (they
    were 101 and 79 with the geometry in the graph)."""

    @pytest.mark.parametrize("gpu", [False, True])
    @pytest.mark.parametrize("name, most", [("train", 15), ("val", 10)])
    def test_operator_count(self, name, most, gpu):
        from gpupipe.backends._dali._proto import operator_count

        graph = define(list(recipe(name).transforms), gpu=gpu)
        assert operator_count(graph.pipe) == len(parse(graph.pipe.serialize())[0]) == 7 <= most

    @pytest.mark.parametrize("gpu", [False, True])
    def test_the_v2_recipe(self, gpu):
        """torchvision's V2 recipe (TrivialAugmentWide and RandomErasing): DALI's graph stops
        before the policy, which the stage runs (``Stage.cut``): 8 operators on either device
        (the decoder fused with the crop, resize, the flip in crop_mirror_normalize, the inputs),
        against 77 on the GPU and 87 on the CPU when DALI ran the policy itself."""
        from gpupipe.backends._dali._proto import operator_count
        from gpupipe.backends._stage import stage_start

        steps = list(recipe("train_v2").transforms)
        start = stage_start(steps)
        assert start is not None and isinstance(steps[start], T.TrivialAugmentWide)
        assert operator_count(define(steps[:start], gpu=gpu).pipe) <= 8

    def test_the_loader_reports_it(self, shards):
        train = gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:train"))(shards)
        with gp.Loader(train, 4, backend="dali", device="cpu") as loader:
            assert "operators=7" in repr(loader) and "backend='dali'" in repr(loader)

    def test_a_graph_with_python_cannot_be_counted(self):
        from gpupipe.backends._dali._graph import define_graph
        from gpupipe.backends._dali._proto import operator_count

        from .support.checkers import Posterize

        graph = define_graph([[Posterize(4)]], gpu=False, device_id=None, batch_size=2, num_threads=1, prefetch=1,
                             seed=0, channels_last=False, decoder_args={})  # fmt: skip
        assert operator_count(graph.pipe) == -1


class TestDecodeStrategy:
    """Where nvJPEG declines a region with fancy upsampling, its images would be decoded on the
    CPU: the strategy follows the installed nvJPEG (faked here), and can be forced."""

    @pytest.mark.parametrize(
        "options, nvjpeg, mode",
        [
            (gp.DaliOptions(), (13, 2, 0), gp.DecodeMode.ROI),
            (gp.DaliOptions(), (13, 3, 2), gp.DecodeMode.ROI),
            (gp.DaliOptions(), (14, 0, 0), gp.DecodeMode.ROI),
            (gp.DaliOptions(), (13, 1, 9), gp.DecodeMode.FULL),
            (gp.DaliOptions(), (12, 4, 0), gp.DecodeMode.FULL),  # the newest CUDA 12 nvJPEG
            (gp.DaliOptions(), None, gp.DecodeMode.FULL),  # not found: the safe choice
            (gp.DaliOptions(jpeg_fancy_upsampling=False), (12, 4, 0), gp.DecodeMode.ROI),
            (gp.DaliOptions(decode="roi"), (12, 4, 0), gp.DecodeMode.ROI),
            (gp.DaliOptions(decode=gp.DecodeMode.FULL), (13, 3, 0), gp.DecodeMode.FULL),
        ],
    )
    def test_choice(self, options, nvjpeg, mode):
        from gpupipe.backends._dali._strategy import choose

        strategy = choose(options, nvjpeg=nvjpeg)
        assert strategy.mode == mode and strategy.reason
        if nvjpeg is not None and options.decode == "auto" and options.jpeg_fancy_upsampling:
            assert ".".join(map(str, nvjpeg)) in str(strategy)

    def test_bad_option(self):
        with pytest.raises(gp.ConfigError, match=r"decode must be a DecodeMode \(AUTO, ROI, FULL\)"):
            gp.DaliOptions(decode="cpu")

    @pytest.mark.parametrize("mode, decoder, ops", [("roi", "decoders__ImageSlice", 7), ("full", "decoders__Image", 8)])
    def test_gpu_graph_of_each_strategy(self, mode, decoder, ops):
        """Either way every operator after the decoder runs on the GPU; ``full`` cuts the fed
        window out of the whole decoded image there."""
        from gpupipe.backends._dali._graph import define_graph

        graph = define_graph([list(recipe("train").transforms)], gpu=True, device_id=None, batch_size=2,
                             num_threads=1, prefetch=1, seed=0, channels_last=False,
                             decoder_args=gp.DaliOptions().decoder_args(ranks_per_node=1),
                             decode=gp.DecodeMode(mode))  # fmt: skip
        parsed = parse(graph.pipe.serialize())
        assert check_gpu_placement(*parsed).schema == decoder and len(parsed[0]) == ops
        assert graph.lowered.decode == mode
        if mode == "full":
            assert [(op.schema, op.device) for op in parsed[0] if op.schema == "Slice"] == [("Slice", "gpu")]

    def test_the_same_pixels_either_way_on_the_cpu(self, images):
        """The CPU graph always decodes the region; the ``full`` path's cut is the same window."""
        from gpupipe.backends._dali import _compiler

        steps = list(recipe("train").transforms)
        roi = run_dali(steps, images)
        graph_full = run_dali(steps, images, graph=lambda enc, ctx: _full_then_lower(steps, enc, ctx, _compiler))
        for a, b in zip(roi, graph_full, strict=True):
            assert torch.equal(a, b)

    def test_nvjpeg_is_found(self):
        """The process's nvJPEG, as DALI loads it (the CUDA 12 wheels bring 12.x; none: None)."""
        from gpupipe.runtime._nvjpeg import in_process

        found = in_process()
        assert found is None or (os.path.basename(found.path).startswith("libnvjpeg") and found.version[0] >= 11)


def _full_then_lower(steps, encoded, ctx, compiler):
    """The train recipe with its window cut from the whole decoded image (the ``full`` strategy's
    shape, on the CPU)."""
    from gpupipe.backends._dali._lowerings import crop_window

    first = steps[0]
    top, left, h, w = crop_window(ctx, *ctx.encoded_shape(encoded))
    whole = compiler.decode(encoded, ctx)
    img = ctx.fn.slice(whole, start=ctx.arg_vector([top, left], "int32"), shape=ctx.arg_vector([h, w], "int32"),
                       axis_names="HW")  # fmt: skip
    img = compiler.resize(ctx, img, *first.size, first.interpolation, first.antialias)
    ctx.size = first.size
    return compiler._crop_mirror_normalize(list(enumerate(steps))[1:], img, ctx, channels_last=False)


@pytest.mark.gpu
def test_the_train_recipe_decodes_on_the_gpu(tmp_path):
    """Fails when the train recipe's decode runs on the CPU: the training process's CPU time per
    image on DALI-cuda is far below DALI-cpu's on the same images (a decode that fell back to
    libjpeg-turbo costs as much CPU as the CPU backend)."""
    with gp.ShardWriter(str(tmp_path / "p-%d.tar")) as w:
        for i in range(384):
            w.write(f"{i:04d}", {"jpg": encode_jpeg(synthetic_image(i, size=(375, 500))), "cls": i % 10})
    pipe = gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:train"))(w.shards)
    per_image = {}
    for device in ("cuda", "cpu"):
        with gp.Loader(pipe, 64, backend="dali", device=device, num_workers=4, seed=0) as loader:
            for _ in loader:  # warm-up epoch: build, first allocations
                pass
            loader.set_epoch(1)
            start = time.process_time()
            for _ in loader:
                pass
            if device == "cuda":
                torch.cuda.synchronize()
            per_image[device] = (time.process_time() - start) / len(loader.plan().samples)
    assert per_image["cuda"] < 0.35 * per_image["cpu"], per_image
