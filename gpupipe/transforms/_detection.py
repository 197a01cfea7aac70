"""The detection transforms of SSD's recipe, the definitions: RandomPhotometricDistort,
RandomZoomOut and RandomIoUCrop (torchvision v2's names, arguments and defaults).

``RandomIoUCrop``'s window depends on the sample's boxes as well as its size and draws: it is the
one transform whose :meth:`~RandomIoUCrop.make_params` takes ``boxes``, and a pipeline has it only
with a ``gp.fields.Boxes`` field. Every backend computes its window where the boxes are moved
(``gpupipe.backends._torch._targets``), so the image is cropped where the boxes were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ..core._errors import ConfigError
from ..core._validate import valid_probability, valid_range
from ._affine import valid_fill
from ._base import ImageSpec, Transform, require_channels
from ._color import _jitter_range

__all__ = ["RandomPhotometricDistort", "RandomZoomOut", "RandomIoUCrop", "PhotometricParams", "ZoomParams",
           "IoUCropParams", "box_iou"]  # fmt: skip


class PhotometricParams(NamedTuple):
    """A factor is ``None`` where that adjustment is off; ``permutation`` of the channels, or ``None``."""

    brightness: float | None
    contrast: float | None
    saturation: float | None
    hue: float | None
    contrast_before: bool
    permutation: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class RandomPhotometricDistort(Transform):
    """SSD's photometric distortion (torchvision v2's ``RandomPhotometricDistort``): each of
    brightness, contrast, saturation and hue with probability ``p`` and a factor uniform in its
    range, contrast before or after saturation and hue (a coin), then with probability ``p`` a
    uniform permutation of the channels; torchvision's kernels, in its order.

    Args:
        brightness: the factor's range ``(min, max)`` (or ``b``: ``1 ± b``). Default ``(0.875, 1.125)``.
        contrast: likewise. Default ``(0.5, 1.5)``.
        saturation: likewise. Default ``(0.5, 1.5)``.
        hue: the shift's range within ``[-0.5, 0.5]``. Default ``(-0.05, 0.05)``.
        p: each adjustment's and the permutation's probability. Default 0.5.

    Shapes unchanged; 1 or 3 channels (saturation, hue and the permutation leave one channel as
    it is). On DALI: the four adjustments as ``ColorJitter``'s kernels with identity factors
    where off (hue selected per sample), the permutation a per-sample ``coord_transform``.
    """

    keeps_size = True

    brightness: Any = (0.875, 1.125)
    contrast: Any = (0.5, 1.5)
    saturation: Any = (0.5, 1.5)
    hue: Any = (-0.05, 0.05)
    p: float = 0.5

    random = True
    draws = 13  # 4 coins and 4 factors, the contrast's place, the permutation's coin and 3 uniforms

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in ("brightness", "contrast", "saturation"):
            self._set(field, _jitter_range(name, getattr(self, field), field, center=1.0, bound=(0.0, float("inf")),
                                           clip_first_on_zero=True))  # fmt: skip
        self._set("hue", _jitter_range(name, self.hue, "hue", center=0.0, bound=(-0.5, 0.5), clip_first_on_zero=False))
        self._set("p", valid_probability(name, self.p))

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        require_channels(self, spec)
        return spec

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 12]``: the four factors (NaN where off: brightness, contrast, saturation, hue),
        the contrast's place (1.0: before), the permutation's coin, then the permutation."""
        drawn = []
        for i, r in enumerate((self.brightness, self.contrast, self.saturation, self.hue)):
            on = u[..., i] < self.p
            value = np.nan if r is None else r[0] + (r[1] - r[0]) * u[..., 4 + i]
            drawn.append(np.where(on, value, np.nan))
        before = (u[..., 8] < 0.5).astype(np.float64)
        permute = (u[..., 9] < self.p).astype(np.float64)
        order = np.argsort(u[..., 10:13], axis=-1, kind="stable").astype(np.float64)
        return np.concatenate([np.stack([*drawn, before, permute], axis=-1), order], axis=-1)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> PhotometricParams:
        b, c, s, h = (None if np.isnan(f) else float(f) for f in factors[:4])
        permutation = tuple(int(o) for o in factors[6:9]) if factors[5] else None
        return PhotometricParams(b, c, s, h, contrast_before=bool(factors[4]), permutation=permutation)


