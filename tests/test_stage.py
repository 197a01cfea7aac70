"""The stage (issue 52): per-sample steps as batched kernels, each sample its own draws.

- Every policy operation at every bin of every space, both signs, both interpolations, with and
  without a fill, on 1 and 3 channels, square and not: a batch through ``apply_slot`` equals
  torchvision's own operation sample by sample, 0 values apart.
- Each step the stage lowers, on a batch of drawn samples: equal to the torch backend's
  per-sample kernels (themselves tested against torchvision), on the CPU here and on a GPU when
  one is present.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from gpupipe import transforms as T
from gpupipe.backends._stage import OPERATIONS, STAGE, Warp, apply_slot, run_stage, stage_start
from gpupipe.backends._torch._kernels import apply_pipeline
from gpupipe.backends._torch._policies import apply_op
from gpupipe.core._random import factors
from gpupipe.testing import synthetic_image
from gpupipe.transforms._policies import OPS, slot_magnitudes

from .test_policies import CODE, SPACES, reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def batch(n: int, h: int, w: int, *, channels: int = 3, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """``n`` photograph-like uint8 images ``[n, C, h, w]``."""
    images = [torch.from_numpy(np.ascontiguousarray(synthetic_image(seed + i, size=(h, w)))) for i in range(n)]
    out = torch.stack(images).permute(0, 3, 1, 2).contiguous()
    return (out[:, :1] if channels == 1 else out).contiguous().to(device)


def per_sample(steps: list[T.Transform], images: torch.Tensor, drawn: list[np.ndarray | None]) -> torch.Tensor:
    """The torch backend's kernels, one sample at a time (on the CPU)."""
    cpu = images.cpu()
    rows = [[None if f is None else f[i] for f in drawn] for i in range(len(cpu))]
    return torch.stack([apply_pipeline(steps, cpu[i], rows[i]) for i in range(len(cpu))])


def check_stage(steps: list[T.Transform], images: torch.Tensor, *, seed: int = 3) -> torch.Tensor:
    """``steps`` through the stage on ``images`` equal the per-sample kernels, exactly; returns
    the stage's output."""
    drawn = factors(steps, seed, 0, np.arange(len(images)))
    got = run_stage(steps, images, drawn)
    want = per_sample(steps, images, drawn)
    assert got.device == images.device and got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)
    return got


class TestEveryOperation:
    @pytest.mark.parametrize(("ours", "tv", "space", "bins", "theirs"), SPACES, ids=[s[1].__name__ for s in SPACES])
    @pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
    def test_every_bin_and_sign_is_torchvisions(self, ours, tv, space, bins, theirs, interpolation):
        """One batch per operation holds every bin at both signs; each row equals torchvision's
        own operation at that bin."""
        images = batch(2 * bins, 40, 56)
        warp = Warp(interpolation, None)
        for name in theirs:
            index = np.repeat(np.arange(bins), 2)
            sign = np.tile([1.0, -1.0], bins)
            codes = np.full(2 * bins, CODE[name])
            mags = slot_magnitudes(space, bins, codes, index, sign, 40, 56)
            got = apply_slot(images, codes, mags, warp)
            for i in range(2 * bins):
                want = reference(tv, theirs, name, bins, int(index[i]), sign[i] < 0, images[i],
                                 interpolation=v2.InterpolationMode(interpolation))  # fmt: skip
                torch.testing.assert_close(got[i], want, atol=0, rtol=0, msg=f"{name} bin {index[i]} {sign[i]}")

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("channels", [1, 3])
    @pytest.mark.parametrize("size", [(40, 56), (48, 48)], ids=["wide", "square"])
    @pytest.mark.parametrize("fill", [None, (10.0, 20.0, 30.0), (7.0,)])
    @pytest.mark.parametrize("mode", ["nearest", "bilinear"])
    def test_each_operation_with_mixed_magnitudes(self, device, channels, size, fill, mode):
        """Every operation (timm's too) on a batch whose samples drew different operations and
        magnitudes (negative, zero, quarter turns, out of range), against the torch backend's."""
        if fill is not None and channels == 1 and len(fill) == 3:
            pytest.skip("three fill values for one channel: refused when the pipeline is built")
        rng = np.random.default_rng(channels * 7 + size[0])
        mags = np.concatenate([rng.uniform(-1, 1, 6), [0.0, 90.0, 180.0, 270.0, -90.0, 360.0, 4.0, 8.0, 2.0, 1.0]])
        codes = np.repeat(np.arange(len(OPS)), len(mags))
        mags = np.tile(mags, len(OPS))
        names = np.array(OPS)[codes]
        mags = np.where(names == "Posterize", np.abs(np.trunc(mags)) % 9, mags)
        mags = np.where(names == "Rotate", mags * np.where(np.abs(mags) <= 1, 45, 1), mags)
        mags = np.where(np.isin(names, ["TranslateX", "TranslateY", "TranslateXRel", "TranslateYRel"]), mags * 9, mags)
        mags = np.where(names == "SolarizeAdd", np.abs(mags) * 50, mags)
        mags = np.where(np.isin(names, ["Brightness", "Color", "Contrast", "Sharpness"]), np.maximum(mags, -1), mags)
        order = rng.permutation(len(codes))
        codes, mags = codes[order], mags[order]
        images = batch(len(codes), *size, channels=channels, device=device)
        interpolation = T.InterpolationMode(mode)
        owner = T.TrivialAugmentWide(interpolation=interpolation, fill=fill)
        got = apply_slot(images, codes, mags, Warp.of(owner)).cpu()
        cpu = images.cpu()
        for i in range(len(codes)):
            want = apply_op(cpu[i], OPS[codes[i]], float(mags[i]), owner)
            torch.testing.assert_close(got[i], want, atol=0, rtol=0, msg=f"{OPS[codes[i]]} at {mags[i]}")

    def test_one_kernel_per_operation(self):
        assert tuple(OPERATIONS) == OPS

    def test_no_operation_is_the_same_tensor(self):
        images = batch(4, 16, 16)
        assert apply_slot(images, np.full(4, -1), np.zeros(4), Warp("nearest", None)) is images


