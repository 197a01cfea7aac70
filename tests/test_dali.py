"""The DALI backend: parity with torchvision (DALI's CPU operators here; the GPU ones where CUDA is
present), DALI's random sampling against torchvision's, the compiler's fusions and errors, the
index cache and the DLPack hand-off."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.testing import encode_jpeg, encode_png, synthetic_image

from .support.checkers import AddMult, EveryOtherColumn, Posterize, check_backend_parity, run_dali, sample_factors

pytest.importorskip("nvidia.dali")

IMAGENET: dict[str, Any] = dict(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
NORMALIZED = 255 * 0.229  # normalised units → 0-255 units (the largest std: the strictest check)
DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    """Photograph-like JPEGs of the sizes real photos have: 300–500 px shorter side, both orientations."""
    return [encode_jpeg(synthetic_image(1000 + i, label=i)) for i in range(10)]


png = encode_png


def coordinates(h: int, w: int) -> np.ndarray:
    """A lossless image whose pixel (r, c) is (r, c, 7): a crop's first pixel gives its offset."""
    r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([r, c, np.full_like(r, 7)], axis=-1).astype(np.uint8)


@pytest.mark.parametrize("device", DEVICES)
class TestParity:
    """DALI vs torchvision, same images, deterministic settings: per-image MAE (0–255 units)
    ≤ 1.0 on average and ≤ 2.5 for the worst image."""

    def test_decode_is_identical_on_cpu(self, device, photos):
        tol = 0.0 if device == "cpu" else 2.5  # nvJPEG's IDCT differs slightly from libjpeg-turbo's
        check_backend_parity([], photos, device=device, mean_tol=tol / 2.5, max_tol=tol)

    def test_imagenet_val(self, device, photos):
        val = gp.load_pipeline(os.path.join(os.path.dirname(__file__), "..", "pipelines", "imagenet.py:val"))
        check_backend_parity(val(["unused.tar"]).transforms, photos, device=device, unit=NORMALIZED)

    @pytest.mark.parametrize(
        "resize",
        [
            T.Resize(256),
            T.Resize((200, 300)),
            T.Resize(100, max_size=120),
            T.Resize(None, max_size=200),
            T.Resize(224, interpolation=T.InterpolationMode.BICUBIC),
            T.Resize(160, antialias=False),
            T.Resize(640),
            [T.Resize(256), T.CenterCrop(224)],
            [T.RandomResize(150, 400), T.CenterCrop(160)],  # a size per sample, drawn on the host
            [T.CenterCrop(300), T.RandomResize(100, 300, antialias=False), T.RandomCrop(120, pad_if_needed=True)],
            [T.RandomShortestSize([120, 150, 200], 260), T.CenterCrop(260)],  # letterboxed: padded around
        ],
    )
    def test_resize(self, device, photos, resize):
        check_backend_parity(resize if isinstance(resize, list) else [resize], photos, device=device)

    @pytest.mark.parametrize(
        "steps",
        [
            [T.CenterCrop(224)],
            [T.CenterCrop((301, 299))],
            [T.CenterCrop(600)],
            [T.CenterCrop(225), T.ToDtype(torch.float32, scale=True)],  # fused into crop_mirror_normalize
            [T.CenterCrop(600), T.ToDtype(torch.float32, scale=True)],  # fused, padded
            [T.CenterCrop(600), T.ToDtype(torch.float32, scale=True), T.Normalize(**IMAGENET)],  # padding normalized
            [T.CenterCrop(600), T.ToDtype(torch.float32, scale=True), T.Normalize(mean=[0.5], std=[0.2, 0.25, 0.3])],
        ],
    )
    def test_center_crop_is_exact(self, device, photos, steps):
        decode = 0.0 if device == "cpu" else 2.5
        check_backend_parity(steps, photos, device=device, mean_tol=decode / 2.5 + 1e-4, max_tol=decode + 1e-4)

    @pytest.mark.parametrize(
        "steps",
        [
            [T.RandomHorizontalFlip(p=1.0)],
            [T.RandomVerticalFlip(p=1.0)],
            [T.RandomHorizontalFlip(p=0.0)],
            [T.CenterCrop(224), T.RandomHorizontalFlip(p=1.0), T.ToDtype(torch.float16, scale=True)],
        ],
    )
    def test_flips(self, device, photos, steps):
        check_backend_parity(steps, photos, device=device)

    @pytest.mark.parametrize(
        "steps",
        [
            [T.ToDtype(torch.float32, scale=True)],
            [T.ToDtype(torch.float32, scale=True), T.ToDtype(torch.uint8, scale=True)],
            [T.ToDtype(torch.float32)],
            [T.ToDtype(torch.float32, scale=True), T.Normalize(**IMAGENET)],
            [T.ToDtype(torch.float32, scale=True), T.GaussianBlur(3, sigma=1.0), T.Normalize(**IMAGENET)],
            [T.ToDtype(torch.float16, scale=True), T.Resize(24), T.Normalize(**IMAGENET)],  # float16 kept
            [T.ToDtype(torch.float64, scale=True), T.Resize(24), T.Normalize(**IMAGENET)],  # float64 kept
            [T.ToDtype(torch.float16, scale=True), T.GaussianBlur(3, sigma=1.0), T.Normalize(**IMAGENET)],  # float16
            [T.ToDtype(torch.float64, scale=True), T.Normalize(**IMAGENET)],  # float64, not crop_mirror_normalize's
            # a fused tail on a float64 image
            [T.ToDtype(torch.float64, scale=True), T.GaussianBlur(3), T.ToDtype(torch.float32), T.Normalize([0], [1])],
        ],
    )
    def test_dtype_and_normalize(self, device, photos, steps):
        unscaled = steps == [T.ToDtype(torch.float32)]  # float values in 0-255
        unit = 1.0 if unscaled else NORMALIZED if isinstance(steps[-1], T.Normalize) else None
        check_backend_parity(steps, photos, device=device, unit=unit)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
    def test_geometry_on_float16_and_float64_images(self, device, dtype):
        """DALI's resize and warp_affine take uint8 and float32 images only, its CPU flip no
        float16, crop_mirror_normalize no float64: such an image goes through them in float32 and
        comes back in its dtype, as the torch backend keeps it (was: DALI failed the batch)."""
        images = [encode_jpeg(synthetic_image(i, size=s)) for i, s in enumerate([(60, 80), (80, 60)])]
        to = T.ToDtype(dtype, scale=True)
        for steps in (
            [to, T.Resize(24), T.CenterCrop(16)],
            [to, T.RandomResize(10, 20), T.RandomCrop(8)],
            [to, T.CenterCrop(16), T.RandomRotation(20)],
            [to, T.CenterCrop(16), T.RandomAffine(20, interpolation="bilinear", fill=(0.5, 0.2, 0.1))],
            [to, T.CenterCrop(16), T.RandomHorizontalFlip(1.0), T.RandomVerticalFlip(1.0)],
            [to, T.CenterCrop(16), T.RandomHorizontalFlip(1.0), T.ToDtype(torch.float32)],
        ):
            check_backend_parity(steps, images, device=device)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
    @pytest.mark.parametrize(
        "step",
        [T.RandomAutocontrast(1.0), T.RandomAdjustSharpness(2.0, 1.0), T.RandomErasing(1.0),
         T.RandomErasing(1.0, value="random"), T.RandomPhotometricDistort(p=1.0), T.RandomEqualize(1.0),
         T.RandomSolarize(0.5, 1.0), T.RandomInvert(1.0), T.RandomGrayscale(1.0), T.GaussianBlur(3),
         T.ColorJitter(0.3, 0.3, 0.3)],
        ids=lambda t: type(t).__name__,
    )  # fmt: skip
    def test_photometric_steps_on_float16_and_float64_images(self, device, photos, dtype, step):
        """DALI's reductions, filter and erase take no float64, its arithmetic and coord_transform
        no float16: such an image goes through them in float32 (was: DALI failed the batch). The
        tolerances are the uint8 tests': ColorJitter's, and Equalize's table (OpenCV's, not PIL's)."""
        tol = {T.ColorJitter: (2.5, 8.0), T.RandomEqualize: (4.0, 14.0)}.get(type(step), (1.0, 2.5))
        check_backend_parity([T.ToDtype(dtype, scale=True), step], photos, device=device, mean_tol=tol[0],
                             max_tol=tol[1])  # fmt: skip

    @pytest.mark.parametrize("blur", [T.GaussianBlur(5, sigma=1.0), T.GaussianBlur((3, 9), sigma=2.0)])
    def test_gaussian_blur(self, device, photos, blur):
        check_backend_parity([blur], photos, device=device)

    @pytest.mark.parametrize(
        "jitter",
        [
            T.ColorJitter(brightness=(1.3, 1.3)),
            T.ColorJitter(brightness=(0.6, 0.6)),
            T.ColorJitter(saturation=(0.4, 0.4)),
            T.ColorJitter(saturation=(1.5, 1.5)),
            T.ColorJitter(contrast=(0.6, 0.6)),  # a blend with the image's mean luma
            T.ColorJitter(contrast=(1.4, 1.4)),
            T.ColorJitter(hue=(0.1, 0.1)),  # in HSV, as torchvision
            T.ColorJitter(hue=(-0.5, -0.5)),
            T.ColorJitter(hue=0.5),
            T.ColorJitter(brightness=0.4, hue=0.1),  # brightness and hue commute
        ],
        ids=repr,
    )
    def test_color_jitter(self, device, photos, jitter):
        check_backend_parity([jitter], photos, device=device)

    def test_color_twist_is_the_faster_kernel_with_its_documented_hue(self, device, photos, shards):
        """``DaliOptions(color_twist=True)``: DALI's own operator, through the loader, in DALI's
        graph (``stage=False``: the stage would run torchvision's kernels): brightness as
        torchvision within the standard tolerance, hue 0.1 about 10 grey levels apart (docs/guide/dali.md)."""
        for jitter, low, high in (
            (T.ColorJitter(brightness=(1.3, 1.3)), 0.0, 1.0),
            (T.ColorJitter(hue=(0.1, 0.1)), 4.0, 30.0),
        ):
            pipe = gp.Pipeline(shards, [T.CenterCrop(48), jitter])
            got = {}
            twist: dict[str, Any] = {"dali": gp.DaliOptions(color_twist=True), "stage": False}
            for backend, options in (("torch", {}), ("dali", twist)):
                # ``device`` is DALI's name ("cpu" or "gpu"); the loader's is torch's ("cpu" or "cuda").
                on = "cuda" if backend == "dali" and device == "gpu" else "cpu"
                with gp.Loader(pipe, 4, backend=backend, device=on, **options) as loader:
                    got[backend] = torch.cat([b.images.cpu() for b in loader]).double()
            error = float((got["torch"] - got["dali"]).abs().mean())
            assert low <= error <= high, (jitter, error)

    def test_color_twist_where_the_stage_runs_colorjitter_is_a_warning(self, device, shards):
        """The option acts where DALI's graph runs ColorJitter: where the stage runs it (a view's
        tail), the loader says so, naming the step, instead of ignoring the option silently."""
        on = "cuda" if device == "gpu" else "cpu"
        pipe = gp.Pipeline(shards, [T.CenterCrop(48), T.RandomApply([T.ColorJitter(0.4)])])
        twist = gp.DaliOptions(color_twist=True)
        with pytest.warns(UserWarning, match=r"color_twist=True\) does not apply to pipeline step 1 \(RandomApply\)"):
            gp.Loader(pipe, 4, backend="dali", device=on, dali=twist).close()
        gp.Loader(pipe, 4, backend="dali", device=on, dali=twist, stage=False).close()  # (warnings are errors)

    @pytest.mark.parametrize(
        "before",
        [[T.ToDtype(torch.float32, scale=True), T.Normalize(**IMAGENET)], [T.ToDtype(torch.float32)]],
        ids=["normalized", "unscaled"],
    )
    def test_hue_of_float_images_outside_0_1_is_torchvisions(self, device, photos, before):
        """torchvision's saturation (range / max) and its clamping of p, q, t to [0, 1], as they
        are: exact on values outside [0, 1] too. On the GPU, nvJPEG's pixels differ from
        libjpeg-turbo's by a level here and there (H200, 2026-11-26: up to 0.026 on the 0-255
        scale, mean 0.005, for these photos); hue carries that difference, and only that, through."""
        decode = (0.0, 0.0) if device == "cpu" else check_backend_parity(before, photos, device=device, unit=1.0,
                                                                         mean_tol=1.0, max_tol=2.5)  # fmt: skip
        check_backend_parity([*before, T.ColorJitter(hue=0.2)], photos, device=device, unit=1.0,
                             mean_tol=1e-4 + 2 * decode[0], max_tol=1e-3 + 2 * decode[1])  # fmt: skip

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_color_jitter_on_float_images(self, device, photos, dtype):
        steps = [T.ToDtype(dtype, scale=True), T.ColorJitter(brightness=0.3, hue=0.05)]
        check_backend_parity(steps, photos, device=device)
        steps = [T.ToDtype(dtype, scale=True), T.ColorJitter(contrast=0.3)]
        check_backend_parity(steps, photos, device=device)

    @pytest.mark.parametrize(
        "jitter", [T.ColorJitter(0.4, 0.4, 0.4), T.ColorJitter(0.4, 0.4, 0.4, 0.1)], ids=["bcs", "bcsh"]
    )
    def test_color_jitter_in_the_drawn_order(self, device, photos, jitter):
        """Several adjustments: DALI applies them in a fixed order (brightness, contrast,
        saturation, hue), torchvision in the drawn one. Brightness, contrast and saturation
        commute but for rounding and clamping; hue does not (docs/guide/dali.md)."""
        avg, _ = check_backend_parity([jitter], photos, device=device, mean_tol=2.5, max_tol=8.0)
        assert avg > 0.1  # the order does show

    def test_grayscale(self, device, photos):
        check_backend_parity([T.RandomGrayscale(p=1.0)], photos, device=device)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
    def test_grayscale_of_a_float_image(self, device, photos, dtype):
        """A float image stays float (DALI's ``hsv`` gives uint8 unless told)."""
        check_backend_parity([T.ToDtype(dtype, scale=True), T.RandomGrayscale(p=0.5)], photos, device=device)

    @pytest.mark.parametrize(
        "steps",
        [
            [T.RandomSolarize(128, p=1.0)],
            [T.RandomSolarize(100)],  # the same per-sample decisions
            [T.ToDtype(torch.float32, scale=True), T.RandomSolarize(0.5)],
        ],
    )
    def test_solarize_is_exact(self, device, photos, steps):
        decode = 0.0 if device == "cpu" else 2.5
        check_backend_parity(steps, photos, device=device, mean_tol=decode / 2.5, max_tol=decode)

    @pytest.mark.parametrize(
        "steps",
        [
            [T.RandomApply([T.ColorJitter(brightness=0.4, hue=0.1)], p=0.8)],
            [T.RandomApply([T.GaussianBlur(5)], p=0.5)],
            [T.ToDtype(torch.float32, scale=True), T.RandomApply([T.GaussianBlur((3, 9))], p=0.5)],
            [T.RandomApply([T.RandomGrayscale(p=1.0), T.RandomSolarize(128, p=1.0)], p=0.5)],
            [T.RandomApply([T.RandomApply([T.RandomSolarize(128, p=1.0)], p=0.5), T.GaussianBlur(3)], p=0.7)],
        ],
    )
    def test_random_apply(self, device, photos, steps):
        """The same decisions and inner draws (nested ones included) as the torch backend."""
        check_backend_parity(steps, photos, device=device)


