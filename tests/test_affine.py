"""Issue 37's geometric building block RandomRotation: torchvision's kernel and sampler on the
torch backend, ``warp_affine`` with the same inverse map on DALI (nearest neighbour the same but
for ties; bilinear the same inside the image, apart at the edge it shares with the fill)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import (
    check_invalid,
    check_torchvision_signature,
    check_transform,
    drawn_params,
    reference_outputs,
    run_dali,
)

FLOAT = T.ToDtype(torch.float32, scale=True)


class TestRandomRotation:
    @pytest.mark.parametrize(("kwargs", "name"), [
        (dict(degrees=-5), "degrees"),
        (dict(degrees=(10, -10)), "degrees"),
        (dict(degrees=10, interpolation="bicubic"), "interpolation"),
        (dict(degrees=10, expand=1), "expand"),
        (dict(degrees=10, center=(1, 2, 3)), "center"),
        (dict(degrees=10, fill="black"), "fill"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomRotation(**kwargs), name)

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomRotation, v2.RandomRotation)

    @pytest.mark.parametrize("kwargs", [
        dict(degrees=45),
        dict(degrees=(-180, 180), interpolation="bilinear", fill=(10, 20, 30)),
        dict(degrees=30, expand=True),
        dict(degrees=90, center=(12.5, 40)),
    ])  # fmt: skip
    def test_matches_torchvision(self, photo, kwargs):
        t = T.RandomRotation(**kwargs)

        def reference(img, p):
            fill = list(t.fill) if isinstance(t.fill, tuple) else t.fill
            center = list(t.center) if t.center else None
            mode = v2.InterpolationMode(T.InterpolationMode(t.interpolation).value)
            return v2.functional.rotate(img, p.angle, interpolation=mode,
                                        expand=t.expand, center=center, fill=fill)  # fmt: skip

        check_transform(t, photo, reference, seeds=range(4))

    def test_the_angle_is_uniform(self):
        angles = np.array([p.angle for p in drawn_params(T.RandomRotation((-30, 60)), 8, 8, 5000)])
        counts = np.histogram(angles, bins=9, range=(-30, 60))[0]
        assert angles.min() >= -30 and angles.max() < 60
        assert ((counts - 5000 / 9) ** 2 / (5000 / 9)).sum() < 26.1  # chi-square, 8 degrees of freedom, p = 0.001

    def test_expand_makes_the_size_vary(self):
        pipe = gp.Pipeline(["a.tar"], [T.RandomRotation(30, expand=True), T.CenterCrop(32)])
        assert str(pipe.specs[1]) == "[3, ?, ?] uint8" and str(pipe.output_spec) == "[3, 32, 32] uint8"


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [encode_jpeg(synthetic_image(50 + i, size=(60 + 5 * i, 90 - 3 * i))) for i in range(12)]


def differences(steps, photos, scale=1.0):
    """Per image, the absolute differences torch vs DALI-CPU (max over channels), in 0-255 units."""
    ref, got = reference_outputs(steps, photos), run_dali(steps, photos)
    return [((r.double() - g.double()) * scale).abs().max(0).values for r, g in zip(ref, got, strict=True)]


class TestRandomRotationOnDali:
    @pytest.fixture(autouse=True)
    def _dali(self):
        pytest.importorskip("nvidia.dali")

    @pytest.mark.parametrize("steps", [
        [T.RandomRotation(180)],
        [T.RandomRotation((-45, 45), fill=128)],
        [T.RandomRotation(180, center=(3.5, 7)), T.CenterCrop(40)],
    ])  # fmt: skip
    def test_nearest_picks_the_same_pixels_but_at_ties(self, photos, steps):
        """Measured: 1 to 2 values in 100,000 differ (a source point halfway between two pixels:
        torch rounds half to even, DALI takes the pixel it falls in)."""
        share = np.mean([float((d > 0).double().mean()) for d in differences(steps, photos)])
        assert share < 1e-4

    @pytest.mark.parametrize("steps", [
        [T.RandomRotation(30, interpolation="bilinear")],
        [FLOAT, T.RandomRotation(90, interpolation="bilinear", center=(10, 20))],
    ])  # fmt: skip
    def test_bilinear_agrees_the_edge_with_the_fill_included(self, photos, steps):
        """The image is warped with a mask channel of ones and the fill put in as torchvision's
        ``_apply_grid_transform`` does (``(v − fill) · mask + fill``): within the last rounding
        everywhere, the edge the rotated image shares with the fill included (warping with DALI's
        own fill put it up to 64 apart there)."""
        scale = 255.0 if steps[0] is FLOAT else 1.0
        assert max(float(d.max()) for d in differences(steps, photos, scale)) <= 1.0 + 1e-4

    @pytest.mark.parametrize("steps", [
        [T.RandomRotation(60, fill=(10, 200, 30))],
        [T.RandomRotation(60, interpolation="bilinear", fill=(10, 200, 30))],
        [FLOAT, T.RandomAffine(20, translate=(0.2, 0.2), fill=(0.1, 0.8, 0.3))],
    ])  # fmt: skip
    def test_a_fill_per_channel(self, photos, steps):
        """Nearest: the same pixels but at ties; bilinear within the last rounding."""
        scale = 255.0 if steps[0] is FLOAT else 1.0
        ds = differences(steps, photos, scale)
        if steps[-1].interpolation == T.InterpolationMode.NEAREST:
            assert np.mean([float((d > 0).double().mean()) for d in ds]) < 1e-3
        else:
            assert max(float(d.max()) for d in ds) <= 1.0 + 1e-4

    @pytest.mark.parametrize("t", [T.RandomRotation(10, expand=True)])
    def test_what_dali_does_not_take_is_refused_at_build(self, t):
        from gpupipe import backends

        with pytest.raises(gp.UnsupportedTransformError, match="RandomRotation"):
            backends.get("dali").require_supported([t])


class TestRandomAffine:
    @pytest.mark.parametrize(("kwargs", "name"), [
        (dict(degrees=-1), "degrees"),
        (dict(degrees=0, translate=(0.5, 1.5)), "translate"),
        (dict(degrees=0, scale=(0.0, 1.0)), "scale"),
        (dict(degrees=0, scale=(1.2, 0.8)), "scale"),
        (dict(degrees=0, shear=(1, 2, 3)), "shear"),
        (dict(degrees=0, shear=(10, -10)), "shear"),
        (dict(degrees=0, interpolation="bicubic"), "interpolation"),
        (dict(degrees=0, center=(1,)), "center"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomAffine(**kwargs), name)

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomAffine, v2.RandomAffine)

    @pytest.mark.parametrize("kwargs", [
        dict(degrees=30, translate=(0.1, 0.2), scale=(0.8, 1.2), shear=10),
        dict(degrees=0, shear=(-5, 5, -20, 20), interpolation="bilinear", fill=(9, 8, 7)),
        dict(degrees=(10, 40), scale=(0.5, 0.6), center=(3, 90.5)),
    ])  # fmt: skip
    def test_matches_torchvision(self, photo, kwargs):
        t = T.RandomAffine(**kwargs)

        def reference(img, p):
            fill = list(t.fill) if isinstance(t.fill, tuple) else t.fill
            mode = v2.InterpolationMode(T.InterpolationMode(t.interpolation).value)
            return v2.functional.affine(img, angle=p.angle, translate=list(p.translate), scale=p.scale,
                                        shear=list(p.shear), interpolation=mode, fill=fill,
                                        center=list(t.center) if t.center else None)  # fmt: skip

        check_transform(t, photo, reference, seeds=range(4))

    def test_the_draws_follow_torchvisions_laws(self):
        t = T.RandomAffine(degrees=(-10, 30), translate=(0.25, 0.5), scale=(0.5, 2.0), shear=(-5, 5, 10, 20))
        params = drawn_params(t, 100, 80, 4000)
        tx = np.array([p.translate[0] for p in params])
        ty = np.array([p.translate[1] for p in params])
        assert tx.min() >= -20 and tx.max() <= 20 and ty.min() >= -50 and ty.max() <= 50  # ±0.25·80, ±0.5·100
        assert abs(tx.mean()) < 0.6 and abs(ty.mean()) < 1.5
        for values, lo, hi in ([p.angle for p in params], -10, 30), ([p.scale for p in params], 0.5, 2.0), \
                ([p.shear[0] for p in params], -5, 5), ([p.shear[1] for p in params], 10, 20):  # fmt: skip
            v = np.array(values)
            assert v.min() >= lo and v.max() < hi and abs(v.mean() - (lo + hi) / 2) < 0.03 * (hi - lo)

    def test_a_number_for_shear_is_x_only(self):
        assert T.RandomAffine(0, shear=7).shear == (-7.0, 7.0)
        assert all(p.shear[1] == 0 for p in drawn_params(T.RandomAffine(0, shear=7), 10, 10, 50))


class TestRandomAffineOnDali:
    @pytest.fixture(autouse=True)
    def _dali(self):
        pytest.importorskip("nvidia.dali")

    @pytest.mark.parametrize("steps", [
        [T.RandomAffine(degrees=30, translate=(0.1, 0.2), scale=(0.8, 1.2), shear=10)],
        [T.RandomAffine(degrees=0, shear=(-5, 5, -20, 20), fill=128), T.CenterCrop(40)],
        [T.RandomAffine(degrees=(10, 40), scale=(0.5, 0.6), center=(3, 30.5))],
    ])  # fmt: skip
    def test_nearest_picks_the_same_pixels_but_at_ties(self, photos, steps):
        share = np.mean([float((d > 0).double().mean()) for d in differences(steps, photos)])
        assert share < 1e-4


class TestWarpForms:
    """Bilinear with zeros outside has two lowerings (``_warp.PAD_FOR_ZEROS``): DALI's
    ``fill_value`` (the GPU's) and, on the CPU, the image padded by a pixel of zeros and sampled
    with the border clamp (about 1.5x faster on DALI's CPU kernel). Both sample zeros at every
    tap outside the image; the shifted map rounds a source point differently now and then."""

    @pytest.fixture(autouse=True)
    def _dali(self):
        pytest.importorskip("nvidia.dali")

    @pytest.mark.parametrize("steps", [
        [T.RandomRotation(180, interpolation="bilinear")],
        [T.RandomAffine(degrees=30, translate=(0.1, 0.2), scale=(0.8, 1.2), shear=10, interpolation="bilinear",
                        fill=(10, 200, 30))],
        [FLOAT, T.RandomRotation(45, interpolation="bilinear", center=(10, 20), fill=0.5)],
        [T.RandomResizedCrop(48), T.RandomRotation(20, interpolation="bilinear")],  # the size fixed: constants
    ], ids=["zeros", "fill-per-channel", "float-fill", "size-fixed"])  # fmt: skip
    def test_padded_agrees_with_dalis_fill(self, photos, monkeypatch, steps):
        from gpupipe.backends._dali import _warp

        forms = {}
        for pad in (False, True):
            monkeypatch.setitem(_warp.PAD_FOR_ZEROS, "cpu", pad)
            forms[pad] = run_dali(steps, photos)
        apart = [(a.double() - b.double()).abs() for a, b in zip(forms[False], forms[True], strict=True)]
        if steps[0] is FLOAT:  # float32 coordinates' rounding, in 0-255 units
            assert max(float(d.max()) * 255 for d in apart) < 0.01
        else:  # the last rounding, now and then (measured: 0.1% of values)
            assert max(float(d.max()) for d in apart) <= 1
            assert np.mean([float((d > 0).double().mean()) for d in apart]) < 5e-3

    def test_only_the_cpu_graph_pads(self):
        from .support.dali_graph import parse
        from .test_gpu_graph import define

        def schemas(gpu: bool) -> list[str]:
            graph = define([T.RandomResizedCrop(64), T.RandomRotation(30, interpolation="bilinear")], gpu=gpu)
            return [op.schema for op in parse(graph.pipe.serialize())[0]]

        assert "Slice" in schemas(False) and "Slice" not in schemas(True)
        assert schemas(True).count("WarpAffine") == schemas(False).count("WarpAffine") == 1
