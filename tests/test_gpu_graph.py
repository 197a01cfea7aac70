"""The DALI backend's GPU graph, built in CI without a GPU: for every transform and option the
graph for ``device="cuda"`` is defined and serialized on the CPU (``device_id=None``), which makes
DALI check operator names, argument names and types and device placement, and the placement and
the decoder's argument values are checked here. A wrong argument in a GPU-only branch fails CI."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T

from .support.checkers import AddMult, Posterize
from .support.dali_graph import check_gpu_placement, parse

pytest.importorskip("nvidia.dali")

FLOAT = T.ToDtype(torch.float32, scale=True)
IMAGENET: dict[str, Any] = dict(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])

# Every transform, with its options: each entry is a pipeline (a transform in the context it needs).
MATRIX: dict[str, list[list[T.Transform]]] = {
    "RandomResizedCrop": [
        [T.RandomResizedCrop(224)],  # fused into the decoder
        [T.RandomResizedCrop((160, 200), scale=(0.3, 1.0), ratio=(0.5, 2.0), interpolation="bicubic", antialias=False)],
        [T.CenterCrop(300), T.RandomResizedCrop(64, interpolation="nearest")],  # not first: no fusion
    ],
    "Resize": [
        [T.Resize(256), T.CenterCrop(224)],
        [T.Resize((200, 300))],
        [T.Resize(100, max_size=120)],
        [T.Resize(None, max_size=200)],
        [T.Resize(64, interpolation="nearest-exact", antialias=False)],
        [FLOAT, T.Resize(48)],  # a float image
    ],
    "RandomResize": [[T.RandomResize(150, 300), T.CenterCrop(128)], [FLOAT, T.RandomResize(40, 80), T.CenterCrop(32)]],
    "RandomShortestSize": [[T.RandomShortestSize([100, 140], 200), T.CenterCrop(200)]],
    "RandomPhotometricDistort": [[T.RandomPhotometricDistort(), T.CenterCrop(64)]],
    "RandomZoomOut": [[T.RandomZoomOut(fill=(1, 2, 3), side_range=(1.0, 2.0), p=0.7), T.Resize((128, 128))]],
    "RandomIoUCrop": [[T.RandomIoUCrop(), T.Resize((128, 128))]],  # (its windows need boxes: not in test_dali_host)
    "CenterCrop": [[T.CenterCrop(224)], [T.CenterCrop((301, 299)), FLOAT]],
    "RandomCrop": [
        [T.RandomCrop(32)],  # with its per-sample too-small check
        [T.RandomCrop(32, padding=4, fill=(1, 2, 3))],
        [T.RandomCrop((64, 48), padding=(1, 2), pad_if_needed=True)],
    ],
    "RandomHorizontalFlip": [
        [T.RandomHorizontalFlip()],  # ends the view: flip and layout as one crop_mirror_normalize
        [T.RandomHorizontalFlip(), T.RandomVerticalFlip()],  # the flip operator itself
        [T.CenterCrop(64), T.RandomHorizontalFlip(p=0.3), FLOAT],
    ],
    "RandomVerticalFlip": [[T.RandomVerticalFlip(p=0.2)]],
    "ColorJitter": [
        [T.ColorJitter(0.4, 0.4, 0.4, 0.1)],
        [T.ColorJitter(brightness=(1.2, 1.2), saturation=(0.5, 0.5))],
        [FLOAT, T.ColorJitter(contrast=0.3)],
    ],
    "RandomGrayscale": [[T.RandomGrayscale()], [T.RandomGrayscale(p=1.0)]],
    "GaussianBlur": [[T.GaussianBlur(5)], [T.GaussianBlur((3, 9), sigma=1.5)], [FLOAT, T.GaussianBlur(3)]],
    "RandomSolarize": [
        [T.RandomSolarize(128)],
        [FLOAT, T.RandomSolarize(0.5, p=1.0)],
        [T.ToDtype(torch.float16, scale=True), T.RandomSolarize(0.5)],  # float16: float32 arithmetic
    ],
    "RandomApply": [
        [T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8)],
        [T.RandomApply([T.GaussianBlur(23)], p=0.5)],
        [FLOAT, T.RandomApply([T.RandomApply([T.RandomSolarize(0.5)], p=0.2), T.GaussianBlur(3), AddMult(0.1)])],
        [T.ToDtype(torch.float16, scale=True), T.RandomApply([T.GaussianBlur(3)])],
        [T.CenterCrop(64), T.RandomApply([T.RandomGrayscale(p=1.0)]), FLOAT],  # before the fused tail
    ],
    "ToDtype": [
        [FLOAT],
        [T.ToDtype(torch.float16, scale=True)],
        [T.ToDtype(torch.float64)],
        [FLOAT, T.ToDtype(torch.uint8, scale=True)],
        [T.ToDtype(torch.float32)],
    ],
    "Normalize": [
        [FLOAT, T.Normalize(**IMAGENET)],
        [T.CenterCrop(64), FLOAT, T.Normalize([0.5], [0.25])],
        [FLOAT, T.Normalize(**IMAGENET), T.GaussianBlur(3)],  # not last: lowered alone, not fused
    ],
    "Arithmetic": [[FLOAT, AddMult(add=-0.5, mult=2.0)]],
    "RandomInvert": [[T.RandomInvert()], [FLOAT, T.RandomInvert(p=0.2)]],
    "RandomPosterize": [[T.RandomPosterize(3)], [FLOAT, T.RandomPosterize(1, p=1.0)]],
    "RandomAutocontrast": [[T.RandomAutocontrast()], [T.CenterCrop(32), FLOAT, T.RandomAutocontrast(p=0.2)]],
    "RandomAdjustSharpness": [[T.RandomAdjustSharpness(2.0)], [FLOAT, T.RandomAdjustSharpness(0.5, p=1.0)]],
    "RandomRotation": [
        [T.RandomRotation(30)],
        [T.CenterCrop(64), FLOAT, T.RandomRotation(90, interpolation="bilinear")],
    ],
    "RandomAffine": [[T.RandomAffine(20, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=(1, 2, 3, 4))]],
    "RandomEqualize": [[T.RandomEqualize()], [FLOAT, T.RandomEqualize(p=1.0)]],
    "TrivialAugmentWide": [
        [T.TrivialAugmentWide()],
        [T.CenterCrop(48), T.TrivialAugmentWide(interpolation="bilinear"), FLOAT],
    ],
    "RandAugment": [[T.CenterCrop(48), T.RandAugment(num_ops=3, fill=5)]],
    "AutoAugment": [[T.AutoAugment()], [T.CenterCrop(40), T.AutoAugment(policy="cifar10")]],
    "AugMix": [[T.CenterCrop(40), T.AugMix(mixture_width=2, chain_depth=1)]],
    "RandomChoice": [  # of per-sample transforms: conditional branches
        [T.RandomChoice([T.RandomGrayscale(p=1.0), T.RandomSolarize(128, p=1.0), T.GaussianBlur(9, sigma=(0.1, 2.0))])],
        [
            T.CenterCrop(40),
            T.RandomChoice(
                [T.RandomChoice([T.RandomInvert(), T.RandomEqualize()]), T.RandomAdjustSharpness(2.0)], p=[2, 1]
            ),
        ],
    ],
    "TimmRandAugment": [[T.CenterCrop(48), T.TimmRandAugment()], [T.TimmRandAugment(interpolation="nearest", fill=9)]],
    "RandomErasing": [
        [T.RandomResizedCrop(64), T.RandomHorizontalFlip(), FLOAT, T.Normalize(**IMAGENET), T.RandomErasing()],
        [T.CenterCrop(64), T.RandomErasing(value=(1, 2, 3))],  # uint8, after the transpose to CHW
        [T.CenterCrop(64), T.RandomErasing(p=1.0, value=9), FLOAT],  # before the fused tail, on HWC
        [T.CenterCrop(64), FLOAT, T.Normalize(**IMAGENET), T.RandomErasing(value="random")],  # the host's noise
    ],
}

ROOT = os.path.join(os.path.dirname(__file__), "..")


def recipes() -> list[list[T.Transform]]:
    imagenet = os.path.join(ROOT, "pipelines", "imagenet.py")
    return [list(gp.load_pipeline(f"{imagenet}:{name}")(["unused.tar"]).transforms) for name in ("train", "val")]


def staged_only(steps) -> bool:
    """Whether ``steps`` hold a type the DALI backend runs in the stage only (the policies): its
    graph never has them (``TestStageOnly`` in ``test_stage.py``)."""
    from gpupipe import backends

    only = backends.get("dali").stage_only
    return any(isinstance(t, only) or any(isinstance(m, only) for m in getattr(t, "transforms", ())) for t in steps)


def cases():
    for name, pipelines in MATRIX.items():
        for i, steps in enumerate(pipelines):
            if not staged_only(steps):
                yield pytest.param(steps, id=f"{name}-{i}")
    for i, steps in enumerate(recipes()):
        yield pytest.param(steps, id=f"imagenet-{('train', 'val')[i]}")


def define(steps, *, gpu=True, channels_last=False, dali=None, ranks_per_node=None, views=None):
    """The DALI pipeline the runner defines for ``steps`` (or for several ``views``; not built: no
    GPU needed)."""
    from gpupipe import backends
    from gpupipe.backends._dali._graph import define_graph

    views = [steps] if views is None else views
    for view in views:
        backends.get("dali").require_supported(view)  # as the Loader does first
    decoder_args = (dali or gp.DaliOptions()).decoder_args(ranks_per_node=ranks_per_node)
    return define_graph(views, gpu=gpu, device_id=None, batch_size=4, num_threads=2, prefetch=2, seed=1,
                        channels_last=channels_last, decoder_args=decoder_args)  # fmt: skip


def gpu_graph(steps, **kwargs):
    """``((operators, outputs), graph)`` of the GPU graph of ``steps``, serialized and parsed."""
    graph = define(steps, **kwargs)
    return parse(graph.pipe.serialize()), graph


def test_the_matrix_covers_every_transform():
    defined = {n for n in T.__all__ if isinstance(getattr(T, n), type) and issubclass(getattr(T, n), T.Transform)}
    not_serializable = {"ArrayFunction"}  # DALI cannot serialize python_function: test_array_function below
    assert defined - {"Transform"} <= set(MATRIX) | not_serializable, defined - set(MATRIX)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("steps", list(cases()))
def test_gpu_graph(steps, channels_last):
    (ops, outputs), graph = gpu_graph(steps, channels_last=channels_last)
    decoder = check_gpu_placement(ops, outputs)
    for name, value in gp.DaliOptions().decoder_args(ranks_per_node=None).items():
        assert decoder.args[name] == pytest.approx(value), name
    assert len(outputs) == 1 + bool(graph.lowered.checks)
    assert decoder.args["adjust_orientation"] is False  # as torchvision's decoders (the torch backend)
    if type(steps[0]) is T.RandomResizedCrop:
        assert decoder.schema == "decoders__ImageSlice"  # the fed window, decoded alone
    # no DALI random operator (a window the boxes choose is drawn where they are moved, not for the graph)
    assert graph.lowered.draws == {(0, i) for i, t in enumerate(steps) if t.random and not t.uses_boxes}
    assert not [op.schema for op in ops if op.schema.startswith("random__")]


def test_the_matrix_reaches_every_dali_lowering(monkeypatch):
    """Each built-in lowering is built at least once by the matrix (fused steps lower through the
    fusion; this counts the standalone lowerings), so none is left untried in CI."""
    from gpupipe import backends
    from gpupipe.backends._dali import _compiler
    from gpupipe.backends._registry import Lowering

    registry, reached = backends.get("dali").lowerings, set()
    table, builtin = dict(registry._table), dict(_compiler.BUILTIN)
    for kind, entry in registry._table.items():

        def recorder(t, node, ctx, _fn=entry.fn, _kind=kind):
            reached.add(_kind)
            return _fn(t, node, ctx)

        table[kind] = Lowering(recorder, entry.unsupported)
        if kind in builtin:  # keep fusion deciding as without the recorders
            builtin[kind] = recorder
    monkeypatch.setattr(registry, "_table", table)
    monkeypatch.setattr(_compiler, "BUILTIN", builtin)
    for case in cases():
        gpu_graph(case.values[0])
    missing = {kind.__name__ for kind in table} - {kind.__name__ for kind in reached} - {"ArrayFunction"}
    assert not missing, missing


def test_the_policies_have_no_dali_lowering_and_a_stage_one():
    """The matrix's policy pipelines: DALI has no lowering of them (its graph stops before them),
    the stage runs each as the view's tail."""
    from gpupipe import backends
    from gpupipe.backends._stage import stage_start

    registry = backends.get("dali").lowerings
    staged = [steps for pipelines in MATRIX.values() for steps in pipelines if staged_only(steps)]
    assert {type(t).__name__ for steps in staged for t in steps} >= {
        "TrivialAugmentWide", "RandAugment", "AutoAugment", "AugMix", "TimmRandAugment"}  # fmt: skip
    for steps in staged:
        for t in steps:
            if isinstance(t, backends.get("dali").stage_only):
                with pytest.raises(gp.UnsupportedTransformError):
                    registry.lookup(t)
        start = stage_start(steps)
        assert start is not None and all(isinstance(t, (T.CenterCrop,)) for t in steps[:start]), steps