def _sample_stats(windows, h, w):
    area = np.array([wh * ww / (h * w) for wh, ww in windows])
    logr = np.array([math.log(ww / wh) for wh, ww in windows])
    return np.array([area.mean(), area.std(), logr.mean(), logr.std()])


class TestRandomSampling:
    """The DALI graph turns the fed factors into parameters: the same as the torch backend's, whose
    distributions are torchvision's."""

    def test_random_resized_crop_windows(self):
        from gpupipe.backends._dali._compiler import decode_random_crop

        h, w, n = 300, 400, 400
        image = encode_jpeg(synthetic_image(5, size=(h, w)))
        t = T.RandomResizedCrop(224)
        crops = run_dali([t], [image] * n, graph=lambda enc, ctx: decode_random_crop(t, enc, ctx))
        ours = _sample_stats([tuple(c.shape[:2]) for c in crops], h, w)
        tv = v2.RandomResizedCrop(224)
        torch.manual_seed(0)
        theirs = _sample_stats(
            [(p["height"], p["width"]) for p in (tv.make_params([torch.empty(3, h, w)]) for _ in range(4000))], h, w
        )
        np.testing.assert_allclose(ours, theirs, atol=0.05)

    @pytest.mark.parametrize(
        "scale, ratio",
        [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (2.0, 3.0)), ((0.5, 2.0), (0.1, 0.2)), ((0.9, 1.0), (2.0, 2.5))],
    )
    def test_windows_are_the_reference_windows(self, scale, ratio):
        """The graph's float64 arithmetic (where only the graph knows the size: EXIF orientation)
        gives exactly ``resized_crop_window``'s windows, fallback (no attempt fits) included, on
        every image shape."""
        from gpupipe.backends._dali._context import peek_shape
        from gpupipe.backends._dali._lowerings import _graph_crop_window as in_graph
        from gpupipe.core._geometry import resized_crop_window

        rng = np.random.default_rng(3)
        sizes: list[tuple[int, int]] = [
            (1, 1),
            (1, 300),
            (300, 1),
            (7, 500),
            (500, 7),
            (375, 500),
            (500, 375),
            (3, 700),
            (700, 3),
            (100, 5),  # the fallback's side a tie (5 / 2, 5 * 2.5): rounded half to even
            (5, 100),
        ]
        sizes += [(int(rng.integers(1, 700)), int(rng.integers(1, 700))) for _ in range(25)]
        images = [encode_jpeg(np.zeros((h, w, 3), np.uint8)) for h, w in sizes] * 4
        t = T.RandomResizedCrop(8, scale=scale, ratio=ratio)

        def graph(encoded, ctx):
            shape = peek_shape(ctx, encoded)
            return ctx.fn.stack(*in_graph(ctx, ctx.random(0), shape[0], shape[1]))

        got = [tuple(int(v) for v in out) for out in run_dali([t], images, graph=graph)]
        drawn = sample_factors([t], len(images))[0]
        expected = [resized_crop_window(*sizes[i % len(sizes)], list(drawn[i]), t.ratio) for i in range(len(images))]
        assert got == expected

    def _first_pixels(self, steps, image, n=300):
        return [out[:, 0, 0] if out.shape[0] == 3 else out[0, 0] for out in run_dali(steps, [png(image)] * n)]

    @pytest.mark.parametrize("flip, axis", [(T.RandomHorizontalFlip, 1), (T.RandomVerticalFlip, 0)])
    def test_flip_rate(self, flip, axis):
        image = coordinates(12, 16)
        outs = run_dali([flip(p=0.3)], [png(image)] * 400)
        flipped = [not torch.equal(o.permute(1, 2, 0), torch.from_numpy(image)) for o in outs]
        assert all(
            torch.equal(o.permute(1, 2, 0), torch.from_numpy(np.flip(image, axis).copy()))
            for o, f in zip(outs, flipped, strict=True)
            if f
        )
        assert abs(np.mean(flipped) - 0.3) < 0.07

    def test_grayscale_rate(self):
        image = synthetic_image(3, size=(16, 16))
        outs = run_dali([T.RandomGrayscale(p=0.3)], [png(image)] * 400)
        gray = [int((o.max(0).values.int() - o.min(0).values.int()).max()) <= 1 for o in outs]  # HSV rounding
        assert abs(np.mean(gray) - 0.3) < 0.07

    def test_random_apply_selects_per_sample(self):
        """Each sample is exactly the inner transform's output (with the factors it has at p=1) or
        exactly the input, as the decision says: whatever the inner kernel's own differences to
        torchvision (ColorJitter's fixed order here)."""
        jitter = T.ColorJitter(0.4, 0.4, 0.2, 0.1)
        images = [png(synthetic_image(i, size=(24, 32))) for i in range(40)]
        chosen = run_dali([T.RandomApply([jitter], p=0.8)], images)
        always = run_dali([T.RandomApply([jitter], p=1.0)], images)  # the same uniforms: the same inner draws
        inputs = run_dali([], images)
        decisions = sample_factors([T.RandomApply([jitter], p=0.8)], len(images))[0][:, 0]
        assert set(decisions) == {0.0, 1.0}
        for out, applied, kept, decision in zip(chosen, always, inputs, decisions, strict=True):
            assert torch.equal(out, applied if decision else kept)
        assert sum(not torch.equal(a, k) for a, k in zip(always, inputs, strict=True)) > 30

    def test_color_jitter_ranges(self):
        image = np.full((8, 8, 3), 100, np.uint8)
        outs = run_dali([T.ColorJitter(brightness=0.5)], [png(image)] * 400)
        factors = np.array([o.double().mean().item() / 100 for o in outs])
        assert 0.5 - 0.01 <= factors.min() < 0.56 and 1.44 < factors.max() <= 1.5 + 0.01
        assert abs(factors.mean() - 1.0) < 0.05

    def test_random_crop_offsets(self):
        image = coordinates(40, 60)
        outs = run_dali([T.RandomCrop(20)], [png(image)] * 400)
        tops, lefts = np.array([int(o[0, 0, 0]) for o in outs]), np.array([int(o[1, 0, 0]) for o in outs])
        assert all(o.shape == (3, 20, 20) for o in outs)
        assert tops.min() == 0 and tops.max() == 20 and lefts.min() == 0 and lefts.max() == 40
        assert abs(tops.mean() - 10) < 1.5 and abs(lefts.mean() - 20) < 2.5
        # consecutive pixels: a real crop, not a resampling
        assert all(
            torch.equal(o[0, :, 0], torch.arange(int(o[0, 0, 0]), int(o[0, 0, 0]) + 20, dtype=torch.uint8))
            for o in outs[:20]
        )

    def test_random_crop_padding(self):
        image = coordinates(40, 60)
        outs = run_dali([T.RandomCrop((50, 70), pad_if_needed=True, fill=(1, 2, 3))], [png(image)] * 200)
        assert all(o.shape == (3, 50, 70) for o in outs)
        tops = []
        for o in outs:  # the image sits inside padding of (1, 2, 3); find its first row
            inside = (o[2] == 7).any(dim=1).nonzero()
            tops.append(int(inside[0]))
            padding = o[:, o[2] != 7]  # pixels not from the image carry the fill value
            assert padding.shape[1] > 0 and torch.equal(
                padding.unique(dim=1).flatten(), torch.tensor([1, 2, 3], dtype=torch.uint8)
            )
        # padded height 60: the crop starts uniformly in [0, 10], i.e. the image at rows 10 - top
        assert min(tops) == 0 and max(tops) == 10


