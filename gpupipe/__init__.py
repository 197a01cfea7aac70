"""gpupipe: GPU-side image decode and augmentation for PyTorch training.

Pipelines are declared once with torchvision-named transforms and run on a backend: ``dali``
(one NVIDIA DALI graph, on the GPU or DALI's CPU operators) or ``torch`` (torchvision kernels in
worker processes).

Example:
    >>> import torch, gpupipe as gp
    >>> from gpupipe import transforms as T
    >>> pipe = gp.Pipeline(gp.WebDataset("data/train-{000000..000007}.tar"),  # doctest: +SKIP
    ...                    [T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
    ...                     T.ToDtype(torch.float32, scale=True),
    ...                     T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    >>> loader = gp.Loader(pipe, batch_size=64, shuffle=True, drop_last=True, seed=0)  # doctest: +SKIP
"""

from .runtime import _nvjpeg

_nvjpeg.preload()  # first: before anything imports torchvision, which brings an older nvJPEG (see _nvjpeg)

from . import fields, sources, transforms
from .backends import register_lowering
from .core._config import DaliOptions, DecodeMode, LoaderConfig, OnError, RayOptions
from .core._errors import (
    BackendUnavailableError,
    ClosedError,
    ConfigError,
    Damage,
    DataError,
    GpupipeError,
    PipelineError,
    SampleError,
    ShardError,
    UnsupportedTransformError,
    WorkerError,
)
from .core._shards import ShardWriter
from .loader._loader import Batch, Loader, SkippedSample
from .loader._records import Tuned
from .loader._tune import tune
from .pipeline._check import CheckReport, check
from .pipeline._pipeline import Pipeline, load_pipeline
from .plan._plan import RankPlan
from .sources import FakeData, ImageFolder, Mix, Source, WebDataset

__version__ = "0.1.0"

__all__ = [
    "Pipeline",
    "Loader",
    "LoaderConfig",
    "DaliOptions",
    "RayOptions",
    "DecodeMode",
    "OnError",
    "Batch",
    "SkippedSample",
    "Damage",
    "RankPlan",
    "Source",
    "WebDataset",
    "ImageFolder",
    "FakeData",
    "Mix",
    "load_pipeline",
    "check",
    "CheckReport",
    "register_lowering",
    "ShardWriter",
    "tune",
    "Tuned",
    "transforms",
    "sources",
    "fields",
    "GpupipeError",
    "ConfigError",
    "PipelineError",
    "UnsupportedTransformError",
    "BackendUnavailableError",
    "ClosedError",
    "WorkerError",
    "DataError",
    "ShardError",
    "SampleError",
    "__version__",
]
