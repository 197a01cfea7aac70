"""TrivialAugmentWide on a batch of decoded images: DALI's lowering (gpupipe's graph, a conditional
branch per operation family) against the same draws applied as batched torch kernels, on each
device present.

    python bench/policy_stage.py                          # each device present
    python bench/policy_stage.py --device cpu --quick     # a smoke run

The question it answers (issue 37): on a GPU, where a DALI operator costs far more than a torch
kernel launch (``bench/operator_cost.py``), would the policy run faster as a torch stage after
DALI's decode and crop than as DALI's 70-odd operators? (One H100, 2026-11-27: yes, 2.95 against
5.81 ms per batch of 256, but both far under the batch's 21 ms, and the V2 recipe ran 0.95x train
without it: ``bench/results/2026-11-27-h100-gpu-run.md``.) Both sides get the same batch of B uint8
images (H x W x 3, already decoded) and the same draws (gpupipe's, of samples 0..B-1). Reported:
ms per batch of each (DALI's net of a pass-through of the same input), and how far each is from
the torch backend, which applies torchvision's kernels sample by sample: the batched kernels
replicate torchvision's arithmetic, so 0 values apart but where a library computes differently
on a device (stated with the figures).

The batched kernels apply each operation once to the samples that drew it, with per-sample
magnitudes: the affine maps are torchvision's ``_get_inverse_affine_matrix`` vectorized over the
samples (its float64 arithmetic, then float32, as it builds ``theta``), sampled by one
``grid_sample``; the blends write torchvision's fused ``x·r + y·(1 − r)`` (``mul`` then
``add_(alpha=)``) in float64, which is exact here and then rounds once, as the fused kernel does.
Results go to ``bench/results/<date>-policy-stage-<machine>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as nnf
from torchvision.transforms.v2 import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish
from _timing import devices, ms_per_call

from gpupipe import transforms as T
from gpupipe.transforms._policies import OPS

# ------------------------------------------------------------------ batched kernels --

# A sample's parameters, one float32 row per sample computed on the host and sent to the device
# in one copy (no copy per operation, so the stage never waits for the device): the inverse
# affine map (6), then the blend's ratio and 1 − ratio, solarize's threshold, posterize's mask.
THETA, RATIO, ALPHA, THRESHOLD, MASK, WIDTH = slice(0, 6), 6, 7, 8, 9, 10
GEOMETRY = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
QUARTERS = {0.0: 0, 90.0: 1, 180.0: 2, 270.0: 3}  # rotate's exact fast paths (90 and 270: square images)


def _inverse_affine(cx: Any, cy: Any, angle: Any, tx: Any, ty: Any, shear_x: Any, shear_y: Any) -> np.ndarray:
    """torchvision's ``_get_inverse_affine_matrix`` (scale 1), per sample: float64 ``[n, 6]``."""
    rot, sx, sy = np.radians(angle), np.radians(shear_x), np.radians(shear_y)
    cos_sy, tan_sx, rot_minus_sy = np.cos(sy), np.tan(sx), rot - sy
    cxt, cyt = cx + tx, cy + ty
    a = np.cos(rot_minus_sy) / cos_sy
    b = -(a * tan_sx + np.sin(rot))
    c = np.sin(rot_minus_sy) / cos_sy
    d = np.cos(rot) - c * tan_sx
    m0, m1, m3, m4 = d / 1.0, -b / 1.0, -c / 1.0, a / 1.0
    m2 = 0.0 + (cx - m0 * cxt - m1 * cyt)
    m5 = 0.0 + (cy - m3 * cxt - m4 * cyt)
    return np.stack(np.broadcast_arrays(m0, m1, m2, m3, m4, m5), axis=1)


