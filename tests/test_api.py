"""The public API is pinned: a change here is a deliberate API change."""

import gpupipe as gp
from gpupipe import transforms as T


def test_top_level_api():
    assert sorted(gp.__all__) == sorted([
        "Pipeline", "Loader", "LoaderConfig", "Batch", "WebDataset", "ImageFolder", "load_pipeline", "register_lowering", "ShardWriter",
        "synthetic_image", "encode_jpeg", "transforms", "GpupipeError", "ConfigError", "PipelineError",
        "UnsupportedTransformError", "BackendUnavailableError", "DataError", "ShardError", "SampleError",
        "__version__",
    ])
    assert all(hasattr(gp, name) for name in gp.__all__)


def test_transforms_api():
    assert sorted(T.__all__) == sorted([
        "Transform", "ImageSpec", "InterpolationMode", "RandomResizedCrop", "Resize", "CenterCrop", "RandomCrop",
        "RandomHorizontalFlip", "RandomVerticalFlip", "ColorJitter", "RandomGrayscale", "GaussianBlur", "ToDtype",
        "Normalize", "Arithmetic",
    ])
    assert all(hasattr(T, name) for name in T.__all__)


def test_error_hierarchy():
    assert issubclass(gp.ConfigError, ValueError) and issubclass(gp.PipelineError, gp.ConfigError)
    assert issubclass(gp.UnsupportedTransformError, gp.PipelineError)
    assert issubclass(gp.SampleError, gp.DataError) and issubclass(gp.ShardError, gp.DataError)
    assert issubclass(gp.BackendUnavailableError, RuntimeError)
    for cls in (gp.ConfigError, gp.DataError, gp.BackendUnavailableError):
        assert issubclass(cls, gp.GpupipeError)
    err = gp.SampleError("msg", shard="s.tar", key="k")  # one positional message: survives worker re-raise
    assert (str(err), err.shard, err.key) == ("msg", "s.tar", "k")


def test_importing_gpupipe_does_not_import_dali():
    import subprocess
    import sys

    code = "import sys, gpupipe; from gpupipe import transforms; print('nvidia.dali' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
