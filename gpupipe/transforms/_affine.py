"""RandomRotation (torchvision v2's): an angle per sample, applied about a centre, the image's
size kept (``expand=False``) or grown to hold it all (``expand=True``, torch backend)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._errors import ConfigError
from .._validate import check_bool, check_range, is_number
from ._base import ImageSpec, InterpolationMode, Transform, check_interpolation

__all__ = ["RandomRotation", "RotationParams"]


class RotationParams(NamedTuple):
    """One sample's rotation: ``angle`` degrees, counter-clockwise."""

    angle: float


def check_fill(owner: str, fill: Any) -> float | tuple[float, ...]:
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
            channel (the DALI backend takes one number for all). Default 0.

    On DALI: ``warp_affine`` with the same inverse matrix, computed on the host per sample.
    Nearest neighbour picks the same pixels but where a source point falls exactly halfway
    between two (torch rounds half to even, DALI takes the pixel the point is in); bilinear
    differs by rounding (tested with tolerances).
    """

    degrees: Any
    interpolation: InterpolationMode | str = InterpolationMode.NEAREST
    expand: bool = False
    center: Sequence[float] | None = None
    fill: Any = 0

    random = True
    draws = 1

    def __post_init__(self) -> None:
        name = type(self).__name__
        degrees = self.degrees
        if is_number(degrees):
            if degrees < 0:
                raise ConfigError(f"{name}: degrees as a number must be non-negative, got {degrees!r}")
            degrees = (-float(degrees), float(degrees))
        self._set("degrees", check_range(name, degrees, "degrees"))
        self._set("interpolation", check_interpolation(name, self.interpolation))
        if self.interpolation not in (InterpolationMode.NEAREST, InterpolationMode.BILINEAR):
            raise ConfigError(f"{name}: interpolation must be NEAREST or BILINEAR, got {self.interpolation!r}")
        self._set("expand", check_bool(name, self.expand, "expand"))
        if self.center is not None:
            center = self.center
            if not (isinstance(center, Sequence) and len(center) == 2 and all(map(is_number, center))):
                raise ConfigError(f"{name}: center must be None or (x, y), got {center!r}")
            self._set("center", (float(center[0]), float(center[1])))
        self._set("fill", check_fill(name, self.fill))

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if isinstance(self.fill, tuple) and len(self.fill) not in (1, spec.channels):
            raise self._fail(f"fill has {len(self.fill)} values for an image of {spec.channels} channels")
        return dataclasses.replace(spec, height=None, width=None) if self.expand else spec

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1]``: the angle, uniform in ``degrees``."""
        return self.degrees[0] + (self.degrees[1] - self.degrees[0]) * u

    def make_params(self, height: int, width: int, factors: np.ndarray) -> RotationParams:
        return RotationParams(float(factors[0]))
