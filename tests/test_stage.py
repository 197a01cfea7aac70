"""The stage (issue 52): per-sample steps as batched kernels, each sample its own draws.

- Every policy operation at every bin of every space, both signs, both interpolations, with and
  without a fill, on 1 and 3 channels, square and not: a batch through ``apply_slot`` equals
  torchvision's own operation sample by sample, 0 values apart.
- Each step the stage lowers, on a batch of drawn samples: equal to the torch backend's
  per-sample kernels (themselves tested against torchvision), on the CPU here and on a GPU when
  one is present.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from gpupipe import transforms as T
from gpupipe.backends._stage import OPERATIONS, STAGE, Warp, apply_slot, run_stage, stage_start
from gpupipe.backends._torch._kernels import apply_pipeline
from gpupipe.core._random import factors
from gpupipe.testing import synthetic_image
from gpupipe.transforms._policies import OPS, slot_magnitudes

from .support.budgets import GPU_OPERATORS
from .test_policies import CODE, SPACES, reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# the kernels' tests also run the GPU's way of batching on the CPU (``_kernels.GPU_WAY``): its
# per-sample tensor arguments, grouped blur and index scatters, checked value for value in CI
GPU_WAY = "cpu-gpu-way"
WAYS = ["cpu", GPU_WAY, pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("device") == GPU_WAY:
        from gpupipe.backends._stage import _kernels

        monkeypatch.setattr(_kernels, "GPU_WAY", True)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batch(n: int, h: int, w: int, *, channels: int = 3, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """``n`` photograph-like uint8 images ``[n, C, h, w]``."""
    images = [torch.from_numpy(np.ascontiguousarray(synthetic_image(seed + i, size=(h, w)))) for i in range(n)]
    out = torch.stack(images).permute(0, 3, 1, 2).contiguous()
    return (out[:, :1] if channels == 1 else out).contiguous().to("cpu" if device == GPU_WAY else device)


def torchvision_op(img: torch.Tensor, name: str, m: float, t: Any) -> torch.Tensor:
    """The reference: operation ``name`` at magnitude ``m`` by torchvision's functional kernels,
    with the arguments torchvision's policies give them (timm's: translations by ``m`` pixels,
    SolarizeAdd ``min(255, v + m)`` below 128)."""
    kw = {"interpolation": v2.InterpolationMode(T.InterpolationMode(t.interpolation).value),
          "fill": list(t.fill) if isinstance(t.fill, tuple) else t.fill}  # fmt: skip
    degrees = math.degrees(math.atan(m))
    if name in ("ShearX", "ShearY"):
        shear = [degrees, 0.0] if name == "ShearX" else [0.0, degrees]
        return F.affine(img, angle=0.0, translate=[0, 0], scale=1.0, shear=shear, center=[0, 0], **kw)
    if name.startswith("Translate"):
        by = int(m) if not name.endswith("Rel") else m
        return F.affine(img, angle=0.0, translate=[by, 0] if "X" in name else [0, by], scale=1.0, shear=[0.0, 0.0],
                        **kw)  # fmt: skip
    if name == "SolarizeAdd":
        return torch.where(img < 128, (img.to(torch.int32) + int(m)).clamp_(max=255).to(img.dtype), img)
    if name == "Solarize":
        return img if 255.0 * m > 255 else F.solarize(img, 255.0 * m)
    simple = {
        "Identity": lambda: img,
        "Rotate": lambda: F.rotate(img, angle=m, **kw),
        "Brightness": lambda: F.adjust_brightness(img, 1.0 + m),
        "Color": lambda: F.adjust_saturation(img, 1.0 + m),
        "Contrast": lambda: F.adjust_contrast(img, 1.0 + m),
        "Sharpness": lambda: F.adjust_sharpness(img, 1.0 + m),
        "Posterize": lambda: F.posterize(img, int(m)),
        "AutoContrast": lambda: F.autocontrast(img),
        "Equalize": lambda: F.equalize(img),
        "Invert": lambda: F.invert(img),
    }
    return simple[name]()


def per_sample(steps: list[T.Transform], images: torch.Tensor, drawn: list[np.ndarray | None]) -> torch.Tensor:
    """The torch backend's kernels, one sample at a time (on the CPU)."""
    cpu = images.cpu()
    rows = [[None if f is None else f[i] for f in drawn] for i in range(len(cpu))]
    return torch.stack([apply_pipeline(steps, cpu[i], rows[i]) for i in range(len(cpu))])


def check_stage(steps: list[T.Transform], images: torch.Tensor, *, seed: int = 3) -> torch.Tensor:
    """``steps`` through the stage on ``images`` equal the per-sample kernels (on the CPU),
    exactly; returns the stage's output. A blur on a GPU is the exception (:func:`check_blurred`)."""
    drawn = factors(steps, seed, 0, np.arange(len(images)))
    got = run_stage(steps, images, drawn)
    want = per_sample(steps, images, drawn)
    assert got.device == images.device and got.dtype == want.dtype and got.shape == want.shape
    if images.is_cuda and "GaussianBlur" in repr(steps):
        check_blurred(got.cpu(), want)
    else:
        torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)
    return got