class TestCompiler:
    def test_unsupported_option_is_reported_at_build(self, shards):
        pipe = gp.Pipeline(shards, [T.RandomCrop(16, padding=2, padding_mode="reflect")])
        with pytest.raises(gp.UnsupportedTransformError, match=r"RandomCrop.*padding_mode='reflect'.*step 0"):
            gp.Loader(pipe, 2, backend="dali", device="cpu")
        gp.Loader(pipe, 2, backend="torch", device="cpu")  # fine on torch

    @pytest.mark.parametrize(
        "steps, replaced",
        [
            ([T.CenterCrop(16), T.ToDtype(torch.float32, scale=True)], T.CenterCrop),  # the fused tail
            ([T.RandomResizedCrop(16), T.ToDtype(torch.float32, scale=True)], T.RandomResizedCrop),  # fused decode
            ([T.CenterCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32), T.Normalize([0.5], [2.0])],
             T.Normalize),
        ],
    )  # fmt: skip
    def test_a_replaced_lowering_is_not_fused_away(self, shards, monkeypatch, steps, replaced):
        from gpupipe import backends

        registry = backends.get("dali").lowerings
        monkeypatch.setattr(registry, "_table", dict(registry._table))
        builtin, called = registry.lookup(next(t for t in steps if type(t) is replaced)), []

        @gp.register_lowering(replaced, backend="dali", replace=True)
        def _mine(t, node, ctx):
            called.append(t)
            return builtin(t, node, ctx)

        with gp.Loader(gp.Pipeline(shards, steps), 4, backend="dali", device="cpu") as loader:
            images, _ = next(iter(loader))
        assert called and images.shape == (4, 3, 16, 16)

    def test_fusions(self):
        from gpupipe.backends._dali._compiler import _fusable_tail

        train = [T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True), T.Normalize(**IMAGENET)]
        assert _fusable_tail(train) == train
        val = [T.Resize(256), T.CenterCrop(224), T.ToDtype(torch.float32, scale=True), T.Normalize(**IMAGENET)]
        assert _fusable_tail(val) == val[1:]
        assert _fusable_tail([T.CenterCrop(224)]) == []  # stays uint8: nothing to fuse
        assert _fusable_tail([T.ToDtype(torch.bfloat16), T.Normalize(**IMAGENET)]) == []


