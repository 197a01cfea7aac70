"""SSD's transforms (``RandomZoomOut``, ``RandomIoUCrop``): torchvision v2's arguments, samplers and
kernels, and the DALI backend's lowering (with and without boxes: tests/test_targets_torchvision.py
runs them with masks and boxes against torchvision's classes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import check_backend_parity, check_invalid, check_transform, sample_factors


class TestRandomZoomOut:
    @pytest.mark.parametrize("kwargs, name", [
        (dict(side_range=(0.5, 2.0)), "side_range"), (dict(side_range=(3.0, 2.0)), "side_range"),
        (dict(p=1.5), "p"), (dict(fill="white"), "fill"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomZoomOut(**kwargs), name)

    def test_defaults_are_torchvision(self):
        t, tv = T.RandomZoomOut(), v2.RandomZoomOut()
        assert t.side_range == tuple(tv.side_range) and t.p == tv.p and t.fill == 0.0

    def test_matches_torchvision_with_the_drawn_padding(self, photo):
        t = T.RandomZoomOut(fill=(10, 20, 30), side_range=(1.0, 2.5), p=0.7)
        tv = v2.RandomZoomOut(fill=[10, 20, 30], side_range=(1.0, 2.5), p=1.0)
        results = check_transform(t, photo, lambda img, p: tv.transform(img, {"padding": list(p.padding)}) if any(
            p.padding) else img, seeds=range(8))  # fmt: skip
        assert any(any(p.padding) for p, _ in results) and any(not any(p.padding) for p, _ in results)

    def test_canvas_follows_torchvision_formula(self):
        """canvas = int(side * r), left = int((canvas - side) * u): torchvision's make_params, with
        gpupipe's draws in place of torch's."""
        t = T.RandomZoomOut(side_range=(1.0, 4.0), p=0.3)
        (factors,) = sample_factors([t], 4000)
        for f in factors[:300]:
            on, r, u, v = f.tolist()
            canvas_w, canvas_h = int(53 * r), int(37 * r)
            left, top = int((canvas_w - 53) * u), int((canvas_h - 37) * v)
            want = (left, top, canvas_w - left - 53, canvas_h - top - 37) if on else (0, 0, 0, 0)
            assert t.make_params(37, 53, f).padding == want
        assert abs(factors[:, 0].mean() - 0.3) < 0.03 and abs(factors[:, 1].mean() - 2.5) < 0.05  # p, r ~ U[1, 4]


class TestRandomIoUCrop:
    def test_invalid_arguments(self):
        check_invalid(lambda: T.RandomIoUCrop(min_scale=0.8, max_scale=0.5), "min_scale")
        check_invalid(lambda: T.RandomIoUCrop(sampler_options=()), "sampler_options")
        check_invalid(lambda: T.RandomIoUCrop(trials=0), "trials")

    def test_defaults_are_torchvision(self):
        t, tv = T.RandomIoUCrop(), v2.RandomIoUCrop()
        assert (t.min_scale, t.max_scale, t.min_aspect_ratio, t.max_aspect_ratio, t.trials) == (
            tv.min_scale, tv.max_scale, tv.min_aspect_ratio, tv.max_aspect_ratio, tv.trials)  # fmt: skip
        assert list(t.sampler_options or ()) == list(tv.options)
        assert t.draws == t.ROUNDS * (1 + 4 * t.trials)

    def test_windows_hold_a_box_centre_at_the_drawn_iou(self):
        """Each window: its scale and aspect in range, a box's centre inside, an IoU with one of
        those at least the option (one option here: 0.5); the option 1.0 (1 in 7 of the
        defaults) and no boxes: no crop."""
        boxes = np.array([[10, 10, 60, 50], [70, 5, 90, 30]], np.float64)
        cx, cy = boxes[:, [0, 2]].mean(1), boxes[:, [1, 3]].mean(1)
        rng = np.random.default_rng(1)
        t = T.RandomIoUCrop(sampler_options=(0.5,))
        for _ in range(300):
            p = t.make_params(80, 100, rng.random(t.draws), boxes=boxes)
            assert p is not None  # (these boxes always allow one in 4 x 40 trials)
            assert 0.5 <= p.width / p.height <= 2.0 and 30 <= p.width <= 100 and 24 <= p.height <= 80
            inside = (p.left < cx) & (cx < p.left + p.width) & (p.top < cy) & (cy < p.top + p.height)
            assert tuple(inside.tolist()) == p.within and inside.any()
            window = np.array([[p.left, p.top, p.left + p.width, p.top + p.height]], np.float64)
            assert T._detection.box_iou(boxes[inside], window).max() >= 0.5
        default = T.RandomIoUCrop()
        crops = sum(
            default.make_params(80, 100, rng.random(default.draws), boxes=boxes) is not None for _ in range(700)
        )
        assert 0.78 < crops / 700 < 0.93  # 6 in 7 draw an option below 1
        assert default.make_params(80, 100, rng.random(default.draws), boxes=np.zeros((0, 4))) is None

    def test_iou_is_torchvisions(self):
        from torchvision.ops import box_iou

        rng = np.random.default_rng(2)
        a, b = rng.uniform(0, 50, (6, 4)), rng.uniform(0, 50, (3, 4))
        a[:, 2:] += a[:, :2]
        b[:, 2:] += b[:, :2]
        ours = T._detection.box_iou(a, b)
        np.testing.assert_allclose(ours, box_iou(torch.from_numpy(a), torch.from_numpy(b)).numpy(), rtol=1e-12)

    def test_refused_without_boxes_or_inside_random_apply(self, tmp_path):
        source = gp.WebDataset(str(tmp_path / "x.tar"), fields={"image": "jpg", "boxes": gp.fields.Boxes("npy")})
        with pytest.raises(gp.ConfigError, match="chooses its window by the sample's boxes: give a Boxes field"):
            gp.Pipeline(str(tmp_path / "x.tar"), [T.RandomIoUCrop(), T.Resize((32, 32))])
        with pytest.raises(gp.ConfigError, match=r"RandomApply.*RandomIoUCrop"):
            gp.Pipeline(source, [T.RandomApply([T.RandomIoUCrop()]), T.Resize((32, 32))])


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [encode_jpeg(synthetic_image(2000 + i, size=(60 + 7 * i, 90 - 5 * i))) for i in range(6)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_zoom_out_on_dali(device, photos):
    pytest.importorskip("nvidia.dali")
    if device == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    steps = [T.RandomZoomOut(fill=(200, 100, 0), side_range=(1.0, 2.0), p=0.8), T.Resize((96, 96))]
    check_backend_parity(steps, photos, device=device)


class TestRandomPhotometricDistort:
    def test_defaults_are_torchvision(self):
        t, tv = T.RandomPhotometricDistort(), v2.RandomPhotometricDistort()
        assert (t.brightness, t.contrast, t.saturation, t.hue, t.p) == (
            tuple(tv.brightness), tuple(tv.contrast), tuple(tv.saturation), tuple(tv.hue), tv.p)  # fmt: skip
        check_invalid(lambda: T.RandomPhotometricDistort(hue=(-0.7, 0.1)), "hue")
        check_invalid(lambda: T.RandomPhotometricDistort(p=2), "p")

    @pytest.mark.parametrize("p", [0.5, 1.0])
    def test_matches_torchvision_with_the_drawn_parameters(self, photo, p):
        tv = v2.RandomPhotometricDistort(p=p)

        def reference(img, params):
            theirs = params._asdict()
            theirs = {f"{k}_factor" if k in ("brightness", "contrast", "saturation", "hue") else k: v
                      for k, v in theirs.items()}  # fmt: skip
            theirs["channel_permutation"] = None if params.permutation is None else torch.tensor(params.permutation)
            del theirs["permutation"]
            return tv.transform(img, theirs)

        results = check_transform(T.RandomPhotometricDistort(p=p), photo, reference, seeds=range(12))
        assert any(r.permutation is not None for r, _ in results) and any(r.contrast_before for r, _ in results)

    def test_draws(self):
        t = T.RandomPhotometricDistort(p=0.3)
        (f,) = sample_factors([t], 20000)
        on = ~np.isnan(f[:, :4])
        assert np.abs(on.mean(0) - 0.3).max() < 0.02 and abs(f[:, 4].mean() - 0.5) < 0.02
        assert abs(f[:, 5].mean() - 0.3) < 0.02
        perms = {tuple(row) for row in f[:, 6:9].astype(int).tolist()}
        assert len(perms) == 6  # every permutation of 3
        assert np.nanmin(f[:, 3]) >= -0.05 and np.nanmax(f[:, 3]) <= 0.05


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("steps", [[T.RandomPhotometricDistort()], [T.RandomPhotometricDistort(p=1.0)],
                                   [T.ToDtype(torch.float32, scale=True), T.RandomPhotometricDistort(p=1.0)]],
                         ids=["uint8", "uint8-every-step", "float"])  # fmt: skip
def test_photometric_distort_on_dali(device, steps, photos):
    """torchvision's kernels in torchvision's order: 0.0005 units apart on average, 0.002 for the
    worst image (uint8, 2026-11-26, DALI-CPU), from the hue's float32 round trip."""
    pytest.importorskip("nvidia.dali")
    if device == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_backend_parity(steps, photos, device=device, mean_tol=0.01, max_tol=0.01)