def check_blurred(got: torch.Tensor, want: torch.Tensor) -> None:
    """A uint8 blur on a GPU against the CPU's: cuDNN sums the kernel's products in another order
    than the CPU's convolution, so a value whose float sum lands within rounding error of a half
    rounds the other way. At most 1 apart, in at most 1 value in 10,000 (H200, 2026-11-28: 1 of
    96,768 and 1 of 5,280)."""
    torch.testing.assert_close(got, want, atol=1, rtol=0)
    assert (got != want).sum().item() <= max(1, got.numel() // 10_000)


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

    @pytest.mark.parametrize("device", WAYS)
    @pytest.mark.parametrize("channels", [1, 3])
    @pytest.mark.parametrize("size", [(40, 56), (48, 48)], ids=["wide", "square"])
    @pytest.mark.parametrize("fill", [None, (10.0, 20.0, 30.0), (7.0,)])
    @pytest.mark.parametrize("mode", ["nearest", "bilinear"])
    def test_each_operation_with_mixed_magnitudes(self, device, channels, size, fill, mode):
        """Every operation (timm's too) on a batch whose samples drew different operations and
        magnitudes (negative, zero, quarter turns, out of range), against torchvision's
        functional kernels called as its policies call them."""
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
            want = torchvision_op(cpu[i], OPS[codes[i]], float(mags[i]), owner)
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
    @pytest.mark.parametrize("device", WAYS)
    @pytest.mark.parametrize("t", POLICIES, ids=repr)
    def test_a_batch_is_the_per_sample_kernels(self, t, device):
        check_stage([t], batch(96, 36, 44, device=device))

    @pytest.mark.parametrize("device", WAYS)
    def test_one_channel(self, device):
        check_stage([T.TrivialAugmentWide()], batch(64, 32, 32, channels=1, device=device))


AUGMIX_NEAREST = T.AugMix(severity=10, mixture_width=2, chain_depth=2, all_ops=False, interpolation="nearest",
                          fill=(5.0, 6.0, 7.0))  # fmt: skip


class TestAugMix:
    @pytest.mark.parametrize("device", WAYS)
    @pytest.mark.parametrize("t", [T.AugMix(), AUGMIX_NEAREST], ids=repr)
    def test_a_batch_is_the_per_sample_kernels(self, t, device):
        check_stage([t], batch(48, 36, 44, device=device))

    def test_summed_in_runs_of_rows_on_the_cpu(self):
        # 64 x 64 x 3 float32: 21 rows to a megabyte, so 40 rows are summed in two runs
        check_stage([T.AugMix()], batch(40, 64, 64))


class TestToDtypeAndNormalize:
    @pytest.mark.parametrize("device", WAYS)
    def test_after_a_policy(self, device):
        steps = [T.TrivialAugmentWide(), T.ToDtype(torch.float32, scale=True),
                 T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))]  # fmt: skip
        out = check_stage(steps, batch(32, 24, 24, device=device))
        assert out.dtype == torch.float32


class TestRandomErasing:
    @pytest.mark.parametrize("device", WAYS)
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

    @pytest.mark.parametrize("value", [0.0, "random"])
    def test_the_stage_never_writes_its_input(self, value):
        images = batch(16, 20, 20).to(torch.float32)
        before = images.clone()
        erasing: T.Transform = T.RandomErasing(p=1.0, value=value)
        for steps in ([erasing], [T.ToDtype(torch.float32, scale=True), erasing]):  # first: the caller's tensor
            out = check_stage(steps, images)  # (ToDtype on float32 gives its input itself)
            torch.testing.assert_close(images, before, atol=0, rtol=0)
            assert not torch.equal(out, before)

    @pytest.mark.parametrize("device", WAYS)
    @pytest.mark.parametrize("n", [1, 4])
    def test_after_a_grayscale_of_every_row(self, device, n):
        """A grayscale of every row (p=1, or a batch of one) hands on torchvision's expanded
        channels (stride 0): the steps after it do not write it in place."""
        mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
        images = batch(n, 16, 16, device=device)
        check_stage([T.RandomGrayscale(p=1.0), T.RandomErasing(p=1.0, value=(7, 100, 200))], images)
        check_stage([T.ToDtype(torch.float32, scale=True), T.RandomGrayscale(p=1.0), T.Normalize(mean=mean, std=std),
                     T.RandomErasing(p=1.0, value="random")], images)  # fmt: skip

    def test_after_a_step_of_the_stage_it_writes_that_steps_tensor(self, monkeypatch):
        from gpupipe.backends._stage import _steps

        calls: list[int] = []

        def spy(fn: Any) -> Any:
            def lowering(t: Any, x: torch.Tensor, f: Any) -> torch.Tensor:
                calls.append(x.data_ptr())
                return fn(t, x, f)

            return lowering

        wrapped = {k: spy(v) for k, v in _steps._IN_PLACE.items()}
        monkeypatch.setattr(_steps, "_IN_PLACE", wrapped)
        steps = [T.ToDtype(torch.float32, scale=True), T.Normalize(mean=(0.5,), std=(0.25,)), T.RandomErasing(p=1.0)]
        out = check_stage(steps, batch(16, 20, 20))
        assert calls == [out.data_ptr()] * 2  # Normalize, then RandomErasing, in place on ToDtype's new tensor
        calls.clear()
        images = batch(16, 20, 20).to(torch.float32)
        before = images.clone()
        check_stage(steps[1:], images)  # Normalize first: on the caller's tensor, not in place
        assert calls == [calls[0]] and calls[0] != images.data_ptr() and torch.equal(images, before)


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
        steps = [T.RandomResizedCrop(224), T.TrivialAugmentWide(), T.RandomRotation(10),
                 T.ToDtype(torch.float32, scale=True)]  # fmt: skip
        assert T.RandomRotation not in STAGE and stage_start(steps) is None
        assert stage_start([*steps, T.RandomErasing()]) == 3


V2 = [T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.TrivialAugmentWide(), T.ToDtype(torch.float32, scale=True),
      T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)), T.RandomErasing(p=0.5)]  # fmt: skip


