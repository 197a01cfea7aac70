"""The public API is pinned: a change here is a deliberate API change."""

import subprocess
import sys

import gpupipe as gp
from gpupipe import sources, testing
from gpupipe import transforms as T


def test_top_level_api():
    assert sorted(gp.__all__) == sorted([
        "Pipeline", "Loader", "LoaderConfig", "DaliOptions", "RayOptions", "DecodeMode", "OnError", "Batch",
        "SkippedSample", "Damage", "RankPlan",
        "Source", "WebDataset", "ImageFolder", "FakeData", "Mix",
        "load_pipeline", "check", "CheckReport",
        "register_lowering", "ShardWriter", "tune", "Tuned", "transforms", "sources", "fields", "GpupipeError",
        "ConfigError", "PipelineError", "UnsupportedTransformError", "BackendUnavailableError", "ClosedError",
        "WorkerError", "DataError", "ShardError", "SampleError", "__version__",
    ])  # fmt: skip
    assert all(hasattr(gp, name) for name in gp.__all__)


def test_transforms_api():
    assert sorted(T.__all__) == sorted([
        "Transform", "ImageSpec", "InterpolationMode", "RandomResizedCrop", "Resize", "RandomResize", "CenterCrop",
        "RandomShortestSize", "RandomZoomOut", "RandomIoUCrop", "RandomPhotometricDistort", "RandomCrop",
        "RandomHorizontalFlip", "RandomVerticalFlip", "ColorJitter", "RandomGrayscale", "GaussianBlur",
        "RandomSolarize", "RandomApply", "ToDtype", "Normalize", "Arithmetic", "ArrayFunction", "BatchTransform",
        "BatchMode", "MixUp", "CutMix", "RandomChoice", "RandomErasing", "RandomInvert", "RandomPosterize",
        "RandomAutocontrast", "RandomAdjustSharpness", "RandomRotation",
        "RandomAffine", "RandomEqualize", "TrivialAugmentWide", "RandAugment", "AutoAugment",
        "AutoAugmentPolicy", "AugMix", "TimmRandAugment",
    ])  # fmt: skip
    assert all(hasattr(T, name) for name in T.__all__)


def test_fields_api():
    assert sorted(gp.fields.__all__) == sorted(
        ["Field", "Image", "Text", "Json", "Label", "Array", "Mask", "Boxes", "BoxFormat", "Missing", "Padded"]
    )
    assert all(hasattr(gp.fields, name) for name in gp.fields.__all__)


def test_sources_api():
    assert sorted(sources.__all__) == sorted([
        "Source", "WebDataset", "ImageFolder", "FakeData", "Mix", "Index", "ShardIndex", "RawSample", "Reader",
        "Located", "NO_LABEL", "Storage", "LocalStorage", "Stat", "register_storage", "storage_for", "expand_urls",
        "split_key", "parse_label", "IMG_EXTENSIONS",
    ])  # fmt: skip
    assert all(hasattr(sources, name) for name in sources.__all__)
    assert gp.Source is sources.Source and gp.WebDataset is sources.WebDataset


def test_storage_api():
    from gpupipe import storage

    assert sorted(storage.__all__) == sorted([
        "Storage", "LocalStorage", "Stat", "MappedFile", "register_storage", "storage_for", "expand_urls", "scheme_of",
    ])  # fmt: skip
    assert all(hasattr(storage, name) for name in storage.__all__)
    assert sources.Storage is storage.Storage and sources.register_storage is storage.register_storage


def test_testing_api():
    assert sorted(testing.__all__) == ["encode_jpeg", "encode_png", "label_map", "paint_boxes", "synthetic_image"]


def test_error_hierarchy():
    assert issubclass(gp.ConfigError, ValueError) and issubclass(gp.PipelineError, gp.ConfigError)
    assert issubclass(gp.UnsupportedTransformError, gp.PipelineError)
    assert issubclass(gp.SampleError, gp.DataError) and issubclass(gp.ShardError, gp.DataError)
    assert issubclass(gp.BackendUnavailableError, RuntimeError) and issubclass(gp.ClosedError, RuntimeError)
    assert issubclass(gp.WorkerError, RuntimeError)
    for cls in (gp.ConfigError, gp.DataError, gp.BackendUnavailableError, gp.ClosedError, gp.WorkerError):
        assert issubclass(cls, gp.GpupipeError)
    err = gp.SampleError("msg", shard="s.tar", key="k")  # one positional message: survives worker re-raise
    assert (str(err), err.shard, err.key) == ("msg", "s.tar", "k")


def test_importing_gpupipe_imports_no_backend_library():
    code = (
        "import sys, gpupipe; from gpupipe import transforms, sources, backends; backends.get('dali');"
        "print('nvidia.dali' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_backends_api():
    from gpupipe import backends

    assert sorted(backends.__all__) == sorted([
        "TABLE", "Backend", "Runner", "RunSpec", "RawBatch", "names", "get", "resolve", "why", "register_lowering",
        "to_device", "DaliContext", "auto_choice",
    ])  # fmt: skip
    ctx = backends.DaliContext("cpu")
    assert ctx.device == "cpu" and ctx.decoder_device == "cpu" and ctx.feeds == {}
    # what the graph is built with and accumulates is its `built`, one per graph; the rest, the step's
    assert ctx.built.feeds is ctx.feeds and ctx.built.checks is ctx.checks and ctx.built.device == "cpu"
    assert not {"step", "view", "dtype", "size", "layout", "branch", "mirrored"} & set(vars(ctx.built))
