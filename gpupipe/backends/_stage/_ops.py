"""Each policy operation once: the kernel it runs and the per-sample arguments it takes, as
torchvision's policies give them (shears ``atan(m)`` in degrees about the top-left corner,
translations of ``int(m)`` pixels, timm's ``...Rel`` of ``m``, rotations about the centre with
torchvision's exact quarter turns, colour factors ``1 + m``, solarize's threshold ``255·m``,
posterize ``int(m)`` bits), for a batch: :func:`apply_slot` applies one slot of a policy, each
sample its own operation and magnitude, every operation once over the samples that drew it.

The host (NumPy) turns magnitudes into arguments; the device gets them as ``[n]`` tensors and
runs :mod:`._kernels`. No step looks at a single sample's values on the host.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ... import transforms as T
from ...core._geometry import centered_inverse_maps, libm
from ...transforms._policies import OPS
from . import _kernels as K

__all__ = ["Warp", "OPERATIONS", "apply_slot", "blend_args"]


@dataclasses.dataclass(frozen=True)
class Warp:
    """How a policy's geometric operations sample: ``"nearest"`` or ``"bilinear"``, and the fill
    (``None``: zeros; else one value, or one per channel)."""

    mode: str
    fill: tuple[float, ...] | None

    @classmethod
    def of(cls, t: Any) -> Warp:
        """A policy's ``interpolation`` and ``fill``."""
        fill = None if t.fill is None else tuple(float(v) for v in (t.fill if isinstance(t.fill, tuple) else (t.fill,)))
        return cls(str(T.InterpolationMode(t.interpolation).value), fill)


# (images [n, C, H, W] uint8, magnitudes [n] float64, warp) -> images
Kernel = Callable[[torch.Tensor, np.ndarray, Warp], torch.Tensor]


