"""Photometric and type transforms: ColorJitter, RandomGrayscale, GaussianBlur, RandomSolarize, ToDtype,
Normalize."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..core._errors import ConfigError
from ..core._validate import is_int, is_number, valid_bool, valid_range
from ._base import Coin, ImageSpec, Transform, require_channels

__all__ = [
    "ColorJitter",
    "RandomGrayscale",
    "GaussianBlur",
    "RandomSolarize",
    "ToDtype",
    "Normalize",
    "ColorJitterParams",
    "GrayscaleParams",
    "BlurParams",
    "SolarizeParams",
]


class ColorJitterParams(NamedTuple):
    """``order`` is a permutation of (0 brightness, 1 contrast, 2 saturation, 3 hue); a factor is
    ``None`` where that adjustment is off."""

    order: tuple[int, ...]
    brightness: float | None
    contrast: float | None
    saturation: float | None
    hue: float | None


class GrayscaleParams(NamedTuple):
    apply: bool


class BlurParams(NamedTuple):
    sigma: float


class SolarizeParams(NamedTuple):
    apply: bool


def _jitter_range(
    owner: str, value: Any, name: str, *, center: float, bound: tuple[float, float], clip_first_on_zero: bool
) -> tuple[float, float] | None:
    if value is None:
        return None
    if is_number(value):
        if value < 0:
            raise ConfigError(f"{owner}: {name} must be non-negative when a single number, got {value!r}")
        value = [center - value, center + value]
        if clip_first_on_zero:
            value[0] = max(value[0], 0.0)
    lo, hi = valid_range(owner, value, name, low=bound[0], high=bound[1])
    return None if lo == hi == center else (lo, hi)


@dataclasses.dataclass(frozen=True)
class ColorJitter(Transform):
    """Randomly changes brightness, contrast, saturation and hue, in a random order.

    Args:
        brightness: ``b`` → factor uniform in ``[max(0, 1 - b), 1 + b]``, or ``(min, max)``.
        contrast: as ``brightness``.
        saturation: as ``brightness``.
        hue: ``h`` in ``[0, 0.5]`` → shift uniform in ``[-h, h]``, or ``(min, max)`` within
            ``[-0.5, 0.5]``. Default for all four: ``None`` (off).

    Shapes unchanged; saturation and hue need 3 channels. Works on uint8 and float images
    (float values in ``[0, 1]``).
    """

    keeps_size = True
    commutes_with_flip = True

    brightness: Any = None
    contrast: Any = None
    saturation: Any = None
    hue: Any = None

    random = True
    draws = 8

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("brightness", "contrast", "saturation"):
            self._set(
                field,
                _jitter_range(
                    name, getattr(self, field), field, center=1.0, bound=(0.0, math.inf), clip_first_on_zero=True
                ),
            )
        self._set("hue", _jitter_range(name, self.hue, "hue", center=0.0, bound=(-0.5, 0.5), clip_first_on_zero=False))

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        require_channels(self, spec, (3,) if (self.saturation or self.hue) else (1, 3))
        return spec

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 8]``: the order (a permutation of 0..3, as floats), then the brightness,
        contrast, saturation and hue factors (NaN where that adjustment is off)."""
        order = np.argsort(u[..., :4], axis=-1, kind="stable").astype(np.float64)
        drawn = [
            np.full(u.shape[:-1], np.nan) if r is None else r[0] + (r[1] - r[0]) * u[..., 4 + i]
            for i, r in enumerate((self.brightness, self.contrast, self.saturation, self.hue))
        ]
        return np.concatenate([order, np.stack(drawn, axis=-1)], axis=-1)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> ColorJitterParams:
        order = tuple(int(o) for o in factors[:4])
        values = [None if math.isnan(f) else float(f) for f in factors[4:8]]
        return ColorJitterParams(order, *values)


@dataclasses.dataclass(frozen=True)
class RandomGrayscale(Coin, Transform):
    """Converts the image to grayscale with probability ``p`` (default 0.1), keeping 3 channels
    (ITU-R 601-2 luma: 0.2989 R + 0.587 G + 0.114 B). Shapes unchanged."""

    keeps_size = True
    commutes_with_flip = True

    p: float = 0.1

    random = True
    draws = 1

    def __post_init__(self) -> None:
        self._check_p()

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        require_channels(self, spec)
        return spec

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1]``: 1.0 where the image turns gray (``u < p``)."""
        return self._coin(u)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> GrayscaleParams:
        return GrayscaleParams(bool(factors[0]))


@dataclasses.dataclass(frozen=True)
class GaussianBlur(Transform):
    """Blurs with a Gaussian kernel whose sigma is drawn uniformly from ``sigma``.

    Args:
        kernel_size: odd positive int (or a sequence of one), or ``(kx, ky)`` (width first, as
            torchvision).
        sigma: a fixed positive number, or a range ``(min, max)``. Default ``(0.1, 2.0)``.

    Shapes unchanged. Borders are reflected (torchvision's ``reflect``: the edge pixel is not
    repeated).
    """

    keeps_size = True
    commutes_with_flip = True

    kernel_size: Any
    sigma: Any = (0.1, 2.0)

    random = True
    draws = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        ks = self.kernel_size
        ks = (ks, ks) if is_int(ks) else tuple(ks) if isinstance(ks, Sequence) and not isinstance(ks, str) else None
        if ks is not None and len(ks) == 1:  # torchvision's _setup_size: one value for both sides
            ks = (ks[0], ks[0])
        if ks is None or len(ks) != 2 or not all(is_int(k) and k > 0 and k % 2 == 1 for k in ks):
            raise ConfigError(
                f"{name}: kernel_size must be an odd positive int or a sequence of two "
                f"odd positive ints (kx, ky), got {self.kernel_size!r}"
            )
        self._set("kernel_size", ks)
        sigma = self.sigma
        if is_number(sigma):
            sigma = (sigma, sigma)
        elif isinstance(sigma, Sequence) and not isinstance(sigma, str) and len(sigma) == 1:
            sigma = (sigma[0], sigma[0])
        sigma = valid_range(name, sigma, "sigma", low=0.0)
        if sigma[0] <= 0:
            raise ConfigError(f"{name}: sigma must be positive, got {self.sigma!r}")
        self._set("sigma", sigma)

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1]``: sigma, uniform in ``sigma``."""
        return self.sigma[0] + (self.sigma[1] - self.sigma[0]) * u

    def make_params(self, height: int, width: int, factors: np.ndarray) -> BlurParams:
        return BlurParams(float(factors[0]))


