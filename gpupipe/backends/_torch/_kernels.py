"""The torch backend's lowerings: torchvision's functional kernels, one sample at a time.

Each lowering is a pure kernel ``(transform, image [C, H, W], params) -> image``; the parameters
come from :meth:`Transform.make_params`, computed in :func:`apply_pipeline` (and nowhere else) from
the sample's random factors, which ``gpupipe.core._random`` draws for every backend. Sizes
and crop anchors come from ``gpupipe.core._geometry`` (as on every backend). For the same image and
parameters the output equals what the torchvision v2 transform gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.transforms import InterpolationMode as TVInterpolation
from torchvision.transforms.v2 import functional as F

from ... import transforms as T
from ...core._geometry import TooSmall, center_crop_anchor, resize_empty, resize_size
from ...transforms._affine import AffineParams, RotationParams
from ...transforms._apply import RandomApplyParams, RandomChoiceParams
from ...transforms._apply import RandomChoice as SampleChoice
from ...transforms._color import BlurParams, ColorJitterParams, GrayscaleParams, SolarizeParams
from ...transforms._detection import IoUCropParams, PhotometricParams, ZoomParams
from ...transforms._erasing import ErasingParams
from ...transforms._spatial import CropParams, FlipParams, RandomCropParams, ResizeParams, SizeParams
from ...transforms._tone import CoinParams
from .._registry import Registry, inner_unsupported
from .._stage._color import tone
from .._stage._steps import normalize, to_dtype
from ._maskindex import IndexedMask, as_indexed

__all__ = ["LOWERINGS", "apply_pipeline", "apply_params", "follow_targets", "boxes_kept"]

LOWERINGS = Registry("torch")


def _interp(mode: T.InterpolationMode | str) -> TVInterpolation:
    return TVInterpolation(T.InterpolationMode(mode).value)


def apply_pipeline(
    transforms: Sequence[T.Transform], image: torch.Tensor, factors: Sequence[np.ndarray | None]
) -> torch.Tensor:
    """Runs ``transforms`` on one ``[C, H, W]`` image; ``factors[i]``: step ``i``'s random factors
    for this sample (a row of ``gpupipe.core._random.factors``), ``None`` for a deterministic step."""
    for t, f in zip(transforms, factors, strict=True):
        params = t.make_params(image.shape[-2], image.shape[-1], f) if f is not None else None
        image = LOWERINGS.lookup(t)(t, image, params)
    return image


def apply_params(transforms: Sequence[T.Transform], image: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
    """Runs ``transforms`` on one ``[C, H, W]`` image with each step's parameters already made
    (:func:`follow_targets`'s: where a step's depend on the boxes)."""
    for t, p in zip(transforms, params, strict=True):
        image = LOWERINGS.lookup(t)(t, image, p)
    return image


def follow_targets(
    transforms: Sequence[T.Transform],
    factors: Sequence[np.ndarray | None],
    size: tuple[int, int],
    masks: Mapping[str, tuple[torch.Tensor, int]],
    boxes: Mapping[str, tuple[torch.Tensor, str]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """The targets of an image of ``size`` ``(height, width)`` moved as :func:`apply_pipeline` moves
    the image with the same ``factors``, without the image: ``masks`` (name: ``([H, W] mask,
    fill)``, of the image's size) and ``boxes`` (name: ``([K, 4] float32, format)``) go through
    each geometric step (``transforms._masks``) with the parameters the image's step draws at the
    same size, by torchvision's mask kernels (nearest, the mask's fill where the step brings pixels
    in) and box kernels (then clamped to the output image). The size after each step is the
    targets' own (a mask's shape, the boxes' canvas), so any backend that knows the image's size
    moves them alike. A step whose parameters depend on the boxes (``Transform.uses_boxes``) gets
    the first boxes field's, as moved so far (XYXY). Returns the targets by name (masks
    ``[H', W']``, boxes ``[K, 4]``: not yet sanitized) and each step's parameters (for the image:
    :func:`apply_params`)."""
    moved: dict[str, Any] = {name: as_indexed(mask, fill) for name, (mask, fill) in masks.items()}
    for name, (value, fmt) in (boxes or {}).items():
        moved[name] = tv_tensors.BoundingBoxes(value, format=fmt, canvas_size=tuple(size))
    first_boxes = next(iter(boxes or {}), None)
    height, width = size
    made: list[Any] = []
    for t, f in zip(transforms, factors, strict=True):
        if f is None:
            params = None
        elif t.uses_boxes:
            xyxy = None if first_boxes is None else F.convert_bounding_box_format(
                moved[first_boxes], new_format="XYXY").as_subclass(torch.Tensor).numpy()  # fmt: skip
            params = t.make_params(height, width, f, boxes=xyxy)  # type: ignore[call-arg]
        else:
            params = t.make_params(height, width, f)
        made.append(params)
        for name, (_, fill) in masks.items():
            moved[name] = _follow(t, moved[name], params, lambda g, m, p, fill=fill: _mask_geometry(g, m, p, fill))
        for name in boxes or {}:
            moved[name] = _follow(t, moved[name], params, _box_geometry)
        first = next(iter(moved.values()), None)
        if first is not None:
            height, width = first.shape if isinstance(first, IndexedMask) else first.canvas_size
    out = {name: moved[name].tensor() for name in masks}
    for name in boxes or {}:
        out[name] = F.clamp_bounding_boxes(moved[name]).as_subclass(torch.Tensor)
    return out, made


def boxes_kept(boxes: np.ndarray, fmt: str, min_size: float, min_area: float = 1.0) -> np.ndarray:
    """Which of ``boxes`` (``[K, 4]`` in ``fmt``, clamped to the image) are at least ``min_size``
    wide and high and ``min_area`` large: torchvision's ``SanitizeBoundingBoxes`` rule. Bool ``[K]``."""
    xyxy = F.convert_bounding_box_format(torch.from_numpy(np.ascontiguousarray(boxes)), old_format=fmt,
                                         new_format="XYXY")  # fmt: skip
    width, height = xyxy[:, 2] - xyxy[:, 0], xyxy[:, 3] - xyxy[:, 1]
    return ((width >= min_size) & (height >= min_size) & (width * height >= min_area)).numpy()