def test_fusions_run_on_the_gpu():
    (ops, _), _ = gpu_graph(recipes()[0])  # train: RRC fused into the decoder, flip+normalize into CMN
    gpu_ops = [op.schema for op in ops if op.device == "gpu"]
    assert gpu_ops == ["Resize", "CropMirrorNormalize"], gpu_ops
    (ops, _), _ = gpu_graph(recipes()[1])  # val: resize, then crop+normalize as one op
    assert [op.schema for op in ops if op.device == "gpu"] == ["Resize", "CropMirrorNormalize"]


def test_decoder_options_reach_the_mixed_decoder():
    dali = gp.DaliOptions(
        jpeg_fancy_upsampling=False,
        hw_decoder_load=0.9,
        device_memory_padding=1 << 20,
        host_memory_padding=0,
        preallocate_width_hint=5980,
        preallocate_height_hint=6430,
    )
    for steps in ([T.CenterCrop(32)], [T.RandomResizedCrop(32)]):
        (ops, outputs), _ = gpu_graph(steps, dali=dali, ranks_per_node=8)
        decoder = check_gpu_placement(ops, outputs)
        assert decoder.args["jpeg_fancy_upsampling"] is False and decoder.args["hw_decoder_load"] == pytest.approx(0.9)
        assert decoder.args["device_memory_padding"] == 1 << 20 and decoder.args["host_memory_padding"] == 0
        assert (decoder.args["preallocate_width_hint"], decoder.args["preallocate_height_hint"]) == (5980, 6430)
        assert decoder.args["affine"] is False  # 8 ranks share the node's cores


