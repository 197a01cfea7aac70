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
from . import _kernels as K
from ._steps import STAGE

__all__ = ["blur_grouped"]


def _rows(images: torch.Tensor, at: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(at).to(images.device, non_blocking=True)


def _on_rows(images: torch.Tensor, at: np.ndarray, fn: Any) -> torch.Tensor:
    """``fn`` on the rows ``at`` of ``images``, the others as they are (a new tensor where any
    row is taken)."""
    if not len(at):
        return images
    if len(at) == len(images):
        return fn(images, np.arange(len(images)))
    index = _rows(images, at)
    out = images.clone()
    out.index_copy_(0, index, fn(images.index_select(0, index), at))
    return out


def _members(t: Any, images: torch.Tensor, factors: np.ndarray, rows: np.ndarray, members: Any) -> torch.Tensor:
    """``members`` (of composite ``t``, each with its columns of ``factors``) in order on
    ``images``, the rows ``rows`` of the batch."""
    for inner, (a, b) in members:
        images = STAGE.lookup(inner)(inner, images, factors[rows, a:b] if inner.draws else None)
    return images


def _random_apply(t: T.RandomApply, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    members = list(zip(t.transforms, t.factor_slices, strict=True))
    return _on_rows(images, np.flatnonzero(factors[:, 0] != 0), lambda x, at: _members(t, x, factors, at, members))


def _random_choice(t: SampleChoice, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    chosen = factors[:, 0].astype(np.int64)
    for k, (inner, cols) in enumerate(zip(t.transforms, t.factor_slices, strict=True)):
        images = _on_rows(images, np.flatnonzero(chosen == k),
                          lambda x, at, m=[(inner, cols)]: _members(t, x, factors, at, m))  # fmt: skip
    return images


def _members_unsupported(t: Any) -> str | None:
    for i, inner in enumerate(t.transforms):
        if type(inner) not in STAGE:
            return f"transforms[{i}] ({type(inner).__name__}) has no stage lowering"
        entry = STAGE._entry(inner, None)
        reason = entry.unsupported(inner) if entry.unsupported else None
        if reason:
            return f"transforms[{i}]: {reason}"
    return None


STAGE.register(T.RandomApply, unsupported=_members_unsupported)(_random_apply)
STAGE.register(SampleChoice, unsupported=_members_unsupported)(_random_choice)


@STAGE.register(T.RandomGrayscale)
def _grayscale(t: T.RandomGrayscale, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    return _on_rows(images, np.flatnonzero(factors[:, 0] != 0),
                    lambda x, at: F.rgb_to_grayscale(x, num_output_channels=x.shape[-3]))  # fmt: skip


@STAGE.register(T.RandomSolarize)
def _solarize(t: T.RandomSolarize, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    return _on_rows(images, np.flatnonzero(factors[:, 0] != 0), lambda x, at: F.solarize(x, t.threshold))


def _blur_kernels(t: T.GaussianBlur, sigma: np.ndarray, device: torch.device) -> torch.Tensor:
    """torchvision's ``_get_gaussian_kernel2d`` for each sample's sigma: ``[n, ky, kx]`` float32
    (the softmax of ``−(x / σ)²`` over ``linspace(±(k − 1) / (2√2))``, σ cast to float32)."""
    kx, ky = t.kernel_size
    s = torch.from_numpy(sigma.astype(np.float32)).to(device)[:, None]

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
    if images.device.type == "cpu":
        out = images
        for value in np.unique(sigma).tolist():
            at = np.flatnonzero(sigma == value)
            out = _on_rows(out, at, lambda x, at, v=value: F.gaussian_blur(x, [kx, ky], [v, v]))
        return out
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


_JITTER = ("brightness", "contrast", "saturation", "hue")


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
    """Adjustment ``j`` (``_JITTER``) of uint8 ``x`` with factors ``f`` ``[n]``: torchvision's
    blends (brightness: ``x·f``; contrast: with the mean luma; saturation: with the luma) and its
    hue shift."""
    if j == 3:
        return _hue(x, torch.from_numpy(f.astype(np.float32)).to(x.device))
    if (f == f[0]).all():  # torchvision's own call, with the Python float
        return (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation)[j](x, float(f[0]))
    ratio = torch.from_numpy(f.astype(np.float32)).to(x.device)
    alpha = torch.from_numpy((1.0 - f).astype(np.float32)).to(x.device)
    return (lambda: K.brightness(x, ratio), lambda: K.contrast(x, ratio, alpha),
            lambda: K.saturation(x, ratio, alpha))[j]()  # fmt: skip


@STAGE.register(T.ColorJitter)
def _color_jitter(t: T.ColorJitter, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """Four rounds; in round ``k`` each sample takes its ``k``-th adjustment (its own order),
    each adjustment once over the samples that take it then."""
    order = factors[:, :4].astype(np.int64)
    values = factors[:, 4:8]
    for k in range(4):
        for j in range(4):
            at = np.flatnonzero((order[:, k] == j) & ~np.isnan(values[:, j]))
            images = _on_rows(images, at, lambda x, rows, j=j: _jitter_one(j, x, values[rows, j]))
    return images