def _follow(t: T.Transform, target: torch.Tensor, params: Any, geometry: Any) -> torch.Tensor:
    """One step on a target (a ``tv_tensors`` mask or boxes): a geometric one (``transforms._masks``)
    by ``geometry(t, target, params)`` with the image's parameters, inside RandomApply /
    RandomChoice too; any other leaves it."""
    if isinstance(t, T.RandomApply):
        if params.apply:
            for inner, p in zip(t.transforms, params.params, strict=True):
                target = _follow(inner, target, p, geometry)
        return target
    if isinstance(t, SampleChoice):
        return _follow(t.transforms[params.chosen], target, params.params[params.chosen], geometry)
    return geometry(t, target, params) if t.moves_masks else target


def _mask_geometry(t: T.Transform, mask: IndexedMask, p: Any, fill: int) -> IndexedMask:
    """A geometric step on a mask, as torchvision's mask kernels do it (nearest, the mask's
    ``fill`` where padding brings pixels in, a ``CenterCrop``'s padding included, where
    torchvision gives 0): resizes, crops, pads and flips by index arithmetic (``_maskindex``: the
    same pixels); the others by the image's kernel (torchvision's dispatches to its mask kernel)
    on the gathered mask."""
    h, w = mask.shape
    if isinstance(t, T.RandomResizedCrop):
        return mask.crop(p.top, p.left, p.height, p.width).resize(*t.size)
    if isinstance(t, T.Resize):
        new_h, new_w = resize_size(h, w, t.size, t.max_size)
        if new_h < 1 or new_w < 1:
            raise TooSmall(resize_empty(t.size, t.max_size, (new_h, new_w)))
        return mask.resize(new_h, new_w)
    if isinstance(t, T.RandomResize):
        return mask.resize(*resize_size(h, w, (p.size,), None))
    if isinstance(t, T.RandomShortestSize):
        return mask.resize(p.height, p.width)
    if isinstance(t, T.CenterCrop):  # padded with the mask's fill where it is smaller (torchvision's: 0)
        (ch, cw) = t.size
        top, left = center_crop_anchor(ch, h), center_crop_anchor(cw, w)  # negative: that many padded first
        mask.pad(max(-left, 0), max(-top, 0), max(cw - w + left, 0), max(ch - h + top, 0))
        return mask.crop(max(top, 0), max(left, 0), ch, cw)
    if isinstance(t, T.RandomCrop) and (t.padding_mode == "constant" or not any(p.padding)):
        mask.pad(*p.padding)
        return mask.crop(p.top, p.left, p.height, p.width) if mask.shape != (p.height, p.width) else mask
    if isinstance(t, (T.RandomHorizontalFlip, T.RandomVerticalFlip)):
        return mask.flip(horizontal=isinstance(t, T.RandomHorizontalFlip)) if p.flip else mask
    if isinstance(t, T.RandomZoomOut):
        return mask.pad(*p.padding)
    if isinstance(t, T.RandomIoUCrop):
        return mask if p is None else mask.crop(p.top, p.left, p.height, p.width)
    if hasattr(t, "fill"):  # rotations, affine maps, reflecting pads: torchvision's kernel
        t = dataclasses.replace(t, fill=fill)  # type: ignore[call-arg]
    out = LOWERINGS.lookup(t)(t, tv_tensors.Mask(mask.tensor()[None]), p)
    return as_indexed(out.as_subclass(torch.Tensor)[0], fill)


