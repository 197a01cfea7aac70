"""Backend-free building blocks of transform definitions.

A transform is a small frozen dataclass. It validates and normalises its arguments at
construction, says what it does to the image's shape and dtype (:meth:`Transform.output_spec`) and,
when it is random, draws its parameters (:meth:`Transform.make_params`). It never touches pixels:
backends lower it through their registries (see ``gpupipe/backends``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from .._errors import ConfigError, PipelineError

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

    Subclasses are frozen dataclasses. ``random`` tells whether :meth:`make_params` draws anything.
    """

    random: ClassVar[bool] = False

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        """Returns the spec of the output for an input of ``spec``; raises PipelineError if invalid."""
        return spec

    def make_params(self, height: int, width: int, rng: random.Random) -> Any:
        """Draws this transform's random parameters for an image of ``height`` x ``width``.

        Deterministic transforms return ``None``. Backends that draw parameters themselves (DALI's
        random operators) follow the same distributions.
        """
        return None

    def _fail(self, message: str) -> PipelineError:
        return PipelineError(f"{type(self).__name__}: {message}")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)


# ---------------------------------------------------------------- argument checks --


def _err(owner: str, name: str, expected: str, got: Any) -> ConfigError:
    return ConfigError(f"{owner}: {name} must be {expected}, got {got!r}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_size(owner: str, value: Any, name: str = "size") -> tuple[int, int]:
    """``int`` or a sequence of one or two positive ints → ``(h, w)``."""
    expected = "a positive int or a sequence of one or two positive ints (h, w)"
    if is_int(value):
        value = (value, value)
    elif isinstance(value, Sequence) and not isinstance(value, str) and len(value) in (1, 2):
        value = (value[0], value[0]) if len(value) == 1 else tuple(value)
    else:
        raise _err(owner, name, expected, value)
    if not all(is_int(v) and v > 0 for v in value):
        raise _err(owner, name, expected, value)
    return (int(value[0]), int(value[1]))


def check_range(
    owner: str, value: Any, name: str, *, low: float = -math.inf, high: float = math.inf,
    allow_equal: bool = True,
) -> tuple[float, float]:
    """A sequence ``(min, max)`` of numbers with ``low <= min <= max <= high``."""
    expected = f"a sequence (min, max) of numbers in [{low}, {high}] with min <= max"
    if not (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
            and all(is_number(v) for v in value)):
        raise _err(owner, name, expected, value)
    lo, hi = float(value[0]), float(value[1])
    if not (low <= lo <= hi <= high) or (not allow_equal and lo == hi):
        raise _err(owner, name, expected, value)
    return (lo, hi)


def check_probability(owner: str, value: Any, name: str = "p") -> float:
    if not (is_number(value) and 0.0 <= value <= 1.0):
        raise _err(owner, name, "a number in [0, 1]", value)
    return float(value)


def check_bool(owner: str, value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _err(owner, name, "True or False", value)
    return value


def check_interpolation(owner: str, value: Any) -> InterpolationMode:
    raw = getattr(value, "value", value)  # torchvision's enum has the same string values
    try:
        return InterpolationMode(raw)
    except ValueError:
        names = ", ".join(m.name for m in InterpolationMode)
        raise _err(owner, "interpolation", f"an InterpolationMode ({names}) or its value", value) from None


def check_channels(t: Transform, spec: ImageSpec, allowed: tuple[int, ...] = (1, 3)) -> None:
    if spec.channels not in allowed:
        raise t._fail(f"needs {' or '.join(map(str, allowed))} channels, got an image {spec}")