def epoch(shards, backend: str, stage: bool | None, *, mix: bool = False, device: str = "cpu", **options: Any) -> list:
    """An epoch of the V2 tail (``mix``: and MixUp or CutMix per batch): ``(keys, images,
    labels)`` per batch."""
    import gpupipe as gp

    mixing = T.RandomChoice([T.MixUp(alpha=0.2, num_classes=1000), T.CutMix(alpha=1.0, num_classes=1000)])
    pipeline = gp.Pipeline(gp.WebDataset(shards), V2, batch_transform=mixing if mix else None)
    with gp.Loader(pipeline, 5, backend=backend, device=device, shuffle=True, seed=11, stage=stage,
                   **options) as loader:  # fmt: skip
        return [(b.keys, b.images.cpu(), b.labels.cpu() if b.labels is not None else None) for b in loader]


def same_epochs(one: list, other: list) -> None:
    assert len(one) == len(other) == 4
    for (keys, images, labels), (keys2, images2, labels2) in zip(one, other, strict=True):
        assert keys == keys2 and torch.equal(labels, labels2)
        torch.testing.assert_close(images, images2, atol=0, rtol=0)


class TestInTheLoader:
    """The loader runs a view's tail in the stage on each delivered batch, the backend having
    stopped the view where the tail starts: the same batches as the backend's own tail."""

    @pytest.mark.parametrize("options", [{"num_workers": 0}, {"num_workers": 2, "memory_format": torch.channels_last}],
                             ids=["in-process", "workers"])  # fmt: skip
    def test_torch_staged_is_torch_per_sample(self, shards, options):
        staged = epoch(shards, "torch", True, **options)
        same_epochs(staged, epoch(shards, "torch", False, **options))
        channels_last = "memory_format" in options
        assert all(images.is_contiguous(memory_format=torch.channels_last) == channels_last for _, images, _ in staged)

    @pytest.mark.parametrize("workers", [0, 2])
    def test_the_batch_transform_mixes_after_the_tail(self, shards, workers):
        """MixUp and CutMix mix the staged images (the loader's), not the backend's uint8 ones
        before the tail (which the torch backend's workers would otherwise mix)."""
        staged = epoch(shards, "torch", True, mix=True, num_workers=workers)
        assert staged[0][1].dtype == torch.float32 and staged[0][2].shape == (5, 1000)
        same_epochs(staged, epoch(shards, "torch", False, mix=True, num_workers=workers))

    @pytest.mark.parametrize("workers", [0, 1])
    def test_a_skipped_sample_in_a_staged_and_mixed_batch(self, tmp_path, workers, monkeypatch):
        """``on_error="skip"``: a sample that cannot be decoded takes its donor's copy and draws
        through the stage, and is neither mixed nor a partner: the torch workers' run of the
        stage gives the batches of the workers' per-sample tail and of the loader's own run of the
        stage (as for DALI and Ray: ``batches_stage`` emptied)."""
        import gpupipe as gp
        from gpupipe import backends

        from .support.data import truncated_jpeg, write_webdataset_shards

        urls = write_webdataset_shards(str(tmp_path), (10,), prefix="skip", patch={2: {"jpg": truncated_jpeg(2)}})
        mixing = T.MixUp(alpha=0.2, num_classes=1000)

        def run(stage: bool) -> list:
            with gp.Loader(gp.Pipeline(urls, V2, batch_transform=mixing), 5, backend="torch", device="cpu",
                           stage=stage, num_workers=workers, shuffle=False, seed=4, on_error="skip",
                           max_skipped=None) as loader:  # fmt: skip
                out = [(b.keys, b.valid.clone(), b.images.clone(), b.labels) for b in loader]
            assert all(labels is not None for *_, labels in out)
            return out

        staged = run(True)
        (keys, valid, _, labels), _ = staged
        assert not [k for k in keys if k.endswith("000002")] and int((~valid).sum()) == 1
        assert labels[~valid].max() == 1.0  # its donor's one-hot label, unmixed
        per_sample = run(False)
        monkeypatch.setattr(backends.get("torch"), "batches_stage", ())
        for want in (per_sample, run(True)):
            for (k1, m1, i1, l1), (k2, m2, i2, l2) in zip(staged, want, strict=True):
                assert k1 == k2 and torch.equal(m1, m2) and torch.equal(l1, l2)
                torch.testing.assert_close(i1, i2, atol=0, rtol=0)

    def test_views_each_with_its_tail(self, shards):
        """Several views (multi-crop): each view's tail with its own draws, one of them without a
        tail to stage."""
        import gpupipe as gp

        views = [V2, [T.RandomResizedCrop(24), T.RandAugment(), T.ToDtype(torch.float32, scale=True)],
                 [T.RandomResizedCrop(16), T.ToDtype(torch.float32, scale=True)]]  # fmt: skip

        def run(stage: bool) -> list:
            with gp.Loader(gp.Pipeline(gp.WebDataset(shards), views=views), 4, backend="torch", device="cpu",
                           stage=stage, num_workers=1, seed=3) as loader:  # fmt: skip
                return [[v.clone() for v in b.images] for b in loader]

        for staged, plain in zip(run(True), run(False), strict=True):
            for a, b in zip(staged, plain, strict=True):
                torch.testing.assert_close(a, b, atol=0, rtol=0)

    def test_views_with_the_same_tail_run_as_one_batch(self, shards, monkeypatch):
        """Views with equal tails on images of one shape (DINO's local views) go through the stage
        stacked, one run for them all, each still with its own draws."""
        import gpupipe as gp
        from gpupipe.backends._stage import _delivered

        views = [V2, V2, [T.RandomResizedCrop(24), *V2[1:]]]
        runs: list[int] = []
        run_stage = _delivered.run_stage

        def counted(steps: Any, x: torch.Tensor, f: Any) -> torch.Tensor:
            runs.append(len(x))
            return run_stage(steps, x, f)

        monkeypatch.setattr(_delivered, "run_stage", counted)

        def run(stage: bool) -> list:
            with gp.Loader(gp.Pipeline(gp.WebDataset(shards), views=views), 4, backend="torch", device="cpu",
                           stage=stage, num_workers=0, seed=3) as loader:  # fmt: skip
                return [[v.clone() for v in b.images] for b in loader]

        staged = run(True)
        assert runs[:2] == [8, 4]  # views 0 and 1 stacked (2 x 4 rows), view 2 alone
        for got, plain in zip(staged, run(False), strict=True):
            assert not torch.equal(got[0], got[1])  # each view its own draws
            for a, b in zip(got, plain, strict=True):
                torch.testing.assert_close(a, b, atol=0, rtol=0)

    def test_a_new_pipeline_brings_its_own_tail(self, shards):
        """``set_pipeline`` between epochs (progressive resizing): the next epoch's views are cut
        and staged as the new pipeline's."""
        import gpupipe as gp

        def pipeline(size: int) -> gp.Pipeline:
            return gp.Pipeline(gp.WebDataset(shards), [T.RandomResizedCrop(size), *V2[1:]])

        with gp.Loader(pipeline(32), 4, backend="torch", device="cpu", stage=True, num_workers=0, seed=2) as loader:
            first = [b.images.shape for b in loader]
            loader.set_pipeline(pipeline(24))
            loader.set_epoch(1)
            second = [b.images.clone() for b in loader]
        with gp.Loader(pipeline(24), 4, backend="torch", device="cpu", stage=False, num_workers=0, seed=2) as plain:
            plain.set_epoch(1)
            want = [b.images for b in plain]
        assert first[0] == (4, 3, 32, 32) and second[0].shape == (4, 3, 24, 24)
        for a, b in zip(second, want, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)

    @pytest.mark.parametrize(("recipe", "options"), [("ssl.py:dino", {"global_size": 32, "local_size": 16}),
                                                     ("ssl.py:simclr", {"size": 32, "blur_kernel": 5}),
                                                     ("imagenet.py:train_3augment", {"size": 32})])  # fmt: skip
    def test_the_ssl_and_3augment_recipes(self, shards, recipe, options):
        """The recipes' views through the stage (their colour tails) equal the backend's own."""
        import gpupipe as gp

        make = gp.load_pipeline(os.path.join(ROOT, "pipelines", recipe))

        def run(stage: bool) -> list:
            with gp.Loader(make(gp.WebDataset(shards), **options), 4, backend="torch", device="cpu", stage=stage,
                           num_workers=1, seed=3) as loader:  # fmt: skip
                return [[v.clone() for v in (b.images if isinstance(b.images, tuple) else (b.images,))]
                        for b in loader]  # fmt: skip

        for staged, plain in zip(run(True), run(False), strict=True):
            for a, b in zip(staged, plain, strict=True):
                torch.testing.assert_close(a, b, atol=0, rtol=0)

    @pytest.mark.gpu
    def test_on_the_gpu_the_stage_is_the_workers_tail(self, shards):
        """On a GPU (the stage by default): the torch backend's workers cut the view, the stage
        runs the tail on the GPU; the values are the CPU workers' own tail's."""
        same_epochs(epoch(shards, "torch", None, device="cuda", num_workers=2),
                    epoch(shards, "torch", False, num_workers=2))  # fmt: skip

    @pytest.mark.parametrize("device", DEVICES)
    def test_dali_staged_is_its_cut_graph_then_the_stage(self, shards, device):
        """DALI with the stage delivers its graph of the view up to the tail, run through the
        stage with each sample's draws of the whole view."""
        pytest.importorskip("nvidia.dali")
        import gpupipe as gp
        from gpupipe.core._random import step_factors

        staged = epoch(shards, "dali", True, device=device, num_workers=2)
        with gp.Loader(gp.Pipeline(gp.WebDataset(shards), V2[:2]), 5, backend="dali", device=device, shuffle=True,
                       seed=11, num_workers=2) as cut:  # fmt: skip
            plan = cut.plan(0)
            for b, batch in enumerate(cut):
                draws = plan.drawn(b)
                drawn = [step_factors(t, plan.seed, 0, draws, step) for step, t in enumerate(V2)][2:]
                want = run_stage(V2[2:], batch.images, drawn)
                assert batch.keys == staged[b][0] and batch.images.dtype == torch.uint8
                torch.testing.assert_close(staged[b][1], want.cpu(), atol=0, rtol=0)

    def test_the_backend_stops_each_view_at_its_tail(self, shards, monkeypatch):
        import gpupipe as gp
        from gpupipe import backends

        seen: list[Any] = []
        real = backends.get("torch").runner

        def runner(self: Any, spec: Any) -> Any:
            seen.append(spec)
            return real(spec)

        monkeypatch.setattr(type(backends.get("torch")), "runner", runner)
        pipeline = gp.Pipeline(gp.WebDataset(shards), V2)
        with gp.Loader(pipeline, 4, backend="torch", device="cpu", stage=True, num_workers=0):
            pass
        with gp.Loader(pipeline, 4, backend="torch", device="cpu", num_workers=0):  # the default on the CPU
            pass
        assert seen[0].views == (tuple(V2[:2]),) and str(seen[0].outputs[0]) == str(pipeline.view_specs[0][2])
        assert seen[1].views == (tuple(V2),)

    def test_where_the_stage_does_not_go(self, shards):
        import gpupipe as gp
        from gpupipe.backends._stage import stage_for

        cpu, cuda = torch.device("cpu"), torch.device("cuda")
        v2 = gp.Pipeline(gp.WebDataset(shards), V2)
        assert stage_for(v2, cpu, None) is None  # the CPU: the backends' workers or threads
        assert stage_for(v2, cuda, None) is not None and stage_for(v2, cpu, True) is not None
        assert stage_for(v2, cuda, False) is None
        train = gp.Pipeline(gp.WebDataset(shards), [T.RandomResizedCrop(32), T.RandomHorizontalFlip(),
                                                    T.ToDtype(torch.float32, scale=True)])  # fmt: skip
        assert stage_for(train, cuda, True) is None  # no tail with a per-sample draw
        sized = gp.Pipeline(gp.WebDataset(shards), [T.Resize(40), T.TrivialAugmentWide(), T.CenterCrop(32)])
        assert stage_for(sized, cuda, True) is None  # the policy's input varies in size

    def test_where_a_backend_measured_the_stage_faster_it_is_on_by_default(self, shards, monkeypatch):
        """DALI on the CPU: the policies' tails go to the stage (1.14-1.47x DALI's own graphs on
        2 cores, which are gone since), and the colour and tone steps' (1.11-2.54x)."""
        pytest.importorskip("nvidia.dali")
        import gpupipe as gp
        from gpupipe import backends

        dali = backends.get("dali")
        augmix = [T.RandomResizedCrop(32), T.AugMix(), T.ToDtype(torch.float32, scale=True)]
        assert "AugMix runs faster in the stage on the cpu" in (dali.stage_default("cpu", [augmix]) or "")
        timm = [T.RandomResizedCrop(32), T.TimmRandAugment.from_config("rand-m9-mstd0.5-inc1")]
        assert "TimmRandAugment runs faster in the stage on the cpu" in (dali.stage_default("cpu", [timm]) or "")
        assert "TrivialAugmentWide runs faster" in (dali.stage_default("cpu", [V2]) or "")
        ra = [T.RandomResizedCrop(32), T.RandAugment()]
        assert "RandAugment runs faster" in (dali.stage_default("cpu", [ra]) or "")
        assert dali.stage_default("cuda", [augmix]) is None
        jitter = [T.RandomResizedCrop(32), T.RandomApply([T.ColorJitter(0.4)])]
        assert "ColorJitter runs faster in the stage on the cpu (3-" in (dali.stage_default("cpu", [jitter]) or "")
        assert "RandomEqualize runs faster" in (dali.stage_default("cpu", [[T.RandomEqualize()]]) or "")
        distort = [T.RandomPhotometricDistort()]
        assert "RandomPhotometricDistort runs faster" in (dali.stage_default("cpu", [distort]) or "")
        assert dali.stage_default("cpu", [[T.RandomResizedCrop(32), T.RandomErasing()]]) is None  # not measured
        # asked of the tails the stage would take, not the whole view: a ColorJitter before the crop
        # stays in DALI's graph and says nothing of the stage's speed
        from gpupipe.backends._stage import candidate_tails

        before = gp.Pipeline(gp.WebDataset(shards), [T.ColorJitter(0.4), T.RandomResizedCrop(32), T.RandomErasing()])
        assert candidate_tails(before) == [(before.views[0][2],)]
        assert dali.stage_default("cpu", candidate_tails(before)) is None
        after = gp.Pipeline(gp.WebDataset(shards), [T.RandomResizedCrop(32), T.ColorJitter(0.4), T.RandomErasing()])
        assert dali.stage_default("cpu", candidate_tails(after)) is not None
        assert backends.get("torch").stage_default("cpu", [augmix]) is None
        seen: list[Any] = []
        real = dali.runner

        def runner(self: Any, spec: Any) -> Any:
            seen.append(spec)
            return real(spec)

        monkeypatch.setattr(type(dali), "runner", runner)
        with gp.Loader(gp.Pipeline(gp.WebDataset(shards), augmix), 4, backend="dali", device="cpu",
                       num_workers=1) as loader:  # fmt: skip
            next(iter(loader))
        assert seen[0].views == (tuple(augmix[:1]),)


