"""The stage's colour steps and the composites around them, on a batch, each sample with its own
draws: ``ColorJitter`` and ``RandomPhotometricDistort`` (uint8; their order per sample),
``RandomGrayscale``, ``RandomSolarize``, ``GaussianBlur``, the tone steps (``RandomInvert``,
``RandomPosterize``, ``RandomAutocontrast``, ``RandomAdjustSharpness``, ``RandomEqualize``),
``RandomApply`` and ``RandomChoice`` of per-sample steps: the DINO, SimCLR and 3-Augment tails.
Values as torchvision's kernels give them sample by sample (tested).

A composite runs its members on the samples that drew them (a gather, the member's lowering on
those rows, a scatter): what each sample pays for is its own choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as nnf
from torchvision.transforms.v2 import functional as F

from ... import transforms as T
from ...transforms._apply import RandomChoice as SampleChoice
from .._registry import inner_unsupported
from . import _kernels as K
from ._ops import blend_args
from ._steps import STAGE

__all__ = ["blur_grouped", "tone"]


def _members(images: torch.Tensor, factors: np.ndarray, rows: np.ndarray, members: Any) -> torch.Tensor:
    """A composite's ``members`` (each with its columns of ``factors``) in order on ``images``,
    the rows ``rows`` of the batch."""
    for inner, (a, b) in members:
        images = STAGE.lookup(inner)(inner, images, factors[rows, a:b] if inner.draws else None)
    return images


def _random_apply(t: T.RandomApply, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    members = list(zip(t.transforms, t.factor_slices, strict=True))
    return K.on_rows(images, [(np.flatnonzero(factors[:, 0] != 0), lambda x, at: _members(x, factors, at, members))])


def _random_choice(t: SampleChoice, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    chosen = factors[:, 0].astype(np.int64)

    def member(m: Any) -> K.RowsFn:
        return lambda x, at: _members(x, factors, at, [m])

    return K.on_rows(images, [(np.flatnonzero(chosen == k), member(m))
                              for k, m in enumerate(zip(t.transforms, t.factor_slices, strict=True))])  # fmt: skip


def _members_unsupported(t: Any) -> str | None:
    return inner_unsupported(STAGE, t.transforms)


STAGE.register(T.RandomApply, unsupported=_members_unsupported)(_random_apply)
STAGE.register(SampleChoice, unsupported=_members_unsupported)(_random_choice)


@STAGE.register(T.RandomGrayscale)
def _grayscale(t: T.RandomGrayscale, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    # (torchvision's three channels are one expanded, stride 0: run_stage writes no such tensor in
    # place, and Stage.run hands on a dense batch)
    return K.on_rows(images, [(np.flatnonzero(factors[:, 0] != 0),
                               lambda x, at: F.rgb_to_grayscale(x, num_output_channels=x.shape[-3]))])  # fmt: skip


@STAGE.register(T.RandomSolarize)
def _solarize(t: T.RandomSolarize, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    return K.on_rows(images, [(np.flatnonzero(factors[:, 0] != 0), lambda x, at: F.solarize(x, t.threshold))])


# The tone steps' kernels: torchvision's, on a batch as on one image (each image's own minimum,
# maximum, histogram or smoothing). The torch backend runs them sample by sample (:func:`tone`).
_TONE: dict[type, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    T.RandomInvert: lambda t, x: F.invert(x),
    T.RandomPosterize: lambda t, x: F.posterize(x, t.bits),
    T.RandomAutocontrast: lambda t, x: F.autocontrast(x),
    T.RandomAdjustSharpness: lambda t, x: F.adjust_sharpness(x, t.sharpness_factor),
    T.RandomEqualize: lambda t, x: F.equalize(x),
}


def tone(t: Any, images: torch.Tensor) -> torch.Tensor:
    """Tone step ``t``'s kernel on ``images`` ``[..., C, H, W]`` (uint8 or float), every image
    changed (a subclass of a tone step: its parent's kernel)."""
    kind = next(cls for cls in type(t).__mro__ if cls in _TONE)
    return _TONE[kind](t, images)


def _tone(t: Any, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """The samples whose coin says so, through :func:`tone`; a float image of one channel
    sharpened image by image (torch's convolution of one channel sums in another order over a
    batch: 2e-7 apart, 2 cores, 2026-11-29)."""
    rows = np.flatnonzero(factors[:, 0] != 0)
    if isinstance(t, T.RandomAdjustSharpness) and images.is_floating_point() and images.shape[-3] == 1:
        return K.on_rows(images, [(rows[k : k + 1], lambda x, at: tone(t, x)) for k in range(len(rows))])
    return K.on_rows(images, [(rows, lambda x, at: tone(t, x))])


STAGE.register(*_TONE)(_tone)


def _blur_kernels(t: T.GaussianBlur, sigma: np.ndarray, device: torch.device) -> torch.Tensor:
    """torchvision's ``_get_gaussian_kernel2d`` for each sample's sigma: ``[n, ky, kx]`` float32
    (the softmax of ``−(x / σ)²`` over ``linspace(±(k − 1) / (2√2))``, σ cast to float32)."""
    kx, ky = t.kernel_size
    s = K.upload(sigma, device, torch.float32)[:, None]

    def one_d(k: int) -> torch.Tensor:
        lim = (k - 1) / (2.0 * np.sqrt(2.0))
        x = torch.linspace(-lim, lim, steps=k, dtype=torch.float32, device=device)
        return torch.softmax(x[None].div(s).pow(2).neg(), dim=1)

    return one_d(ky)[:, :, None] * one_d(kx)[:, None, :]


@STAGE.register(T.GaussianBlur)
def _gaussian_blur(t: T.GaussianBlur, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """torchvision's blur (reflected borders, the 2-D kernel, rounded for uint8) with each
    sample's sigma: one grouped convolution over the batch's channels on a GPU; on a CPU, one
    call per sigma (torchvision's own, the fastest there)."""
    sigma = factors[:, 0]
    kx, ky = t.kernel_size
    if not K.gpu_way(images.device):

        def blur(v: float) -> K.RowsFn:
            return lambda x, at: F.gaussian_blur(x, [kx, ky], [v, v])

        return K.on_rows(images, [(np.flatnonzero(sigma == v), blur(v)) for v in np.unique(sigma).tolist()])
    return blur_grouped(t, images, sigma)


def blur_grouped(t: T.GaussianBlur, images: torch.Tensor, sigma: np.ndarray) -> torch.Tensor:
    """The batch's blurs as one convolution, ``groups`` = samples x channels, each group its
    sample's kernel (the GPU's way)."""
    kx, ky = t.kernel_size
    b, c, h, w = images.shape
    fp = images.is_floating_point()
    if not fp or images.dtype == torch.float32:
        kernels = _blur_kernels(t, sigma, images.device).to(torch.float32)
    else:  # float64 and the half types: torchvision builds the kernel in the image's dtype, sigma a Python float
        from torchvision.transforms.v2.functional._misc import _get_gaussian_kernel2d

        kernels = torch.stack([_get_gaussian_kernel2d([kx, ky], [v, v], images.dtype, images.device)
                               for v in sigma.tolist()])  # fmt: skip
    x = images if fp else images.to(torch.float32)
    x = nnf.pad(x.reshape(1, b * c, h, w), [kx // 2, kx // 2, ky // 2, ky // 2], mode="reflect")
    out = nnf.conv2d(x, kernels.repeat_interleave(c, dim=0)[:, None], groups=b * c).reshape(b, c, h, w)
    return out if fp else out.round_().to(images.dtype)


def _hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """torchvision's ``adjust_hue_image`` with a shift per sample (``[n]`` float32)."""
    from torchvision.transforms.v2.functional._color import _hsv_to_rgb, _rgb_to_hsv

    if x.shape[-3] == 1:
        return x
    hsv = _rgb_to_hsv(F.to_dtype(x, torch.float32, scale=True))
    h, s, v = hsv.unbind(dim=-3)
    h.add_(shift.view(-1, 1, 1)).remainder_(1.0)
    return F.to_dtype(_hsv_to_rgb(torch.stack((h, s, v), dim=-3)), x.dtype, scale=True)


def _jitter_one(j: int, x: torch.Tensor, f: np.ndarray) -> torch.Tensor:
    """Adjustment ``j`` (0 brightness, 1 contrast, 2 saturation, 3 hue: ``ColorJitter``'s order
    codes) of uint8 ``x`` with factors ``f`` ``[n]``: torchvision's blends with ratio ``f``
    (brightness: ``x·f``; contrast: with the mean luma; saturation: with the luma), as the
    policies' colour operations blend, and its hue shift."""
    if j == 3:
        return _hue(x, K.upload(f, x.device, torch.float32))
    ratio, alpha = blend_args(x, f)
    return (lambda: K.brightness(x, ratio), lambda: K.contrast(x, ratio, alpha),
            lambda: K.saturation(x, ratio, alpha))[j]()  # fmt: skip


@STAGE.register(T.ColorJitter)
def _color_jitter(t: T.ColorJitter, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """Four rounds; in round ``k`` each sample takes its ``k``-th adjustment (its own order):
    the GPU's way, the round's blends in one pass and the hue shifts in another; on a CPU, each
    blend once per value (a per-sample blend takes float64 there: 3-Augment's ColorJitter on 64
    images of 224², one thread, 320 ms that way against 80-90 ms, the per-sample kernels' 72-92
    ms; 2 cores, 2026-11-29)."""
    order = factors[:, :4].astype(np.int64)
    values = factors[:, 4:8]

    def blend(k: int) -> K.RowsFn:
        return lambda x, rows: K.blends(x, order[rows, k], *blend_args(x, values[rows, order[rows, k]]))

    one_channel = images.shape[-3] == 1
    for k in range(4):  # each sample takes one adjustment per round: disjoint rows
        takes = [np.flatnonzero((order[:, k] == j) & ~np.isnan(values[:, j])) for j in range(4)]
        if K.gpu_way(images.device):  # the round's blends in one pass (saturation of one channel: none)
            merged = np.sort(np.concatenate(takes[:2] if one_channel else takes[:3]))
            images = K.on_rows(images, [(merged, blend(k)), *_adjustments(3, takes[3], values[:, 3], gpu=True)])
        else:
            images = K.on_rows(images, [g for j, rows in enumerate(takes) for g in _adjustments(j, rows, values[:, j])])
    return images


def _adjustments(j: int, rows: np.ndarray, values: np.ndarray, *,
                 gpu: bool = False) -> list[tuple[np.ndarray, K.RowsFn]]:  # fmt: skip
    """Adjustment ``j`` (:func:`_jitter_one`) of the batch's ``rows``, each with its factor of
    ``values`` ``[B]``, as :func:`K.on_rows`'s groups: the GPU's way (``gpu``) one group, the
    factors per sample; on a CPU once per value, torchvision's scalar calls (a per-sample blend
    takes float64 there), but hue's shift, float32 either way."""

    def adjust(x: torch.Tensor, at: np.ndarray) -> torch.Tensor:
        return _jitter_one(j, x, values[at])

    if gpu or j == 3:
        return [(rows, adjust)]
    return [(rows[values[rows] == v], adjust) for v in np.unique(values[rows])]


@STAGE.register(T.RandomPhotometricDistort)
def _photometric(t: T.RandomPhotometricDistort, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """torchvision's order: brightness, contrast where drawn before, saturation, hue, contrast
    where drawn after, each on the samples that drew it; then each drawn permutation of the
    channels (3 channels; one is left as it is)."""
    gpu = K.gpu_way(images.device)
    before = factors[:, 4] != 0
    for j, place in ((0, None), (1, before), (2, None), (3, None), (1, ~before)):
        on = ~np.isnan(factors[:, j]) & (True if place is None else place)
        images = K.on_rows(images, _adjustments(j, np.flatnonzero(on), factors[:, j], gpu=gpu))
    permuted = np.flatnonzero(factors[:, 5] != 0)
    if images.shape[-3] != 3:
        return images
    return K.on_rows(images, [(permuted, lambda x, at: _permute_channels(x, factors[at, 6:9]))])


def _permute_channels(x: torch.Tensor, orders: np.ndarray) -> torch.Tensor:
    """``x`` ``[n, 3, H, W]`` with each sample's channels in its order ``orders`` ``[n, 3]``
    (torchvision's ``permute_channels``: channel ``k`` of the result is channel ``orders[k]``)."""
    index = K.upload(orders.astype(np.int64), x.device)
    return x[torch.arange(len(x), device=x.device)[:, None], index]
