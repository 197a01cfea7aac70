"""The augmentation policies of torchvision v2: TrivialAugmentWide, RandAugment, AutoAugment and
AugMix, with torchvision's operations, magnitude tables and defaults; each sample draws its own.

A policy applies a few *slots* in order; each slot is one operation (or none) of the policy's
space with a magnitude. :meth:`_Policy.sample` turns a sample's uniforms into, per slot, the
operation's code (``-1``: none), its magnitude bin and its sign; :func:`slot_magnitudes` turns
those into torchvision's magnitudes (a translation's table depends on the image's size), for one
sample or, vectorized, for a batch. The tables are torchvision's, computed as it computes them
(float32 ``torch.linspace``), so a bin gives the very magnitude torchvision's would.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from ..core._errors import ConfigError
from ..core._validate import is_number, valid_bool, valid_enum
from ._affine import valid_fill
from ._base import ImageSpec, InterpolationMode, Transform, require_channels, valid_interpolation

__all__ = [
    "AutoAugmentPolicy",
    "TrivialAugmentWide",
    "RandAugment",
    "AutoAugment",
    "AugMix",
    "PolicyParams",
    "AugMixParams",
    "OPS",
    "slot_magnitudes",
]

# Every operation of the policies; a code is an index here.
# (SolarizeAdd and TranslateX/YRel, a translation in fractional pixels, are timm's.)
OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
       "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert", "SolarizeAdd", "TranslateXRel",
       "TranslateYRel")  # fmt: skip
_CODE = {name: i for i, name in enumerate(OPS)}
SIGNED = frozenset(_CODE[n] for n in OPS[1:10])  # geometry and the four colour factors

# torchvision's spaces, in its order (the order maps a uniform to an operation).
_RANDAUGMENT_OPS = OPS[:14]
_AUGMIX_OPS = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Posterize", "Solarize", "AutoContrast",
               "Equalize", "Brightness", "Color", "Contrast", "Sharpness")  # fmt: skip
_AUGMIX_CODES = np.array([_CODE[name] for name in _AUGMIX_OPS], dtype=np.int64)


class AutoAugmentPolicy(str, enum.Enum):
    """AutoAugment's learned policies, with ``torchvision.transforms.AutoAugmentPolicy``'s names
    and values (either is accepted)."""

    IMAGENET = "imagenet"
    CIFAR10 = "cifar10"
    SVHN = "svhn"


@functools.lru_cache(maxsize=4096)
def _table(space: str, op: int, bins: int, extent: int) -> np.ndarray | None:
    """torchvision's magnitudes of ``op`` in ``space`` (``"standard"``: RandAugment and
    AutoAugment; ``"wide"``: TrivialAugmentWide; ``"augmix"``) over ``bins`` bins, float64 copies
    of its float32 values; ``extent``: the image's width (TranslateX) or height (TranslateY)."""
    name = OPS[op]
    wide, augmix = space == "wide", space == "augmix"

    def linspace(end: float, start: float = 0.0) -> np.ndarray:
        return torch.linspace(start, end, bins).numpy().astype(np.float64)

    if name in ("ShearX", "ShearY"):
        return linspace(0.99 if wide else 0.3)
    if name in ("TranslateX", "TranslateY"):
        return linspace(32.0 if wide else extent / 3.0 if augmix else 150.0 / 331.0 * extent)
    if name == "Rotate":
        return linspace(135.0 if wide else 30.0)
    if name in ("Brightness", "Color", "Contrast", "Sharpness"):
        return linspace(0.99 if wide else 0.9)
    if name == "Posterize":
        top, span = (4, 4) if augmix else (8, 6) if wide else (8, 4)
        return (top - (torch.arange(bins) / ((bins - 1) / span))).round().int().numpy().astype(np.float64)
    if name == "Solarize":
        return linspace(0.0, 1.0)
    return None  # Identity, AutoContrast, Equalize, Invert


