"""How each transform treats a mask (``gp.fields.Mask``): torchvision v2's rules for
``tv_tensors.Mask``. Geometric transforms move it with the image, with the image's draws (sampled
nearest, the mask's own fill where they bring pixels in); the others leave it as it is; the ones
that choose their operations per sample (the augmentation policies, AugMix) are refused, as
torchvision's refuse masks, and so are custom functions, whose geometry gpupipe cannot follow."""

from __future__ import annotations

from collections.abc import Sequence

from ._apply import RandomApply, RandomChoice
from ._base import Transform
from ._custom import ArrayFunction
from ._policies import AugMix, AutoAugment, RandAugment, TrivialAugmentWide
from ._timm import TimmRandAugment

__all__ = ["mask_refusal", "boxes_refusal"]

_POLICY = "chooses its operations per sample, some of them geometric (torchvision's refuses masks too)"
_REFUSED: dict[type[Transform], str] = {
    **dict.fromkeys((TrivialAugmentWide, RandAugment, AutoAugment, TimmRandAugment, AugMix), _POLICY),
    ArrayFunction: "is a function of the image whose geometry gpupipe cannot follow",
}


def boxes_refusal(transforms: Sequence[Transform], boxes: bool) -> str | None:
    """Why the steps whose parameters depend on the boxes (``RandomIoUCrop``) cannot run in
    ``transforms`` (``boxes``: whether the source has a ``gp.fields.Boxes`` field), or ``None``."""
    for i, t in enumerate(transforms):
        if t.uses_boxes and not boxes:
            return f"step {i} ({type(t).__name__}) chooses its window by the sample's boxes: give a Boxes field"
        if isinstance(t, (RandomApply, RandomChoice)) and any(_uses_boxes(inner) for inner in t.transforms):
            return f"step {i} ({type(t).__name__}): a step that chooses its window by the boxes runs at the top level"
    return None


def _uses_boxes(t: Transform) -> bool:
    inner = t.transforms if isinstance(t, (RandomApply, RandomChoice)) else ()
    return t.uses_boxes or any(_uses_boxes(x) for x in inner)


def mask_refusal(transforms: Sequence[Transform]) -> str | None:
    """Why ``transforms`` cannot move a mask with the image (naming the step), or ``None``."""
    for i, t in enumerate(transforms):
        if isinstance(t, (RandomApply, RandomChoice)):
            inner = mask_refusal(t.transforms)
            if inner is not None:
                return f"step {i} ({type(t).__name__}): {inner}"
        for kind, why in _REFUSED.items():
            if isinstance(t, kind):
                return f"step {i} ({type(t).__name__}) {why}"
    return None