def _to(x: torch.Tensor, values: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Host arguments ``[n]`` on ``x``'s device (one small copy, queued)."""
    return K.upload(values, x.device, dtype)


def _uniform(m: np.ndarray) -> bool:
    """Whether every sample has the same magnitude: then a kernel takes it as a Python number,
    the very call torchvision makes."""
    return bool((m == m[0]).all())


def _warped(maps: Callable[[np.ndarray, int, int], np.ndarray]) -> Kernel:
    def kernel(x: torch.Tensor, m: np.ndarray, warp: Warp) -> torch.Tensor:
        theta = maps(m, x.shape[-2], x.shape[-1]).astype(np.float32)
        return K.warp(x, _to(x, theta), mode=warp.mode, fill=warp.fill)

    return kernel


def _shear(axis: int) -> Kernel:
    """torchvision's policies: ``affine(shear=[atan(m)°, 0] or [0, atan(m)°], center=[0, 0])``."""

    def maps(m: np.ndarray, h: int, w: int) -> np.ndarray:
        degrees = libm(math.degrees, libm(math.atan, m))
        zero = np.zeros_like(m)
        shear = (degrees, zero) if axis == 0 else (zero, degrees)
        return centered_inverse_maps(zero, (zero, zero), shear, (0.0 - w * 0.5, 0.0 - h * 0.5))

    return _warped(maps)


def _translate(axis: int, whole: bool) -> Kernel:
    """``affine(translate=[int(m), 0] ...)``; timm's ``...Rel``: by ``m``, fractional."""

    def maps(m: np.ndarray, h: int, w: int) -> np.ndarray:
        by, zero = (np.trunc(m) if whole else m), np.zeros_like(m)
        return centered_inverse_maps(zero, (by, zero) if axis == 0 else (zero, by))

    return _warped(maps)


def _rotate(x: torch.Tensor, m: np.ndarray, warp: Warp) -> torch.Tensor:
    """``rotate(angle=m)`` about the centre: ``m % 360`` as Python takes it; 0 and 180 degrees
    (and 90 and 270 on a square image) are torchvision's exact turns, the rest a warp by the
    inverse map of ``−angle``."""
    angle = libm(lambda v: v % 360, m)
    square = x.shape[-1] == x.shape[-2]
    turns = {0.0: 0, 180.0: 2, **({90.0: 1, 270.0: 3} if square else {})}
    if _uniform(angle):  # one call for the batch, as torchvision's for one image
        k = turns.get(float(angle[0]))
        if k is not None:
            return x.clone() if k == 0 else torch.rot90(x, k=k, dims=(-2, -1))
        theta = centered_inverse_maps(-angle).astype(np.float32)
        return K.warp(x, _to(x, theta), mode=warp.mode, fill=warp.fill)

    def warped(rows: torch.Tensor, at: np.ndarray) -> torch.Tensor:
        theta = centered_inverse_maps(-angle[at]).astype(np.float32)
        return K.warp(rows, _to(x, theta), mode=warp.mode, fill=warp.fill)

    def turned(k: int) -> K.RowsFn:
        return lambda rows, at: torch.rot90(rows, k=k, dims=(-2, -1))

    quarter = [(np.flatnonzero(angle == value), turned(k)) for value, k in turns.items() if k]
    return K.on_rows(x, [*quarter, (np.flatnonzero(~np.isin(angle, list(turns))), warped)])


def blend_args(x: torch.Tensor, ratio: np.ndarray) -> tuple[K.Param, K.Param]:
    """A blend's ``(r, 1 − r)`` (``1 − r`` computed in float64), as torchvision passes them:
    Python floats where every sample has the same ``ratio``, else float32 ``[n]``."""
    if _uniform(ratio):
        one = float(ratio[0])
        return one, 1.0 - one
    return _to(x, ratio.astype(np.float32)), _to(x, (1.0 - ratio).astype(np.float32))


def _ratios(x: torch.Tensor, m: np.ndarray) -> tuple[K.Param, K.Param]:
    """The policies' blends: ``r = 1 + m``."""
    return blend_args(x, 1.0 + m)


def _blend(kernel: Callable[..., torch.Tensor]) -> Kernel:
    def blend(x: torch.Tensor, m: np.ndarray, warp: Warp) -> torch.Tensor:
        return kernel(x, *_ratios(x, m))

    return blend


def _brightness(x: torch.Tensor, m: np.ndarray, warp: Warp) -> torch.Tensor:
    return K.brightness(x, _ratios(x, m)[0])


def _posterize(x: torch.Tensor, m: np.ndarray, warp: Warp) -> torch.Tensor:
    bits = np.trunc(m).astype(np.int64)
    if ((bits < 0) | (bits > 8)).any():
        raise ValueError(f"Posterize: bits must be in [0, 8], got {sorted(set(bits.tolist()))}")
    mask = ((1 << bits) - 1) << (8 - bits)
    return K.posterize(x, int(mask[0]) if _uniform(m) else _to(x, mask, torch.uint8))


def _solarize(x: torch.Tensor, m: np.ndarray, warp: Warp) -> torch.Tensor:
    """``solarize(x, 255·m)``; a threshold above 255 (timm's 256 at level 0) inverts nothing."""
    if _uniform(m):
        threshold = 255.0 * float(m[0])
        return x if threshold > 255.0 else K.solarize(x, threshold)
    return K.solarize(x, _to(x, (255.0 * m).astype(np.float32)))


def _solarize_add(x: torch.Tensor, m: np.ndarray, warp: Warp) -> torch.Tensor:
    return K.solarize_add(x, int(np.trunc(m[0])) if _uniform(m) else _to(x, np.trunc(m), torch.int32))


OPERATIONS: dict[str, Kernel] = {
    "Identity": lambda x, m, warp: x,
    "ShearX": _shear(0),
    "ShearY": _shear(1),
    "TranslateX": _translate(0, whole=True),
    "TranslateY": _translate(1, whole=True),
    "Rotate": _rotate,
    "Brightness": _brightness,
    "Color": _blend(K.saturation),
    "Contrast": _blend(K.contrast),
    "Sharpness": lambda x, m, warp: K.sharpness(x, _ratios(x, m)[1]),
    "Posterize": _posterize,
    "Solarize": _solarize,
    "AutoContrast": lambda x, m, warp: K.autocontrast(x),
    "Equalize": lambda x, m, warp: K.equalize(x),
    "Invert": lambda x, m, warp: K.invert(x),
    "SolarizeAdd": _solarize_add,
    "TranslateXRel": _translate(0, whole=False),
    "TranslateYRel": _translate(1, whole=False),
}
assert tuple(OPERATIONS) == OPS, "one kernel per operation of the policies, in OPS's order"


def apply_slot(images: torch.Tensor, codes: np.ndarray, mags: np.ndarray, warp: Warp) -> torch.Tensor:
    """One slot of a policy on ``images`` ``[B, C, H, W]`` uint8: sample ``i`` gets operation
    ``codes[i]`` (an index of ``OPS``; ``-1``: none) at magnitude ``mags[i]`` (torchvision's, from
    ``_Policy.magnitudes``); a new tensor where any sample changes, ``images`` itself where none
    does.

    On a GPU each operation runs once, on the samples that drew it, with per-sample arguments (a
    launch costs more than the arithmetic). On a CPU, once per operation and magnitude, with
    torchvision's scalar calls: there a launch costs little and float32 with one scalar is the
    fastest arithmetic (a per-sample blend takes float64)."""
    codes = np.where(np.asarray(codes) < 0, 0, np.asarray(codes)).astype(np.int64)
    mags = np.where(codes == 0, 0.0, np.asarray(mags, dtype=np.float64))
    if images.device.type == "cpu":
        pairs, at = np.unique(np.stack([codes.astype(np.float64), mags], axis=1), axis=0, return_inverse=True)
        group_codes = pairs[:, 0].astype(np.int64)
    else:
        group_codes, at = np.unique(codes, return_inverse=True)
    at = at.reshape(-1)

    def call(op: Kernel) -> K.RowsFn:
        return lambda rows, where: op(rows, mags[where], warp)

    return K.on_rows(images, [(np.flatnonzero(at == g), call(OPERATIONS[OPS[code]]))
                              for g, code in enumerate(group_codes.tolist()) if code != 0])  # fmt: skip
