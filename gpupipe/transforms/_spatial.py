"""Spatial transforms, the definitions: RandomResizedCrop, Resize, CenterCrop, RandomCrop and the
flips.

Names, argument names and defaults are torchvision.transforms.v2's; the output geometry (sizes,
rounding, crop offsets, too-small images) is torchvision's, computed once in ``gpupipe.core._geometry``
(the math every backend shares) and used by ``output_spec``, ``make_params`` and every backend.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core._errors import ConfigError
from ..core._geometry import (
    ATTEMPTS,
    TooSmall,
    crop_padding,
    crop_start,
    crop_too_large,
    resize_size,
    resized_crop_window,
    shortest_size,
)
from ..core._validate import is_int, is_number, valid_bool, valid_range, valid_size
from ._base import Coin, ImageSpec, InterpolationMode, Transform, valid_interpolation

__all__ = [
    "RandomResizedCrop",
    "Resize",
    "CenterCrop",
    "RandomCrop",
    "RandomHorizontalFlip",
    "RandomVerticalFlip",
    "RandomShortestSize",
    "CropParams",
    "SizeParams",
    "RandomCropParams",
    "FlipParams",
]


class CropParams(NamedTuple):
    """A crop window in input pixels."""

    top: int
    left: int
    height: int
    width: int


class RandomCropParams(NamedTuple):
    """Padding ``[left, top, right, bottom]`` applied first, then the crop window."""

    padding: tuple[int, int, int, int]
    top: int
    left: int
    height: int
    width: int


class FlipParams(NamedTuple):
    flip: bool


@dataclasses.dataclass(frozen=True)
class RandomResizedCrop(Transform):
    """Crops a random area and aspect ratio, then resizes it to ``size``.

    Args:
        size: output ``(h, w)``, or an int for a square output.
        scale: range of the crop's area, as a fraction of the image's area. Default ``(0.08, 1.0)``.
        ratio: range of the crop's aspect ratio (w / h), sampled log-uniformly.
            Default ``(3/4, 4/3)``.
        interpolation: resampling filter. Default ``BILINEAR``.
        antialias: low-pass filter when downscaling. Default ``True``.

    Shapes: ``[C, H, W] -> [C, size[0], size[1]]``.

    Parameters follow torchvision's sampler: 10 attempts of a uniform area fraction and a
    log-uniform aspect ratio, the first that fits wins, at a uniform position; else a central crop
    (``gpupipe.core._geometry.resized_crop_window``). Every backend computes the same window for the same
    sample; DALI fuses it with decoding (only the window is decoded).
    """

    moves_masks = True

    size: Any
    _: dataclasses.KW_ONLY
    scale: Sequence[float] = (0.08, 1.0)
    ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0)
    interpolation: InterpolationMode | str = InterpolationMode.BILINEAR  # stored as an InterpolationMode
    antialias: bool = True

    random = True
    draws = 2 * ATTEMPTS + 2

    def __post_init__(self) -> None:
        name = type(self).__name__
        self._set("size", valid_size(name, self.size))
        self._set("scale", valid_range(name, self.scale, "scale", low=0.0, high=math.inf))
        if self.scale[1] <= 0:
            raise ConfigError(f"{name}: scale must have a positive max, got {self.scale!r}")
        self._set("ratio", valid_range(name, self.ratio, "ratio", low=1e-9))
        self._set("interpolation", valid_interpolation(name, self.interpolation))
        valid_bool(name, self.antialias, "antialias")

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        return dataclasses.replace(spec, height=self.size[0], width=self.size[1])

    def sample(self, u: np.ndarray) -> np.ndarray:
        """Factors ``[..., 2 * ATTEMPTS + 4]``: each attempt's width and height per unit of
        ``sqrt(area)`` (``sqrt(s * r)``, ``sqrt(s / r)`` for area fraction ``s`` and aspect ratio
        ``r``), two uniforms for the window's position, then ``ratio`` itself (constants, carried
        as float64 data because DALI holds its graph's real constants as float32)."""
        n = ATTEMPTS
        s = self.scale[0] + (self.scale[1] - self.scale[0]) * u[..., :n]
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        r = np.exp(lo + (hi - lo) * u[..., n : 2 * n])
        ratio = np.broadcast_to(np.asarray(self.ratio, np.float64), (*u.shape[:-1], 2))
        return np.concatenate([np.sqrt(s * r), np.sqrt(s / r), u[..., 2 * n : 2 * n + 2], ratio], axis=-1)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> CropParams:
        return CropParams(*resized_crop_window(height, width, [float(f) for f in factors], self.ratio))