def _box_geometry(t: T.Transform, boxes: Any, params: Any) -> torch.Tensor:
    """A geometric step on a ``tv_tensors.BoundingBoxes`` (its ``canvas_size`` the image's size
    before the step): torchvision's box kernels; the steps whose kernels read the size off the
    image here, from the canvas."""
    h, w = boxes.canvas_size
    if isinstance(t, T.Resize):
        return F.resize(boxes, list(resize_size(h, w, t.size, t.max_size)))
    if isinstance(t, T.CenterCrop):
        (ch, cw) = t.size
        return F.crop(boxes, center_crop_anchor(ch, h), center_crop_anchor(cw, w), ch, cw)
    if isinstance(t, T.RandomCrop):
        if any(params.padding):
            boxes = F.pad(boxes, list(params.padding))
        return F.crop(boxes, params.top, params.left, params.height, params.width)
    return LOWERINGS.lookup(t)(t, boxes, params)


def sample_factors(
    transforms: Sequence[T.Transform], seed: int, epoch: int, sample: int, view: int = 0
) -> list[np.ndarray | None]:
    """One sample's random factors for view ``view``'s ``transforms``, step by step (what the DALI
    runner feeds its graph per batch)."""
    from ...core._random import factors

    return [None if f is None else f[0] for f in factors(transforms, seed, epoch, [sample], view)]


@LOWERINGS.register(T.RandomResizedCrop)
def _random_resized_crop(t: T.RandomResizedCrop, img: torch.Tensor, p: CropParams) -> torch.Tensor:
    return F.resized_crop(
        img,
        p.top,
        p.left,
        p.height,
        p.width,
        list(t.size),
        interpolation=_interp(t.interpolation),
        antialias=t.antialias,
    )


@LOWERINGS.register(T.Resize)
def _resize(t: T.Resize, img: torch.Tensor, _: None) -> torch.Tensor:
    h, w = resize_size(img.shape[-2], img.shape[-1], t.size, t.max_size)
    if h < 1 or w < 1:
        raise TooSmall(resize_empty(t.size, t.max_size, (h, w)))
    return F.resize(img, [h, w], interpolation=_interp(t.interpolation), antialias=t.antialias)


@LOWERINGS.register(T.RandomResize)
def _random_resize(t: T.RandomResize, img: torch.Tensor, p: ResizeParams) -> torch.Tensor:
    return F.resize(img, [p.size], interpolation=_interp(t.interpolation), antialias=t.antialias)


@LOWERINGS.register(T.RandomShortestSize)
def _random_shortest_size(t: T.RandomShortestSize, img: torch.Tensor, p: SizeParams) -> torch.Tensor:
    return F.resize(img, [p.height, p.width], interpolation=_interp(t.interpolation), antialias=t.antialias)


