"""Tone transforms with a probability: RandomInvert, RandomPosterize, RandomAutocontrast
(torchvision v2's; the building blocks of the augmentation policies)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from ..core._errors import ConfigError
from ..core._validate import is_number
from ._base import Coin, ImageSpec, Transform, require_channels

__all__ = [
    "RandomInvert",
    "RandomPosterize",
    "RandomAutocontrast",
    "RandomAdjustSharpness",
    "RandomEqualize",
    "CoinParams",
]


class CoinParams(NamedTuple):
    """One sample's decision: whether the transform acts."""

    apply: bool


class _Coined(Coin, Transform):
    """A transform that acts on a sample with probability ``p``: one draw, its decision. A
    subclass with ``channels`` takes images of those channel counts only."""

    channels: ClassVar[tuple[int, ...] | None] = None

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if self.channels is not None:
            require_channels(self, spec, self.channels)
        return spec

    random = True
    draws = 1

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1]``: 1.0 where the transform acts (``u < p``)."""
        return self._coin(u)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> CoinParams:
        return CoinParams(bool(factors[0]))


@dataclasses.dataclass(frozen=True)
class RandomInvert(_Coined):
    """Inverts the image with probability ``p`` (default 0.5): ``255 - v`` (uint8), ``1 - v``
    (float). Shapes and dtype unchanged; exact on every backend."""

    keeps_size = True
    commutes_with_flip = True

    p: float = 0.5

    def __post_init__(self) -> None:
        self._check_p()


@dataclasses.dataclass(frozen=True)
class RandomPosterize(_Coined):
    """Keeps the ``bits`` most significant bits of each value with probability ``p`` (default
    0.5): ``v & mask`` on uint8, ``floor(v · 2^bits) / 2^bits`` (clamped) on a float image, as
    torchvision. ``bits`` in ``[0, 8]``. Shapes and dtype unchanged; exact on every backend."""

    keeps_size = True
    commutes_with_flip = True

    bits: int
    p: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 0 <= self.bits <= 8:
            raise ConfigError(f"RandomPosterize: bits must be an int in [0, 8], got {self.bits!r}")
        self._check_p()

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if spec.dtype not in (torch.uint8, torch.float32, torch.float64, torch.float16):
            raise self._fail(f"takes a uint8 or float image, got {spec}")
        return spec


@dataclasses.dataclass(frozen=True)
class RandomAutocontrast(_Coined):
    """Stretches each channel to the full range with probability ``p`` (default 0.5): ``(v − min)
    / ((max − min) / bound)``, clamped (a flat channel is kept), as torchvision computes it in
    float32 (a uint8 image truncated back). 1 or 3 channels. Exact on every backend."""

    keeps_size = True
    commutes_with_flip = True

    p: float = 0.5
    channels = (1, 3)

    def __post_init__(self) -> None:
        self._check_p()


@dataclasses.dataclass(frozen=True)
class RandomAdjustSharpness(_Coined):
    """Adjusts the sharpness with probability ``p`` (default 0.5), as torchvision: the image
    blended with its smoothed copy (the 3x3 kernel ``[[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13``,
    rounded for uint8, the border pixels kept), ``sharpness_factor`` 0 giving the smoothed image,
    1 the original, 2 twice as sharp. 1 or 3 channels; an image of 2 pixels or fewer a side is
    kept. On DALI: the same float32 kernel and blend; torch may fuse the blend's multiply-add
    where DALI rounds twice, so a value could land one unit apart (none did in 1.3 M tested).

    Args:
        sharpness_factor: a non-negative number.
        p: probability of adjusting. Default 0.5.
    """

    keeps_size = True
    commutes_with_flip = True

    sharpness_factor: float
    p: float = 0.5
    channels = (1, 3)

    def __post_init__(self) -> None:
        if not (is_number(self.sharpness_factor) and self.sharpness_factor >= 0):
            raise ConfigError(f"RandomAdjustSharpness: sharpness_factor must be a non-negative number, got "
                              f"{self.sharpness_factor!r}")  # fmt: skip
        self._set("sharpness_factor", float(self.sharpness_factor))
        self._check_p()


@dataclasses.dataclass(frozen=True)
class RandomEqualize(_Coined):
    """Equalizes each channel's histogram with probability ``p`` (default 0.5), as torchvision
    (PIL's lookup table; a float image through uint8 and back). On DALI: DALI's ``equalize``,
    whose table is OpenCV's: on photographs of about 100 x 80, 1.6 units apart on average (11 at
    most); on smaller images further (5.5 at 40 x 56); a flat channel is kept by both."""

    keeps_size = True
    commutes_with_flip = True

    p: float = 0.5
    channels = (1, 3)

    def __post_init__(self) -> None:
        self._check_p()