def slot_magnitudes(space: str, bins: int, codes: Any, index: Any, sign: Any, height: Any, width: Any) -> np.ndarray:
    """float64 magnitudes (the shape of ``codes``) of operations ``codes`` at bins ``index``,
    negated where ``sign`` is negative for the signed operations, 0 for the operations without
    one; ``height``/``width``: the images' sizes (ints, or arrays like ``codes``)."""
    codes = np.asarray(codes, dtype=np.int64)
    index = np.asarray(index, dtype=np.int64)
    heights = np.broadcast_to(np.asarray(height, dtype=np.int64), codes.shape)
    widths = np.broadcast_to(np.asarray(width, dtype=np.int64), codes.shape)
    out = np.zeros(codes.shape, dtype=np.float64)
    for op in np.unique(codes):
        if op < 0 or _table(space, int(op), bins, 1) is None:
            continue
        at = codes == op
        if OPS[op] in ("TranslateX", "TranslateY") and space != "wide":
            extents = (widths if OPS[op] == "TranslateX" else heights)[at]
            values = np.empty(len(extents))
            for extent in np.unique(extents):
                same = extents == extent
                values[same] = _table(space, int(op), bins, int(extent))[index[at][same]]  # type: ignore[index]
            out[at] = values
        else:
            out[at] = _table(space, int(op), bins, 1)[index[at]]  # type: ignore[index]
    signed = np.isin(codes, list(SIGNED))
    return np.where(signed & (np.asarray(sign) < 0), -out, out)


class PolicyParams(NamedTuple):
    """One sample's operations, in order: ``(name, magnitude)`` pairs, torchvision's magnitude
    (degrees of rotation, pixels of translation, shear, colour offsets, posterize bits, solarize
    fraction; 0 for the operations without one)."""

    ops: tuple[tuple[str, float], ...]


@dataclasses.dataclass(frozen=True)
class _Policy(Transform):
    """A policy: ``slots`` operations per sample, each drawn from ``space``; three factors per
    slot: the code (``-1``: none), the magnitude's bin, the sign (``±1``)."""

    random = True
    draws = 3  # an instance's own count is set in __post_init__
    space_name: ClassVar[str] = "standard"

    def _check_common(self) -> None:
        name = type(self).__name__
        self._set("interpolation", valid_interpolation(name, self.interpolation))  # type: ignore[attr-defined]
        if self.interpolation not in (InterpolationMode.NEAREST, InterpolationMode.BILINEAR):  # type: ignore[attr-defined]
            raise ConfigError(f"{name}: interpolation must be NEAREST or BILINEAR, got {self.interpolation!r}")  # type: ignore[attr-defined]
        if self.fill is not None:  # type: ignore[attr-defined]
            self._set("fill", valid_fill(name, self.fill))  # type: ignore[attr-defined]

    @property
    def bins(self) -> int:
        return int(self.num_magnitude_bins)  # type: ignore[attr-defined]

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        require_channels(self, spec, (1, 3))
        if spec.dtype != torch.uint8:
            raise self._fail(f"takes a uint8 image (torchvision's policies do): put it before ToDtype, got {spec}")
        fill = getattr(self, "fill", None)
        if isinstance(fill, tuple) and len(fill) not in (1, spec.channels):
            raise self._fail(f"fill has {len(fill)} values for an image of {spec.channels} channels")
        return spec

    def magnitudes(self, height: Any, width: Any, factors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The codes ``[..., slots]`` (int64) and magnitudes ``[..., slots]`` of ``factors``."""
        f = np.asarray(factors, dtype=np.float64)
        codes = f[..., 0::3].astype(np.int64)
        h, w = (np.asarray(v)[..., None] if np.ndim(v) else v for v in (height, width))  # per sample: per slot
        return codes, slot_magnitudes(self.space_name, self.bins, codes, f[..., 1::3], f[..., 2::3], h, w)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> PolicyParams:
        codes, mags = self.magnitudes(height, width, factors)
        pairs = zip(codes.tolist(), mags.tolist(), strict=True)
        return PolicyParams(tuple((OPS[c], float(m)) for c, m in pairs if c > 0))


def _pick(u: np.ndarray, n: int) -> np.ndarray:
    """A uniform index in ``range(n)`` from ``u`` in ``[0, 1)``."""
    return np.minimum((u * n).astype(np.int64), n - 1)


def _sign(u: np.ndarray) -> np.ndarray:
    """torchvision's sign: negative where ``rand() <= 0.5``."""
    return np.where(u <= 0.5, -1.0, 1.0)


def _check_bins(owner: str, bins: Any) -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2:
        raise ConfigError(f"{owner}: num_magnitude_bins must be an int >= 2, got {bins!r}")
    return bins


@dataclasses.dataclass(frozen=True)
class TrivialAugmentWide(_Policy):
    """TrivialAugment Wide, as torchvision: per sample one operation of 14 (Identity, ShearX/Y,
    TranslateX/Y, Rotate, Brightness, Color, Contrast, Sharpness, Posterize, Solarize,
    AutoContrast, Equalize), uniformly, at a magnitude bin uniform in ``num_magnitude_bins``, its
    sign (where it has one) negative with probability 1/2. The wide ranges: shear 0–0.99,
    translation 0–32 px, rotation 0–135°, colour factors 1 ± 0–0.99, posterize 8–2 bits, solarize
    threshold 1–0 of the range. ``[C, H, W]`` (1 or 3 channels) in, the same shape out.

    Args:
        num_magnitude_bins: bins of each magnitude's range. Default 31.
        interpolation: ``NEAREST`` (default) or ``BILINEAR``, for the geometric operations.
        fill: outside the source image: ``None`` (default: 0), a number, or one per channel.

    Backends: torch runs torchvision's kernels, sample by sample in its workers or batched in the
    stage (``LoaderConfig.stage``); the values are torchvision's either way. DALI runs it in the
    stage only, after its graph: as a view's last steps (after every step the stage does not
    run), on images of one size; elsewhere the loader refuses the pipeline, saying why.
    """

    keeps_size = True

    num_magnitude_bins: int = 31
    interpolation: InterpolationMode | str = InterpolationMode.NEAREST
    fill: Any = None

    space_name = "wide"

    def __post_init__(self) -> None:
        self._set("num_magnitude_bins", _check_bins(type(self).__name__, self.num_magnitude_bins))
        self._check_common()

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 3]``: the operation's code, its bin, its sign."""
        codes = np.array([_CODE[n] for n in _RANDAUGMENT_OPS])[_pick(u[..., 0], 14)]
        return np.stack([codes.astype(np.float64), _pick(u[..., 1], self.bins), _sign(u[..., 2])], axis=-1)