class TestSpare:
    def test_a_batch_without_a_good_sample_is_the_spares_copies_as_without_the_stage(self, tmp_path):
        """DALI fills a batch whose every sample is bad with a spare good sample, drawn with the
        spare's number: the stage draws it too (``RawBatch.draws``), so each row is the spare's
        own row (where the epoch has it), as without the stage."""
        pytest.importorskip("nvidia.dali")
        import gpupipe as gp
        from gpupipe.testing import encode_jpeg, synthetic_image

        for c in range(2):
            (tmp_path / f"c{c}").mkdir()
            for i in range(4):
                data = encode_jpeg(synthetic_image(i + 4 * c, size=(32, 32)))
                (tmp_path / f"c{c}" / f"{i}.jpg").write_bytes(data[:40] if c == 0 else data)  # c0: all cut short
        steps = [T.CenterCrop(16), T.ColorJitter(0.5, 0.5, 0.5), T.ToDtype(torch.float32, scale=True)]
        for stage in (False, True):
            pipe = gp.Pipeline(gp.ImageFolder(str(tmp_path)), steps)
            with gp.Loader(pipe, 4, backend="dali", device="cpu", stage=stage, num_workers=1, seed=3, on_error="skip",
                           max_skipped=None) as loader:  # fmt: skip
                first, second = list(loader)
            assert not first.valid.any() and first.keys == ["c1/0.jpg"] * 4 and second.keys[0] == "c1/0.jpg"
            for row in first.images:
                torch.testing.assert_close(row, second.images[0], rtol=0, atol=0)


