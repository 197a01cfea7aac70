"""Backend-free building blocks of transform definitions.

A transform is a small frozen dataclass. It validates and normalises its arguments at
construction, says what it does to the image's shape and dtype (:meth:`Transform.output_spec`) and,
when it is random, how its parameters follow from uniform draws (:meth:`Transform.sample`,
:meth:`Transform.make_params`). It never draws them itself (``gpupipe.core._random`` does, for every
backend) and never touches pixels: backends lower it through their registries (see
``gpupipe/backends``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

import numpy as np
import torch

from ..core._errors import PipelineError
from ..core._validate import valid_enum, valid_probability

__all__ = ["Transform", "ImageSpec", "InterpolationMode"]


class InterpolationMode(str, enum.Enum):
    """Resampling filter, with the names and values of ``torchvision.transforms.InterpolationMode``.

    The tensor modes only: torchvision's PIL-only modes (BOX, HAMMING, LANCZOS) are not accepted.
    ``torchvision.transforms.InterpolationMode`` members and their string values are accepted
    wherever a transform takes ``interpolation``.
    """

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """What is known about one image at a point of the pipeline, at build time.

    Images are CHW. ``height``/``width`` are ``None`` where they depend on the input image.
    """

    channels: int = 3
    height: int | None = None
    width: int | None = None
    dtype: torch.dtype = torch.uint8

    @property
    def fixed_size(self) -> bool:
        return self.height is not None and self.width is not None

    def __str__(self) -> str:
        h = "?" if self.height is None else self.height
        w = "?" if self.width is None else self.width
        return f"[{self.channels}, {h}, {w}] {str(self.dtype).replace('torch.', '')}"


@dataclasses.dataclass(frozen=True)
class Transform:
    """Base class of all transforms.

    Subclasses are frozen dataclasses. A random transform sets ``draws``, the number of uniforms
    in ``[0, 1)`` it consumes per sample (``random`` is then true; a composite transform such as
    ``RandomApply`` sets its instances' own ``draws``, so read it from the instance), and defines
    its parameters in two pure steps, so that every backend computes the same ones:

    1. :meth:`sample`: uniforms ``[..., draws]`` → the transform's random factors ``[..., F]``,
       vectorized (what does not depend on the image: a flip decision, a blur sigma, the crop
       scales of ``RandomResizedCrop``'s attempts);
    2. :meth:`make_params`: one sample's factors and its image size → its parameters.

    The torch backend applies both per sample; the DALI backend runs :meth:`sample` on the host
    for a whole batch and computes step 2 in its graph, with the same arithmetic.

    What the compilers and the masks need to know of a transform is declared on its class:

    - ``keeps_size``: its output has its input's size on every backend, so the host knows the
      size after it (:meth:`size_kept` answers for an instance whose arguments decide);
    - ``moves_masks``: it is geometric: a ``gp.fields.Mask`` (and boxes) follows it, moved by
      each backend's mask kernels; the others leave masks as they are;
    - ``commutes_with_flip``: a horizontal flip before it may move after it (it acts per pixel,
      on the whole image, or with a mirror-symmetric kernel). Not inherited: a subclass may
      change what the image undergoes, so it declares it itself.
    """

    random: ClassVar[bool] = False
    draws: ClassVar[int] = 0
    uses_boxes: ClassVar[bool] = False  # make_params takes the sample's boxes too (RandomIoUCrop)
    keeps_size: ClassVar[bool] = False
    moves_masks: ClassVar[bool] = False
    commutes_with_flip: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.random != (cls.draws > 0):
            raise TypeError(f"{cls.__name__}: a random transform sets draws > 0, a deterministic one draws = 0")
        cls.commutes_with_flip = bool(vars(cls).get("commutes_with_flip", False))  # declared, never inherited

    def size_kept(self) -> bool:
        """Whether this step's output has its input's size on every backend (``keeps_size``)."""
        return self.keeps_size

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        """Returns the spec of the output for an input of ``spec``; raises PipelineError if invalid."""
        return spec

    def sample(self, u: np.ndarray) -> np.ndarray:
        """This transform's random factors (float64 ``[..., F]``) from uniforms ``[..., draws]``;
        vectorized over the leading axes. Default: the uniforms themselves."""
        return u

    def make_params(self, height: int, width: int, factors: np.ndarray) -> Any:
        """The parameters for an image of ``height`` x ``width`` with this sample's random
        ``factors`` (one row of :meth:`sample`'s output). Deterministic transforms return ``None``."""
        return None

    def _fail(self, message: str) -> PipelineError:
        return PipelineError(f"{type(self).__name__}: {message}")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)


class Coin:
    """Mixin of the transforms that act with a probability ``p`` (RandomGrayscale, RandomSolarize,
    the flips, RandomApply): one place validates ``p`` and draws the decision.

    The transform declares its own ``p`` field (so that the field keeps its place and default among
    the transform's arguments), calls :meth:`_check_p` in its ``__post_init__`` and takes its
    decision from one uniform per sample with :meth:`_coin`.
    """

    p: float

    def _check_p(self) -> None:
        object.__setattr__(self, "p", valid_probability(type(self).__name__, self.p))

    def _coin(self, u: np.ndarray) -> np.ndarray:
        """1.0 where the transform acts (``u < p``), else 0.0: float64, the shape of ``u``."""
        return (u < self.p).astype(np.float64)


# ------------------------------------------------------------ transform-specific checks --


def valid_interpolation(owner: str, value: Any) -> InterpolationMode:
    return valid_enum(owner, value, "interpolation", InterpolationMode)


def require_channels(t: Transform, spec: ImageSpec, allowed: tuple[int, ...] = (1, 3)) -> None:
    if spec.channels not in allowed:
        raise t._fail(f"needs {' or '.join(map(str, allowed))} channels, got an image {spec}")