def _table(codes: np.ndarray, mags: np.ndarray, h: int, w: int) -> np.ndarray:
    """float64 ``[B, WIDTH]``: each sample's parameters for the operation it drew, as
    torchvision's policies compute them (shears ``atan(m)`` in degrees about the top-left corner,
    translations ``int(m)``, rotations about the centre, factors ``1 + m``, solarize's threshold
    ``255·m``, posterize's mask of ``int(m)`` bits)."""
    n, zero = len(codes), np.zeros(len(codes))
    names = np.array(OPS, dtype=object)[codes]
    table = np.zeros((n, WIDTH))
    degrees = np.degrees(np.arctan(mags))
    corner = (np.full(n, 0.0 - w * 0.5), np.full(n, 0.0 - h * 0.5))  # center=[0, 0], relative to the centre
    maps = {
        "ShearX": _inverse_affine(*corner, zero, zero, zero, degrees, zero),
        "ShearY": _inverse_affine(*corner, zero, zero, zero, zero, degrees),
        "TranslateX": _inverse_affine(zero, zero, zero, np.trunc(mags), zero, zero, zero),
        "TranslateY": _inverse_affine(zero, zero, zero, zero, np.trunc(mags), zero, zero),
        "Rotate": _inverse_affine(zero, zero, -np.mod(mags, 360.0), zero, zero, zero, zero),
    }
    for name, m in maps.items():
        table[names == name, THETA] = m[names == name]
    ratio = 1.0 + mags
    table[:, RATIO], table[:, ALPHA] = np.float32(ratio), np.float32(1.0 - ratio)
    table[:, THRESHOLD] = np.float32(255.0 * mags)
    bits = np.clip(np.trunc(mags), 0, 8).astype(np.int64)
    table[:, MASK] = ((1 << bits) - 1) << (8 - bits)
    return table


def _groups(codes: np.ndarray, mags: np.ndarray, square: bool) -> np.ndarray:
    """Each sample's group: its operation, and for Rotate whether an exact quarter turn (a
    transpose, as torchvision's fast paths) — ``code * 8 + k``."""
    turn = np.mod(mags, 360.0)
    quarter = np.zeros(len(codes), dtype=np.int64)
    for angle, k in QUARTERS.items():
        if k in (1, 3) and not square:
            continue
        quarter[turn == angle] = 1 + k
    return codes * 8 + np.where(codes == OPS.index("Rotate"), quarter, 0)