POLICIES = [
    T.TrivialAugmentWide(),
    T.TrivialAugmentWide(interpolation="bilinear", fill=(1.0, 2.0, 3.0)),
    T.RandAugment(),
    T.RandAugment(num_ops=3, magnitude=20, interpolation="bilinear", fill=9),
    T.AutoAugment(),
    T.AutoAugment(T.AutoAugmentPolicy.SVHN),
    T.TimmRandAugment.from_config("rand-m9-mstd0.5-inc1"),
    T.TimmRandAugment.from_config("rand-m7-mstd101-n3"),
]


class TestPolicies:
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("t", POLICIES, ids=repr)
    def test_a_batch_is_the_per_sample_kernels(self, t, device):
        check_stage([t], batch(96, 36, 44, device=device))

    def test_one_channel(self):
        check_stage([T.TrivialAugmentWide()], batch(64, 32, 32, channels=1))


AUGMIX_NEAREST = T.AugMix(severity=10, mixture_width=2, chain_depth=2, all_ops=False, interpolation="nearest",
                          fill=(5.0, 6.0, 7.0))  # fmt: skip


class TestAugMix:
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("t", [T.AugMix(), AUGMIX_NEAREST], ids=repr)
    def test_a_batch_is_the_per_sample_kernels(self, t, device):
        check_stage([t], batch(48, 36, 44, device=device))


class TestToDtypeAndNormalize:
    @pytest.mark.parametrize("device", DEVICES)
    def test_after_a_policy(self, device):
        steps = [T.TrivialAugmentWide(), T.ToDtype(torch.float32, scale=True),
                 T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))]  # fmt: skip
        out = check_stage(steps, batch(32, 24, 24, device=device))
        assert out.dtype == torch.float32


class TestRandomErasing:
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("value", [0.0, (0.5, -1.0, 2.0), "random"])
    def test_after_normalize(self, device, value):
        steps = [T.ToDtype(torch.float32, scale=True), T.Normalize(mean=(0.5,), std=(0.25,)),
                 T.RandomErasing(p=0.8, value=value)]  # fmt: skip
        images = batch(64, 32, 40, device=device)
        out = check_stage(steps, images)
        erased = (out != run_stage(steps[:2], images, [None, None])).flatten(1).any(dim=1)
        assert 0.6 * 64 < int(erased.sum()) < 64  # p=0.8: some erased, not all

    def test_on_uint8(self):
        check_stage([T.RandomErasing(p=1.0, value=(7,))], batch(32, 20, 20))


class TestStageStart:
    def test_the_v2_tail(self):
        steps = [T.RandomResizedCrop(176), T.RandomHorizontalFlip(), T.TrivialAugmentWide(),
                 T.ToDtype(torch.float32, scale=True), T.Normalize(mean=(0.5,), std=(0.5,)),
                 T.RandomErasing(p=0.1)]  # fmt: skip
        assert stage_start(steps) == 2

    def test_a_tail_without_draws_stays_per_sample(self):
        steps = [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True),
                 T.Normalize(mean=(0.5,), std=(0.5,))]  # fmt: skip
        assert stage_start(steps) is None

    def test_a_step_it_does_not_lower_ends_the_tail(self):
        steps = [T.RandomResizedCrop(224), T.TrivialAugmentWide(), T.ColorJitter(0.4, 0.4, 0.4),
                 T.ToDtype(torch.float32, scale=True)]  # fmt: skip
        assert T.ColorJitter not in STAGE and stage_start(steps) is None
        assert stage_start([*steps, T.RandomErasing()]) == 3