class TestStageOnly:
    """DALI runs the policies in the stage only (``Backend.stage_only``): a pipeline where the
    stage cannot take one is refused when the loader is built, saying why and what to change;
    the torch backend runs it anywhere."""

    @pytest.fixture(autouse=True)
    def _dali(self):
        pytest.importorskip("nvidia.dali")

    @staticmethod
    def refusal(shards, steps, **options) -> str:
        import gpupipe as gp

        options = {"backend": "dali", "device": "cpu", "num_workers": 1, **options}
        with pytest.raises(gp.UnsupportedTransformError) as e:
            gp.Loader(gp.Pipeline(gp.WebDataset(shards), steps), 4, **options)
        with gp.Loader(gp.Pipeline(gp.WebDataset(shards), steps), 4, **{**options, "backend": "torch"}) as loader:
            assert next(iter(loader)).images.shape[0] == 4  # the torch backend runs it
        return str(e.value)

    def test_stage_false(self, shards):
        steps = [T.RandomResizedCrop(32), T.TrivialAugmentWide(), T.ToDtype(torch.float32, scale=True)]
        why = self.refusal(shards, steps, stage=False)
        assert why.startswith("the dali backend runs TrivialAugmentWide (pipeline step 1) in the stage only")
        assert "stage=False keeps it out" in why and "backend='torch'" in why

    def test_a_step_after_it_the_stage_does_not_run(self, shards):
        steps = [T.RandomResizedCrop(32), T.RandAugment(), T.RandomRotation(10), T.ToDtype(torch.float32, scale=True)]
        assert "step 2 after it (RandomRotation) is not one the stage runs" in self.refusal(shards, steps)

    def test_an_input_of_varying_size(self, shards):
        """(A tail keeps its input's size, so a policy on images of varying size has a step that
        fixes it after it.)"""
        why = self.refusal(shards, [T.Resize(40), T.AugMix(), T.CenterCrop(32)])
        assert "AugMix (pipeline step 1)" in why and "step 2 after it (CenterCrop)" in why

    def test_inside_a_composite(self, shards):
        steps = [T.RandomResizedCrop(32), T.RandomApply([T.TrivialAugmentWide()], p=0.5), T.RandomRotation(5)]
        assert "runs RandomApply (pipeline step 1) in the stage only" in self.refusal(shards, steps)
        steps = [T.RandomResizedCrop(32), T.RandomChoice([T.TrivialAugmentWide(), T.RandomRotation(10)])]
        assert "RandomRotation inside RandomChoice is not one the stage runs" in self.refusal(shards, steps)

    def test_auto_passes_dali_by_where_the_stage_cannot_take_it(self, shards):
        """On a GPU ``auto`` picks DALI for a staged policy, and the torch backend where DALI
        would refuse it (the stage off, or a step after it the stage does not run)."""
        import gpupipe as gp
        from gpupipe import backends

        def choice(steps, stage=None):
            pipe = gp.Pipeline(gp.WebDataset(shards), steps)
            return backends.auto_choice("cuda", pipe.views, available=lambda b: True, pipeline=pipe, stage=stage)

        staged = [T.RandomResizedCrop(32), T.TrivialAugmentWide()]
        assert choice(staged)[0].name == "dali" and choice(staged, stage=True)[0].name == "dali"
        backend, why = choice(staged, stage=False)
        assert backend.name == "torch" and "stage=False keeps it out" in why
        backend, why = choice([*staged, T.RandomRotation(10)])
        assert backend.name == "torch" and "(RandomRotation) is not one the stage runs" in why

    def test_staged_it_runs_on_every_device_type(self, shards):
        """Staged, the DALI graph has no policy: the stage's values are torchvision's."""
        import gpupipe as gp

        for policy in (T.TrivialAugmentWide(), T.RandomApply([T.RandAugment()], p=0.5)):
            steps = [T.RandomResizedCrop(32), T.RandomHorizontalFlip(), policy]
            with gp.Loader(gp.Pipeline(gp.WebDataset(shards), steps), 4, backend="dali", device="cpu",
                           num_workers=1) as loader:  # fmt: skip
                assert next(iter(loader)).images.shape == (4, 3, 32, 32)
                assert loader._runner.operators <= 8  # type: ignore[attr-defined]