class TestHandOff:
    def test_held_batches_are_never_overwritten(self, shards):
        pipe = gp.Pipeline(shards, [T.RandomResizedCrop(24), T.ToDtype(torch.float32, scale=True)])
        loader = gp.Loader(pipe, 2, backend="dali", device="cpu", prefetch=2)
        held, copies = [], []
        for images, _ in loader:
            held.append(images)
            copies.append(images.clone())
        assert len(held) == 8 and all(torch.equal(h, c) for h, c in zip(held, copies, strict=True))
        assert not torch.equal(held[0], held[1])

    @pytest.mark.gpu
    def test_batches_on_another_stream(self, shards):
        """Handed over on the consumer's current stream: kernels queued on a side stream read
        finished batches, and the results equal those on the default stream."""
        train = gp.load_pipeline(os.path.join(os.path.dirname(__file__), "..", "pipelines", "imagenet.py:val"))
        loader = gp.Loader(train(shards, size=32), 4, backend="dali", device="cuda")
        reference = [b.images.double().sum().item() for b in loader]
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            sums = [b.images.double().sum() for b in loader]  # queued on the side stream, no host sync
        side.synchronize()
        assert [s.item() for s in sums] == pytest.approx(reference)
        loader.close()

    @pytest.mark.gpu
    def test_cuda_loader(self, shards):
        """A CUDA loader yields the batches of the CPU loader of the same seed, on the GPU: every
        sample once, in the same order, with the same labels, the images within nvJPEG's and the
        GPU kernels' rounding (a crop or flip drawn otherwise differs by tens)."""
        train = gp.load_pipeline(os.path.join(os.path.dirname(__file__), "..", "pipelines", "imagenet.py:train"))
        got: dict[str, list] = {}
        for device in ("cuda", "cpu"):
            with gp.Loader(train(shards, size=32), 4, backend="dali", device=device, shuffle=True, seed=3) as loader:
                batches = list(loader)
                assert len(batches) == len(loader) == 4
                every = sorted(loader.index.key(i) for i in range(len(loader.index)))
                assert sorted(k for b in batches for k in b.keys) == every and len(every) == 16
                got[device] = []
                for batch in batches:
                    images, labels = batch
                    assert labels is not None and labels.dtype == torch.int64
                    assert images.device.type == labels.device.type == device and images.dtype == torch.float32
                    assert images.shape == (4, 3, 32, 32)
                    got[device].append((batch.keys, images.cpu().clone(), labels.cpu().clone()))
        errors = []
        for (keys, images, labels), (cpu_keys, cpu_images, cpu_labels) in zip(got["cuda"], got["cpu"], strict=True):
            assert keys == cpu_keys and torch.equal(labels, cpu_labels)
            errors += [float((a - b).abs().mean()) * NORMALIZED for a, b in zip(images, cpu_images, strict=True)]
        assert np.mean(errors) <= 2.0 and max(errors) <= 5.0, errors  # 0-255 units


