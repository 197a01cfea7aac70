"""The stage's batched kernels: torchvision's uint8 image kernels over ``[n, C, H, W]``, in
torchvision's arithmetic, so that each sample's values are the ones its per-sample kernel gives
(tested on every operation and bin against ``torchvision.transforms.v2.functional``).

A parameter is one Python number for the whole batch (torchvision's own scalar operations, the
fastest on a CPU) or one per sample (an ``[n]`` tensor on the images' device: one launch per
operation on a GPU, whatever the samples drew). Where torchvision's kernel takes a Python float it
casts it to float32 inside the operation; a per-sample tensor is cast the same way (``float32``).
Where it fuses a multiply into an add (``add_(y, alpha=a)``: one rounding of ``x + a·y``), a
per-sample ``a`` takes the float64 sum of two float32 products, which is exact, and rounds once to
the same float32. Conditional writes are ``torch.where``, never a masked assignment, which would
wait for the device. Host values reach the device through :func:`upload` (pinned memory, queued on
the stream) and constants through :func:`constant` (made once), so the host never waits for the
device's queued work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as nnf

__all__ = ["GPU_WAY", "gpu_way", "warp", "brightness", "saturation", "contrast", "blends", "sharpness", "posterize",
           "solarize", "solarize_add", "autocontrast", "equalize", "invert", "column", "Param", "RowsFn", "on_rows",
           "upload", "constant"]  # fmt: skip

Param = float | int | torch.Tensor  # one value for the batch, or ``[n]`` per sample

# The GPU's way (``None``: on every device but the CPU): where a kernel launch costs more than its
# arithmetic, each operation runs once per batch with per-sample tensor arguments, and rows are
# gathered and scattered by index tensors; on the CPU, once per operation and value with
# torchvision's scalar calls, rows written one by one. Tests set it to check the GPU's way, value
# for value, on the CPU.
GPU_WAY: bool | None = None


def gpu_way(device: torch.device) -> bool:
    """Whether the stage batches ``device``'s work the GPU's way (:data:`GPU_WAY`)."""
    return device.type != "cpu" if GPU_WAY is None else GPU_WAY


def upload(values: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host ``values`` on ``device``, cast to ``dtype`` on the host first (the cast a copy would
    make). On a GPU through pinned memory, the copy queued on the current stream: a copy from
    pageable memory first waits for the stream's queued work, and the stage's did so 135 times per
    batch of timm's recipe (H200, 2026-11-28). The caching host allocator keeps the pinned block
    until the copy has run. On the CPU: the values themselves, not copied."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type == "cpu":
        return host
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


@functools.cache  # never evicted: a later stream may still read one (few keys)
def constant(device: torch.device, values: tuple[float, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values`` as a tensor on ``device``, made once per device, values and dtype (one made from
    Python values per batch would wait for the device's queued work). Read-only."""
    return torch.tensor(values, dtype=dtype, device=device)


def column(values: Param, like: torch.Tensor) -> Param:
    """``[n]`` per-sample values as ``[n, 1, 1, 1]``, to broadcast over ``like`` ``[n, C, H, W]``;
    a number as it is."""
    return _column(values, like) if isinstance(values, torch.Tensor) else values


