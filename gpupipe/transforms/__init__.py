"""Transform definitions, with torchvision.transforms.v2's names, argument names and defaults.

Each transform is a small frozen dataclass: it validates its arguments when constructed and imports
no backend. Backends lower it through their registries. Images enter the pipeline decoded, as
uint8 RGB ``[3, H, W]``.

Example:
    >>> import torch
    >>> from gpupipe import transforms as T
    >>> steps = [T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
    ...          T.ToDtype(torch.float32, scale=True),
    ...          T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])]
"""

from ._affine import RandomAffine, RandomRotation
from ._apply import RandomApply
from ._base import ImageSpec, InterpolationMode, Transform
from ._batch import BatchMode, BatchTransform, CutMix, MixUp, RandomChoice
from ._color import ColorJitter, GaussianBlur, Normalize, RandomGrayscale, RandomSolarize, ToDtype
from ._custom import Arithmetic, ArrayFunction
from ._detection import RandomIoUCrop, RandomPhotometricDistort, RandomZoomOut
from ._erasing import RandomErasing
from ._policies import AugMix, AutoAugment, AutoAugmentPolicy, RandAugment, TrivialAugmentWide
from ._spatial import (
    CenterCrop,
    RandomCrop,
    RandomHorizontalFlip,
    RandomResize,
    RandomResizedCrop,
    RandomShortestSize,
    RandomVerticalFlip,
    Resize,
)
from ._timm import TimmRandAugment
from ._tone import RandomAdjustSharpness, RandomAutocontrast, RandomEqualize, RandomInvert, RandomPosterize

__all__ = [
    "Transform",
    "ImageSpec",
    "InterpolationMode",
    "RandomResizedCrop",
    "Resize",
    "RandomResize",
    "RandomShortestSize",
    "RandomZoomOut",
    "RandomIoUCrop",
    "RandomPhotometricDistort",
    "CenterCrop",
    "RandomCrop",
    "RandomHorizontalFlip",
    "RandomVerticalFlip",
    "ColorJitter",
    "RandomGrayscale",
    "GaussianBlur",
    "RandomSolarize",
    "RandomApply",
    "RandomErasing",
    "RandomInvert",
    "RandomPosterize",
    "RandomAutocontrast",
    "RandomAdjustSharpness",
    "RandomEqualize",
    "RandomRotation",
    "RandomAffine",
    "TrivialAugmentWide",
    "RandAugment",
    "AutoAugment",
    "AutoAugmentPolicy",
    "AugMix",
    "TimmRandAugment",
    "ToDtype",
    "Normalize",
    "Arithmetic",
    "ArrayFunction",
    "BatchTransform",
    "BatchMode",
    "MixUp",
    "CutMix",
    "RandomChoice",
]
