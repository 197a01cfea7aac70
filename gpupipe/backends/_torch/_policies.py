"""The torch backend's policies, sample by sample, through the stage's operations
(``gpupipe.backends._stage._ops.OPERATIONS``: each operation's one definition, exact to
torchvision's kernels) on a batch of one. A batch's fetch runs a policy in the stage instead,
over the whole batch (``_persample.Samples.stage_starts``); this path serves the samples that
cannot be batched there (targets that follow the image, one list per source, a sample alone)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ... import transforms as T
from ...transforms._policies import AugMixParams, PolicyParams
from .._stage import OPERATIONS, Warp
from ._kernels import LOWERINGS

__all__ = ["apply_op"]


def apply_op(img: torch.Tensor, name: str, magnitude: float, t: Any) -> torch.Tensor:
    """Operation ``name`` of a policy at ``magnitude`` (torchvision's) on ``img`` ``[C, H, W]``,
    with ``t``'s interpolation and fill."""
    return OPERATIONS[name](img[None], np.array([magnitude], dtype=np.float64), Warp.of(t))[0]


def _policy(t: Any, img: torch.Tensor, p: PolicyParams | None) -> torch.Tensor:
    for name, magnitude in p.ops if p is not None else ():
        img = apply_op(img, name, magnitude, t)
    return img


for _kind in (T.TrivialAugmentWide, T.RandAugment, T.AutoAugment, T.TimmRandAugment):
    LOWERINGS.register(_kind)(_policy)


@LOWERINGS.register(T.AugMix)
def _augmix(t: T.AugMix, img: torch.Tensor, p: AugMixParams) -> torch.Tensor:
    """torchvision's mix: the original and each chain weighted in float32, truncated back."""
    mix = p.original * img.to(torch.float32)
    for weight, chain in zip(p.weights, p.chains, strict=True):
        aug = img
        for name, magnitude in chain:
            aug = apply_op(aug, name, magnitude, t)
        mix += weight * aug.to(torch.float32)
    return mix.to(img.dtype)