class ZoomParams(NamedTuple):
    """``padding``: ``(left, top, right, bottom)`` pixels of fill around the image (all 0: none)."""

    padding: tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class RandomZoomOut(Transform):
    """With probability ``p``, puts the image on a canvas ``r`` times its size, ``r`` uniform in
    ``side_range``, at a uniform place, the rest ``fill`` (torchvision v2's ``RandomZoomOut``, SSD's
    "expand"): ``canvas = int(side * r)``, ``left = int((canvas_w - w) * u)``, as torchvision's
    (in float64 here, float32 there).

    Args:
        fill: the canvas's value: a number, or one per channel. Default 0 (a mask's own fill:
            ``gp.fields.Mask(fill=)``).
        side_range: ``(min, max)`` of ``r``, ``1 <= min <= max``. Default ``(1.0, 4.0)``.
        p: the probability of zooming out. Default 0.5.

    Shapes: ``[C, H, W] -> [C, h, w]``, varying per sample: a resize to one size must follow
    before batching. On DALI: a padding ``slice`` with the canvas computed on the host.
    """

    moves_masks = True

    fill: Any = 0
    side_range: Sequence[float] = (1.0, 4.0)
    p: float = 0.5

    random = True
    draws = 4  # the coin, r, the two positions

    def __post_init__(self) -> None:
        name = type(self).__name__
        self._set("fill", valid_fill(name, self.fill))
        self._set("side_range", valid_range(name, self.side_range, "side_range", low=1.0))
        self._set("p", valid_probability(name, self.p))

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if isinstance(self.fill, tuple) and len(self.fill) not in (1, spec.channels):
            raise self._fail(f"fill has {len(self.fill)} values for an image of {spec.channels} channels")
        return dataclasses.replace(spec, height=None, width=None)

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 4]``: the decision (1.0: zoom out), ``r``, and the two positions' uniforms."""
        lo, hi = self.side_range
        return np.stack([(u[..., 0] < self.p).astype(np.float64), lo + u[..., 1] * (hi - lo), u[..., 2],
                         u[..., 3]], axis=-1)  # fmt: skip

    def make_params(self, height: int, width: int, factors: np.ndarray) -> ZoomParams:
        padding = zoom_out_padding(height, width, factors[None])[0]
        return ZoomParams(tuple(int(v) for v in padding))  # type: ignore[arg-type]


def zoom_out_padding(height: Any, width: Any, factors: np.ndarray) -> np.ndarray:
    """int64 ``[B, 4]`` ``(left, top, right, bottom)`` of :class:`RandomZoomOut` for images of
    ``height`` x ``width`` (ints or ``[B]``) and factors ``[B, 4]``; zeros where it does not act."""
    h, w = np.asarray(height, np.float64), np.asarray(width, np.float64)
    on, r, u, v = factors[:, 0], factors[:, 1], factors[:, 2], factors[:, 3]
    canvas_w, canvas_h = np.floor(w * r), np.floor(h * r)
    left, top = np.floor((canvas_w - w) * u), np.floor((canvas_h - h) * v)
    pad = np.stack([left, top, canvas_w - (left + w), canvas_h - (top + h)], axis=1) * on[:, None]
    return pad.astype(np.int64)


