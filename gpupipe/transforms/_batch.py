"""Batch transforms: MixUp and CutMix, applied to whole batches after batching, as torchvision v2
applies them in its reference scripts' collate function (and timm's ``Mixup`` in its loader).

They are definitions like every transform: frozen dataclasses that validate their arguments, and
whose parameters follow from random draws in one pure step (:meth:`BatchTransform.sample`, from a
generator ``gpupipe.core._random`` keys by ``(seed, epoch, rank, batch)``). One torch kernel applies
them for every backend (``backends/_stage/_mix.py``), in the stage: the loader's, on its device,
or on the CPU the torch backend's workers, where they batch.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, overload

import numpy as np

from ..core._errors import ConfigError
from ..core._validate import valid_choice_weights, valid_enum
from ._base import ImageSpec, Transform

if TYPE_CHECKING:
    from ._apply import RandomChoice as PerSampleChoice

__all__ = ["BatchTransform", "BatchMode", "MixUp", "CutMix", "RandomChoice", "MixParams"]


class BatchMode(str, enum.Enum):
    """Whether one draw serves the whole batch (``"batch"``, torchvision's way: one λ, one box)
    or each sample draws its own (``"elem"``, timm's per-sample mode)."""

    BATCH = "batch"
    ELEM = "elem"


class MixParams(NamedTuple):
    """A batch's mixing, drawn by :meth:`BatchTransform.sample` (``B`` rows, one per sample):

    - ``lam``: float64 ``[B]``, the weight of each sample's own image and label; for a cut row,
      one minus the share of the image its box covers (CutMix's λ corrected to the real box);
    - ``cut``: bool ``[B]``, rows that take a box of their partner (CutMix) rather than a blend;
    - ``box``: int64 ``[B, 4]``, ``(x1, y1, x2, y2)`` of each cut row's box (zeros elsewhere).
    """

    lam: np.ndarray
    cut: np.ndarray
    box: np.ndarray


class BatchTransform:
    """Base class of the batch transforms (:class:`MixUp`, :class:`CutMix`, :class:`RandomChoice`).

    A batch transform takes a batch's images ``[B, C, H, W]`` and class labels ``[B]`` and gives
    images of the same shape and soft labels ``[B, num_classes]`` (float32).
    """

    num_classes: int | None
    label_smoothing: float
    mode: BatchMode | str  # a BatchMode once constructed

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        """Checks that the pipeline's output ``spec`` can be mixed; returns it."""
        return spec

    def sample(self, rng: np.random.Generator, batch: int, height: int, width: int) -> MixParams:
        """This batch's mixing, drawn from ``rng`` (pure in ``rng``'s state)."""
        raise NotImplementedError


def _check_common(t: Any) -> None:
    name = type(t).__name__
    if isinstance(t.alpha, bool) or not isinstance(t.alpha, (int, float)) or not t.alpha > 0 or math.isinf(t.alpha):
        raise ConfigError(f"{name}: alpha must be a number > 0 (the Beta(alpha, alpha) of λ), got {t.alpha!r}")
    object.__setattr__(t, "alpha", float(t.alpha))
    if t.num_classes is None:
        raise ConfigError(f"{name}: num_classes is required: gpupipe's labels are class indices, made one-hot here")
    if isinstance(t.num_classes, bool) or not isinstance(t.num_classes, int) or t.num_classes < 1:
        raise ConfigError(f"{name}: num_classes must be an int >= 1, got {t.num_classes!r}")
    smoothing = t.label_smoothing
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing < 1.0:
        raise ConfigError(f"{name}: label_smoothing must be in [0, 1), got {smoothing!r}")
    object.__setattr__(t, "label_smoothing", float(smoothing))
    object.__setattr__(t, "mode", valid_enum(name, t.mode, "mode", BatchMode))


def _lam(t: Any, rng: np.random.Generator, batch: int) -> np.ndarray:
    """λ ~ Beta(alpha, alpha): one for the batch, or one per sample (``elem``)."""
    if t.mode == BatchMode.ELEM:
        return rng.beta(t.alpha, t.alpha, size=batch)
    return np.full(batch, rng.beta(t.alpha, t.alpha))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Mixing(BatchTransform):
    """MixUp's and CutMix's arguments (see :class:`MixUp`)."""

    alpha: float = 1.0
    num_classes: int | None = None
    label_smoothing: float = 0.0
    mode: BatchMode | str = BatchMode.BATCH

    def __post_init__(self) -> None:
        _check_common(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixUp(_Mixing):
    """Blends each sample with its neighbour in the batch: ``x = λ·x + (1 − λ)·x_prev``, and so
    their labels (torchvision's ``MixUp``; the partner of sample ``i`` is sample ``i − 1``, the
    first's the last).

    Args:
        alpha: λ ~ Beta(alpha, alpha). Default 1.0.
        num_classes: the number of classes; labels become one-hot ``[B, num_classes]`` before
            mixing. Required (gpupipe's labels are class indices).
        label_smoothing: keyword-only, timm's: the one-hot labels are ``1 − ε + ε/K`` and ``ε/K``
            before mixing (the same targets as ``CrossEntropyLoss(label_smoothing=ε)`` on the mixed
            one-hot labels, torchvision's recipe). Default 0.0.
        mode: ``"batch"`` (default, torchvision's: one λ per batch) or ``"elem"`` (timm's: a λ
            per sample; the partner is still the neighbour, where timm mirrors the batch).

    Needs float images (after ``ToDtype(torch.float32, ...)``). Rows that are not valid
    (padding, skipped samples: ``batch.valid``) are neither mixed nor partners; see the loader's
    docs.
    """

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if not spec.dtype.is_floating_point:
            raise ConfigError(f"MixUp blends images: it needs a float image, got {spec} (put it after ToDtype(float))")
        return spec

    def sample(self, rng: np.random.Generator, batch: int, height: int, width: int) -> MixParams:
        return MixParams(_lam(self, rng, batch), np.zeros(batch, bool), np.zeros((batch, 4), np.int64))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CutMix(_Mixing):
    """Pastes a box of each sample's neighbour into it, and mixes their labels by the box's share
    of the image (torchvision's ``CutMix``: λ ~ Beta(alpha, alpha), a centre uniform over the
    pixels, half-sides ``int(0.5·sqrt(1 − λ)·W)`` and ``…·H``, the box clipped to the image and λ
    corrected to ``1 − area / (H·W)``).

    Args: as :class:`MixUp` (``alpha``, ``num_classes``, ``label_smoothing``, ``mode``). Any
    image dtype.
    """

    def sample(self, rng: np.random.Generator, batch: int, height: int, width: int) -> MixParams:
        lam = _lam(self, rng, batch)
        size = batch if self.mode == BatchMode.ELEM else 1
        r_x = np.broadcast_to(rng.integers(width, size=size), (batch,))
        r_y = np.broadcast_to(rng.integers(height, size=size), (batch,))
        r = 0.5 * np.sqrt(1.0 - lam)
        half_w, half_h = (r * width).astype(np.int64), (r * height).astype(np.int64)  # int(): toward zero, >= 0
        x1, y1 = np.maximum(r_x - half_w, 0), np.maximum(r_y - half_h, 0)
        x2, y2 = np.minimum(r_x + half_w, width), np.minimum(r_y + half_h, height)
        corrected = 1.0 - (x2 - x1) * (y2 - y1) / (width * height)
        return MixParams(corrected.astype(np.float64), np.ones(batch, bool), np.stack([x1, y1, x2, y2], axis=1))


@dataclasses.dataclass(frozen=True)
class _ChoiceFields(BatchTransform):
    """:class:`RandomChoice`'s fields and ``__init__`` (apart, so that type checkers read the
    choice's own ``__new__``, which makes the per-sample choice of per-sample transforms)."""

    transforms: Sequence[BatchTransform]
    p: Sequence[float] | None = None

    def __post_init__(self) -> None:
        members = tuple(self.transforms)
        if not members or not all(isinstance(t, _Mixing) for t in members):
            raise ConfigError(
                "RandomChoice: transforms must be MixUp and CutMix instances (a batch's choice), or per-sample "
                f"transforms (a sample's choice), got {[type(t).__name__ for t in members]}"
            )
        for name in ("num_classes", "label_smoothing", "mode"):
            if len({getattr(t, name) for t in members}) > 1:
                raise ConfigError(f"RandomChoice: its transforms must share {name}")
        object.__setattr__(self, "transforms", members)
        for name in ("num_classes", "label_smoothing", "mode"):  # the members' (not fields: not compared)
            object.__setattr__(self, name, getattr(members[0], name))
        if self.p is not None:  # normalized, as torchvision's (and the per-sample choice's)
            object.__setattr__(self, "p", valid_choice_weights("RandomChoice", self.p, len(members)))


class RandomChoice(_ChoiceFields):
    """One of ``transforms`` per batch, ``transforms[i]`` with probability ``p[i]`` (uniform by
    default): torchvision's ``RandomChoice([MixUp(...), CutMix(...)])`` of its reference recipe,
    or timm's ``switch_prob`` (``p=[1 - s, s]``). With ``"elem"`` members each sample chooses.

    Args:
        transforms: :class:`MixUp` and :class:`CutMix` instances, of one ``num_classes``,
            ``label_smoothing`` and ``mode``.
        p: their probabilities (normalized to sum to 1, as torchvision's); ``None``: uniform.
    """

    @overload
    def __new__(cls, transforms: Sequence[BatchTransform], p: Sequence[float] | None = None) -> RandomChoice: ...
    @overload
    def __new__(cls, transforms: Sequence[Transform], p: Sequence[float] | None = None) -> PerSampleChoice: ...  # type: ignore[misc]
    def __new__(cls, transforms: Any = None, p: Any = None) -> Any:
        """With per-sample transforms: the per-sample choice (``gpupipe.transforms._apply``), as
        torchvision's one ``RandomChoice`` takes either."""
        if isinstance(transforms, Sequence) and transforms and all(isinstance(t, Transform) for t in transforms):
            from ._apply import RandomChoice as PerSample

            return PerSample(transforms, p)
        return super().__new__(cls)

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        for t in self.transforms:
            t.output_spec(spec)
        return spec

    def sample(self, rng: np.random.Generator, batch: int, height: int, width: int) -> MixParams:
        k = len(self.transforms)
        if self.mode == BatchMode.BATCH:
            return self.transforms[int(rng.choice(k, p=self.p))].sample(rng, batch, height, width)
        choice = rng.choice(k, size=batch, p=self.p)
        drawn = [t.sample(rng, batch, height, width) for t in self.transforms]
        return MixParams(*(np.choose(choice[:, None] if f.ndim > 1 else choice, [d[i] for d in drawn])
                           for i, f in enumerate(drawn[0])))  # fmt: skip


# torchvision's signature, not __new__'s: (transforms, p=None)
_init = inspect.signature(RandomChoice.__init__)
RandomChoice.__signature__ = _init.replace(parameters=list(_init.parameters.values())[1:])  # type: ignore[attr-defined]
