"""Masks and boxes against torchvision v2 itself (issue 39 step 5): the same geometric pipeline run
by torchvision's transform classes on ``(tv_tensors.Image, Mask, BoundingBoxes)`` with gpupipe's
draws (each class's ``make_params`` answering the sample's parameters), then
``SanitizeBoundingBoxes``, and by ``gp.Loader`` on the torch and DALI backends: masks equal,
boxes within 1e-4 of the canvas, images equal on torch (DALI's images are
``check_backend_parity``'s business)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.backends._torch._kernels import sample_factors
from gpupipe.testing import encode_jpeg, encode_png, synthetic_image

SIZE = (56, 72)  # (height, width)
FILL = 250  # the mask's fill: torchvision's per-type fill {Mask: 250}
N = 8


def _mask(i: int) -> np.ndarray:
    y, x = np.mgrid[: SIZE[0], : SIZE[1]]
    return ((y // 3 * 5 + x // 4 * 3 + i) % 200).astype(np.uint8)


def _boxes(i: int) -> np.ndarray:
    """Three boxes: one inside, one across the right edge region, one small near a corner."""
    return np.array([[6 + i, 5, 40 + i, 30 + i], [50 - i, 20, 71, 50], [1, 44, 7 + i, 54]], np.float32)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("tvt")
    with gp.ShardWriter(str(root / "t-%06d.tar"), max_count=N) as w:
        for i in range(N):
            w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=SIZE)), "seg.png": encode_png(_mask(i)),
                              "boxes.npy": _boxes(i), "labels.npy": np.arange(3, dtype=np.int64) + 10 * i})  # fmt: skip
    return w.shards


def _source(urls: list[str]) -> gp.WebDataset:
    return gp.WebDataset(urls, fields={
        "image": "jpg",
        "mask": gp.fields.Mask("seg.png", fill=FILL),
        "boxes": gp.fields.Boxes("boxes.npy", labels="labels"),
        "labels": gp.fields.Array("labels.npy"),
    })  # fmt: skip


def _fill(fill: Any) -> dict:
    return {tv_tensors.Image: fill, tv_tensors.Mask: FILL}


def _fixed(transform: v2.Transform, params: dict) -> v2.Transform:
    """``transform`` drawing ``params`` (gpupipe's) instead of its own."""
    transform.make_params = lambda flat_inputs: params
    return transform


def _center_crop(size: tuple[int, int]) -> Any:
    """``v2.CenterCrop(size)``, the mask padded with its fill: v2's pads masks with 0 (class 0 to
    a loss), gpupipe's with the mask's fill, so ``v2.Pad`` with a per-type fill first (the image
    and the boxes come out as ``v2.CenterCrop`` alone gives them)."""

    def run(sample: dict) -> dict:
        (h, w), (ch, cw) = sample["image"].shape[-2:], size
        dh, dw = max(ch - h, 0), max(cw - w, 0)
        if dh or dw:  # torchvision's centre-crop padding: the odd pixel after
            sample = v2.Pad([dw // 2, dh // 2, (dw + 1) // 2, (dh + 1) // 2], fill=_fill(0))(sample)
        return v2.CenterCrop(size)(sample)

    return run


def _torchvision(t: T.Transform, p: Any) -> list[Any]:
    """torchvision v2's transform for one of gpupipe's steps, with that step's drawn parameters."""
    mode = v2.InterpolationMode(T.InterpolationMode(getattr(t, "interpolation", "bilinear")).value)
    if isinstance(t, T.RandomApply):
        return [v for inner, q in zip(t.transforms, p.params, strict=True) for v in _torchvision(inner, q)] if p.apply \
            else []  # fmt: skip
    if isinstance(t, T.RandomResizedCrop):
        made = v2.RandomResizedCrop(t.size, scale=t.scale, ratio=t.ratio, interpolation=mode, antialias=t.antialias)
        return [_fixed(made, p._asdict())]
    if isinstance(t, T.RandomResize):
        made = v2.RandomResize(t.min_size, t.max_size, interpolation=mode, antialias=t.antialias)
        return [_fixed(made, {"size": [p.size]})]
    if isinstance(t, T.Resize):
        return [v2.Resize(t.size, interpolation=mode, max_size=t.max_size, antialias=t.antialias)]
    if isinstance(t, T.CenterCrop):
        return [_center_crop(t.size)]
    if isinstance(t, T.RandomCrop):
        made = v2.RandomCrop(t.size, fill=_fill(t.fill))
        params = dict(needs_crop=True, top=p.top, left=p.left, height=p.height, width=p.width,
                      needs_pad=any(p.padding), padding=list(p.padding))  # fmt: skip
        return [_fixed(made, params)]
    if isinstance(t, T.RandomHorizontalFlip):
        return [v2.RandomHorizontalFlip(1.0)] if p.flip else []
    if isinstance(t, T.RandomVerticalFlip):
        return [v2.RandomVerticalFlip(1.0)] if p.flip else []
    if isinstance(t, T.RandomRotation):
        made = v2.RandomRotation(t.degrees, interpolation=mode, expand=t.expand, center=t.center, fill=_fill(t.fill))
        return [_fixed(made, {"angle": p.angle})]
    if isinstance(t, T.RandomPhotometricDistort):
        params = {f"{k}_factor": getattr(p, k) for k in ("brightness", "contrast", "saturation", "hue")}
        params["contrast_before"] = p.contrast_before
        params["channel_permutation"] = None if p.permutation is None else torch.tensor(p.permutation)
        return [_fixed(v2.RandomPhotometricDistort(p=t.p), params)]
    if isinstance(t, T.RandomZoomOut):
        made = v2.RandomZoomOut(fill=_fill(t.fill), side_range=t.side_range, p=1.0)
        return [_fixed(made, {"padding": list(p.padding)})] if any(p.padding) else []
    if isinstance(t, T.RandomIoUCrop):
        if p is None:
            return []
        made = v2.RandomIoUCrop(t.min_scale, t.max_scale, t.min_aspect_ratio, t.max_aspect_ratio, t.sampler_options,
                                t.trials)  # fmt: skip
        return [_fixed(made, dict(top=p.top, left=p.left, height=p.height, width=p.width,
                                  is_within_crop_area=torch.tensor(p.within)))]  # fmt: skip
    if isinstance(t, T.RandomAffine):
        made = v2.RandomAffine(t.degrees, interpolation=mode, fill=_fill(t.fill), center=t.center)
        return [_fixed(made, p._asdict())]
    raise AssertionError(f"no torchvision counterpart written for {t}")


def _reference(steps: list[T.Transform], i: int, *, seed: int, epoch: int) -> dict:
    """Sample ``k{i}`` through torchvision v2 with gpupipe's draws (its draw number is ``i``)."""
    from gpupipe.runtime._decode import decode_rgb

    image = tv_tensors.Image(decode_rgb(encode_jpeg(synthetic_image(i, size=SIZE)), shard="-", key="-"))
    sample = {"image": image, "mask": tv_tensors.Mask(torch.from_numpy(_mask(i))[None]),
              "boxes": tv_tensors.BoundingBoxes(torch.from_numpy(_boxes(i)), format="XYXY", canvas_size=SIZE),
              "labels": torch.arange(3) + 10 * i}  # fmt: skip
    for t, f in zip(steps, sample_factors(steps, seed, epoch, i), strict=True):
        height, width = sample["image"].shape[-2:]
        if f is None:
            params = None
        elif t.uses_boxes:
            params = t.make_params(height, width, f, boxes=sample["boxes"].as_subclass(torch.Tensor).numpy())  # type: ignore[call-arg]
            sample["windowed"] = params is not None
        else:
            params = t.make_params(height, width, f)
        for made in _torchvision(t, params):
            sample = made(sample)
    sample = v2.ClampBoundingBoxes()(sample)
    return v2.SanitizeBoundingBoxes(min_size=1.0)(sample)


PIPELINES: dict[str, list[T.Transform]] = {
    "segmentation preset": [T.RandomResize(28, 112), T.RandomCrop(64, pad_if_needed=True), T.RandomHorizontalFlip()],
    "resized crop and flips": [T.RandomResizedCrop((48, 64), scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                               T.RandomVerticalFlip()],
    "rotation": [T.RandomRotation(30, fill=7), T.CenterCrop(48)],
    "affine": [T.RandomAffine(15, translate=(0.1, 0.2), scale=(0.8, 1.2), shear=(-8, 8, -4, 4)), T.Resize((40, 48))],
    "maybe rotated, padded crop": [T.RandomApply([T.RandomRotation(15)], p=0.5), T.RandomCrop((50, 70), padding=3)],
    "ssd": [T.RandomPhotometricDistort(p=1.0), T.RandomZoomOut(fill=(123, 117, 104), side_range=(1.0, 2.0)),
            T.RandomIoUCrop(), T.RandomHorizontalFlip(),
            T.Resize((48, 48))],
    "letterboxed": [T.RandomHorizontalFlip(), T.Resize(30, max_size=48), T.CenterCrop(48)],  # padded around
}  # fmt: skip


class TestAgainstTorchvisionV2:
    @pytest.mark.parametrize("backend", ["torch", "dali", pytest.param("dali-cuda", marks=pytest.mark.gpu)])
    @pytest.mark.parametrize("name", list(PIPELINES))
    def test_masks_and_boxes_as_torchvision_moves_them(self, shards, name, backend):
        if backend.startswith("dali"):
            pytest.importorskip("nvidia.dali")
        steps = PIPELINES[name]
        device = "cuda" if backend == "dali-cuda" else "cpu"
        with gp.Loader(gp.Pipeline(_source(shards), steps), 4, shuffle=False, seed=11, num_workers=0,
                       backend=backend.partition("-")[0], device=device) as loader:  # fmt: skip
            loader.set_epoch(2)
            batches = [batch.to("cpu") for batch in loader]
        dropped, windowed = 0, 0
        for batch in batches:
            for j, key in enumerate(batch.keys):
                want = _reference(steps, int(key[1:]), seed=11, epoch=2)
                canvas = max(want["image"].shape[-2:])
                if backend == "torch":
                    assert torch.equal(batch.images[j], want["image"].as_subclass(torch.Tensor)), (name, key)
                assert torch.equal(batch["mask"][j], want["mask"][0].as_subclass(torch.Tensor)), (name, key)
                count = int(batch["boxes"].lengths[j, 0])
                assert count == len(want["boxes"]), (name, key)
                got = batch["boxes"].data[j, :count]
                assert torch.allclose(got, want["boxes"].as_subclass(torch.Tensor), rtol=0, atol=1e-4 * canvas), key
                assert batch["labels"][j].tolist() == want["labels"].tolist()
                dropped += 3 - count
                windowed += int(want.get("windowed", False))
        if name in ("segmentation preset", "resized crop and flips"):
            assert dropped > 0  # some boxes left the crop: sanitized alike
        if name == "letterboxed":  # CenterCrop padded the mask with its fill (torchvision's v2.CenterCrop: 0)
            assert all(bool((batch["mask"] == FILL).any()) for batch in batches)
        if name == "ssd":
            assert windowed > 0  # cropped by their boxes' IoU (1 in 7 draws no crop: class tests)