@dataclasses.dataclass(frozen=True)
class Resize(Transform):
    """Resizes the image.

    Args:
        size: ``(h, w)`` for an exact output size, or an int (or a one-element sequence) for the
            shorter side, the longer side keeping the aspect ratio (rounded down, as torchvision).
            ``None`` only together with ``max_size``.
        interpolation: resampling filter. Default ``BILINEAR``.
        max_size: upper bound of the longer side; only with an int ``size`` or ``size=None``.
        antialias: low-pass filter when downscaling. Default ``True``.

    Shapes: ``[C, H, W] -> [C, h, w]``; with an int ``size`` the output size depends on the input,
    so a crop must follow before images are batched.
    """

    moves_masks = True

    size: Any
    _: dataclasses.KW_ONLY
    interpolation: InterpolationMode | str = InterpolationMode.BILINEAR  # stored as an InterpolationMode
    max_size: int | None = None
    antialias: bool = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        size = self.size
        if size is None:
            if not is_int(self.max_size):
                raise ConfigError(f"{name}: max_size must be an int when size is None, got {self.max_size!r}")
        elif is_int(size) or (isinstance(size, Sequence) and len(size) == 1):
            (short, _) = valid_size(name, size)
            size = (short,)
        else:
            size = valid_size(name, size)
            if self.max_size is not None:
                raise ConfigError(
                    f"{name}: max_size is only allowed with an int size (the shorter side), got size={size}"
                )
        if self.max_size is not None:
            if not (is_int(self.max_size) and self.max_size > 0):
                raise ConfigError(f"{name}: max_size must be None or a positive int, got {self.max_size!r}")
            if size is not None and self.max_size <= size[0]:
                raise ConfigError(f"{name}: max_size={self.max_size} must be greater than size={size[0]}")
        self._set("size", size)
        self._set("interpolation", valid_interpolation(name, self.interpolation))
        valid_bool(name, self.antialias, "antialias")

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if self.size is not None and len(self.size) == 2:
            return dataclasses.replace(spec, height=self.size[0], width=self.size[1])
        if spec.fixed_size:
            h, w = resize_size(spec.height, spec.width, self.size, self.max_size)
            return dataclasses.replace(spec, height=h, width=w)
        return dataclasses.replace(spec, height=None, width=None)


class ResizeParams(NamedTuple):
    size: int  # the shorter side