def _column(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.view(-1, *([1] * (like.dim() - 1)))


# (the rows' images [n, C, H, W], the rows' positions in the batch [n]) -> the rows' new images
RowsFn = Callable[[torch.Tensor, np.ndarray], torch.Tensor]


def on_rows(images: torch.Tensor, groups: Iterable[tuple[np.ndarray, RowsFn]]) -> torch.Tensor:
    """Each group's function on its rows of ``images`` (a gather, the function, a scatter), the
    other rows as they are; the groups' rows are disjoint, so every function reads the input.
    ``images`` itself where no group has a row; the function on the whole batch, with no gather,
    where one group has them all; else one copy of the batch, written group by group."""
    taken = [(rows, fn) for rows, fn in groups if len(rows)]
    if not taken:
        return images
    if len(taken) == 1 and len(taken[0][0]) == len(images):
        return taken[0][1](images, taken[0][0])
    out = images.clone()
    indices = upload(np.concatenate([rows for rows, _ in taken]), images.device)  # one copy for every group
    for (rows, fn), index in zip(taken, torch.split(indices, [len(rows) for rows, _ in taken]), strict=True):
        new = fn(images.index_select(0, index), rows)
        if gpu_way(images.device):
            out.index_copy_(0, index, new)
        else:  # row by row: on a CPU index_copy_ ran ~10x slower (2 cores, 2026-11-28)
            for k, i in enumerate(rows.tolist()):
                out[i].copy_(new[k])
    return out


@functools.lru_cache(maxsize=64)
def _base_grid(device: torch.device, h: int, w: int) -> torch.Tensor:
    """torchvision's ``_affine_grid`` base: ``[1, h·w, 3]`` float32 pixel centres about the image's
    centre, and ones; made once per device and size (a constant copied per batch would wait)."""
    base = torch.empty(1, h, w, 3, dtype=torch.float32, device=device)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=device))
    base[..., 1].copy_(torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    return base.view(1, h * w, 3)


def warp(x: torch.Tensor, theta: torch.Tensor, *, mode: str, fill: tuple[float, ...] | None) -> torch.Tensor:
    """torchvision's ``affine_image``/``rotate_image`` (no expand) with one inverse map per
    sample: ``theta`` ``[n, 6]`` float32 (torchvision's ``_get_inverse_affine_matrix``, cast as it
    casts it); ``mode`` ``"nearest"`` or ``"bilinear"``; ``fill`` ``None`` (zeros) or one value per
    channel (torchvision's mask channel: nearest takes the fill where the mask is under 0.5,
    bilinear blends ``mask·(img − fill) + fill``)."""
    n, c, h, w = x.shape
    divisor = constant(x.device, (0.5 * w, 0.5 * h))
    scaled = theta.reshape(n, 2, 3).transpose(1, 2).div(divisor)
    grid = _base_grid(x.device, h, w).expand(n, -1, -1).bmm(scaled).view(n, h, w, 2)
    img = x.to(torch.float32)
    if fill is not None:
        img = torch.cat((img, torch.ones((n, 1, h, w), dtype=torch.float32, device=x.device)), dim=1)
    img = nnf.grid_sample(img, grid, mode=mode, padding_mode="zeros", align_corners=False)
    if fill is not None:
        img, mask = torch.tensor_split(img, indices=(-1,), dim=-3)
        mask = mask.expand_as(img)
        fill_img = constant(x.device, fill if len(fill) == c else fill * c).view(1, -1, 1, 1)
        if mode == "nearest":
            img = torch.where(mask < 0.5, fill_img.expand_as(img), img)
        else:
            img = img.sub_(fill_img).mul_(mask).add_(fill_img)
    return img.round_().to(x.dtype)


def _fused_blend(x: torch.Tensor, y: torch.Tensor, ratio: Param, alpha: Param) -> torch.Tensor:
    """torchvision's ``_blend``: ``x.mul(r).add_(y, alpha=1 − r)`` clamped and truncated to
    uint8; per sample, ``ratio`` and ``alpha`` ``[n]`` float32 (``alpha``: ``1 − r`` in float64,
    then float32, as torch casts the Python float)."""
    if not isinstance(ratio, torch.Tensor) and not isinstance(alpha, torch.Tensor):
        return x.mul(ratio).add_(y, alpha=alpha).clamp_(0, 255).to(x.dtype)
    assert isinstance(ratio, torch.Tensor) and isinstance(alpha, torch.Tensor)
    product = x.to(torch.float32) * _column(ratio, x)
    out = product.double().add_(y.double() * _column(alpha, x).double()).float()
    return out.clamp_(0, 255).to(x.dtype)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """torchvision's luma of a uint8 RGB batch, float32 ``[n, 1, H, W]``, floored."""
    r, g, b = x.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(-3).floor_()


def brightness(x: torch.Tensor, factor: Param) -> torch.Tensor:
    """``adjust_brightness_image``: ``x·f`` clamped, truncated; per sample, ``factor`` float32."""
    if not isinstance(factor, torch.Tensor):
        return x.mul(factor).clamp_(0, 255).to(x.dtype)
    return (x.to(torch.float32) * column(factor, x)).clamp_(0, 255).to(x.dtype)


def saturation(x: torch.Tensor, ratio: Param, alpha: Param) -> torch.Tensor:
    """``adjust_saturation_image``: the blend with the floored luma (1 channel: unchanged)."""
    return x if x.shape[-3] == 1 else _fused_blend(x, _gray(x), ratio, alpha)


def contrast(x: torch.Tensor, ratio: Param, alpha: Param) -> torch.Tensor:
    """``adjust_contrast_image``: the blend with the mean of the floored luma (1 channel: of the
    image)."""
    gray = _gray(x) if x.shape[-3] == 3 else x.to(torch.float32)
    return _fused_blend(x, torch.mean(gray, dim=(-3, -2, -1), keepdim=True), ratio, alpha)


@functools.lru_cache(maxsize=16)
def _smoothing(device: torch.device, channels: int) -> torch.Tensor:
    a, b = 1.0 / 13.0, 5.0 / 13.0
    kernel = torch.tensor([[a, a, a], [a, b, a], [a, a, a]], dtype=torch.float32, device=device)
    return kernel.expand(channels, 1, 3, 3)


def blends(x: torch.Tensor, kinds: np.ndarray, ratio: Param, alpha: Param) -> torch.Tensor:
    """Each sample's own blend of torchvision's three in one pass: ``kinds[i]`` 0 brightness (with
    0: ``x·r``, the same float32 product), 1 contrast, 2 saturation (3 channels only: on one,
    saturation leaves the image as it is, so none is given)."""
    if x.shape[-3] == 1:
        assert not (kinds == 2).any(), "saturation of one channel changes nothing"
    if not ((kinds == 1) | (kinds == 2)).any():
        return brightness(x, ratio)
    gray = _gray(x) if x.shape[-3] == 3 else x.to(torch.float32)
    kind = upload(kinds.astype(np.uint8), x.device).view(-1, 1, 1, 1)
    mean = torch.mean(gray, dim=(-3, -2, -1), keepdim=True)
    target = torch.where(kind == 2, gray, torch.where(kind == 1, mean, 0.0))
    return _fused_blend(x, target, ratio, alpha)


def sharpness(x: torch.Tensor, alpha: Param) -> torch.Tensor:
    """``adjust_sharpness_image``: the interior blended with its rounded 3x3 smoothing,
    ``v + (1 − f)·(blurred − v)`` (one rounding); images of 2 pixels a side or less unchanged."""
    c, h, w = x.shape[-3:]
    if h <= 2 or w <= 2:
        return x
    out = x.to(torch.float32)
    blurred = nnf.conv2d(out, _smoothing(x.device, c), groups=c).round_()
    view = out[..., 1:-1, 1:-1]
    if not isinstance(alpha, torch.Tensor):
        view.add_(blurred.sub_(view), alpha=alpha)
    else:
        view.copy_(view.double().add_(blurred.sub_(view).double() * _column(alpha, x).double()).float())
    return out.clamp_(0, 255).to(x.dtype)


def posterize(x: torch.Tensor, mask: Param) -> torch.Tensor:
    """``posterize_image``: ``x & mask``; per sample, ``mask`` uint8 (255 where bits >= 8)."""
    return x & column(mask, x)


def solarize(x: torch.Tensor, threshold: Param) -> torch.Tensor:
    """``solarize_image``: ``255 − x`` where ``x >= threshold`` (compared in float32; above 255:
    nothing)."""
    return torch.where(x >= column(threshold, x), x.bitwise_not(), x)


def solarize_add(x: torch.Tensor, addend: Param) -> torch.Tensor:
    """timm's SolarizeAdd: ``min(255, x + addend)`` where ``x < 128``; per sample, int32."""
    added = (x.to(torch.int32) + column(addend, x)).clamp_(max=255).to(x.dtype)
    return torch.where(x < 128, added, x)


def autocontrast(x: torch.Tensor) -> torch.Tensor:
    """``autocontrast_image``: each channel stretched to 0..255 (a flat channel unchanged)."""
    f = x.to(torch.float32)
    low, high = f.amin(dim=(-2, -1), keepdim=True), f.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    inv_scale = torch.where(flat, 1.0, high.sub(low).mul_(1.0 / 255.0))
    return f.sub_(torch.where(flat, 0.0, low)).div_(inv_scale).clamp_(0, 255).to(x.dtype)


def equalize(x: torch.Tensor) -> torch.Tensor:
    """``equalize_image``: it works per channel of a batch already."""
    from torchvision.transforms.v2 import functional as F

    return F.equalize(x)


def invert(x: torch.Tensor) -> torch.Tensor:
    """``invert_image`` of uint8."""
    return x.bitwise_not()
