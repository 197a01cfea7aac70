"""RandomRotation and RandomAffine (torchvision v2's): an angle (and a translation, scale and
shears) per sample, applied about a centre; the map of output to source points is
``gpupipe.core._geometry.affine_matrices``, for every backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core._errors import ConfigError
from ..core._validate import is_number, valid_bool, valid_range
from ._base import ImageSpec, InterpolationMode, Transform, valid_interpolation

__all__ = ["RandomRotation", "RotationParams", "RandomAffine", "AffineParams"]


class RotationParams(NamedTuple):
    """One sample's rotation: ``angle`` degrees, counter-clockwise."""

    angle: float


def valid_fill(owner: str, fill: Any) -> float | tuple[float, ...]:
    """A number, or a non-empty sequence of numbers (one per channel)."""
    if isinstance(fill, Sequence) and not isinstance(fill, str) and fill and all(map(is_number, fill)):
        return tuple(float(f) for f in fill)
    if not is_number(fill):
        raise ConfigError(f"{owner}: fill must be a number or a sequence of numbers, got {fill!r}")
    return float(fill)


@dataclasses.dataclass(frozen=True)
class RandomRotation(Transform):
    """Rotates the image by an angle uniform in ``degrees`` (counter-clockwise), as torchvision.

    Args:
        degrees: ``(min, max)``, or a number ``d`` for ``(-d, d)``.
        interpolation: ``NEAREST`` (default) or ``BILINEAR``.
        expand: grow the output to hold the whole rotated image (its size then varies per
            sample: put a crop after it). Default ``False``: the image's size is kept. The DALI
            backend takes ``expand=False`` only, for now.
        center: ``(x, y)`` of the rotation's centre, from the image's top-left corner; ``None``
            (default): the image's centre.
        fill: the value of the pixels that fall outside the source image: a number, or one per
            channel. Default 0.

    On DALI: ``warp_affine`` with the same inverse matrix, computed on the host per sample.
    Nearest neighbour picks the same pixels but where a source point falls exactly halfway
    between two (torch rounds half to even, DALI takes the pixel the point is in); bilinear, and
    a fill per channel, warp a mask channel and put the fill in as torchvision does: within one
    unit, the fill's edge included (tested).
    """

    moves_masks = True

    degrees: Any
    interpolation: InterpolationMode | str = InterpolationMode.NEAREST
    expand: bool = False
    center: Sequence[float] | None = None
    fill: Any = 0

    random = True
    draws = 1

    def size_kept(self) -> bool:
        return not self.expand

    def __post_init__(self) -> None:
        name = type(self).__name__
        degrees = self.degrees
        if is_number(degrees):
            if degrees < 0:
                raise ConfigError(f"{name}: degrees as a number must be non-negative, got {degrees!r}")
            degrees = (-float(degrees), float(degrees))
        self._set("degrees", valid_range(name, degrees, "degrees"))
        self._set("interpolation", valid_interpolation(name, self.interpolation))
        if self.interpolation not in (InterpolationMode.NEAREST, InterpolationMode.BILINEAR):
            raise ConfigError(f"{name}: interpolation must be NEAREST or BILINEAR, got {self.interpolation!r}")
        self._set("expand", valid_bool(name, self.expand, "expand"))
        if self.center is not None:
            center = self.center
            if not (isinstance(center, Sequence) and len(center) == 2 and all(map(is_number, center))):
                raise ConfigError(f"{name}: center must be None or (x, y), got {center!r}")
            self._set("center", (float(center[0]), float(center[1])))
        self._set("fill", valid_fill(name, self.fill))

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if isinstance(self.fill, tuple) and len(self.fill) not in (1, spec.channels):
            raise self._fail(f"fill has {len(self.fill)} values for an image of {spec.channels} channels")
        return dataclasses.replace(spec, height=None, width=None) if self.expand else spec

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1]``: the angle, uniform in ``degrees``."""
        return self.degrees[0] + (self.degrees[1] - self.degrees[0]) * u

    def make_params(self, height: int, width: int, factors: np.ndarray) -> RotationParams:
        return RotationParams(float(factors[0]))


class AffineParams(NamedTuple):
    """One sample's affine transform, as torchvision's ``affine`` takes it: ``angle`` degrees
    (clockwise), a translation in whole pixels, a scale and shears (degrees) along x and y."""

    angle: float
    translate: tuple[int, int]
    scale: float
    shear: tuple[float, float]


def _angles(owner: str, value: Any, name: str, sizes: tuple[int, ...]) -> tuple[float, ...]:
    """torchvision's angle ranges: a non-negative number ``d`` for ``(-d, d)``, or a sequence of
    ``sizes`` numbers, each pair ``(min, max)``."""
    if is_number(value):
        if value < 0:
            raise ConfigError(f"{owner}: {name} as a number must be non-negative, got {value!r}")
        return (-float(value), float(value))
    if not (isinstance(value, Sequence) and not isinstance(value, str) and len(value) in sizes
            and all(map(is_number, value))):  # fmt: skip
        raise ConfigError(f"{owner}: {name} must be a number or a sequence of {' or '.join(map(str, sizes))} numbers, "
                          f"got {value!r}")  # fmt: skip
    out = tuple(float(v) for v in value)
    if any(out[i] > out[i + 1] for i in range(0, len(out), 2)):
        raise ConfigError(f"{owner}: {name} ranges must be (min, max), got {value!r}")
    return out


@dataclasses.dataclass(frozen=True)
class RandomAffine(Transform):
    """A random affine transform keeping the centre, as torchvision: an angle uniform in
    ``degrees`` (clockwise), a translation uniform in ``±translate · (width, height)`` rounded to
    whole pixels, a scale uniform in ``scale``, shears uniform in ``shear`` (degrees; x, then y).

    Args:
        degrees: ``(min, max)``, or a number ``d`` for ``(-d, d)``.
        translate: ``(a, b)``, fractions in ``[0, 1]`` of the width and height. Default ``None``.
        scale: ``(min, max)``, positive. Default ``None`` (1).
        shear: a number ``s`` (x in ``(-s, s)``), ``(min, max)`` along x, or four numbers for x
            and y. Default ``None``.
        interpolation: ``NEAREST`` (default) or ``BILINEAR``.
        fill: outside the source: a number, or one per channel.
        center: ``(x, y)`` from the top-left corner; ``None`` (default): the image's centre.

    Shapes unchanged. On DALI: ``warp_affine`` with the same map, computed on the host (see
    :class:`RandomRotation` for how the two kernels differ).
    """

    keeps_size = True
    moves_masks = True

    degrees: Any
    translate: Sequence[float] | None = None
    scale: Sequence[float] | None = None
    shear: Any = None
    interpolation: InterpolationMode | str = InterpolationMode.NEAREST
    fill: Any = 0
    center: Sequence[float] | None = None

    random = True
    draws = 6  # angle, translation x and y, scale, shear x and y

    def __post_init__(self) -> None:
        name = type(self).__name__
        self._set("degrees", _angles(name, self.degrees, "degrees", (2,)))
        if self.translate is not None:
            self._set("translate", _fractions(name, self.translate))
        if self.scale is not None:
            scale = valid_range(name, self.scale, "scale")
            if scale[0] <= 0:
                raise ConfigError(f"{name}: scale values must be positive, got {self.scale!r}")
            self._set("scale", scale)
        if self.shear is not None:
            self._set("shear", _angles(name, self.shear, "shear", (2, 4)))
        self._set("interpolation", valid_interpolation(name, self.interpolation))
        if self.interpolation not in (InterpolationMode.NEAREST, InterpolationMode.BILINEAR):
            raise ConfigError(f"{name}: interpolation must be NEAREST or BILINEAR, got {self.interpolation!r}")
        self._set("fill", valid_fill(name, self.fill))
        if self.center is not None:
            center = self.center
            if not (isinstance(center, Sequence) and len(center) == 2 and all(map(is_number, center))):
                raise ConfigError(f"{name}: center must be None or (x, y), got {center!r}")
            self._set("center", (float(center[0]), float(center[1])))

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if isinstance(self.fill, tuple) and len(self.fill) not in (1, spec.channels):
            raise self._fail(f"fill has {len(self.fill)} values for an image of {spec.channels} channels")
        return spec

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 6]``: the angle, the translation's two factors in ``[-1, 1)`` (times the
        image's ``translate`` share, per axis), the scale, the shears along x and y."""

        def uniform(i: int, lo: float, hi: float) -> np.ndarray:
            return lo + (hi - lo) * u[..., i]

        scale = uniform(3, *self.scale) if self.scale is not None else np.ones(u.shape[:-1])
        shear: tuple[float, ...] = self.shear or (0.0, 0.0)
        shear_y = uniform(5, shear[2], shear[3]) if len(shear) == 4 else np.zeros(u.shape[:-1])
        return np.stack([uniform(0, *self.degrees), 2 * u[..., 1] - 1, 2 * u[..., 2] - 1, scale,
                         uniform(4, shear[0], shear[1]), shear_y], axis=-1)  # fmt: skip

    def translation(self, height: Any, width: Any, fx: Any, fy: Any) -> tuple[Any, Any]:
        """The translation in whole pixels (torchvision's ``int(round(·))``, half to even), of ints
        or arrays."""
        if self.translate is None:
            return 0 * fx, 0 * fy
        return (np.round(fx * (self.translate[0] * width)).astype(np.int64),
                np.round(fy * (self.translate[1] * height)).astype(np.int64))  # fmt: skip

    def make_params(self, height: int, width: int, factors: np.ndarray) -> AffineParams:
        f = np.asarray(factors, dtype=np.float64)
        tx, ty = self.translation(height, width, f[1], f[2])
        return AffineParams(float(f[0]), (int(tx), int(ty)), float(f[3]), (float(f[4]), float(f[5])))


def _fractions(owner: str, value: Any) -> tuple[float, float]:
    """``translate``: two fractions in ``[0, 1]``."""
    if not (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
            and all(map(is_number, value)) and all(0.0 <= v <= 1.0 for v in value)):  # fmt: skip
        raise ConfigError(f"{owner}: translate must be two fractions in [0, 1], got {value!r}")
    return (float(value[0]), float(value[1]))