def test_the_cpu_graph_has_the_same_operators_on_the_cpu():
    steps = recipes()[1]
    graph = define(steps, gpu=False)
    ops, _ = parse(graph.pipe.serialize())
    (gpu_ops, _), _ = gpu_graph(steps)
    assert [op.schema for op in ops] == [op.schema for op in gpu_ops]
    assert {op.device for op in ops} == {"cpu"}
    decoder = next(op for op in ops if op.schema.startswith("decoders__"))
    assert "hw_decoder_load" not in decoder.args  # the mixed decoder's settings go to the mixed decoder only


class TestDaliOptions:
    def test_defaults(self):
        args = gp.DaliOptions().decoder_args(ranks_per_node=None)
        assert args == dict(
            jpeg_fancy_upsampling=True,
            hw_decoder_load=0.65,
            device_memory_padding=16 << 20,
            host_memory_padding=8 << 20,
            preallocate_width_hint=0,
            preallocate_height_hint=0,
            affine=True,
        )

    @pytest.mark.parametrize("ranks, affine", [(None, True), (1, True), (2, False), (8, False)])
    def test_affinity_follows_the_ranks_on_the_node(self, ranks, affine):
        assert gp.DaliOptions().decoder_args(ranks_per_node=ranks)["affine"] is affine
        assert gp.DaliOptions(affine=True).decoder_args(ranks_per_node=ranks)["affine"] is True

    def test_ranks_per_node_from_the_launcher(self, clean_env):
        from gpupipe.runtime import _dist

        assert _dist.ranks_per_node() is None
        clean_env.setenv("SLURM_NTASKS_PER_NODE", "4")
        assert _dist.ranks_per_node() == 4
        clean_env.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's first
        assert _dist.ranks_per_node() == 8

    @pytest.mark.parametrize("kwargs, name", [
        (dict(hw_decoder_load=1.5), "hw_decoder_load"), (dict(device_memory_padding=-1), "device_memory_padding"),
        (dict(jpeg_fancy_upsampling=1), "jpeg_fancy_upsampling"), (dict(affine="yes"), "affine"),
        (dict(preallocate_width_hint=2.5), "preallocate_width_hint"), (dict(color_twist=None), "color_twist"),
    ])  # fmt: skip
    def test_invalid(self, kwargs, name):
        with pytest.raises(gp.ConfigError, match=f"DaliOptions: {name}"):
            gp.DaliOptions(**kwargs)

    @pytest.mark.parametrize("color_twist", [False, True])
    def test_color_twist_chooses_the_jitter_kernel(self, color_twist):
        from gpupipe.backends._dali._graph import define_graph

        steps = [T.ColorJitter(0.4, 0.4, 0.4, 0.1)]
        graph = define_graph([steps], gpu=True, device_id=None, batch_size=4, num_threads=2, prefetch=2, seed=1,
                             channels_last=False, decoder_args={}, color_twist=color_twist)  # fmt: skip
        ops, outputs = parse(graph.pipe.serialize())
        check_gpu_placement(ops, outputs)
        schemas = {op.schema for op in ops}
        assert ("ColorTwist" in schemas) is color_twist
        on_gpu = {op.schema for op in ops if op.device == "gpu"}
        assert ("_ArithmeticGenericOp" in on_gpu) is not color_twist  # torchvision's kernels, in arithmetic
        assert "color_twist" not in gp.DaliOptions(color_twist=True).decoder_args(ranks_per_node=None)

    def test_in_the_loader_config(self):
        with pytest.raises(gp.ConfigError, match=r"dali must be a gp\.DaliOptions"):
            gp.LoaderConfig(4, dali={"hw_decoder_load": 0.5})  # type: ignore[arg-type]
        assert gp.LoaderConfig(4, dali=gp.DaliOptions(hw_decoder_load=0.5)).dali.hw_decoder_load == 0.5