def max_value(dtype: torch.dtype) -> float:
    """The largest value of an image of ``dtype``: 255 for uint8, 1.0 for a float image."""
    return 255.0 if dtype == torch.uint8 else 1.0


@dataclasses.dataclass(frozen=True)
class RandomSolarize(Coin, Transform):
    """Solarizes the image with probability ``p``: every pixel value ``>= threshold`` is inverted
    (``v -> 255 - v`` for uint8, ``v -> 1.0 - v`` for a float image).

    Args:
        threshold: a non-negative number, in the image's units (``[0, 255]`` for uint8, ``[0, 1]``
            for float images; a threshold above the image's largest value is an error when the
            pipeline is built, where torchvision raises when it runs).
        p: probability of solarizing the image. Default 0.5.

    Shapes and dtype unchanged. Every backend computes torchvision's values exactly (on DALI:
    arithmetic on the image, the per-sample decision selecting the result).
    """

    keeps_size = True
    commutes_with_flip = True

    threshold: float
    p: float = 0.5

    random = True
    draws = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not (is_number(self.threshold) and self.threshold >= 0):
            raise ConfigError(f"{name}: threshold must be a non-negative number, got {self.threshold!r}")
        self._set("threshold", float(self.threshold))
        self._check_p()

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if self.threshold > max_value(spec.dtype):
            raise self._fail(
                f"threshold {self.threshold:g} is above the largest value of an image {spec} "
                f"({max_value(spec.dtype):g}); float images are in [0, 1]"
            )
        return spec

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1]``: 1.0 where the image is solarized (``u < p``)."""
        return self._coin(u)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> SolarizeParams:
        return SolarizeParams(bool(factors[0]))


_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class ToDtype(Transform):
    """Converts the image's dtype.

    Args:
        dtype: one of ``torch.uint8``, ``float16``, ``bfloat16``, ``float32``, ``float64``.
        scale: rescale values between the dtypes' ranges (uint8 ``[0, 255]`` ↔ float
            ``[0, 1]``). Default ``False``: a plain cast.
    """

    keeps_size = True

    dtype: torch.dtype
    _: dataclasses.KW_ONLY
    scale: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.dtype not in _DTYPES:
            names = ", ".join(f"torch.{str(d).replace('torch.', '')}" for d in _DTYPES)
            raise ConfigError(f"{name}: dtype must be one of {names}, got {self.dtype!r}")
        valid_bool(name, self.scale, "scale")

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        return dataclasses.replace(spec, dtype=self.dtype)


@dataclasses.dataclass(frozen=True)
class Normalize(Transform):
    """Subtracts ``mean`` and divides by ``std``, per channel: ``out = (in - mean) / std``.

    Args:
        mean: one number per channel (or one for all).
        std: one non-zero number per channel (or one for all).
        inplace: accepted for torchvision compatibility; gpupipe's kernels never alias their
            input, so it changes nothing.

    Needs a float image: put ``ToDtype(torch.float32, scale=True)`` before it (checked when the
    pipeline is built). Shapes unchanged.
    """

    keeps_size = True

    mean: Sequence[float]
    std: Sequence[float]
    _: dataclasses.KW_ONLY
    inplace: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("mean", "std"):
            value = getattr(self, field)
            if is_number(value):
                value = (value,)
            if not (
                isinstance(value, Sequence) and not isinstance(value, str) and value and all(map(is_number, value))
            ):
                raise ConfigError(f"{name}: {field} must be a sequence of numbers (one per channel), got {value!r}")
            self._set(field, tuple(float(v) for v in value))
        if any(s == 0 for s in self.std):
            raise ConfigError(f"{name}: std must not contain 0, got {self.std!r}")
        valid_bool(name, self.inplace, "inplace")

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if not spec.dtype.is_floating_point:
            raise self._fail(f"needs a float image, got {spec}; add ToDtype(torch.float32, scale=True) before it")
        for field in ("mean", "std"):
            if len(getattr(self, field)) not in (1, spec.channels):
                raise self._fail(
                    f"{field} has {len(getattr(self, field))} values for an image of {spec.channels} channels"
                )
        return spec