def _budget_id(value: Any) -> str:
    return value if isinstance(value, str) else ",".join(f"{k}={x}" for k, x in value) or "-"


class TestOperatorBudgets:
    """Every recipe of ``pipelines/`` on the GPU, as the loader builds its DALI graph: at most
    its budget (``tests/support/budgets.py``), which is the target wherever the stage takes the
    tail. The graph is defined and serialized, not run: no GPU needed."""

    def test_every_recipe_has_a_budget(self):
        files = {name.split(":")[0] for name, _ in GPU_OPERATORS}
        assert files == {f for f in os.listdir(os.path.join(ROOT, "pipelines")) if f.endswith(".py")}

    @pytest.mark.parametrize(("recipe", "options"), list(GPU_OPERATORS), ids=_budget_id)
    def test_at_most_its_budget(self, recipe, options):
        pytest.importorskip("nvidia.dali")
        import gpupipe as gp
        from gpupipe.backends._stage import stage_for

        from .support.budgets import MULTI_VIEW, TARGET
        from .support.dali_graph import parse
        from .test_gpu_graph import define

        pipeline = gp.load_pipeline(os.path.join(ROOT, "pipelines", recipe))(["unused.tar"], **dict(options))
        stage = stage_for(pipeline, torch.device("cuda"), None)
        views = pipeline.views if stage is None else stage.cut()
        operators = len(parse(define(None, views=list(views), gpu=True).pipe.serialize())[0])
        budget = GPU_OPERATORS[recipe, options]
        assert operators <= budget
        if stage is not None and stage.tails and recipe not in MULTI_VIEW:
            assert budget <= TARGET


SampleChoice = T.RandomChoice  # of per-sample steps: gpupipe's per-sample RandomChoice