def test_the_values_gpupipe_computes():
    """DALI checks argument names and types; the values come from gpupipe, checked here."""
    (ops, _), _ = gpu_graph(recipes()[0])
    decoder, cmn = next(op for op in ops if op.schema.startswith("decoders__")), ops[-1]
    assert decoder.args["axis_names"] == "HW"  # the fed window: start=(top, left), shape=(h, w)
    assert cmn.args["mean"] == pytest.approx([m * 255 for m in IMAGENET["mean"]], rel=1e-6)
    assert cmn.args["std"] == pytest.approx([s * 255 for s in IMAGENET["std"]], rel=1e-6)
    assert cmn.args["output_layout"] == "CHW"
    (ops, _), _ = gpu_graph([T.RandomCrop(32, padding=4, fill=(1, 2, 3))])
    (crop,) = [op for op in ops if op.schema == "Slice"]
    assert crop.device == "gpu" and crop.args["fill_values"] == [1.0, 2.0, 3.0]
    assert crop.args["out_of_bounds_policy"] == "pad"


class TestArrayFunction:
    """ArrayFunction runs in DALI's python_function: on the GPU with CuPy, and such a graph cannot
    be serialized, so its GPU graph is checked from DALI's operator list."""

    def graph(self):
        return define([T.CenterCrop(32), Posterize(bits=3), FLOAT])

    def test_on_the_gpu_with_cupy(self, monkeypatch):
        import sys
        import types

        monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))  # defining the graph imports it only
        graph = self.graph()
        graph.pipe._build_graph()
        placed = {op._op.schema_name: op._op.device for op in graph.pipe._ops if hasattr(op._op, "schema_name")}
        assert placed["decoders__Image"] == "mixed" and placed["PythonFunction"] == "gpu"
        assert placed["CropMirrorNormalize"] == "gpu"

    def test_without_cupy_the_error_says_what_to_install(self, monkeypatch):
        import sys

        monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy fails
        with pytest.raises(gp.BackendUnavailableError, match=r"Posterize .*needs CuPy: pip install cupy-cuda12x"):
            self.graph()
