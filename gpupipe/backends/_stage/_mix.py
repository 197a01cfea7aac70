"""Batch transforms (``gpupipe.transforms.MixUp``, ``CutMix``, ``RandomChoice``) applied to a
batch by the stage (:meth:`Stage.finish`, after the views' tails): one torch kernel for every
backend, after batching, never per-sample Python.

The parameters come from :meth:`BatchTransform.sample` with the batch's generator
(``gpupipe.core._random.batch_generator``); :func:`mix` applies them. Only valid rows (``batch.valid``)
mix: each with the valid row before it (the first with the last), as torchvision's
``roll(1, 0)`` pairs them; padding and skipped samples are neither mixed nor partners, and keep
their own (one-hot) labels. With every row valid this is torchvision's ``MixUp``/``CutMix``
exactly (tested).

On a GPU the host never waits for the device: the per-row values reach it through pinned memory
(``_kernels.upload``) and nothing is read back (boolean-mask writes would be: ``torch.where``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ...core._random import batch_generator
from ...runtime._threads import one_intraop_thread
from ...transforms._batch import BatchTransform, MixParams
from ._kernels import upload

__all__ = ["apply_batch", "mix", "soft_labels"]


def apply_batch(t: BatchTransform, images: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, *, seed: int,
                epoch: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``t`` on one batch (images ``[B, C, H, W]``, class labels ``[B]``, ``valid`` ``[B]``):
    images of the same shape and float32 soft labels ``[B, num_classes]``.

    On the CPU it runs on the calling thread alone (:func:`~gpupipe.runtime._threads.one_intraop_thread`):
    the mix is bound by memory bandwidth, and torch's intra-op team, spinning between steps, would
    take the cores from the loader's own threads (11-18 ms of CPU per batch on a 2-core VM)."""
    rng = batch_generator(seed, epoch, rank, batch)
    params = t.sample(rng, images.shape[0], images.shape[-2], images.shape[-1])
    assert t.num_classes is not None  # checked when constructed
    with one_intraop_thread() if images.device.type == "cpu" else contextlib.nullcontext():
        return mix(images, labels, valid, params, num_classes=t.num_classes, smoothing=t.label_smoothing)


def soft_labels(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """Class indices ``[B]`` as float32 ``[B, num_classes]`` one-hot rows, smoothed as timm does
    (``1 − ε + ε/K`` and ``ε/K``)."""
    out = torch.nn.functional.one_hot(labels, num_classes).float()
    return out * (1.0 - smoothing) + smoothing / num_classes if smoothing else out


def mix(images: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, params: MixParams, *, num_classes: int,
        smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Applies ``params`` to the valid rows (in place on ``images``); returns the images and the
    soft labels. ``valid``: host memory (a device mask is read back)."""
    soft = soft_labels(labels, num_classes, smoothing)
    rows = np.flatnonzero(valid.cpu().numpy())
    if len(rows) < 2:  # a sample alone mixes with itself: unchanged
        return images, soft
    if len(rows) == len(valid):
        return _all_valid(images, soft, params), soft
    device = images.device
    index, other = upload(np.stack([rows, np.roll(rows, 1)]), device)  # one copy
    keep, give = _weights(params.lam[rows], device)
    soft[index] = soft[other].mul(give).add_(soft[index].mul(keep))
    mine, theirs = images[index], images[other]
    cut = params.cut[rows]
    out = mine.clone()
    shape = (-1,) + (1,) * (images.dim() - 1)
    if (~cut).any():
        blend = np.flatnonzero(~cut)
        on = upload(blend, device)
        out[on] = theirs[on].mul(give[on].view(shape)).add_(mine[on].mul(keep[on].view(shape)))
    if cut.any():
        out = torch.where(_inside(params.box[rows], cut, images)[:, None], theirs, out)
    images[index] = out
    return images, soft


def _weights(lam: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's own share and its partner's, ``[n, 1]`` float32, as torchvision's scalars give
    them (``λ`` and ``1 − λ`` in float64, then cast)."""
    lam = np.asarray(lam, dtype=np.float64)
    keep, give = upload(np.stack([lam.astype(np.float32), (1.0 - lam).astype(np.float32)])[..., None], device)
    return keep, give


def _inside(boxes: np.ndarray, cut: np.ndarray, images: torch.Tensor) -> torch.Tensor:
    """``[n, H, W]`` bool: each pixel inside its row's box ``(x1, y1, x2, y2)``, for the rows that
    ``cut``."""
    device = images.device
    height, width = images.shape[-2], images.shape[-1]
    box = upload(np.asarray(boxes, dtype=np.int64), device)
    ys = torch.arange(height, device=device)[None, :, None]
    xs = torch.arange(width, device=device)[None, None, :]
    x1, y1, x2, y2 = (box[:, i, None, None] for i in range(4))
    return (ys >= y1) & (ys < y2) & (xs >= x1) & (xs < x2) & upload(cut, device)[:, None, None]


def _all_valid(images: torch.Tensor, soft: torch.Tensor, params: MixParams) -> torch.Tensor:
    """:func:`mix` where every row is valid (nearly every batch), in place, with torchvision's
    arithmetic: the training thread's share of the work, so with at most one copy of the batch
    (MixUp: the partners' share, ``x[i - 1] · (1 − λ)``, rolled and scaled in one pass; CutMix
    with one box: the box's slice only). On 64 x 3 x 176 x 176, one thread: MixUp 6.0 → 5.1 ms,
    CutMix 4.4 → 2.2 ms (2026-11-26)."""
    keep, give = _weights(params.lam, images.device)
    soft.copy_(soft.roll(1, 0).mul_(give).add_(soft.mul(keep)))
    cut = np.asarray(params.cut, dtype=bool)
    shape = (-1,) + (1,) * (images.dim() - 1)
    if not cut.any():  # MixUp: the partners' share written as it is rolled (one pass less)
        theirs = torch.empty_like(images)
        torch.mul(images[:-1], give[1:].view(shape), out=theirs[1:])
        torch.mul(images[-1:], give[:1].view(shape), out=theirs[:1])
        return images.mul_(keep.view(shape)).add_(theirs)
    if cut.all() and bool((params.box == params.box[:1]).all()):  # CutMix, one box: that slice rolled
        left, top, right, bottom = (int(v) for v in params.box[0])
        images[..., top:bottom, left:right] = images[..., top:bottom, left:right].roll(1, 0)
        return images
    theirs = images.roll(1, 0)
    inside = _inside(params.box, cut, images)
    if (~cut).any():  # timm's per-sample mode: some rows blend, the others cut
        rows = upload(np.flatnonzero(~cut), images.device)
        images[rows] = images[rows].mul_(keep[rows].view(shape)).add_(theirs[rows].mul(give[rows].view(shape)))
    return images.copy_(torch.where(inside[:, None], theirs, images))