COLOR = [
    T.ColorJitter(0.4, 0.4, 0.2, 0.1),
    T.ColorJitter(brightness=(0.5, 1.5)),
    T.ColorJitter(contrast=0.8, saturation=0.8),
    T.ColorJitter(hue=0.5),
    T.RandomGrayscale(p=0.5),
    T.RandomSolarize(128, p=0.5),
    T.GaussianBlur(9, sigma=(0.1, 2.0)),
    T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8),
    SampleChoice([T.RandomGrayscale(p=1.0), T.RandomSolarize(128, p=1.0), T.GaussianBlur(5)]),
    T.RandomPhotometricDistort(),
    T.RandomPhotometricDistort(p=1.0),
    T.RandomPhotometricDistort(brightness=None, hue=None, p=0.8),
]
TONE = [
    T.RandomInvert(p=0.5),
    T.RandomPosterize(3, p=0.5),
    T.RandomPosterize(0, p=0.5),
    T.RandomAutocontrast(p=0.5),
    T.RandomAdjustSharpness(2.0, p=0.5),
    T.RandomAdjustSharpness(0.3, p=1.0),
    T.RandomEqualize(p=0.5),
]


class TestColorSteps:
    @pytest.mark.parametrize("device", WAYS)
    @pytest.mark.parametrize("t", COLOR, ids=repr)
    def test_a_batch_is_the_per_sample_kernels(self, t, device):
        check_stage([t], batch(48, 24, 28, device=device))

    def test_a_tail_ending_in_a_grayscale_then_the_mix(self):
        """torchvision's grayscale expands one channel to three (stride 0); the stage hands on a
        dense batch, which MixUp writes in place (it raised before)."""
        from gpupipe.backends._stage._delivered import Stage

        stage = Stage(((T.ToDtype(torch.float32, scale=True), T.RandomGrayscale(p=1.0)),), (0,),
                      mix=T.MixUp(alpha=1.0, num_classes=10))  # fmt: skip
        (out,), labels = stage.finish((batch(4, 8, 8),), torch.arange(4), np.ones(4, dtype=bool), seed=0, epoch=0,
                                      rank=0, batch=0, draws=np.arange(4))  # fmt: skip
        assert out.is_contiguous() and labels is not None and labels.shape == (4, 10)

    @pytest.mark.parametrize("device", WAYS)
    @pytest.mark.parametrize("t", [T.ColorJitter(0.4, 0.4, 0.4, 0.1), T.RandomPhotometricDistort(p=0.7)], ids=repr)
    def test_color_jitter_of_one_channel(self, device, t):
        check_stage([t], batch(48, 20, 24, channels=1, device=device))

    @pytest.mark.parametrize("device", WAYS)
    @pytest.mark.parametrize("channels", [1, 3])
    @pytest.mark.parametrize("t", TONE, ids=repr)
    def test_a_tone_step_is_the_per_sample_kernels(self, t, device, channels):
        """uint8, then float: torchvision's kernel on the rows whose coin says so."""
        check_stage([t], batch(32, 20, 24, channels=channels, device=device))
        check_stage([T.ToDtype(torch.float32, scale=True), t, T.Normalize(mean=(0.5,), std=(0.25,))],
                    batch(32, 20, 24, channels=channels, device=device))  # fmt: skip

    def test_the_ssd_colour_steps_after_the_crop(self):
        """RandomPhotometricDistort with the tone steps and the policies' neighbours in one tail."""
        tail: list[T.Transform] = [T.RandomPhotometricDistort(p=0.6), T.RandomEqualize(p=0.3),
                                   T.RandomAdjustSharpness(1.7, p=0.4), T.RandomApply([T.RandomInvert(p=1.0)], p=0.3),
                                   T.ToDtype(torch.float32, scale=True)]  # fmt: skip
        specs = [T.ImageSpec(3, 28, 30, torch.uint8)] * 4 + [T.ImageSpec(3, 28, 30, torch.float32)]
        assert stage_start(tail, specs) == 0
        check_stage(tail, batch(40, 28, 30))

    def test_the_ssl_tails(self):
        """DINO's first global view and SimCLR's, after their crop and flip."""
        dino: list[T.Transform] = [T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8), T.RandomGrayscale(p=0.2),
                T.GaussianBlur(23, sigma=(0.1, 2.0)), T.ToDtype(torch.float32, scale=True),
                T.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))]  # fmt: skip
        check_stage(dino, batch(24, 32, 32))
        three: list[Any] = [SampleChoice([T.RandomGrayscale(p=1.0), T.RandomSolarize(128, p=1.0), T.GaussianBlur(5)]),
                 T.ColorJitter(0.3, 0.3, 0.3), T.ToDtype(torch.float32, scale=True)]  # fmt: skip
        check_stage(three, batch(24, 32, 32))

    def test_where_a_colour_step_stays_in_the_backend(self):
        spec8, spec_f = T.ImageSpec(3, 32, 32, torch.uint8), T.ImageSpec(3, 32, 32, torch.float32)
        jitter = T.ColorJitter(0.4)
        assert stage_start([jitter], [spec8]) == 0 and stage_start([jitter], [spec_f]) is None  # float: twice rounded
        distort = T.RandomPhotometricDistort()
        assert stage_start([distort], [spec8]) == 0 and stage_start([distort], [spec_f]) is None
        assert stage_start([T.RandomEqualize()], [spec_f]) == 0
        small = T.ImageSpec(3, 8, 8, torch.uint8)
        assert stage_start([T.GaussianBlur(23)], [small]) is None  # smaller than half the kernel
        assert stage_start([T.RandomApply([T.GaussianBlur(23)])], [small]) is None

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("kernel", [5, 23])
    def test_the_grouped_blur_is_torchvisions(self, device, kernel):
        """On a GPU the batch's blurs are one grouped convolution (each sample its own kernel):
        the values of torchvision's blur, sample by sample."""
        from gpupipe.backends._stage._color import blur_grouped

        images, t = batch(32, 40, 44, device=device), T.GaussianBlur(kernel)
        sigma = np.random.default_rng(kernel).uniform(0.1, 2.0, len(images))
        got = blur_grouped(t, images, sigma).cpu()
        for i in range(len(images)):
            want = F.gaussian_blur(images[i].cpu(), [kernel, kernel], [float(sigma[i])] * 2)
            if device == "cuda":
                check_blurred(got[i], want)
            else:
                torch.testing.assert_close(got[i], want, atol=0, rtol=0)

    @pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
    def test_the_grouped_blur_of_other_floats_is_torchvisions(self, dtype):
        """torchvision builds the kernel in the image's dtype (sigma a Python float): the grouped
        blur of a float64 or half image takes the same kernel, not float32's cast."""
        from gpupipe.backends._stage._color import blur_grouped

        images, t = F.to_dtype(batch(6, 12, 10), dtype, scale=True), T.GaussianBlur(5)
        sigma = np.random.default_rng(0).uniform(0.1, 2.0, len(images))
        got = blur_grouped(t, images, sigma)
        for i in range(len(images)):
            torch.testing.assert_close(
                got[i], F.gaussian_blur(images[i], [5, 5], [float(sigma[i])] * 2), atol=0, rtol=0
            )


