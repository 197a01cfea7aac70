"""The stage's colour steps and the composites around them, on a batch, each sample with its own
draws: ``ColorJitter`` (uint8; its order per sample), ``RandomGrayscale``, ``RandomSolarize``,
``GaussianBlur``, ``RandomApply`` and ``RandomChoice`` of per-sample steps: the DINO, SimCLR and
3-Augment tails. Values as torchvision's kernels give them sample by sample (tested).

A composite runs its members on the samples that drew them (a gather, the member's lowering on
those rows, a scatter): what each sample pays for is its own choice.
"""

from __future__ import annotations

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

__all__ = ["blur_grouped"]


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
    kernels = _blur_kernels(t, sigma, images.device).to(images.dtype if fp else torch.float32)
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

    def adjust(j: int) -> K.RowsFn:
        return lambda x, rows: _jitter_one(j, x, values[rows, j])

    def blend(k: int) -> K.RowsFn:
        return lambda x, rows: K.blends(x, order[rows, k], *blend_args(x, values[rows, order[rows, k]]))

    one_channel = images.shape[-3] == 1
    for k in range(4):  # each sample takes one adjustment per round: disjoint rows
        takes = [np.flatnonzero((order[:, k] == j) & ~np.isnan(values[:, j])) for j in range(4)]
        if K.gpu_way(images.device):  # the round's blends in one pass (saturation of one channel: none)
            merged = np.sort(np.concatenate(takes[:2] if one_channel else takes[:3]))
            images = K.on_rows(images, [(merged, blend(k)), (takes[3], adjust(3))])
        else:  # once per adjustment and value: torchvision's scalar calls (a per-sample blend takes float64)
            groups: list[tuple[np.ndarray, K.RowsFn]] = []
            for j, rows in enumerate(takes):
                if j == 3:  # hue: a shift per sample is float32 either way
                    groups.append((rows, adjust(j)))
                else:
                    groups += [(rows[values[rows, j] == v], adjust(j)) for v in np.unique(values[rows, j])]
            images = K.on_rows(images, groups)
    return images