class TestArrayFunction:
    """Written once over arrays: NumPy on DALI's CPU operators (python_function), CuPy on the GPU."""

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("steps", [[Posterize(bits=3)], [T.CenterCrop(64), EveryOtherColumn()]])
    def test_parity(self, device, photos, steps):
        if device == "gpu":
            pytest.importorskip("cupy")
        exact = device == "cpu"  # the same NumPy on the same decoded pixels; nvJPEG's IDCT differs slightly
        check_backend_parity(steps, photos, device=device, mean_tol=0.0 if exact else 1.0,
                             max_tol=0.0 if exact else 2.5)  # fmt: skip


class TestHueForms:
    """Hue's two lowerings (``_color.HUE_CHANNELS_TOGETHER``: the GPU's, channels together in
    fewer operators; the CPU's, one by one) give the same values: the GPU's runs here on DALI's
    CPU operators against the CPU's."""

    @pytest.mark.parametrize(
        "steps",
        [
            [T.ColorJitter(hue=(0.1, 0.1))],
            [T.ColorJitter(hue=(-0.5, -0.5))],
            [T.ColorJitter(0.4, 0.4, 0.4, 0.1)],
            [T.ToDtype(torch.float32, scale=True), T.Normalize(**IMAGENET), T.ColorJitter(hue=0.2)],
            [T.RandomPhotometricDistort(p=1.0)],
            [T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.5)],  # inside a conditional branch
        ],
        ids=["hue", "hue-half", "all-four", "float-normalized", "photometric", "in-a-branch"],
    )
    def test_together_equals_one_by_one(self, photos, monkeypatch, steps):
        from gpupipe.backends._dali import _color

        forms = {}
        for together in (False, True):
            monkeypatch.setitem(_color.HUE_CHANNELS_TOGETHER, "cpu", together)
            forms[together] = run_dali(steps, photos)
        for a, b in zip(forms[False], forms[True], strict=True):  # (the one-by-one form's parity with
            torch.testing.assert_close(a, b, atol=0, rtol=0)  # torchvision: TestParity)

    def test_the_gpu_graph_takes_the_channels_together(self):
        """The hue of ColorJitter: 41 operators on the GPU, 72 on the CPU."""
        from .support.dali_graph import parse
        from .test_gpu_graph import define

        def added(gpu: bool) -> int:
            crop = [T.RandomResizedCrop(64)]
            graphs = (define([*crop, T.ColorJitter(hue=0.1)], gpu=gpu), define(crop, gpu=gpu))
            with_hue, without = (len(parse(g.pipe.serialize())[0]) for g in graphs)
            return with_hue - without

        assert (added(True), added(False)) == (41, 72)