class IoUCropParams(NamedTuple):
    """The window ``(top, left, height, width)`` and which boxes have their centre inside it
    (``within``; the others are zeroed, for ``SanitizeBoundingBoxes`` to drop)."""

    top: int
    left: int
    height: int
    width: int
    within: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class RandomIoUCrop(Transform):
    """SSD's random crop (torchvision v2's ``RandomIoUCrop``): a minimum IoU drawn from
    ``sampler_options`` (1.0 or more: no crop), then up to ``trials`` windows of scale
    ``[min_scale, max_scale]`` per side and aspect ratio ``[min_aspect_ratio, max_aspect_ratio]``;
    the first that holds the centre of a box and overlaps one of those by at least that IoU is
    the crop. The boxes whose centre falls outside are zeroed (dropped by the sanitizing that
    follows). torchvision draws options until one fits, without end; here at most
    :attr:`ROUNDS` options are drawn, then the image is left as it is (a sample without boxes, which
    makes torchvision's loop endless, is left as it is at once).

    Needs a ``gp.fields.Boxes`` field (its window depends on the boxes); with several, the first.

    Shapes: ``[C, H, W] -> [C, h, w]``, varying per sample: a resize to one size must follow.
    On DALI: a ``slice`` by the window the host computed with the boxes.
    """

    moves_masks = True

    min_scale: float = 0.3
    max_scale: float = 1.0
    min_aspect_ratio: float = 0.5
    max_aspect_ratio: float = 2.0
    sampler_options: Sequence[float] | None = None
    trials: int = 40

    ROUNDS: ClassVar[int] = 4
    uses_boxes: ClassVar[bool] = True
    random = True
    draws = 1  # (per instance: ROUNDS x (1 + 4 x trials), set in __post_init__)

    def __post_init__(self) -> None:
        name = type(self).__name__
        valid_range(name, (self.min_scale, self.max_scale), "min_scale/max_scale", low=0.0, high=1.0)
        valid_range(name, (self.min_aspect_ratio, self.max_aspect_ratio), "min/max_aspect_ratio", low=0.0)
        options = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0) if self.sampler_options is None else self.sampler_options
        if not (isinstance(options, Sequence) and options and all(isinstance(o, (int, float)) for o in options)):
            raise ConfigError(f"{name}: sampler_options must be a non-empty sequence of numbers, got {options!r}")
        self._set("sampler_options", tuple(float(o) for o in options))
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ConfigError(f"{name}: trials must be a positive int, got {self.trials!r}")
        self._set("draws", self.ROUNDS * (1 + 4 * self.trials))

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        return dataclasses.replace(spec, height=None, width=None)

    def make_params(self, height: int, width: int, factors: np.ndarray,
                    boxes: np.ndarray | None = None) -> IoUCropParams | None:  # fmt: skip
        """The window for an image of ``height`` x ``width`` whose boxes are ``boxes`` (XYXY
        ``[K, 4]``), or ``None``: left as it is."""
        options = self.sampler_options
        assert isinstance(options, tuple)
        boxes = np.zeros((0, 4)) if boxes is None else np.asarray(boxes, np.float64).reshape(-1, 4)
        if len(boxes) == 0:
            return None
        cx, cy = 0.5 * (boxes[:, 0] + boxes[:, 2]), 0.5 * (boxes[:, 1] + boxes[:, 3])
        per_round = 1 + 4 * self.trials
        for r in range(self.ROUNDS):
            at = r * per_round
            least = options[min(int(factors[at] * len(options)), len(options) - 1)]
            if least >= 1.0:
                return None
            for t in factors[at + 1 : at + per_round].reshape(self.trials, 4).tolist():
                new_w = int(width * (self.min_scale + (self.max_scale - self.min_scale) * t[0]))
                new_h = int(height * (self.min_scale + (self.max_scale - self.min_scale) * t[1]))
                if new_w == 0 or new_h == 0 or not self.min_aspect_ratio <= new_w / new_h <= self.max_aspect_ratio:
                    continue
                left, top = int((width - new_w) * t[2]), int((height - new_h) * t[3])
                right, bottom = left + new_w, top + new_h
                within = (left < cx) & (cx < right) & (top < cy) & (cy < bottom)
                if not within.any():
                    continue
                if box_iou(boxes[within], np.array([[left, top, right, bottom]], np.float64)).max() < least:
                    continue
                return IoUCropParams(top, left, new_h, new_w, tuple(bool(v) for v in within))
        return None


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[N, M]`` intersection over union of XYXY boxes ``a`` ``[N, 4]`` and ``b`` ``[M, 4]``
    (torchvision's ``box_iou``)."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt, rb = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = np.clip(rb - lt, 0, None)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area_a[:, None] + area_b[None, :] - inter)