@LOWERINGS.register(T.RandomPhotometricDistort)
def _photometric(t: T.RandomPhotometricDistort, img: torch.Tensor, p: PhotometricParams) -> torch.Tensor:
    if p.brightness is not None:
        img = F.adjust_brightness(img, p.brightness)
    if p.contrast is not None and p.contrast_before:
        img = F.adjust_contrast(img, p.contrast)
    if p.saturation is not None:
        img = F.adjust_saturation(img, p.saturation)
    if p.hue is not None:
        img = F.adjust_hue(img, p.hue)
    if p.contrast is not None and not p.contrast_before:
        img = F.adjust_contrast(img, p.contrast)
    if p.permutation is not None and img.shape[-3] == 3:
        img = F.permute_channels(img, list(p.permutation))
    return img


@LOWERINGS.register(T.RandomZoomOut)
def _zoom_out(t: T.RandomZoomOut, img: torch.Tensor, p: ZoomParams) -> torch.Tensor:
    if not any(p.padding):
        return img
    fill = list(t.fill) if isinstance(t.fill, tuple) else t.fill
    return F.pad(img, list(p.padding), fill=fill)


@LOWERINGS.register(T.RandomIoUCrop)
def _iou_crop(t: T.RandomIoUCrop, img: torch.Tensor, p: IoUCropParams | None) -> torch.Tensor:
    if p is None:
        return img
    out = F.crop(img, p.top, p.left, p.height, p.width)
    if isinstance(out, tv_tensors.BoundingBoxes):  # those whose centre left the window: zeroed, then dropped
        out[~torch.tensor(p.within, dtype=torch.bool)] = 0
    return out


@LOWERINGS.register(T.CenterCrop)
def _center_crop(t: T.CenterCrop, img: torch.Tensor, _: None) -> torch.Tensor:
    (ch, cw), (h, w) = t.size, img.shape[-2:]
    return F.crop(img, center_crop_anchor(ch, h), center_crop_anchor(cw, w), ch, cw)  # pads with zeros outside


@LOWERINGS.register(T.RandomCrop)
def _random_crop(t: T.RandomCrop, img: torch.Tensor, p: RandomCropParams) -> torch.Tensor:
    if any(p.padding):
        fill = list(t.fill) if isinstance(t.fill, tuple) else t.fill
        img = F.pad(img, list(p.padding), fill=fill, padding_mode=t.padding_mode)
    if img.shape[-2:] != (p.height, p.width):
        img = F.crop(img, p.top, p.left, p.height, p.width)
    return img


@LOWERINGS.register(T.RandomHorizontalFlip)
def _hflip(t: T.RandomHorizontalFlip, img: torch.Tensor, p: FlipParams) -> torch.Tensor:
    return F.horizontal_flip(img) if p.flip else img


@LOWERINGS.register(T.RandomVerticalFlip)
def _vflip(t: T.RandomVerticalFlip, img: torch.Tensor, p: FlipParams) -> torch.Tensor:
    return F.vertical_flip(img) if p.flip else img


_JITTER = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)


@LOWERINGS.register(T.ColorJitter)
def _color_jitter(t: T.ColorJitter, img: torch.Tensor, p: ColorJitterParams) -> torch.Tensor:
    factors = (p.brightness, p.contrast, p.saturation, p.hue)
    for i in p.order:
        if factors[i] is not None:
            img = _JITTER[i](img, factors[i])
    return img


@LOWERINGS.register(T.RandomGrayscale)
def _grayscale(t: T.RandomGrayscale, img: torch.Tensor, p: GrayscaleParams) -> torch.Tensor:
    return F.rgb_to_grayscale(img, num_output_channels=img.shape[-3]) if p.apply else img


@LOWERINGS.register(T.GaussianBlur)
def _gaussian_blur(t: T.GaussianBlur, img: torch.Tensor, p: BlurParams) -> torch.Tensor:
    kx, ky = t.kernel_size
    h, w = img.shape[-2:]
    if h > ky // 2 and w > kx // 2:
        return F.gaussian_blur(img, [kx, ky], [p.sigma, p.sigma])
    # Smaller than half the kernel: torch's reflect padding refuses it. Pad by reflection (the
    # same "101" border, repeated as often as needed, as DALI's blur does), blur, take the middle.
    py, px = ky // 2, kx // 2
    padded = img.index_select(-2, _reflect101(h, py)).index_select(-1, _reflect101(w, px))
    return F.gaussian_blur(padded, [kx, ky], [p.sigma, p.sigma])[..., py : py + h, px : px + w]


