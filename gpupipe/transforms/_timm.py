"""timm's RandAugment (``rand-m9-mstd0.5-inc1``) on torchvision's kernels: timm's operations,
level functions, per-operation probability and magnitude noise, drawn where every draw is drawn
(``gpupipe.core._random``), lowered as torchvision's policies are (``_policies._Policy``)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from ..core._errors import ConfigError
from ..core._validate import is_number, valid_bool, valid_probability
from ._base import InterpolationMode
from ._policies import _CODE, _pick, _Policy, _sign

__all__ = ["TimmRandAugment"]

# timm's 'inc1' operations (_RAND_INCREASING_TRANSFORMS), and without 'inc' (_RAND_TRANSFORMS), in its order.
_TIMM_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Brightness",
             "Color", "Contrast", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")  # fmt: skip
_TIMM_DEFAULT_FILL = (124.0, 116.0, 104.0)  # timm's img_mean: ImageNet's mean x 255, rounded


@dataclasses.dataclass(frozen=True)
class TimmRandAugment(_Policy):
    """timm's RandAugment (``rand-m9-mstd0.5-inc1``: :meth:`from_config`), on torchvision's
    kernels: ``num_ops`` operations per sample, each uniform over timm's 15 (with replacement),
    each applied with probability ``p``, at a magnitude ``N(magnitude, magnitude_std)`` drawn per
    operation and clipped to ``[0, magnitude_max]`` (``magnitude_std=inf``: uniform in ``[0,
    magnitude]``), with timm's level functions (``increasing``: its ``inc1`` set, severity growing
    with the magnitude: posterize ``4 − int(m/10·4)`` bits, solarize from ``256 − int(m/10·256)``,
    enhance factors ``max(0.1, 1 ± m/10·0.9)``; else posterize ``int(m/10·4)`` bits, solarize from
    ``int(m/10·256)``, factors ``m/10·1.8 + 0.1``), rotations ``±m/10·30°``, shears ``±m/10·0.3``,
    translations ``±m/10·0.45`` of the size (fractional pixels), SolarizeAdd ``+int(m/10·110)``
    below 128.

    Args:
        num_ops: operations per sample (timm's ``n``). Default 2.
        magnitude: timm's ``m``, in ``[0, magnitude_max]``. Default 9.
        magnitude_std: timm's ``mstd``: the noise of each operation's magnitude; 0 none, ``inf``
            uniform. Default 0.5.
        magnitude_max: timm's ``mmax``. Default 10.
        increasing: timm's ``inc1``. Default ``True``.
        p: each operation's probability. Default 0.5.
        interpolation: ``BILINEAR`` (default) or ``NEAREST`` (timm draws bilinear or bicubic per
            operation; bicubic is not offered here).
        fill: outside the source image: timm's ImageNet mean ``(124, 116, 104)`` by default.

    Differences from timm: torchvision's tensor kernels stand for Pillow's (the enhance blends
    round as torchvision's; Pillow's contrast takes a rounded mean), and the interpolation is one.
    Backends: as :class:`TrivialAugmentWide`.
    """

    keeps_size = True

    num_ops: int = 2
    magnitude: float = 9
    magnitude_std: float = 0.5
    magnitude_max: float = 10
    increasing: bool = True
    p: float = 0.5
    interpolation: InterpolationMode | str = InterpolationMode.BILINEAR
    fill: Any = _TIMM_DEFAULT_FILL

    space_name = "timm"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.num_ops, bool) or not isinstance(self.num_ops, int) or self.num_ops < 0:
            raise ConfigError(f"{name}: num_ops must be a non-negative int, got {self.num_ops!r}")
        for field in ("magnitude", "magnitude_std", "magnitude_max"):
            value = getattr(self, field)
            uniform = field == "magnitude_std" and value == math.inf  # (inf: uniform in [0, magnitude])
            if not (uniform or (is_number(value) and value >= 0)):
                raise ConfigError(f"{name}: {field} must be a non-negative number, got {value!r}")
            self._set(field, float(value))
        if self.magnitude > self.magnitude_max:
            raise ConfigError(f"{name}: magnitude must be at most magnitude_max, got {self.magnitude!r}")
        self._set("increasing", valid_bool(name, self.increasing, "increasing"))
        self._set("p", valid_probability(name, self.p))
        self._check_common()
        self._set("draws", 5 * self.num_ops)

    @classmethod
    def from_config(cls, config: str, **kwargs: Any) -> TimmRandAugment:
        """timm's config string: ``rand`` then dash-separated ``m<int>``, ``n<int>``,
        ``mstd<float>`` (above 100: uniform), ``mmax<int>``, ``inc<0|1>`` (``w``, its op weights, is
        not taken); ``kwargs`` set the rest (``fill``, ``interpolation``)."""
        parts = config.split("-")
        if parts[0] != "rand":
            raise ConfigError(f"TimmRandAugment: a config starts with 'rand', got {config!r}")
        options: dict[str, Any] = {"magnitude": 10.0, "magnitude_std": 0.0, "increasing": False}
        for part in parts[1:]:
            match = re.fullmatch(r"([a-z]+)(\d.*)", part)
            if match is None:
                raise ConfigError(f"TimmRandAugment: cannot read {part!r} of {config!r}")
            key, value = match.groups()
            if key not in ("m", "n", "mstd", "mmax", "inc"):
                raise ConfigError(f"TimmRandAugment: unknown section {part!r} of {config!r} (m, n, mstd, mmax, inc)")
            try:
                number = float(value) if key == "mstd" else int(value)
            except ValueError:
                raise ConfigError(f"TimmRandAugment: cannot read {part!r} of {config!r}") from None
            if key == "mstd":
                options["magnitude_std"] = math.inf if number > 100 else number  # timm: above 100, uniform
            else:
                field = {"m": "magnitude", "n": "num_ops", "mmax": "magnitude_max", "inc": "increasing"}[key]
                options[field] = bool(number) if key == "inc" else float(number) if key != "n" else number
        return cls(**{**options, **kwargs})

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 3 * num_ops]``: per operation its code (``-1`` where it does not apply), its
        magnitude (noised, clipped), its sign."""
        table = np.array([_CODE[n] for n in _TIMM_OPS])
        cols = []
        for i in range(self.num_ops):
            v = u[..., 5 * i : 5 * i + 5]
            codes = np.where(v[..., 1] < self.p, table[_pick(v[..., 0], len(table))], -1)
            if math.isinf(self.magnitude_std):
                level = v[..., 2] * self.magnitude
            elif self.magnitude_std > 0:  # Box-Muller: two uniforms, one normal
                normal = np.sqrt(-2.0 * np.log1p(-v[..., 2])) * np.cos(2.0 * np.pi * v[..., 3])
                level = self.magnitude + self.magnitude_std * normal
            else:
                level = np.full(v.shape[:-1], self.magnitude)
            level = np.clip(level, 0.0, self.magnitude_max)
            cols += [codes.astype(np.float64), level, _sign(v[..., 4])]
        return np.stack(cols, axis=-1)

    def magnitudes(self, height: Any, width: Any, factors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Codes and the kernels' arguments: degrees, shears, pixels of translation, ``factor − 1``
        of the enhance operations, posterize bits, solarize's threshold over 255, SolarizeAdd's
        addend."""
        f = np.asarray(factors, dtype=np.float64)
        codes, level, sign = f[..., 0::3].astype(np.int64), f[..., 1::3] / 10.0, f[..., 2::3]
        h, w = (np.asarray(v, dtype=np.float64)[..., None] if np.ndim(v) else float(v) for v in (height, width))
        if self.increasing:
            bits = 4 - np.trunc(level * 4)
            threshold = 256 - np.trunc(level * 256)
            factor = np.maximum(0.1, 1.0 + sign * level * 0.9)
        else:
            bits, threshold, factor = np.trunc(level * 4), np.trunc(level * 256), level * 1.8 + 0.1
        by_name = {
            "Rotate": sign * level * 30.0,
            "ShearX": sign * level * 0.3,
            "ShearY": sign * level * 0.3,
            "TranslateXRel": sign * level * 0.45 * w,
            "TranslateYRel": sign * level * 0.45 * h,
            "Posterize": bits,
            "Solarize": threshold / 255.0,
            "SolarizeAdd": np.trunc(level * 110),
            **dict.fromkeys(("Brightness", "Color", "Contrast", "Sharpness"), factor - 1.0),
        }
        mags = np.zeros(codes.shape)
        for name, value in by_name.items():
            mags = np.where(codes == _CODE[name], value, mags)
        return codes, mags
