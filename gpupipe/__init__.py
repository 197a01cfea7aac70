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

from . import transforms
from .backends import register_lowering
from ._errors import (
    BackendUnavailableError, ConfigError, DataError, GpupipeError, PipelineError, SampleError, ShardError,
    UnsupportedTransformError,
)
from ._config import LoaderConfig
from ._loader import Batch, Loader
from ._pipeline import Pipeline, load_pipeline
from ._shards import ShardWriter, encode_jpeg, synthetic_image
from . import sources
from .sources import ImageFolder, Source, WebDataset

__version__ = "0.1.0"

__all__ = [
    "Pipeline",
    "Loader",
    "LoaderConfig",
    "Batch",
    "WebDataset",
    "ImageFolder",
    "load_pipeline",
    "register_lowering",
    "ShardWriter",
    "synthetic_image",
    "encode_jpeg",
    "transforms",
    "GpupipeError",
    "ConfigError",
    "PipelineError",
    "UnsupportedTransformError",
    "BackendUnavailableError",
    "DataError",
    "ShardError",
    "SampleError",
    "__version__",
]