@dataclasses.dataclass(frozen=True)
class RandAugment(_Policy):
    """RandAugment, as torchvision: ``num_ops`` operations in sequence per sample, each one of 14
    (TrivialAugmentWide's) uniformly, at bin ``magnitude`` of ``num_magnitude_bins`` (ranges:
    shear 0–0.3, translation 0–150/331 of the size, rotation 0–30°, colour factors 1 ± 0–0.9,
    posterize 8–4 bits, solarize 1–0), the sign negative with probability 1/2.

    Args:
        num_ops: operations per sample, ``>= 0``. Default 2.
        magnitude: the bin, in ``[0, num_magnitude_bins)``. Default 9.
        num_magnitude_bins: default 31.
        interpolation: ``NEAREST`` (default) or ``BILINEAR``.
        fill: ``None`` (default: 0), a number, or one per channel.

    Backends: as :class:`TrivialAugmentWide`.
    """

    keeps_size = True

    num_ops: int = 2
    magnitude: int = 9
    num_magnitude_bins: int = 31
    interpolation: InterpolationMode | str = InterpolationMode.NEAREST
    fill: Any = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.num_ops, bool) or not isinstance(self.num_ops, int) or self.num_ops < 0:
            raise ConfigError(f"{name}: num_ops must be a non-negative int, got {self.num_ops!r}")
        bins = _check_bins(name, self.num_magnitude_bins)
        if isinstance(self.magnitude, bool) or not isinstance(self.magnitude, int) or not 0 <= self.magnitude < bins:
            raise ConfigError(f"{name}: magnitude must be an int in [0, num_magnitude_bins), got {self.magnitude!r}")
        self._check_common()
        self._set("draws", 2 * self.num_ops)

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 3 * num_ops]``: per operation its code, the bin ``magnitude``, its sign."""
        table = np.array([_CODE[n] for n in _RANDAUGMENT_OPS])
        cols = []
        for i in range(self.num_ops):
            codes = table[_pick(u[..., 2 * i], 14)].astype(np.float64)
            cols += [codes, np.full(codes.shape, float(self.magnitude)), _sign(u[..., 2 * i + 1])]
        return np.stack(cols, axis=-1)


def _policy_table(policy: AutoAugmentPolicy) -> tuple[tuple[tuple[str, float, int | None], ...], ...]:
    from ._autoaugment_policies import POLICIES

    return POLICIES[policy.value]


@dataclasses.dataclass(frozen=True)
class AutoAugment(_Policy):
    """AutoAugment, as torchvision: per sample one of the policy's 25 sub-policies, uniformly;
    each of its two operations applied with its probability, at its bin of 10 (RandAugment's
    ranges), the sign negative with probability 1/2.

    Args:
        policy: :class:`AutoAugmentPolicy` (``IMAGENET``, default; ``CIFAR10``; ``SVHN``), or
            torchvision's enum, or its value.
        interpolation: ``NEAREST`` (default) or ``BILINEAR``.
        fill: ``None`` (default: 0), a number, or one per channel.

    Backends: as :class:`TrivialAugmentWide`.
    """

    keeps_size = True

    policy: AutoAugmentPolicy | str = AutoAugmentPolicy.IMAGENET
    interpolation: InterpolationMode | str = InterpolationMode.NEAREST
    fill: Any = None

    draws = 5  # the sub-policy; per operation, whether it applies and its sign

    def __post_init__(self) -> None:
        self._set("policy", valid_enum(type(self).__name__, self.policy, "policy", AutoAugmentPolicy))
        self._check_common()

    @property
    def bins(self) -> int:
        return 10

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 6]``: per operation of the drawn sub-policy its code (``-1`` where it does not
        apply), its bin, its sign."""
        table = _policy_table(self.policy)  # type: ignore[arg-type]
        codes = np.array([[_CODE[op[0]] for op in sub] for sub in table])
        probs = np.array([[op[1] for op in sub] for sub in table])
        bins = np.array([[op[2] or 0 for op in sub] for sub in table])
        sub = _pick(u[..., 0], len(table))
        cols = []
        for i in range(2):
            applies = u[..., 1 + 2 * i] <= probs[sub, i]
            cols += [np.where(applies, codes[sub, i], -1).astype(np.float64), bins[sub, i].astype(np.float64),
                     _sign(u[..., 2 + 2 * i])]  # fmt: skip
        return np.stack(cols, axis=-1)


