"""The torch backend's policies: each drawn operation by torchvision's functional kernel, with the
arguments torchvision's policies give it (shears as ``atan`` in degrees about the top-left corner,
translations truncated to whole pixels, colour factors ``1 + magnitude``, solarize's threshold a
share of the dtype's range)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torchvision.transforms.v2 import functional as F

from ... import transforms as T
from ...transforms._policies import AugMixParams, PolicyParams
from ._kernels import LOWERINGS, _interp

__all__ = ["apply_op"]


def _shear(x: float, y: float) -> Callable[..., torch.Tensor]:
    def shear(img: torch.Tensor, m: float, **kw: Any) -> torch.Tensor:
        degrees = math.degrees(math.atan(m))
        return F.affine(
            img, angle=0.0, translate=[0, 0], scale=1.0, shear=[degrees * x, degrees * y], center=[0, 0], **kw
        )

    return shear


def _translate(x: int, y: int, whole: bool = True) -> Callable[..., torch.Tensor]:
    """torchvision's policies translate by ``int(m)`` pixels; timm's (``...Rel``) by ``m``."""

    def translate(img: torch.Tensor, m: float, **kw: Any) -> torch.Tensor:
        by = int(m) if whole else m
        return F.affine(img, angle=0.0, translate=[by * x, by * y], scale=1.0, shear=[0.0, 0.0], **kw)

    return translate


def _solarize(img: torch.Tensor, threshold: float) -> torch.Tensor:
    """torchvision's solarize; a threshold above the range (timm's 256 at level 0) inverts none."""
    return img if threshold > _bound(img) else F.solarize(img, threshold)


def _solarize_add(img: torch.Tensor, m: float, **kw: Any) -> torch.Tensor:
    """timm's SolarizeAdd: ``min(255, v + m)`` below 128 (uint8)."""
    return torch.where(img < 128, (img.to(torch.int32) + int(m)).clamp_(max=255).to(img.dtype), img)


def _bound(img: torch.Tensor) -> float:
    return 1.0 if img.is_floating_point() else float(torch.iinfo(img.dtype).max)


_OPS: dict[str, Callable[..., torch.Tensor]] = {
    "Identity": lambda img, m, **kw: img,
    "ShearX": _shear(1, 0),
    "ShearY": _shear(0, 1),
    "TranslateX": _translate(1, 0),
    "TranslateY": _translate(0, 1),
    "Rotate": lambda img, m, **kw: F.rotate(img, angle=m, **kw),
    "Brightness": lambda img, m, **kw: F.adjust_brightness(img, 1.0 + m),
    "Color": lambda img, m, **kw: F.adjust_saturation(img, 1.0 + m),
    "Contrast": lambda img, m, **kw: F.adjust_contrast(img, 1.0 + m),
    "Sharpness": lambda img, m, **kw: F.adjust_sharpness(img, 1.0 + m),
    "Posterize": lambda img, m, **kw: F.posterize(img, int(m)),
    "Solarize": lambda img, m, **kw: _solarize(img, _bound(img) * m),
    "AutoContrast": lambda img, m, **kw: F.autocontrast(img),
    "Equalize": lambda img, m, **kw: F.equalize(img),
    "Invert": lambda img, m, **kw: F.invert(img),
    "SolarizeAdd": _solarize_add,
    "TranslateXRel": _translate(1, 0, whole=False),
    "TranslateYRel": _translate(0, 1, whole=False),
}


def apply_op(img: torch.Tensor, name: str, magnitude: float, t: Any) -> torch.Tensor:
    """Operation ``name`` of a policy at ``magnitude`` on ``img`` ``[C, H, W]``, with ``t``'s
    interpolation and fill."""
    fill = list(t.fill) if isinstance(t.fill, tuple) else t.fill
    return _OPS[name](img, magnitude, interpolation=_interp(t.interpolation), fill=fill)


def _policy(t: Any, img: torch.Tensor, p: PolicyParams | None) -> torch.Tensor:
    for name, magnitude in p.ops if p is not None else ():
        img = apply_op(img, name, magnitude, t)
    return img


for _kind in (T.TrivialAugmentWide, T.RandAugment, T.AutoAugment, T.TimmRandAugment):
    LOWERINGS.register(_kind)(_policy)


@LOWERINGS.register(T.AugMix)
def _augmix(t: T.AugMix, img: torch.Tensor, p: AugMixParams) -> torch.Tensor:
    mix = p.original * img.to(torch.float32)
    for weight, chain in zip(p.weights, p.chains, strict=True):
        aug = img
        for name, magnitude in chain:
            aug = apply_op(aug, name, magnitude, t)
        mix += weight * aug.to(torch.float32)
    return mix.to(img.dtype)
