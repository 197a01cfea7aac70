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


# (magnitudes [n] float64, height, width) -> the inverse maps [n, 6] float64 of a geometric operation
Maps = Callable[[np.ndarray, int, int], np.ndarray]


def _warped(maps: Maps) -> Kernel:
    def kernel(x: torch.Tensor, m: np.ndarray, warp: Warp) -> torch.Tensor:
        theta = maps(m, x.shape[-2], x.shape[-1]).astype(np.float32)
        return K.warp(x, _to(x, theta), mode=warp.mode, fill=warp.fill)

    return kernel


def _shear(axis: int) -> Maps:
    """torchvision's policies: ``affine(shear=[atan(m)°, 0] or [0, atan(m)°], center=[0, 0])``."""

    def maps(m: np.ndarray, h: int, w: int) -> np.ndarray:
        degrees = libm(math.degrees, libm(math.atan, m))
        zero = np.zeros_like(m)
        shear = (degrees, zero) if axis == 0 else (zero, degrees)
        return centered_inverse_maps(zero, (zero, zero), shear, (0.0 - w * 0.5, 0.0 - h * 0.5))

    return maps


def _translate(axis: int, whole: bool) -> Maps:
    """``affine(translate=[int(m), 0] ...)``; timm's ``...Rel``: by ``m``, fractional."""

    def maps(m: np.ndarray, h: int, w: int) -> np.ndarray:
        by, zero = (np.trunc(m) if whole else m), np.zeros_like(m)
        return centered_inverse_maps(zero, (by, zero) if axis == 0 else (zero, by))

    return maps


def _angle(m: np.ndarray) -> np.ndarray:
    """``m % 360`` as Python takes it."""
    return libm(lambda v: v % 360, m)


def _rotate_maps(m: np.ndarray, h: int, w: int) -> np.ndarray:
    """``rotate(angle=m)``'s inverse map (of ``−angle``), where it is no exact turn."""
    return centered_inverse_maps(-_angle(m))


def _turns(h: int, w: int) -> dict[float, int]:
    """The angles torchvision rotates by exact quarter turns, and their turns: 0 and 180 degrees,
    and 90 and 270 on a square image."""
    return {0.0: 0, 180.0: 2, **({90.0: 1, 270.0: 3} if h == w else {})}


# Every geometric operation's maps: on the GPU's way a slot warps all the samples that drew one in
# one call (each with its own map), a rotation by exact turns aside.
MAPS: dict[str, Maps] = {
    "ShearX": _shear(0),
    "ShearY": _shear(1),
    "TranslateX": _translate(0, whole=True),
    "TranslateY": _translate(1, whole=True),
    "Rotate": _rotate_maps,
    "TranslateXRel": _translate(0, whole=False),
    "TranslateYRel": _translate(1, whole=False),
}


def _turned(k: int) -> K.RowsFn:
    return lambda rows, at: torch.rot90(rows, k=k, dims=(-2, -1))


def _rotations(
    rows: np.ndarray, angle: np.ndarray, h: int, w: int
) -> tuple[list[tuple[np.ndarray, K.RowsFn]], np.ndarray]:
    """``rows`` rotated by ``angle`` (each row's, ``m % 360``) on ``h`` x ``w`` images: a group per
    exact turn (:func:`_turns`), and the rows left to warp (0 degrees: in neither, unchanged)."""
    turns = _turns(h, w)
    return [(rows[angle == value], _turned(k)) for value, k in turns.items() if k], rows[~np.isin(angle, list(turns))]


def _rotate(x: torch.Tensor, m: np.ndarray, warp: Warp) -> torch.Tensor:
    """``rotate(angle=m)`` about the centre: ``m % 360`` as Python takes it; the exact turns
    (:func:`_turns`) as torchvision turns, the rest a warp by the inverse map of ``−angle``."""
    angle = _angle(m)
    turns = _turns(x.shape[-2], x.shape[-1])
    if _uniform(angle):  # one call for the batch, as torchvision's for one image
        k = turns.get(float(angle[0]))
        if k is not None:
            return x.clone() if k == 0 else torch.rot90(x, k=k, dims=(-2, -1))
        return _warped(_rotate_maps)(x, m, warp)

    def warped(rows: torch.Tensor, at: np.ndarray) -> torch.Tensor:
        return _warped(_rotate_maps)(rows, m[at], warp)

    turned, rest = _rotations(np.arange(len(m)), angle, x.shape[-2], x.shape[-1])
    return K.on_rows(x, [*turned, (rest, warped)])


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
    "ShearX": _warped(MAPS["ShearX"]),
    "ShearY": _warped(MAPS["ShearY"]),
    "TranslateX": _warped(MAPS["TranslateX"]),
    "TranslateY": _warped(MAPS["TranslateY"]),
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
    "TranslateXRel": _warped(MAPS["TranslateXRel"]),
    "TranslateYRel": _warped(MAPS["TranslateYRel"]),
}
assert tuple(OPERATIONS) == OPS, "one kernel per operation of the policies, in OPS's order"