def _reflect101(n: int, pad: int) -> torch.Tensor:
    """Indices of ``pad`` reflected positions, ``n`` own, ``pad`` reflected (edge not repeated)."""
    i = torch.arange(-pad, n + pad)
    if n == 1:
        return torch.zeros_like(i)
    period = 2 * (n - 1)
    i = i.remainder(period)
    return torch.where(i < n, i, period - i)


@LOWERINGS.register(T.RandomSolarize)
def _solarize(t: T.RandomSolarize, img: torch.Tensor, p: SolarizeParams) -> torch.Tensor:
    return F.solarize(img, t.threshold) if p.apply else img


def _tone(t: T.Transform, img: torch.Tensor, p: CoinParams) -> torch.Tensor:
    """The tone transforms: the stage's kernel (torchvision's) where the sample's coin says so."""
    return tone(t, img) if p.apply else img


LOWERINGS.register(T.RandomInvert, T.RandomPosterize, T.RandomAutocontrast, T.RandomAdjustSharpness,
                   T.RandomEqualize)(_tone)  # fmt: skip


@LOWERINGS.register(T.RandomRotation)
def _rotation(t: T.RandomRotation, img: torch.Tensor, p: RotationParams) -> torch.Tensor:
    fill = list(t.fill) if isinstance(t.fill, tuple) else t.fill
    center = list(t.center) if t.center is not None else None
    return F.rotate(img, p.angle, interpolation=_interp(t.interpolation), expand=t.expand, center=center, fill=fill)


@LOWERINGS.register(T.RandomAffine)
def _affine(t: T.RandomAffine, img: torch.Tensor, p: AffineParams) -> torch.Tensor:
    fill = list(t.fill) if isinstance(t.fill, tuple) else t.fill
    center = list(t.center) if t.center is not None else None
    return F.affine(img, angle=p.angle, translate=list(p.translate), scale=p.scale, shear=list(p.shear),
                    interpolation=_interp(t.interpolation), fill=fill, center=center)  # fmt: skip


@LOWERINGS.register(T.RandomErasing)
def _random_erasing(t: T.RandomErasing, img: torch.Tensor, p: ErasingParams) -> torch.Tensor:
    if not p.erase:
        return img
    if t.noise:  # N(0, 1) per erased value, from the sample's own seed
        generator = torch.Generator().manual_seed(p.seed)
        value = torch.empty([img.shape[0], p.h, p.w], dtype=torch.float32).normal_(generator=generator)
    else:
        value = torch.tensor(t.value)[:, None, None]
    return F.erase(img, p.top, p.left, p.h, p.w, value)


@LOWERINGS.register(T.RandomApply, unsupported=lambda t: inner_unsupported(LOWERINGS, t.transforms))
def _random_apply(t: T.RandomApply, img: torch.Tensor, p: RandomApplyParams) -> torch.Tensor:
    if p.apply:
        for inner, params in zip(t.transforms, p.params, strict=True):
            img = LOWERINGS.lookup(inner)(inner, img, params)
    return img


@LOWERINGS.register(SampleChoice, unsupported=lambda t: inner_unsupported(LOWERINGS, t.transforms))
def _random_choice(t: SampleChoice, img: torch.Tensor, p: RandomChoiceParams) -> torch.Tensor:
    inner = t.transforms[p.chosen]
    return LOWERINGS.lookup(inner)(inner, img, p.params[p.chosen])


# ToDtype and Normalize: the stage's, which take one image or a batch alike
LOWERINGS.register(T.ToDtype)(to_dtype)
LOWERINGS.register(T.Normalize)(normalize)


@LOWERINGS.register(T.Arithmetic)
def _arithmetic(t: T.Arithmetic, img: torch.Tensor, _: None) -> torch.Tensor:
    return t.apply(img).to(img.dtype)


@LOWERINGS.register(T.ArrayFunction)
def _array_function(t: T.ArrayFunction, img: torch.Tensor, _: None) -> torch.Tensor:
    out = t.apply(img.permute(1, 2, 0).numpy(), np)  # [H, W, C], a view
    return torch.from_numpy(np.ascontiguousarray(out)).permute(2, 0, 1)