@functools.cache
def _constants(device: torch.device, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On ``device``, once: torchvision's base grid of an ``h`` x ``w`` image, its divisor, and
    the sharpness kernel (a constant copied to a device per batch would wait for the device)."""
    base = torch.empty(1, h, w, 3, dtype=torch.float32, device=device)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=device))
    base[..., 1].copy_(torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    a, b = 1.0 / 13.0, 5.0 / 13.0
    kernel = torch.tensor([[a, a, a], [a, b, a], [a, a, a]], dtype=torch.float32, device=device)
    return base, torch.tensor([0.5 * w, 0.5 * h], device=device), kernel.expand(3, 1, 3, 3)


def _warp(x: torch.Tensor, theta: torch.Tensor, mode: str) -> torch.Tensor:
    """torchvision's ``_affine_grid`` and ``_apply_grid_transform`` (no fill: zeros) with one map
    per sample (``theta`` ``[n, 6]`` float32)."""
    n, _, h, w = x.shape
    base, divisor, _ = _constants(x.device, h, w)
    scaled = theta.reshape(n, 2, 3).transpose(1, 2).div(divisor)
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(scaled).view(n, h, w, 2)
    out = nnf.grid_sample(x.to(torch.float32), grid, mode=mode, padding_mode="zeros", align_corners=False)
    return out.round_().to(x.dtype)


def _column(p: torch.Tensor, i: int) -> torch.Tensor:
    return p[:, i].view(-1, 1, 1, 1)


def _fused_blend(x: torch.Tensor, y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_blend`` for uint8 ``x``: ``x.mul(r).add_(y, alpha=1 − r)`` clamped and
    truncated, ``r`` per sample (``y`` float32). The product ``y·(1 − r)`` of two float32 values
    is exact in float64 and so is its sum with ``x·r``: one rounding to float32, as the fused
    kernel's."""
    out = (x.to(torch.float32) * _column(p, RATIO)).double().add_(y.double() * _column(p, ALPHA).double()).float()
    return out.clamp_(0, 255).to(x.dtype)


def _gray(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(-3).floor_()


def _sharpness(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """torchvision's ``adjust_sharpness_image`` with a factor per sample."""
    kernel = _constants(x.device, *x.shape[-2:])[2]
    out = x.to(torch.float32)
    blurred = nnf.conv2d(out, kernel, groups=3).round_()
    view = out[..., 1:-1, 1:-1]
    view.copy_(view.double().add_(blurred.sub_(view).double() * _column(p, ALPHA).double()).float())
    return out.clamp_(0, 255).to(x.dtype)


def _autocontrast(x: torch.Tensor) -> torch.Tensor:
    """torchvision's ``autocontrast_image`` with ``torch.where`` for its masked assignments (which
    would wait for the device): the same arithmetic."""
    f = x.to(torch.float32)
    low, high = f.amin(dim=(-2, -1), keepdim=True), f.amax(dim=(-2, -1), keepdim=True)
    flat = high == low
    inv_scale = torch.where(flat, 1.0, high.sub(low).mul_(1.0 / 255.0))
    return f.sub_(torch.where(flat, 0.0, low)).div_(inv_scale).clamp_(0, 255).to(x.dtype)


def _kernels(mode: str) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    def contrast(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return _fused_blend(x, torch.mean(_gray(x), dim=(-3, -2, -1), keepdim=True), p)

    def solarize(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.where(x >= _column(p, THRESHOLD), 255 - x, x)

    def brightness(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32) * _column(p, RATIO)).clamp_(0, 255).to(x.dtype)

    kernels: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        name: (lambda x, p: _warp(x, p[:, THETA], mode)) for name in GEOMETRY
    }
    return kernels | {
        "Brightness": brightness,
        "Color": lambda x, p: _fused_blend(x, _gray(x), p),
        "Contrast": contrast,
        "Sharpness": _sharpness,
        "Posterize": lambda x, p: x & _column(p, MASK).to(torch.uint8),
        "Solarize": solarize,
        "AutoContrast": lambda x, p: _autocontrast(x),
        "Equalize": lambda x, p: F.equalize(x),
    }


def batched_policy(images: torch.Tensor, codes: np.ndarray, mags: np.ndarray, mode: str) -> torch.Tensor:
    """One slot of a policy on ``images`` ``[B, 3, H, W]`` uint8: each operation once, on the
    samples that drew it (``codes``, ``mags``: ``[B]``). The host sorts the samples by operation
    and sends their order and parameters to the device in one copy each; every operation then
    takes a contiguous slice of them."""
    h, w = images.shape[-2:]
    groups = _groups(codes, mags, h == w)
    order = np.argsort(groups, kind="stable")
    bounds = np.flatnonzero(np.diff(groups[order])) + 1
    table = _table(codes, mags, h, w)[order].astype(np.float32)
    cuda = images.is_cuda
    index, params = (torch.from_numpy(a) for a in (order, table))
    if cuda:
        index, params = (t.pin_memory().to(images.device, non_blocking=True) for t in (index, params))
    kernels = _kernels(mode)
    out = images.clone()
    for start, stop in zip([0, *bounds.tolist()], [*bounds.tolist(), len(order)], strict=True):
        group = int(groups[order[start]])
        name, k = OPS[group // 8], group % 8
        if name == "Identity" or (name == "Rotate" and k == 1):  # a turn of 0 degrees: the image
            continue
        idx = index[start:stop]
        x = images.index_select(0, idx)
        if name == "Rotate" and k > 1:
            y = torch.rot90(x, k=k - 1, dims=(-2, -1))
        else:
            y = kernels[name](x, params[start:stop])
        out.index_copy_(0, idx, y)
    return out


# ------------------------------------------------------------------------- the runs --


def draws(t: Any, n: int, h: int, w: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The factors of samples ``0..n-1`` (every backend's), and their codes and magnitudes."""
    from gpupipe.core._random import factors

    (f,) = factors([t], seed, 0, list(range(n)))
    codes, mags = t.magnitudes(h, w, f)
    return f, codes[:, 0], mags[:, 0]


def per_sample(t: Any, images: torch.Tensor, factors: np.ndarray) -> torch.Tensor:
    """The torch backend: torchvision's kernels, sample by sample."""
    from gpupipe.backends._torch._kernels import apply_pipeline

    return torch.stack([apply_pipeline([t], images[i], [factors[i]]) for i in range(len(images))])


def dali_pipeline(t: Any | None, batch: list[np.ndarray], factors: np.ndarray, *, gpu: bool, threads: int) -> Any:
    """A built DALI pipeline of gpupipe's lowering of ``t`` (``None``: a pass-through) on the fed
    HWC batch, and a function that runs one iteration (feeding the batch and the host's values)."""
    from nvidia.dali import Pipeline, fn, types

    from gpupipe.backends._dali._compiler import Ctx, _lower_images
    from gpupipe.backends._dali._host import HostEnv, evaluate

    n = len(batch)
    pipe = Pipeline(batch_size=n, num_threads=threads, device_id=0 if gpu else None, exec_dynamic=True,
                    prefetch_queue_depth=2)  # fmt: skip
    ctx = Ctx("gpu" if gpu else "cpu", 0)
    with pipe:
        images = fn.external_source(name="images", device="gpu" if gpu else "cpu", layout="HWC", dtype=types.UINT8)
        out = images if t is None else _lower_images([t], None, ctx, channels_last=True, decoded=images)
        pipe.set_outputs(out)
    pipe.build()
    sizes = np.array([img.shape[:2] for img in batch], dtype=np.int64)
    inputs = {"images": batch, **evaluate(ctx.feeds, HostEnv(sizes, lambda view, step: factors), n)}

    def feed() -> None:
        for name, value in inputs.items():
            pipe.feed_input(name, value)

    for _ in range(2):  # the prefetch queue's depth: fed ahead, as the loader's runner feeds
        feed()

    def run() -> Any:
        out = pipe.run()[0]
        feed()
        return out

    return run


def apart(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    """Share of values apart and the largest difference."""
    d = (got.int() - want.int()).abs()
    return float((d > 0).double().mean()), int(d.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="all", choices=("all", "cpu", "gpu"))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--size", type=int, default=176, help="images of size x size (the V2 recipe's crop)")
    parser.add_argument("--interpolation", default="bilinear", choices=("bilinear", "nearest"))
    parser.add_argument("--threads", type=int, default=8, help="DALI's threads")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 16 of 32 x 32")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    if args.quick:
        args.batch_size, args.size, args.iters = 16, 32, 2
    cuda = torch.cuda.is_available()
    chosen = devices(parser, args.device)
    from gpupipe.testing import synthetic_image

    n, size = args.batch_size, args.size
    t = T.TrivialAugmentWide(interpolation=T.InterpolationMode(args.interpolation))
    hwc = [np.ascontiguousarray(synthetic_image(i, size=(size, size))) for i in range(n)]
    factors, codes, mags = draws(t, n, size, size)
    results: list[dict[str, Any]] = []
    for device in chosen:
        gpu = device == "gpu"
        where = torch.device("cuda" if gpu else "cpu")
        images = torch.from_numpy(np.stack(hwc)).permute(0, 3, 1, 2).contiguous().to(where)
        want = per_sample(t, images, factors)
        got = batched_policy(images, codes, mags, args.interpolation)
        torch_ms = ms_per_call(functools.partial(batched_policy, images, codes, mags, args.interpolation), args.iters)
        through = ms_per_call(dali_pipeline(None, hwc, factors, gpu=gpu, threads=args.threads), args.iters)
        run = dali_pipeline(t, hwc, factors, gpu=gpu, threads=args.threads)
        dali_ms = ms_per_call(run, args.iters) - through
        out = run()
        dali_out = torch.from_numpy(np.stack([np.array(s) for s in (out.as_cpu() if gpu else out)])).permute(0, 3, 1, 2)
        per_sample_ms = ms_per_call(functools.partial(per_sample, t, images, factors), max(1, args.iters // 4))
        for impl, ms, value in (("torch, batched", torch_ms, got.cpu()), ("DALI, gpupipe's graph", dali_ms, dali_out),
                                ("torch backend, per sample", per_sample_ms, want.cpu())):  # fmt: skip
            share, largest = apart(value, want.cpu())
            results.append({"device": device, "impl": impl, "ms": ms, "apart": share, "max_diff": largest})
            print(json.dumps(results[-1]), flush=True)
    machine = torch.cuda.get_device_name() if cuda else f"{os.cpu_count()}-core CPU"
    name = "policy-stage-" + machine.replace(" ", "-").lower() + ("-quick" if args.quick else "")
    import nvidia.dali

    ops = {OPS[c]: int((codes == c).sum()) for c in np.unique(codes).tolist()}
    intro = (f"{machine}; DALI {nvidia.dali.__version__}, torch {torch.__version__}; TrivialAugmentWide "
             f"({args.interpolation}) on a batch of {n} uint8 images of {size} x {size}, already decoded, gpupipe's "
             f"draws of samples 0..{n - 1} ({ops}); {args.threads} DALI threads; {args.iters} iterations after 3. "
             "ms per batch (DALI's net of a pass-through of the same input), and the values apart from the torch "
             "backend's (torchvision's kernels, sample by sample) (`bench/policy_stage.py`).")  # fmt: skip
    header = ["device", "implementation", "ms per batch", "values apart", "largest difference"]
    rows = [[r["device"], r["impl"], f"{r['ms']:.2f}", f"{r['apart']:.2%}", str(r["max_diff"])] for r in results]
    data = {"machine": machine, "batch_size": n, "size": size, "interpolation": args.interpolation,
            "operations": ops, "results": results}  # fmt: skip
    path = publish(args.out, name, f"TrivialAugmentWide as batched torch kernels or DALI's graph, {machine}", intro,
                   header, rows, data)  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