def apply_slot(images: torch.Tensor, codes: np.ndarray, mags: np.ndarray, warp: Warp) -> torch.Tensor:
    """One slot of a policy on ``images`` ``[B, C, H, W]`` uint8: sample ``i`` gets operation
    ``codes[i]`` (an index of ``OPS``; ``-1``: none) at magnitude ``mags[i]`` (torchvision's, from
    ``_Policy.magnitudes``); a new tensor where any sample changes, ``images`` itself where none
    does.

    The GPU's way (``_kernels.gpu_way``): each operation once, on the samples that drew it, with
    per-sample arguments, and every geometric operation in one warp (a launch costs more than the
    arithmetic). On a CPU, once per operation and magnitude, with torchvision's scalar calls:
    there a launch costs little and float32 with one scalar is the fastest arithmetic (a
    per-sample blend takes float64)."""
    codes = np.where(np.asarray(codes) < 0, 0, np.asarray(codes)).astype(np.int64)
    mags = np.where(codes == 0, 0.0, np.asarray(mags, dtype=np.float64))

    if K.gpu_way(images.device):
        return K.on_rows(images, _gpu_groups(images, codes, mags, warp))
    pairs, at = np.unique(np.stack([codes.astype(np.float64), mags], axis=1), axis=0, return_inverse=True)
    at, group_codes = at.reshape(-1), pairs[:, 0].astype(np.int64).tolist()
    return K.on_rows(images, [(np.flatnonzero(at == g), _call(OPERATIONS[OPS[code]], mags, warp))
                              for g, code in enumerate(group_codes) if code != 0])  # fmt: skip


Groups = list[tuple[np.ndarray, K.RowsFn]]


def _call(op: Kernel, mags: np.ndarray, warp: Warp) -> K.RowsFn:
    """``op`` on a group's rows, with their magnitudes."""
    return lambda rows, at: op(rows, mags[at], warp)


def _gpu_groups(images: torch.Tensor, codes: np.ndarray, mags: np.ndarray, warp: Warp) -> Groups:
    """A slot's groups of rows the GPU's way: one per operation but the geometric ones, which
    share one warp (each sample its own map; a rotation by an exact turn, one per turn), and the
    blends (Brightness, Contrast, Color), which share one pass (``_kernels.blends``)."""
    h, w = images.shape[-2:]
    groups: Groups = []
    warped = np.zeros(len(codes), dtype=bool)
    kinds = np.full(len(codes), -1)  # a blend's kind per row (-1: none)
    for code in np.unique(codes).tolist():
        rows, name = np.flatnonzero(codes == code), OPS[code]
        if code == 0:
            continue
        if name in BLENDS:
            if not (name == "Color" and images.shape[-3] == 1):  # (saturation of one channel: unchanged)
                kinds[rows] = BLENDS[name]
            continue
        if name == "Rotate":
            turned, rows = _rotations(rows, _angle(mags[rows]), h, w)
            groups += turned
        if name in MAPS:
            warped[rows] = True
        else:
            groups.append((rows, _call(OPERATIONS[name], mags, warp)))
    if warped.any():

        def warp_all(x: torch.Tensor, at: np.ndarray) -> torch.Tensor:
            theta = np.empty((len(at), 6), dtype=np.float64)
            for code in np.unique(codes[at]).tolist():
                mine = codes[at] == code
                theta[mine] = MAPS[OPS[code]](mags[at][mine], h, w)
            return K.warp(x, _to(x, theta.astype(np.float32)), mode=warp.mode, fill=warp.fill)

        groups.append((np.flatnonzero(warped), warp_all))
    if (kinds >= 0).any():
        groups.append((np.flatnonzero(kinds >= 0), lambda x, at: K.blends(x, kinds[at], *_ratios(x, mags[at]))))
    return groups


# the policies' blends and their kinds in ``_kernels.blends``: ratio ``1 + m`` each
BLENDS = {"Brightness": 0, "Contrast": 1, "Color": 2}
