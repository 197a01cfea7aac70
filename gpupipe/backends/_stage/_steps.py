"""The stage's lowerings: a step on a whole batch, ``(transform, images [B, C, H, W], factors [B,
draws] or None) -> images``, with each sample's own draws (the rows ``gpupipe.core._random``
draws for every backend), so the stage gives what the per-sample kernels give.

:func:`stage_start` finds where a view's steps can go to the stage (the longest tail of steps the
stage lowers, holding a per-sample draw); :func:`run_stage` runs such a tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torchvision.transforms.v2 import functional as F

from ... import transforms as T
from ...core._geometry import erasing_windows
from .._registry import Registry, inner_unsupported
from ._kernels import column, constant, gpu_way, upload
from ._ops import Warp, apply_slot

__all__ = ["STAGE", "stage_start", "run_stage", "to_dtype", "normalize"]

STAGE = Registry("stage")


@STAGE.register(T.TrivialAugmentWide, T.RandAugment, T.AutoAugment, T.TimmRandAugment)
def _policy(t: Any, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """Each slot in turn, each sample its own operation and magnitude."""
    codes, mags = t.magnitudes(images.shape[-2], images.shape[-1], factors)
    warp = Warp.of(t)
    for slot in range(codes.shape[1]):
        images = apply_slot(images, codes[:, slot], mags[:, slot], warp)
    return images


@STAGE.register(T.AugMix)
def _augmix(t: T.AugMix, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """torchvision's AugMix: the original and each chain weighted in float32, summed in its
    order, truncated back to uint8."""
    codes, mags, weights = t.drawn(images.shape[-2], images.shape[-1], factors)
    w = upload(weights, images.device)
    warp = Warp.of(t)
    n, width = len(images), t.mixture_width
    if gpu_way(images.device):  # the chains stacked, [width · n, C, H, W]: a slot's launches once for all
        stacked = images.repeat(width, 1, 1, 1)
        for j in range(t.depth):
            slots = [chain * t.depth + j for chain in range(width)]
            stacked = apply_slot(stacked, codes[:, slots].T.reshape(-1), mags[:, slots].T.reshape(-1), warp)
        chains = list(stacked.split(n))
    else:
        chains = []
        for chain in range(width):
            aug = images
            for j in range(t.depth):
                slot = chain * t.depth + j
                aug = apply_slot(aug, codes[:, slot], mags[:, slot], warp)
            chains.append(aug)
    # The sum in runs of rows of about 1 MB of float32 on a CPU, where a batch's float32 passes
    # would leave the caches (2 cores, 2026-11-28: 1.2x the step); the whole batch on a GPU.
    rows = n if gpu_way(images.device) else max(1, (1 << 20) // max(1, images[0].numel() * 4))
    out = torch.empty_like(images)
    for a in range(0, n, rows):
        at = slice(a, a + rows)
        mix = column(w[at, 0], images[at]) * images[at]  # (uint8 promoted to float32 in the product: exact)
        for chain, aug in enumerate(chains):
            mix += column(w[at, 1 + chain], images[at]) * aug[at]
        out[at] = mix  # (truncated, as .to(uint8))
    return out


@STAGE.register(T.ToDtype)
def to_dtype(t: T.ToDtype, images: torch.Tensor, _: None) -> torch.Tensor:
    """``[..., C, H, W]`` to ``t.dtype`` (torchvision's ``to_dtype``)."""
    return F.to_dtype(images, t.dtype, scale=t.scale)


@STAGE.register(T.Normalize)
def normalize(t: T.Normalize, images: torch.Tensor, _: None) -> torch.Tensor:
    """``[..., C, H, W]`` normalized per channel (one mean and std for every channel where ``t``
    has one): torchvision's ``normalize_image`` (subtract, then divide in place), its mean and
    std made once per device (it makes them from Python values each call, on a GPU a copy from
    pageable memory that waits for the stream's queued work)."""
    return _normalize(t, images, in_place=False)


def _normalize_in_place(t: T.Normalize, images: torch.Tensor, _: None) -> torch.Tensor:
    """:func:`normalize` written into ``images``, the same arithmetic. A new float32 batch of 64 x
    3 x 224² is 38 MB, which a CPU's allocator maps afresh each time: its ``sub`` took 4x the
    per-sample kernels' time in the torch workers (2 cores, 2026-11-29)."""
    return _normalize(t, images, in_place=True)


def _normalize(t: T.Normalize, images: torch.Tensor, *, in_place: bool) -> torch.Tensor:
    if not images.is_floating_point():
        raise TypeError(f"Input tensor should be a float tensor. Got {images.dtype}.")
    channels = images.shape[-3]
    mean = tuple(t.mean) * channels if len(t.mean) == 1 else tuple(t.mean)
    std = tuple(t.std) * channels if len(t.std) == 1 else tuple(t.std)
    if not all(std):
        raise ValueError("std evaluated to zero, leading to division by zero.")
    column = (-1, 1, 1)
    means, stds = (constant(images.device, v, images.dtype).view(column) for v in (mean, std))
    return (images.sub_(means) if in_place else images.sub(means)).div_(stds)


@STAGE.register(T.RandomErasing)
def _random_erasing(t: T.RandomErasing, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """Each sample's box (``erasing_windows``, the per-sample rule vectorized) filled with the
    value; ``value="random"``: each erased box's N(0, 1) noise from the sample's own seed, as the
    torch backend draws it (:func:`erase_with_noise`). A new tensor (``images`` where nothing is
    erased); :func:`_erase_in_place` writes ``images`` itself."""
    return _erase(t, images, factors, in_place=False)


def _erase_in_place(t: T.RandomErasing, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """:func:`_random_erasing` written into ``images`` on a CPU (each box, and nothing else: a copy
    of the batch and a pass over it cost more than the boxes, 2 cores, 2026-11-28); on a GPU as it."""
    return _erase(t, images, factors, in_place=not gpu_way(images.device))


def _erase(t: T.RandomErasing, images: torch.Tensor, factors: np.ndarray, *, in_place: bool) -> torch.Tensor:
    h, w = images.shape[-2:]
    windows = erasing_windows(h, w, factors)  # [B, 4]: top, left, h, w
    erased = np.flatnonzero((windows[:, 2] > 0) & (windows[:, 3] > 0))  # (a box 0 wide erases nothing)
    if not len(erased):
        return images
    if t.noise:
        return erase_with_noise(images, windows[erased], erased, factors[erased, -1], in_place=in_place)
    value = constant(images.device, tuple(float(v) for v in t.value)).to(images.dtype).view(-1, 1, 1)
    if not gpu_way(images.device):  # each box written: no pass over the rows it leaves (a launch costs little)
        out = images if in_place else images.clone()
        for i, (top, left, eh, ew) in zip(erased.tolist(), windows[erased].tolist(), strict=True):
            out[i, :, top : top + eh, left : left + ew] = value
        return out
    box = upload(windows, images.device)
    ys = torch.arange(h, device=images.device)[None, :, None]
    xs = torch.arange(w, device=images.device)[None, None, :]
    top, left, eh, ew = (box[:, k, None, None] for k in range(4))
    inside = (ys >= top) & (ys < top + eh) & (xs >= left) & (xs < left + ew)  # [B, H, W]
    return torch.where(inside[:, None], value, images)


def erase_with_noise(images: torch.Tensor, windows: np.ndarray, rows: np.ndarray, seeds: np.ndarray, *,
                     in_place: bool = False) -> torch.Tensor:  # fmt: skip
    """Rows ``rows`` of ``images`` erased with N(0, 1) noise in their ``windows`` ``[n, 4]``, each
    box's values ``[C, eh, ew]`` from ``torch.Generator().manual_seed(seed · 2**53)`` (the torch
    backend's draw, value for value): drawn on the host into one buffer, copied to the device once
    (on a GPU through pinned memory, queued), then each box written from its slice (a copy queued
    per erased sample, no wait and no index tensor); into ``images`` itself with ``in_place``."""
    c = images.shape[-3]
    sizes = c * windows[:, 2] * windows[:, 3]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    noise = torch.empty(int(sizes.sum()), dtype=torch.float32)
    for k, seed in enumerate(seeds.tolist()):  # the draws: each box's own generator, as the backends draw
        generator = torch.Generator().manual_seed(int(float(seed) * 2**53))
        noise[int(offsets[k]) : int(offsets[k] + sizes[k])].normal_(generator=generator)
    values = upload(noise.numpy(), images.device).to(images.dtype)
    out = images if in_place else images.clone()
    if gpu_way(images.device):  # every box at once: a fixed number of launches, whatever the boxes
        return _boxes_at_once(out, values, windows, rows, offsets)
    for k, (i, (top, left, eh, ew)) in enumerate(zip(rows.tolist(), windows.tolist(), strict=True)):
        box = values[int(offsets[k]) : int(offsets[k] + sizes[k])].view(c, eh, ew)
        out[i, :, top : top + eh, left : left + ew] = box
    return out


def _boxes_at_once(out: torch.Tensor, values: torch.Tensor, windows: np.ndarray, rows: np.ndarray,
                   offsets: np.ndarray) -> torch.Tensor:  # fmt: skip
    """:func:`erase_with_noise`'s boxes written into ``out`` in one gather: each erased row's
    pixels inside its box take ``values[offset + c·eh·ew + (y − top)·ew + (x − left)]``."""
    c, h, w = out.shape[-3:]
    args = upload(np.concatenate([windows, offsets[:, None]], axis=1).astype(np.int64), out.device)
    top, left, eh, ew, offset = (args[:, k, None, None, None] for k in range(5))  # [n, 1, 1, 1] each
    index = upload(rows.astype(np.int64), out.device)
    ys = torch.arange(h, device=out.device).view(1, 1, h, 1)
    xs = torch.arange(w, device=out.device).view(1, 1, 1, w)
    cs = torch.arange(c, device=out.device).view(1, c, 1, 1)
    inside = (ys >= top) & (ys < top + eh) & (xs >= left) & (xs < left + ew)  # [n, 1, H, W]
    at = torch.where(inside, offset + cs * eh * ew + (ys - top) * ew + (xs - left), 0)  # [n, C, H, W]
    return out.index_copy_(0, index, torch.where(inside, values[at], out.index_select(0, index)))


def stage_start(steps: Sequence[T.Transform], specs: Sequence[T.ImageSpec] | None = None) -> int | None:
    """Where ``steps``' tail that the stage runs starts: the longest tail of steps with a stage
    lowering (:func:`tail_start`), if it holds a step that draws per sample (a tail of
    ``ToDtype`` and ``Normalize`` alone gains nothing batched); ``None`` where there is none."""
    start = tail_start(steps, specs)
    return start if any(t.random for t in steps[start:]) else None


def tail_start(steps: Sequence[T.Transform], specs: Sequence[T.ImageSpec] | None = None) -> int:
    """Where the longest tail of ``steps`` the stage can run starts (``len(steps)``: none): steps
    with a stage lowering whose options it supports, on its input ``specs[i]`` where given."""
    start = len(steps)
    while start and takes(steps[start - 1], None if specs is None else specs[start - 1]):
        start -= 1
    return start


def takes(t: T.Transform, spec: T.ImageSpec | None) -> bool:
    """Whether the stage runs ``t`` on an input of ``spec``: ``ColorJitter`` and
    ``RandomPhotometricDistort`` on uint8 images (their float blends would round twice),
    ``GaussianBlur`` on images of more than half its kernel a side (smaller, the backends pad by
    reflection again and again), composites on their members'."""
    if inner_unsupported(STAGE, [t]) is not None:  # no lowering, or options it does not take
        return False
    if spec is None:
        return True
    if isinstance(t, T.ColorJitter | T.RandomPhotometricDistort) and spec.dtype != torch.uint8:
        return False
    if isinstance(t, T.GaussianBlur):
        kx, ky = t.kernel_size
        return spec.fixed_size and spec.height > ky // 2 and spec.width > kx // 2
    members = getattr(t, "transforms", None)
    return members is None or all(takes(inner, spec) for inner in members)


# A lowering's variant that may write its input, run where the input is the stage's own
# (a tensor an earlier step made, not the caller's): it saves a copy of the batch.
_IN_PLACE: dict[Any, Any] = {_random_erasing: _erase_in_place, normalize: _normalize_in_place}


def _dense(images: torch.Tensor) -> bool:
    """Whether each element of ``images`` has memory of its own (no stride 0, as an expanded
    tensor has: a write would land on several elements)."""
    return images.is_contiguous() or images.is_contiguous(memory_format=torch.channels_last)


def run_stage(steps: Sequence[T.Transform], images: torch.Tensor, factors: Sequence[np.ndarray | None]) -> torch.Tensor:
    """``steps`` (a tail from :func:`stage_start`) on ``images`` ``[B, C, H, W]``; ``factors[i]``:
    step ``i``'s ``[B, draws]`` rows (``None`` for a deterministic step). ``images`` is never
    written: a step writes in place (:data:`_IN_PLACE`) only a dense tensor an earlier step made."""
    source = images.untyped_storage().data_ptr()
    for t, f in zip(steps, factors, strict=True):
        lowering = STAGE.lookup(t)
        if images.untyped_storage().data_ptr() != source and _dense(images):  # the stage's own tensor
            lowering = _IN_PLACE.get(lowering, lowering)
        images = lowering(t, images, f)
    return images