@dataclasses.dataclass(frozen=True)
class RandomResize(Transform):
    """Resizes the image's shorter side to a size drawn uniformly from ``min_size`` to
    ``max_size - 1``, the longer side keeping the aspect ratio (torchvision v2's ``RandomResize``,
    as its segmentation reference scales by 0.5-2x).

    Args:
        min_size: the smallest shorter side (included).
        max_size: the largest shorter side (excluded), greater than ``min_size``.
        interpolation: resampling filter. Default ``BILINEAR``.
        antialias: low-pass filter when downscaling. Default ``True``.

    Shapes: ``[C, H, W] -> [C, h, w]``, varying per sample: a crop must follow before batching.
    On DALI: ``resize`` to each sample's output size, computed on the host (the image's size must
    be known there: not after a step whose size only the graph knows).
    """

    moves_masks = True

    min_size: int
    max_size: int
    _: dataclasses.KW_ONLY
    interpolation: InterpolationMode | str = InterpolationMode.BILINEAR
    antialias: bool = True

    random = True
    draws = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not (is_int(self.min_size) and self.min_size > 0):
            raise ConfigError(f"{name}: min_size must be a positive int, got {self.min_size!r}")
        if not (is_int(self.max_size) and self.max_size > self.min_size):
            raise ConfigError(f"{name}: max_size must be an int greater than min_size={self.min_size}, "
                              f"got {self.max_size!r}")  # fmt: skip
        self._set("interpolation", valid_interpolation(name, self.interpolation))
        valid_bool(name, self.antialias, "antialias")

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        return dataclasses.replace(spec, height=None, width=None)

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1]``: the shorter side, an integer uniform in ``[min_size, max_size)``."""
        span = self.max_size - self.min_size
        return self.min_size + np.minimum(np.floor(u * span), span - 1)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> ResizeParams:
        return ResizeParams(int(factors[0]))


class SizeParams(NamedTuple):
    height: int
    width: int


@dataclasses.dataclass(frozen=True)
class RandomShortestSize(Transform):
    """Resizes the image's shorter side to one of ``min_size``, drawn uniformly, capped so that the
    longer side is at most ``max_size`` (torchvision v2's ``RandomShortestSize``, the multi-scale
    training of its detection reference). Each side is ``int(side * scale)``, as torchvision's.

    Args:
        min_size: the shorter sides to draw from (an int, or a sequence of them).
        max_size: the longest the longer side may be; ``None`` (default): no cap.
        interpolation: resampling filter. Default ``BILINEAR``.
        antialias: low-pass filter when downscaling. Default ``True``.

    Shapes: ``[C, H, W] -> [C, h, w]``, varying per sample: a crop (or ``CenterCrop`` to a canvas
    of ``max_size``, which pads) must follow before batching. On DALI: ``resize`` to each sample's
    size, computed on the host (the image's size must be known there).
    """

    moves_masks = True

    min_size: Sequence[int] | int
    max_size: int | None = None
    _: dataclasses.KW_ONLY
    interpolation: InterpolationMode | str = InterpolationMode.BILINEAR
    antialias: bool = True

    random = True
    draws = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        sizes: Any = (self.min_size,) if is_int(self.min_size) else self.min_size
        if not (isinstance(sizes, Sequence) and sizes and all(is_int(s) and s > 0 for s in sizes)):
            raise ConfigError(f"{name}: min_size must be a positive int or a non-empty sequence of them, "
                              f"got {self.min_size!r}")  # fmt: skip
        self._set("min_size", tuple(int(s) for s in sizes))
        if self.max_size is not None and not (is_int(self.max_size) and self.max_size > 0):
            raise ConfigError(f"{name}: max_size must be None or a positive int, got {self.max_size!r}")
        self._set("interpolation", valid_interpolation(name, self.interpolation))
        valid_bool(name, self.antialias, "antialias")

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        return dataclasses.replace(spec, height=None, width=None)

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1]``: the index of the drawn shorter side, uniform over ``min_size``."""
        n = len(self.min_size)  # type: ignore[arg-type]
        return np.minimum(np.floor(u * n), n - 1)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> SizeParams:
        short = self.min_size[int(factors[0])]  # type: ignore[index]
        h, w = shortest_size(height, width, short, self.max_size)
        return SizeParams(int(h), int(w))


@dataclasses.dataclass(frozen=True)
class CenterCrop(Transform):
    """Crops the center of the image; pads with zeros where the image is smaller than ``size``.

    The window's offset is ``round((H - h) / 2)`` (Python's round-half-to-even), as torchvision.
    A ``gp.fields.Mask`` is padded with its ``fill`` (default 255, the ignore label), not with 0
    as torchvision's ``CenterCrop`` pads masks: a 0 would label the padding as class 0.

    Shapes: ``[C, H, W] -> [C, size[0], size[1]]``.
    """

    moves_masks = True

    size: Any

    def __post_init__(self) -> None:
        self._set("size", valid_size(type(self).__name__, self.size))

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        return dataclasses.replace(spec, height=self.size[0], width=self.size[1])


_PADDING_MODES = ("constant", "edge", "reflect", "symmetric")


@dataclasses.dataclass(frozen=True)
class RandomCrop(Transform):
    """Crops a random window of ``size``, optionally after padding.

    Args:
        size: output ``(h, w)``, or an int for a square output.
        padding: ``None`` (default), an int for all sides, ``(left/right, top/bottom)`` or
            ``(left, top, right, bottom)``.
        pad_if_needed: pad images smaller than ``size`` (on both sides). Default ``False``: such
            an image is an error (a ``SampleError`` naming the sample, on every backend).
        fill: constant fill value for ``padding_mode="constant"``: a number, or one per channel.
        padding_mode: ``"constant"`` (default), ``"edge"``, ``"reflect"`` or ``"symmetric"``.
            The reflecting modes take their pixels from the image: an image no larger than the
            padding (``"reflect"``) or smaller than it (``"symmetric"``) is too small, as in
            torchvision.

    Shapes: ``[C, H, W] -> [C, size[0], size[1]]``.
    """

    moves_masks = True

    size: Any
    _: dataclasses.KW_ONLY
    padding: Any = None
    pad_if_needed: bool = False
    fill: Any = 0
    padding_mode: str = "constant"

    random = True
    draws = 2

    def __post_init__(self) -> None:
        name = type(self).__name__
        self._set("size", valid_size(name, self.size))
        padding = self.padding
        if padding is not None:
            if is_int(padding):
                padding = (padding,) * 4
            elif isinstance(padding, Sequence) and len(padding) in (1, 2, 4) and all(map(is_int, padding)):
                padding = {1: lambda p: p * 4, 2: lambda p: (p[0], p[1], p[0], p[1]), 4: tuple}[len(padding)](
                    tuple(padding)
                )
            else:
                padding = "bad"
            if padding == "bad" or any(p < 0 for p in padding):
                raise ConfigError(
                    f"{name}: padding must be None, a non-negative int, or a sequence of 1, 2 "
                    f"or 4 non-negative ints, got {self.padding!r}"
                )
            padding = None if not any(padding) else padding  # stored as (left, top, right, bottom)
        self._set("padding", padding)
        valid_bool(name, self.pad_if_needed, "pad_if_needed")
        fill = self.fill
        if isinstance(fill, Sequence) and not isinstance(fill, str) and all(map(is_number, fill)) and fill:
            fill = tuple(float(f) for f in fill)
        elif not is_number(fill):
            raise ConfigError(f"{name}: fill must be a number or a sequence of numbers, got {self.fill!r}")
        self._set("fill", fill)
        if self.padding_mode not in _PADDING_MODES:
            raise ConfigError(f"{name}: padding_mode must be one of {_PADDING_MODES}, got {self.padding_mode!r}")

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if isinstance(self.fill, tuple) and len(self.fill) not in (1, spec.channels):
            raise self._fail(f"fill has {len(self.fill)} values for an image of {spec.channels} channels")
        if spec.height is not None and spec.width is not None:  # a size the steps before fix: known now
            try:
                self.make_params(spec.height, spec.width, np.zeros(self.draws))
            except TooSmall as e:
                said = str(e).removeprefix(f"{type(self).__name__}: ")
                raise self._fail(f"every sample would be refused, the steps before giving {spec.height}x{spec.width}: "
                                 f"{said}") from None  # fmt: skip
        return dataclasses.replace(spec, height=self.size[0], width=self.size[1])

    def make_params(self, height: int, width: int, factors: np.ndarray) -> RandomCropParams:
        left, top, right, bottom = self.padding or (0, 0, 0, 0)
        ch, cw = self.size
        top, bottom, ph = crop_padding(height, top, bottom, ch, self.pad_if_needed)
        left, right, pw = crop_padding(width, left, right, cw, self.pad_if_needed)
        if ph < ch or pw < cw:  # torchvision raises too; the DALI backend reports the same error
            raise TooSmall(crop_too_large((ch, cw), (ph, pw), padding=self.padding is not None))
        # reflecting pads take their pixels from the image: torch's "reflect" at most side - 1 of
        # them, torchvision's "symmetric" at most side (it fails on more, as torchvision does)
        most = {"reflect": 1, "symmetric": 0}.get(self.padding_mode)
        if most is not None and (max(top, bottom) > height - most or max(left, right) > width - most):
            raise TooSmall(
                f"RandomCrop: padding (left, top, right, bottom) {(left, top, right, bottom)} with "
                f"padding_mode={self.padding_mode!r} is larger than this {height}x{width} image allows "
                f"({'less than' if most else 'at most'} its side, each)"
            )
        # the window starts uniformly in [0, padded - crop]: floor(u * (padded - crop + 1))
        y, x = (crop_start(float(u), room) for u, room in zip(factors, (ph - ch + 1, pw - cw + 1), strict=True))
        return RandomCropParams((left, top, right, bottom), y, x, ch, cw)


@dataclasses.dataclass(frozen=True)
class _RandomFlip(Coin, Transform):
    p: float = 0.5

    random = True
    draws = 1

    def __post_init__(self) -> None:
        self._check_p()

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1]``: 1.0 where the image is flipped (``u < p``), else 0.0."""
        return self._coin(u)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> FlipParams:
        return FlipParams(bool(factors[0]))


@dataclasses.dataclass(frozen=True)
class RandomHorizontalFlip(_RandomFlip):
    """Flips the image left-right with probability ``p`` (default 0.5). Shapes unchanged."""

    keeps_size = True
    moves_masks = True


@dataclasses.dataclass(frozen=True)
class RandomVerticalFlip(_RandomFlip):
    """Flips the image upside down with probability ``p`` (default 0.5). Shapes unchanged."""

    keeps_size = True
    moves_masks = True