class TestAhead:
    """The stage one batch ahead on a GPU (``_ahead``): the order, and where errors surface. The
    CUDA stream itself runs on a GPU only (gpu-marked test below); here a stand-in records what
    the loader asks of it."""

    def test_depth_one_launches_the_next_before_yielding(self):
        from gpupipe.backends._stage._ahead import ahead

        log: list[str] = []

        def items():
            for i in range(3):
                log.append(f"pull {i}")
                yield i

        def launch(i: int) -> int:
            log.append(f"launch {i}")
            return i

        def finish(i: int) -> int:
            log.append(f"finish {i}")
            return i * 10

        out = []
        for value in ahead(items(), launch, finish, depth=1):
            log.append(f"yield {value}")
            out.append(value)
        assert out == [0, 10, 20]
        assert log == ["pull 0", "launch 0", "pull 1", "launch 1", "finish 0", "yield 0", "pull 2", "launch 2",
                       "finish 1", "yield 10", "finish 2", "yield 20"]  # fmt: skip

    def test_an_error_comes_after_the_batches_before_it(self):
        from gpupipe.backends._stage._ahead import ahead

        def items():
            yield 1
            raise RuntimeError("batch 2 is bad")

        it = ahead(items(), lambda i: i, lambda i: i, depth=1)
        assert next(it) == 1
        with pytest.raises(RuntimeError, match="batch 2"):
            next(it)

    def test_after_close_the_batch_staged_ahead_is_not_handed_on(self, shards, monkeypatch):
        """``close()`` in the loop's body on a (stand-in) GPU: the next step raises ClosedError,
        not the batch the stage had launched ahead (found by a review, 2026-11-29)."""
        import gpupipe as gp
        from gpupipe.backends._stage import _delivered

        class Side:
            def __init__(self, device):
                pass

            def launch(self, run, uses=()):
                return run(), None

            def finish(self, launched):
                return launched[0]

        monkeypatch.setattr(_delivered, "SideStream", Side)
        batches = _delivered.Stage.batches
        monkeypatch.setattr(_delivered.Stage, "batches", lambda self, raw, plan, device, **kw: batches(
            self, raw, plan, torch.device("cuda"), **kw))  # fmt: skip
        if not gp.backends.get("dali").available():
            pytest.skip("DALI is not installed")
        pipeline = gp.Pipeline(gp.WebDataset(shards), [T.RandomResizedCrop(16), T.ToDtype(torch.float32, scale=True)],
                               batch_transform=T.MixUp(alpha=0.2, num_classes=10))  # fmt: skip
        loader = gp.Loader(pipeline, 2, backend="dali", device="cpu", shuffle=True, seed=1, num_workers=1)
        it = iter(loader)
        next(it)
        loader.close()
        with pytest.raises(gp.ClosedError, match="after 1 of its 8 batches"):
            next(it)

    def test_on_a_gpu_the_loader_stages_one_batch_ahead(self, shards, monkeypatch):
        """``Stage.batches`` on a (stand-in) GPU: the tail of batch b + 1 is launched before
        batch b is handed over, and the values are the stage's."""
        import gpupipe as gp
        from gpupipe.backends._stage import _delivered

        log: list[str] = []
        used: list = []

        class Side:
            def __init__(self, device):
                log.append(f"stream on {device}")

            def launch(self, run, uses=()):
                log.append("launch")
                used.append(uses)  # the batch's inputs, marked used on the side stream
                return run(), None

            def finish(self, launched):
                log.append("finish")
                return launched[0]

        monkeypatch.setattr(_delivered, "SideStream", Side)
        pipeline = gp.Pipeline(gp.WebDataset(shards), V2)
        stage = _delivered.stage_for(pipeline, torch.device("cuda"), None)
        assert stage is not None
        with gp.Loader(gp.Pipeline(gp.WebDataset(shards), V2[:2]), 4, backend="torch", device="cpu", seed=1,
                       num_workers=0) as cut:  # fmt: skip
            plan = cut.plan(0)
            raw = list(enumerate(cut._runner.run(plan, 0)))
            got = list(stage.batches(iter(raw), plan, torch.device("cuda"), rank=0))
        assert log[0] == "stream on cuda" and log[1:4] == ["launch", "launch", "finish"]
        assert log.count("launch") == log.count("finish") == len(raw) == 4
        assert all(u[0] is r.images and u[1] is r.labels for u, (_, r) in zip(used, raw, strict=True))
        for (b, one, images, labels), (b2, two) in zip(got, raw, strict=True):
            assert b == b2 and one is two and labels is two.labels
            want = stage.run(two.images, seed=plan.seed, epoch=0, draws=plan.drawn(b))
            torch.testing.assert_close(images[0], want[0], atol=0, rtol=0)