class TestArithmetic:
    """A user transform written once runs on every backend (in a loader: tests/test_loader.py)."""

    @pytest.mark.parametrize("device", DEVICES)
    def test_parity(self, device, photos):
        steps = [T.CenterCrop(64), T.ToDtype(torch.float32, scale=True), AddMult(add=-0.5, mult=2.0)]
        check_backend_parity(steps, photos, device=device, unit=255 / 2)


def test_dali_augmentation_depends_only_on_seed_epoch_and_rank(shards, clean_env):
    pipeline = gp.Pipeline(shards, [T.RandomResizedCrop(16), T.RandomHorizontalFlip()])

    def epoch0(first_run_epoch1):
        loader = gp.Loader(pipeline, 4, shuffle=True, seed=3, backend="dali", device="cpu", num_workers=1)
        if first_run_epoch1:  # epoch 0 then runs on a rebuilt pipeline, not the one built with the loader
            loader.set_epoch(1)
            list(loader)
            loader.set_epoch(0)
        return torch.cat([images for images, _ in loader])

    pytest.importorskip("nvidia.dali")
    torch.testing.assert_close(epoch0(False), epoch0(True), atol=0, rtol=0)


class TestFailures:
    """What a DALI failure is reported as: only a sample gpupipe's decoder also rejects is bad data."""

    GOOD = encode_jpeg(synthetic_image(0, size=(24, 24)))

    def samples(self, *pairs):
        from gpupipe.sources import RawSample

        return [RawSample(key, "s.tar", data, 0) for key, data in pairs]

    def explain(self, message, samples):
        from gpupipe.backends._dali._failures import explain_failure

        return explain_failure(RuntimeError(message), iter(samples), batch=3, ahead=2)

    @pytest.mark.parametrize("message", [
        # DALI's own (libdali_core's strings), as PropagateError passes them on
        "Critical error in pipeline:\nError in MIXED operator `nvidia.dali.fn.decoders.image`, which was used in "
        "the pipeline definition with the following traceback:\n...\nCan't allocate 115356000 bytes on device 0.",
        "Error in GPU operator `nvidia.dali.fn.resize`:\nCUDA allocation failed",
        "[/opt/dali/dali/core/mm/default_resources.cc:123] CUDA error: out of memory",
        "Error in MIXED operator `decoders__Image`: std::bad_alloc",
        "cudaErrorMemoryAllocation: out of memory",
    ])  # fmt: skip
    def test_out_of_memory_is_torchs_error_not_bad_data(self, message):
        error = self.explain(message, self.samples(("a", self.GOOD), ("b", b"\xff\xd8broken")))
        assert isinstance(error, torch.OutOfMemoryError) and not isinstance(error, gp.DataError)
        assert "batch 3" in str(error)

    def test_a_cuda_failure_is_not_bad_data(self):
        error = self.explain("CUDA error: an illegal memory access was encountered", self.samples(("b", b"\xff\xd8x")))
        assert type(error) is RuntimeError and "on the device" in str(error)

    def test_a_decoder_status_is_not_taken_for_the_device(self):
        """nvJPEG reports a bad bitstream with a status: the sample search decides."""
        message = "Error in MIXED operator decoders__Image: nvImageCodec failure: '#3' (NVJPEG_STATUS_BAD_JPEG)"
        error = self.explain(message, self.samples(("a", self.GOOD), ("b", b"\xff\xd8x")))
        assert isinstance(error, gp.SampleError) and error.key == "b"

    def test_a_sample_our_decoder_rejects_is_named(self):
        error = self.explain("Error in CPU operator decoders__Image: failed to decode",
                             self.samples(("a", self.GOOD), ("b", self.GOOD[:100])))  # fmt: skip
        assert isinstance(error, gp.SampleError) and (error.key, error.shard) == ("b", "s.tar")
        assert "DALI: " in str(error)

    def test_no_sample_to_blame_is_not_bad_data(self):
        error = self.explain("Error in CPU operator resize: something else", self.samples(("a", self.GOOD)))
        assert type(error) is RuntimeError and "not known to be bad data" in str(error)
