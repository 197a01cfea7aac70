"""RandomErasing (torchvision v2's), whose box follows from uniform draws by ``gpupipe.core._geometry``."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core._errors import ConfigError
from ..core._geometry import ATTEMPTS, erasing_window
from ..core._validate import valid_range
from ._base import Coin, ImageSpec, Transform, require_channels

__all__ = ["RandomErasing", "ErasingParams"]


class ErasingParams(NamedTuple):
    """One sample's erasing: a box ``(top, left, h, w)``, or none (``erase`` false: the coin said
    no, or no attempt fitted); ``seed``: where ``value="random"``, the seed of its N(0, 1) noise."""

    erase: bool
    top: int
    left: int
    h: int
    w: int
    seed: int


@dataclasses.dataclass(frozen=True)
class RandomErasing(Coin, Transform):
    """Erases a random box of the image with probability ``p`` (torchvision's ``RandomErasing``;
    Zhong et al., 2017): up to 10 attempts draw an area fraction in ``scale`` and a log-uniform
    aspect ratio in ``ratio``; the box's sides are ``round(sqrt(area · ratio))`` and
    ``round(sqrt(area / ratio))``; the first box smaller than the image on both sides is placed
    uniformly, and filled with ``value``. No fitting attempt: nothing is erased.

    Args:
        p: probability of erasing. Default 0.5.
        scale: ``(min, max)`` fraction of the image's area. Default ``(0.02, 0.33)``.
        ratio: ``(min, max)`` aspect ratio (height / width). Default ``(0.3, 3.3)``.
        value: a number (default 0), a tuple of one value or one per channel, or ``"random"``:
            each erased pixel N(0, 1) (timm's "pixel" mode; the torch backend only, for now).
        inplace: accepted for torchvision's signature; every backend returns a new image.

    Used after ``Normalize`` in the recipes (the erased box then holds the mean, or noise in the
    normalized units). Shapes and dtype unchanged.
    """

    keeps_size = True

    p: float = 0.5
    scale: Sequence[float] = (0.02, 0.33)
    ratio: Sequence[float] = (0.3, 3.3)
    value: Any = 0.0
    inplace: bool = False

    random = True
    draws = 1 + 2 * ATTEMPTS + 3  # the coin; each attempt's area and ratio; the position; the noise's seed

    def __post_init__(self) -> None:
        name = type(self).__name__
        self._check_p()
        self._set("scale", valid_range(name, self.scale, "scale", low=0.0, high=1.0))
        self._set("ratio", valid_range(name, self.ratio, "ratio", low=0.0, allow_equal=True))
        if self.ratio[0] <= 0:
            raise ConfigError(f"{name}: ratio must be positive, got {self.ratio!r}")
        value = self.value
        if isinstance(value, str):
            if value != "random":
                raise ConfigError(f"{name}: value must be a number, a tuple of numbers or 'random', got {value!r}")
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            self._set("value", (float(value),))
        elif isinstance(value, Sequence) and value and all(isinstance(v, numbers.Real) for v in value):
            self._set("value", tuple(float(v) for v in value))
        else:
            raise ConfigError(f"{name}: value must be a number, a tuple of numbers or 'random', got {value!r}")

    @property
    def noise(self) -> bool:
        """Whether the box is filled with N(0, 1) noise (``value="random"``)."""
        return self.value == "random"

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        require_channels(self, spec, (1, 3))
        if not self.noise and len(self.value) not in (1, spec.channels):
            raise self._fail(f"value has {len(self.value)} numbers: give 1 or {spec.channels} (its channels)")
        return spec

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., draws]``: the coin, each attempt's area fraction and aspect ratio, the two
        position uniforms, and the noise's uniform."""
        n = ATTEMPTS
        area = self.scale[0] + (self.scale[1] - self.scale[0]) * u[..., 1 : 1 + n]
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = np.exp(lo + (hi - lo) * u[..., 1 + n : 1 + 2 * n])
        return np.concatenate([self._coin(u[..., :1]), area, aspect, u[..., 1 + 2 * n :]], axis=-1)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> ErasingParams:
        f = [float(x) for x in factors]
        seed = int(f[-1] * 2**53)
        window = erasing_window(height, width, f[1:-1]) if f[0] else None
        if window is None:
            return ErasingParams(False, 0, 0, 0, 0, seed)
        return ErasingParams(True, *window, seed)
