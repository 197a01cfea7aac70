"""Issue 37's building blocks of the augmentation policies: RandomInvert, RandomPosterize and
RandomAutocontrast — torchvision's kernels on the torch backend, the same values on DALI (tables
and float32 arithmetic: exact on the CPU), and the coin's rate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from gpupipe import transforms as T
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import (
    check_backend_parity,
    check_invalid,
    check_torchvision_signature,
    check_transform,
    drawn_params,
)

FLOAT = T.ToDtype(torch.float32, scale=True)


def as_float(image):
    return image.to(torch.float32) / 255


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [encode_jpeg(synthetic_image(30 + i, size=(40 + 3 * i, 56 - 2 * i))) for i in range(8)]


def flat_and_dark(photo):
    """A channel that is flat and one that spans little: autocontrast's two branches."""
    image = photo.clone()
    image[0] = 77
    image[1] = image[1] // 8 + 100
    return image


class TestRandomInvert:
    def test_invalid_arguments(self):
        check_invalid(lambda: T.RandomInvert(p=-0.1), "p")

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomInvert, v2.RandomInvert)

    @pytest.mark.parametrize("as_float_image", [False, True])
    def test_matches_torchvision(self, photo, as_float_image):
        image = as_float(photo) if as_float_image else photo
        results = check_transform(T.RandomInvert(), image, lambda img, p: v2.functional.invert(img) if p.apply else img,
                                  seeds=range(8))  # fmt: skip
        assert {p.apply for p, _ in results} == {True, False}

    def test_rate(self):
        assert abs(np.mean([p.apply for p in drawn_params(T.RandomInvert(p=0.3), 1, 1, 4000)]) - 0.3) < 0.03


class TestRandomPosterize:
    @pytest.mark.parametrize("kwargs", [dict(bits=9), dict(bits=-1), dict(bits=2.0), dict(bits=True)])
    def test_invalid_arguments(self, kwargs):
        check_invalid(lambda: T.RandomPosterize(**kwargs), "bits")

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomPosterize, v2.RandomPosterize)

    @pytest.mark.parametrize("bits", [0, 1, 4, 8])
    @pytest.mark.parametrize("as_float_image", [False, True])
    def test_matches_torchvision(self, photo, bits, as_float_image):
        image = as_float(photo) if as_float_image else photo
        check_transform(T.RandomPosterize(bits, p=0.7), image,
                        lambda img, p: v2.functional.posterize(img, bits) if p.apply else img,
                        seeds=range(6))  # fmt: skip


class TestRandomAutocontrast:
    def test_invalid_arguments(self):
        check_invalid(lambda: T.RandomAutocontrast(p=2), "p")

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomAutocontrast, v2.RandomAutocontrast)

    @pytest.mark.parametrize("as_float_image", [False, True])
    def test_matches_torchvision(self, photo, as_float_image):
        image = flat_and_dark(photo)
        image = as_float(image) if as_float_image else image
        check_transform(T.RandomAutocontrast(p=0.6), image,
                        lambda img, p: v2.functional.autocontrast(img) if p.apply else img, seeds=range(6))  # fmt: skip


class TestRandomAdjustSharpness:
    @pytest.mark.parametrize(
        "kwargs", [dict(sharpness_factor=-1), dict(sharpness_factor="2"), dict(sharpness_factor=None)]
    )
    def test_invalid_arguments(self, kwargs):
        check_invalid(lambda: T.RandomAdjustSharpness(**kwargs), "sharpness_factor")

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomAdjustSharpness, v2.RandomAdjustSharpness)

    @pytest.mark.parametrize("factor", [0.0, 0.5, 2.0])
    @pytest.mark.parametrize("as_float_image", [False, True])
    def test_matches_torchvision(self, photo, factor, as_float_image):
        image = as_float(photo) if as_float_image else photo
        check_transform(T.RandomAdjustSharpness(factor, p=0.7), image,
                        lambda img, p: v2.functional.adjust_sharpness(img, factor) if p.apply else img,
                        seeds=range(6))  # fmt: skip


class TestRandomEqualize:
    def test_invalid_arguments(self):
        check_invalid(lambda: T.RandomEqualize(p=1.1), "p")

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomEqualize, v2.RandomEqualize)

    @pytest.mark.parametrize("as_float_image", [False, True])
    def test_matches_torchvision(self, photo, as_float_image):
        image = flat_and_dark(photo)
        image = as_float(image) if as_float_image else image
        check_transform(T.RandomEqualize(p=0.6), image, lambda img, p: v2.functional.equalize(img) if p.apply else img,
                        seeds=range(6))  # fmt: skip


class TestOnDali:
    @pytest.fixture(autouse=True)
    def _dali(self):
        pytest.importorskip("nvidia.dali")

    @pytest.mark.parametrize("steps", [
        [T.RandomInvert()],
        [FLOAT, T.RandomInvert(p=0.7)],
        [T.RandomPosterize(3)],
        [T.RandomPosterize(0, p=1.0)],
        [FLOAT, T.RandomPosterize(2, p=0.8)],
        [T.RandomAutocontrast()],
        [T.CenterCrop(24), FLOAT, T.RandomAutocontrast(p=0.9)],
        [T.RandomAutocontrast(p=1.0), T.RandomInvert(), T.RandomPosterize(4), T.RandomHorizontalFlip()],
    ])  # fmt: skip
    def test_exact(self, photos, steps):
        unit = 255.0 if steps[0] is FLOAT or FLOAT in steps else None
        check_backend_parity(steps, photos, unit=unit, mean_tol=0.0, max_tol=0.0)

    @pytest.mark.parametrize("steps", [[T.RandomEqualize(p=1.0)], [FLOAT, T.RandomEqualize(p=0.6)]])
    def test_equalize_is_opencvs_table_not_pils(self, photos, steps):
        """DALI's equalize builds OpenCV's table, torchvision PIL's: the smaller the image, the
        sparser its histogram and the further apart. Measured: these 8 images of about 40 x 56,
        5.5 units apart on average, 9.9 for the worst; 16 of about 100 x 80, 1.6 and 2.4."""
        unit = 255.0 if FLOAT in steps else None
        check_backend_parity(steps, photos, unit=unit, mean_tol=6.0, max_tol=10.5)

    @pytest.mark.parametrize("steps", [
        [T.RandomAdjustSharpness(2.0, p=1.0)],
        [T.RandomAdjustSharpness(0.0)],
        [FLOAT, T.RandomAdjustSharpness(1.7, p=0.8)],
        [T.CenterCrop((2, 40)), T.RandomAdjustSharpness(3.0, p=1.0)],  # too thin: kept
    ])  # fmt: skip
    def test_sharpness_within_one_unit(self, photos, steps):
        """torch fuses the blend's multiply-add (one rounding), DALI rounds twice: a value may
        land one unit apart after the truncation to uint8 (none did in 1.3 M values tried)."""
        unit = 255.0 if FLOAT in steps else None
        check_backend_parity(steps, photos, unit=unit, mean_tol=0.01, max_tol=0.05)