class AugMixParams(NamedTuple):
    """One sample's AugMix: the original's weight, each chain's weight and operations."""

    original: float
    weights: tuple[float, ...]
    chains: tuple[tuple[tuple[str, float], ...], ...]


@dataclasses.dataclass(frozen=True)
class AugMix(Transform):
    """AugMix, as torchvision: ``mixture_width`` chains of ``chain_depth`` operations (1 to 3,
    uniformly, where ``None``), each operation uniform in the space (13 operations; the 9 without
    the colour factors where ``all_ops`` is false) at a bin uniform in ``range(severity)`` of 10;
    the chains mixed with Dirichlet(``alpha``) weights, and the mix with the original by
    Dirichlet(``alpha``, ``alpha``); a uint8 image truncated back.

    Args:
        severity: 1 to 10. Default 3.
        mixture_width: chains, ``>= 1``. Default 3.
        chain_depth: operations per chain (``>= 1``), or ``None`` (default; torchvision's -1 is
            accepted): 1 to 3 per chain.
        alpha: the Dirichlet concentration, ``> 0``. Default 1.0.
        all_ops: include Brightness, Color, Contrast, Sharpness. Default ``True``.
        interpolation: ``BILINEAR`` (default) or ``NEAREST``.
        fill: ``None`` (default: 0), a number, or one per channel.

    Draws: one uniform per sample seeds the sample's own generator (its Dirichlet weights and
    chains), so every backend and a resumed epoch draw the same. Backends: as
    :class:`TrivialAugmentWide`.
    """

    keeps_size = True

    severity: int = 3
    mixture_width: int = 3
    chain_depth: int | None = None
    alpha: float = 1.0
    all_ops: bool = True
    interpolation: InterpolationMode | str = InterpolationMode.BILINEAR
    fill: Any = None

    random = True
    draws = 1

    def __post_init__(self) -> None:
        name = type(self).__name__

        def positive_int(value: Any, field: str, top: int | None = None) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (top and value > top):
                bound = f"in [1, {top}]" if top else ">= 1"
                raise ConfigError(f"{name}: {field} must be an int {bound}, got {value!r}")

        positive_int(self.severity, "severity", 10)
        positive_int(self.mixture_width, "mixture_width")
        if self.chain_depth is not None and self.chain_depth != -1:
            positive_int(self.chain_depth, "chain_depth")
        if self.chain_depth == -1:
            self._set("chain_depth", None)
        if not (is_number(self.alpha) and self.alpha > 0):
            raise ConfigError(f"{name}: alpha must be a positive number, got {self.alpha!r}")
        self._set("alpha", float(self.alpha))
        self._set("all_ops", valid_bool(name, self.all_ops, "all_ops"))
        _Policy._check_common(self)  # type: ignore[arg-type]

    output_spec = _Policy.output_spec

    @property
    def depth(self) -> int:
        """The most operations a chain applies."""
        return self.chain_depth or 3

    def drawn(self, height: Any, width: Any, factors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A batch's draws (``factors`` ``[B, 1]``, sizes ints or ``[B]``): codes and magnitudes
        ``[B, mixture_width * depth]`` (chain by chain, ``-1`` past a chain's depth) and float32
        weights ``[B, 1 + mixture_width]`` (the original's first), from :meth:`make_params`."""
        batch, slots = len(factors), self.mixture_width * self.depth
        codes, mags = np.full((batch, slots), -1, np.int64), np.zeros((batch, slots))
        weights = np.zeros((batch, 1 + self.mixture_width), np.float32)
        index, signs = np.zeros((batch, slots), np.int64), np.ones((batch, slots))
        for b in range(batch):  # each sample's own generator: the draws alone, per sample
            original, mixed, chains = self._raw(factors[b])
            weights[b] = (original, *mixed)
            for i, (c, k, sign) in enumerate(chains):
                at = slice(i * self.depth, i * self.depth + len(c))
                codes[b, at], index[b, at], signs[b, at] = c, k, sign
        heights = np.broadcast_to(np.asarray(height), (batch,))[:, None]
        widths = np.broadcast_to(np.asarray(width), (batch,))[:, None]
        mags = slot_magnitudes("augmix", 10, codes, index, signs, heights, widths)  # the batch's, at once
        return codes, mags, weights

    def _raw(self, factors: np.ndarray) -> tuple[float, np.ndarray, list[tuple[np.ndarray, ...]]]:
        """One sample's draws from its generator: the original's weight, the chains' weights, and
        each chain's ``(codes, bins, signs)``."""
        rng = np.random.default_rng(int(factors[0] * (1 << 53)))
        original, rest = rng.dirichlet([self.alpha, self.alpha])
        weights = rng.dirichlet([self.alpha] * self.mixture_width) * rest
        space = _AUGMIX_CODES if self.all_ops else _AUGMIX_CODES[:9]
        chains: list[tuple[np.ndarray, ...]] = []
        for _ in range(self.mixture_width):
            depth = self.chain_depth or int(rng.integers(1, 4))
            codes = space[rng.integers(len(space), size=depth)]
            chains.append((codes, rng.integers(self.severity, size=depth), _sign(rng.random(depth))))
        return float(original), weights, chains

    def make_params(self, height: int, width: int, factors: np.ndarray) -> AugMixParams:
        original, weights, raw = self._raw(factors)
        chains = []
        for codes, index, signs in raw:
            mags = slot_magnitudes("augmix", 10, codes, index, signs, height, width)
            chains.append(tuple((OPS[c], float(m)) for c, m in zip(codes.tolist(), mags.tolist(), strict=True)))
        return AugMixParams(original, tuple(map(float, weights)), tuple(chains))
