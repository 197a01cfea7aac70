"""Every transform: argument validation, output shape/dtype, equality with torchvision on fixed
parameters (torch backend), and parameter sampling against torchvision's."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.core._geometry import resized_crop_windows

from .support.checkers import (
    AddMult,
    EveryOtherColumn,
    Posterize,
    check_invalid,
    check_torchvision_signature,
    check_transform,
    drawn_params,
    run_torch,
    spec_of,
)


def as_float(image):
    return image.to(torch.float32) / 255


class TestRandomResizedCrop:
    @pytest.mark.parametrize(
        "kwargs, name",
        [
            (dict(size=0), "size"),
            (dict(size=(1, 2, 3)), "size"),
            (dict(size="224"), "size"),
            (dict(size=224, scale=(0.5,)), "scale"),
            (dict(size=224, scale=(0.9, 0.1)), "scale"),
            (dict(size=224, ratio=(0, 1)), "ratio"),
            (dict(size=224, interpolation="lanczos"), "interpolation"),
            (dict(size=224, antialias=None), "antialias"),
        ],
    )
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomResizedCrop(**kwargs), name)

    def test_options_are_keyword_only(self):
        with pytest.raises(TypeError):
            T.RandomResizedCrop(224, (0.5, 1.0))  # type: ignore[call-arg]

    def test_defaults_are_torchvision(self):
        t, tv = T.RandomResizedCrop(224), v2.RandomResizedCrop(224)
        assert t.size == tuple(tv.size) and t.scale == tuple(tv.scale) and t.ratio == tuple(tv.ratio)
        assert isinstance(t.interpolation, T.InterpolationMode)  # strings are stored as the enum
        assert t.antialias is tv.antialias and t.interpolation.value == getattr(
            tv.interpolation, "value", tv.interpolation
        )

    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(size=48),
            dict(size=(40, 64), scale=(0.3, 0.9)),
            dict(size=32, interpolation=v2.InterpolationMode.BICUBIC),
            dict(size=50, interpolation="nearest", antialias=False),
        ],
    )
    def test_matches_torchvision(self, photo, kwargs):
        tv = v2.RandomResizedCrop(**kwargs)
        check_transform(T.RandomResizedCrop(**kwargs), photo, lambda img, p: tv.transform(img, p._asdict()))

    def test_sampling_matches_torchvision(self):
        t, tv = T.RandomResizedCrop(32), v2.RandomResizedCrop(32)
        h, w, n = 375, 500, 4000
        ours = drawn_params(t, h, w, n)
        torch.manual_seed(0)
        theirs = [tv.make_params([torch.empty(3, h, w)]) for _ in range(n)]

        def stats(ps, get):
            area = np.array([get(p, "height") * get(p, "width") / (h * w) for p in ps])
            logr = np.array([math.log(get(p, "width") / get(p, "height")) for p in ps])
            top = np.array([get(p, "top") for p in ps])
            return area.mean(), area.std(), logr.mean(), logr.std(), top.mean()

        a = stats(ours, lambda p, k: getattr(p, k))
        b = stats(theirs, lambda p, k: p[k])
        np.testing.assert_allclose(a[:4], b[:4], atol=0.02)
        assert abs(a[4] - b[4]) < 0.05 * h

    def test_fallback_is_central_crop(self):
        t = T.RandomResizedCrop(8, scale=(5.0, 6.0))  # never fits: torchvision's central fallback
        assert drawn_params(t, 100, 400, 1)[0] == (0, 133, 100, 133)

    @pytest.mark.parametrize("size, ratio", [((100, 5), (2.0, 4.0)), ((377, 500), (0.25, 0.5)),
                                             ((5, 100), (2.0, 2.5))])  # fmt: skip
    def test_fallback_rounds_half_to_even(self, size, ratio):
        """No attempt fits: the central crop's side is rounded as torchvision rounds it, half to
        even (``W / ratio`` is a tie for an odd side and a ratio of 2), on every backend's window."""
        t = T.RandomResizedCrop(8, scale=(0.9, 1.0), ratio=ratio)
        tv = v2.RandomResizedCrop(8, scale=(0.9, 1.0), ratio=ratio)
        p = tv.make_params([torch.empty(3, *size)])
        expected = [p["top"], p["left"], p["height"], p["width"]]
        assert list(drawn_params(t, size[0], size[1], 1)[0]) == expected
        factors = t.sample(np.random.default_rng(0).random((4, t.draws)))  # the DALI runner's, per batch
        assert resized_crop_windows(size[0], size[1], factors).tolist() == [expected] * 4


class TestRandomResize:
    """torchvision v2's RandomResize (its segmentation reference's 0.5-2x scaling): the shorter
    side uniform in [min_size, max_size), then torchvision's resize."""

    @pytest.mark.parametrize("kwargs, name", [
        (dict(min_size=0, max_size=10), "min_size"), (dict(min_size=10, max_size=10), "max_size"),
        (dict(min_size=10, max_size=20.0), "max_size"),
        (dict(min_size=10, max_size=20, interpolation=3), "interpolation"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomResize(**kwargs), name)

    def test_matches_torchvision_with_the_drawn_size(self, photo):
        t = T.RandomResize(40, 90, antialias=False)
        results = check_transform(t, photo, lambda img, p: v2.functional.resize(img, [p.size], antialias=False),
                                  seeds=range(4))  # fmt: skip
        for params, out in results:
            assert 40 <= params.size < 90 and min(out.shape[-2:]) == params.size
        assert not t.output_spec(T.ImageSpec(3, 100, 120)).fixed_size

    def test_sizes_are_uniform(self):
        t = T.RandomResize(10, 14)
        sizes = t.sample(np.random.default_rng(0).random((40000, 1)))
        counts = np.bincount(sizes[:, 0].astype(int) - 10, minlength=4)
        assert counts.sum() == 40000 and set(np.unique(sizes)) == {10, 11, 12, 13}
        assert abs(counts / 40000 - 0.25).max() < 0.01


class TestRandomShortestSize:
    """torchvision v2's RandomShortestSize (its detection reference's multi-scale training): one of
    ``min_size`` for the shorter side, uniformly, the scale capped by ``max_size``."""

    @pytest.mark.parametrize("kwargs, name", [
        (dict(min_size=0), "min_size"), (dict(min_size=()), "min_size"), (dict(min_size=[10, 2.5]), "min_size"),
        (dict(min_size=10, max_size=0), "max_size"), (dict(min_size=10, interpolation=3), "interpolation"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomShortestSize(**kwargs), name)

    def test_defaults_are_torchvision(self):
        t, tv = T.RandomShortestSize([480, 512], 1333), v2.RandomShortestSize([480, 512], 1333)
        assert t.min_size == tuple(tv.min_size) and t.max_size == tv.max_size and t.antialias is tv.antialias
        assert T.RandomShortestSize(8).min_size == (8,)

    def test_sizes_are_torchvision(self):
        """Every image size and shorter side: the size torchvision's own make_params gives (one
        choice, so it draws nothing), capped or not."""
        rng = np.random.default_rng(0)
        for h, w, short, cap in zip(rng.integers(1, 900, 300), rng.integers(1, 900, 300), rng.integers(1, 700, 300),
                                    rng.choice([0, 300, 1333], 300), strict=True):  # fmt: skip
            max_size = None if cap == 0 else int(cap)
            tv = v2.RandomShortestSize([int(short)], max_size)
            want = tv.make_params([torch.zeros(1, int(h), int(w))])["size"]
            got = T.RandomShortestSize([int(short)], max_size).make_params(int(h), int(w), np.array([0.0]))
            assert (got.height, got.width) == (max(want[0], 1), max(want[1], 1)), (h, w, short, max_size)

    def test_matches_torchvision_with_the_drawn_size(self, photo):
        t = T.RandomShortestSize([20, 30, 45], 60)
        results = check_transform(t, photo, lambda img, p: v2.functional.resize(img, [p.height, p.width]),
                                  seeds=range(4))  # fmt: skip
        for params, out in results:
            assert tuple(out.shape[-2:]) == (params.height, params.width) and max(params) <= 60
        assert not t.output_spec(T.ImageSpec(3, 100, 120)).fixed_size

    def test_choices_are_uniform(self):
        t = T.RandomShortestSize([10, 20, 30])
        chosen = t.sample(np.random.default_rng(0).random((30000, 1)))[:, 0].astype(int)
        counts = np.bincount(chosen, minlength=3)
        assert counts.sum() == 30000 and abs(counts / 30000 - 1 / 3).max() < 0.01


class TestResize:
    @pytest.mark.parametrize(
        "kwargs, name",
        [
            (dict(size=-1), "size"),
            (dict(size=None), "max_size"),
            (dict(size=(10, 20), max_size=30), "max_size"),
            (dict(size=100, max_size=100), "max_size"),
            (dict(size=10, interpolation=3), "interpolation"),
        ],
    )
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.Resize(**kwargs), name)

    def test_a_size_of_nothing_known_at_build_time_is_refused(self):
        """After a fixed size, ``max_size`` that rounds a side to 0 was an output spec of 0 rows
        and every sample refused at run time: the pipeline is refused when built."""
        with pytest.raises(gp.PipelineError, match=r"step 1: Resize.*makes an empty image, \[3, 0, 10\]"):
            gp.Pipeline(gp.FakeData(8), [T.CenterCrop((2, 1000)), T.Resize(1, max_size=10)])
        assert gp.Pipeline(gp.FakeData(8), [T.CenterCrop((2, 1000)), T.Resize(1, max_size=500)]).output_spec.height == 1

    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(size=37),
            dict(size=(50, 70)),
            dict(size=[61]),
            dict(size=100, max_size=150),
            dict(size=None, max_size=90),
            dict(size=64, interpolation="bicubic"),
            dict(size=150, antialias=False),
        ],
    )
    def test_matches_torchvision(self, photo, kwargs):
        tv = v2.Resize(**kwargs)
        check_transform(T.Resize(**kwargs), photo, lambda img, p: tv(img), seeds=[0])

    def test_variable_output_size(self):
        assert not T.Resize(256).output_spec(T.ImageSpec()).fixed_size
        assert T.Resize((3, 4)).output_spec(T.ImageSpec()).fixed_size

    @pytest.mark.parametrize("h, w", [(375, 500), (333, 500), (500, 281), (224, 224), (479, 640)])
    def test_output_size_rule(self, h, w):
        spec = T.Resize(256).output_spec(T.ImageSpec(3, h, w))
        expected = v2.Resize(256)(torch.empty(1, h, w)).shape[-2:]
        assert (spec.height, spec.width) == tuple(expected)


class TestCenterCrop:
    @pytest.mark.parametrize("size", [0, (1, 2, 3), None, 2.5])
    def test_invalid_arguments(self, size):
        check_invalid(lambda: T.CenterCrop(size), "size")

    @pytest.mark.parametrize("size", [64, (33, 47), (120, 160), (130, 171), (121, 10)])
    def test_matches_torchvision(self, photo, size):
        tv = v2.CenterCrop(size)
        check_transform(T.CenterCrop(size), photo, lambda img, p: tv(img), seeds=[0])

    @pytest.mark.parametrize("crop, size", [(5, 10), (4, 9), (13, 10), (12, 9), (10, 10)])
    def test_anchor_rule(self, crop, size):
        from gpupipe.core._geometry import center_crop_anchor

        image = torch.arange(size * size, dtype=torch.float32).reshape(1, size, size) + 1
        out = v2.functional.center_crop(image, [crop, crop])
        top = left = center_crop_anchor(crop, size)
        first = (top if top >= 0 else 0) * size + (left if left >= 0 else 0) + 1
        r, c = max(0, -top), max(0, -left)
        assert out[0, r, c] == first


class TestRandomCrop:
    @pytest.mark.parametrize(
        "kwargs, name",
        [
            (dict(size=0), "size"),
            (dict(size=8, padding=-1), "padding"),
            (dict(size=8, padding=(1, 2, 3)), "padding"),
            (dict(size=8, padding_mode="wrap"), "padding_mode"),
            (dict(size=8, fill="red"), "fill"),
            (dict(size=8, pad_if_needed=1), "pad_if_needed"),
        ],
    )
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomCrop(**kwargs), name)

    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(size=50),
            dict(size=(120, 160)),
            dict(size=40, padding=4),
            dict(size=(130, 100), pad_if_needed=True, fill=(10, 20, 30)),
            dict(size=(100, 170), padding=(1, 2), pad_if_needed=True, padding_mode="reflect"),
            dict(size=64, padding=(1, 2, 3, 4), padding_mode="edge"),
        ],
    )
    def test_matches_torchvision(self, photo, kwargs):
        tv = v2.RandomCrop(**kwargs)

        def reference(img, p):
            return tv.transform(
                img,
                dict(
                    needs_pad=any(p.padding),
                    padding=list(p.padding),
                    top=p.top,
                    left=p.left,
                    height=p.height,
                    width=p.width,
                    needs_crop=True,
                ),
            )

        check_transform(T.RandomCrop(**kwargs), photo, reference)

    def test_too_small_image_is_an_error(self):
        with pytest.raises(ValueError, match="pad_if_needed"):
            drawn_params(T.RandomCrop(200), 120, 160, 1)

    @pytest.mark.parametrize("padding_mode", ["reflect", "symmetric", "edge"])
    def test_reflecting_pad_too_large_is_too_small(self, padding_mode):
        """A reflecting pad larger than the image allows fails in torchvision (torch's "reflect"
        pads less than the side, "symmetric" at most the side): here the sample is too small (a
        ``TooSmall``, made a SampleError naming it), decided before any kernel runs, exactly
        where torchvision's own fails."""
        from gpupipe.core._geometry import TooSmall

        sizes = [(1, 1), (3, 5), (4, 4), (6, 2)]
        paddings: list[dict] = [dict(padding=3), dict(padding=(1, 4)), dict(pad_if_needed=True)]
        for (h, w), kwargs in itertools.product(sizes, paddings):
            t, tv = (
                T.RandomCrop(6, padding_mode=padding_mode, **kwargs),
                v2.RandomCrop(6, padding_mode=padding_mode, **kwargs),
            )
            image = torch.arange(3 * h * w, dtype=torch.uint8).reshape(3, h, w)
            try:
                expected = tv(image)
            except (RuntimeError, IndexError, ValueError):
                expected = None
            try:
                params = drawn_params(t, h, w, 1)[0]
            except TooSmall:
                assert expected is None, (h, w, kwargs)
                continue
            assert expected is not None, (h, w, kwargs, params)
            assert tuple(run_torch(t, image, params).shape) == (3, 6, 6)

    @pytest.mark.parametrize(
        "steps, refused",
        [([T.CenterCrop(10), T.RandomCrop(20)], "crop size"),
         ([T.CenterCrop(3), T.RandomCrop(4, padding=3, padding_mode="reflect")], "padding_mode='reflect'"),
         ([T.CenterCrop(10), T.RandomCrop(20, pad_if_needed=True)], None),
         ([T.CenterCrop(10), T.RandomCrop(20, padding=5)], None)],
    )  # fmt: skip
    def test_a_crop_known_too_large_at_build_time_is_refused(self, steps, refused):
        """After a fixed size, a crop every sample fails (run-time too-small refusals of the whole
        dataset) is refused when the pipeline is built; one that padding makes fit is not."""
        if refused is None:
            assert gp.Pipeline(gp.FakeData(8), steps).output_spec.height == 20
        else:
            with pytest.raises(gp.PipelineError, match=f"every sample would be refused.*{refused}"):
                gp.Pipeline(gp.FakeData(8), steps)


class TestRandomHorizontalFlip:
    @pytest.mark.parametrize("p", [-0.1, 1.5, "0.5", None])
    def test_invalid_arguments(self, p):
        check_invalid(lambda: T.RandomHorizontalFlip(p), "p")

    def test_matches_torchvision(self, photo):
        tv = v2.RandomHorizontalFlip(p=1.0)
        results = check_transform(
            T.RandomHorizontalFlip(), photo, lambda img, p: tv(img) if p.flip else img, seeds=range(20)
        )
        assert {p.flip for p, _ in results} == {True, False}

    def test_rate(self):
        flips = [p.flip for p in drawn_params(T.RandomHorizontalFlip(p=0.3), 1, 1, 4000)]
        assert abs(np.mean(flips) - 0.3) < 0.03


class TestRandomVerticalFlip:
    def test_invalid_arguments(self):
        check_invalid(lambda: T.RandomVerticalFlip(p=2), "p")

    def test_matches_torchvision(self, photo):
        tv = v2.RandomVerticalFlip(p=1.0)
        check_transform(T.RandomVerticalFlip(p=0.5), photo, lambda img, p: tv(img) if p.flip else img, seeds=range(8))


def _jitter_reference(tv):
    def reference(img, p):
        return tv.transform(
            img,
            dict(
                fn_idx=torch.tensor(p.order),
                brightness_factor=p.brightness,
                contrast_factor=p.contrast,
                saturation_factor=p.saturation,
                hue_factor=p.hue,
            ),
        )

    return reference


class TestColorJitter:
    @pytest.mark.parametrize(
        "kwargs, name",
        [
            (dict(brightness=-0.1), "brightness"),
            (dict(contrast=(0.5,)), "contrast"),
            (dict(saturation=(2, 1)), "saturation"),
            (dict(hue=0.6), "hue"),
            (dict(hue=(-0.7, 0.1)), "hue"),
        ],
    )
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.ColorJitter(**kwargs), name)

    def test_normalised_like_torchvision(self):
        t, tv = T.ColorJitter(0.4, 0.4, 0.4, 0.1), v2.ColorJitter(0.4, 0.4, 0.4, 0.1)
        for name in ("brightness", "contrast", "saturation", "hue"):
            assert getattr(t, name) == pytest.approx(tuple(getattr(tv, name)))
        assert T.ColorJitter(brightness=0).brightness is None

    @pytest.mark.parametrize("as_float_image", [False, True])
    def test_matches_torchvision(self, photo, as_float_image):
        kwargs = dict(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1)
        image = as_float(photo) if as_float_image else photo
        check_transform(T.ColorJitter(**kwargs), image, _jitter_reference(v2.ColorJitter(**kwargs)))

    def test_ranges(self):
        t = T.ColorJitter(brightness=(0.5, 1.5), hue=0.2)
        ps = drawn_params(t, 1, 1, 2000, seed=1)
        b, h = np.array([p.brightness for p in ps]), np.array([p.hue for p in ps])
        assert 0.5 <= b.min() < 0.52 and 1.48 < b.max() <= 1.5 and abs(b.mean() - 1.0) < 0.03
        assert -0.2 <= h.min() < -0.19 and 0.19 < h.max() <= 0.2
        assert all(p.contrast is None and p.saturation is None for p in ps)
        assert len({p.order for p in ps}) == 24

    def test_needs_three_channels_for_saturation(self):
        with pytest.raises(gp.PipelineError, match="3 channels"):
            T.ColorJitter(saturation=0.5).output_spec(T.ImageSpec(channels=1))


class TestRandomGrayscale:
    def test_invalid_arguments(self):
        check_invalid(lambda: T.RandomGrayscale(p=-1), "p")

    def test_default_p_is_torchvision(self):
        assert T.RandomGrayscale().p == v2.RandomGrayscale().p == 0.1

    def test_matches_torchvision(self, photo):
        tv = v2.RandomGrayscale(p=1.0)
        ref = lambda img, p: tv.transform(img, dict(num_input_channels=3)) if p.apply else img  # noqa: E731
        results = check_transform(T.RandomGrayscale(p=0.5), photo, ref, seeds=range(10))
        gray = [out for p, out in results if p.apply]
        assert gray and all(torch.equal(g[0], g[1]) and torch.equal(g[1], g[2]) for g in gray)


class TestGaussianBlur:
    @pytest.mark.parametrize(
        "kwargs, name",
        [
            (dict(kernel_size=4), "kernel_size"),
            (dict(kernel_size=(3, 0)), "kernel_size"),
            (dict(kernel_size=3, sigma=0), "sigma"),
            (dict(kernel_size=3, sigma=(2.0, 1.0)), "sigma"),
        ],
    )
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.GaussianBlur(**kwargs), name)

    @pytest.mark.parametrize(
        "kwargs",
        [
            dict(kernel_size=5),
            dict(kernel_size=(3, 9), sigma=(0.5, 3.0)),
            dict(kernel_size=7, sigma=1.5),
            dict(kernel_size=[5], sigma=[1.0]),
        ],
    )
    def test_matches_torchvision(self, photo, kwargs):
        tv = v2.GaussianBlur(**kwargs)
        assert T.GaussianBlur(**kwargs).kernel_size == tuple(tv.kernel_size)
        check_transform(T.GaussianBlur(**kwargs), photo, lambda img, p: tv.transform(img, dict(sigma=[p.sigma] * 2)))

    def test_sigma_range(self):
        s = [p.sigma for p in drawn_params(T.GaussianBlur(3, sigma=(0.1, 2.0)), 1, 1, 2000)]
        assert 0.1 <= min(s) < 0.15 and 1.95 < max(s) <= 2.0


class TestRandomSolarize:
    @pytest.mark.parametrize(
        "kwargs, name",
        [
            (dict(threshold=-1), "threshold"),
            (dict(threshold="128"), "threshold"),
            (dict(threshold=None), "threshold"),
            (dict(threshold=True), "threshold"),
            (dict(threshold=math.nan), "threshold"),
            (dict(threshold=128, p=1.5), "p"),
            (dict(threshold=128, p="0.5"), "p"),
        ],
    )
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomSolarize(**kwargs), name)

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomSolarize, v2.RandomSolarize)
        assert T.RandomSolarize(128, 0.3) == T.RandomSolarize(threshold=128.0, p=0.3)

    @pytest.mark.parametrize("as_float_image, threshold", [(False, 128), (False, 0), (False, 200.5), (True, 0.5)])
    def test_matches_torchvision(self, photo, as_float_image, threshold):
        image = as_float(photo) if as_float_image else photo
        tv = v2.RandomSolarize(threshold, p=1.0)
        results = check_transform(
            T.RandomSolarize(threshold), image, lambda img, p: tv(img) if p.apply else img, seeds=range(10)
        )
        assert {p.apply for p, _ in results} == {True, False}
        assert any(not torch.equal(out, image) for p, out in results if p.apply)

    def test_rate(self):
        applied = [p.apply for p in drawn_params(T.RandomSolarize(128, p=0.2), 1, 1, 4000)]
        assert abs(np.mean(applied) - 0.2) < 0.03

    def test_threshold_above_the_dtype_is_a_build_error(self, shards):
        assert T.RandomSolarize(255).output_spec(T.ImageSpec()) == T.ImageSpec()
        with pytest.raises(gp.PipelineError, match=r"RandomSolarize: threshold 128 is above .* \(1\)"):
            T.RandomSolarize(128).output_spec(T.ImageSpec(dtype=torch.float32))
        with pytest.raises(gp.PipelineError, match="step 1: RandomSolarize: threshold 256"):
            gp.Pipeline(shards, [T.CenterCrop(8), T.RandomSolarize(256)])


class TestRandomApply:
    JITTER = T.ColorJitter(0.4, 0.4, 0.2, 0.1)

    def test_a_crop_that_keeps_a_known_size_runs_on_every_backend(self, backend, shards):
        """Accepted by the pipeline (the image is 32 x 32 there), so every backend runs it."""
        pipe = gp.Pipeline(shards, [T.CenterCrop(32), T.RandomApply([T.RandomCrop(32, padding=4)], p=0.5)])
        with backend.loader(pipe, 4, num_workers=0) as loader:
            assert {tuple(b.images.shape) for b in loader} == {(4, 3, 32, 32)}

    @pytest.mark.parametrize(
        "kwargs, name",
        [
            (dict(transforms=[]), "transforms"),
            (dict(transforms=T.ColorJitter(0.4)), "transforms"),  # a transform, not a list of them
            (dict(transforms="ColorJitter"), "transforms"),
            (dict(transforms=[T.GaussianBlur(3), "blur"]), r"transforms\[1\] is a str"),
            (dict(transforms=[v2.ColorJitter(0.4)]), r"transforms\[0\] is a ColorJitter.*use gpupipe\.transforms"),
            (dict(transforms=[T.GaussianBlur(3)], p=-0.1), "p"),
            (dict(transforms=[T.GaussianBlur(3)], p=None), "p"),
        ],
    )
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomApply(**kwargs), name)

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomApply, v2.RandomApply)

    def test_stored_as_a_tuple_frozen_and_hashable(self):
        import dataclasses

        t = T.RandomApply([self.JITTER, T.GaussianBlur(3)], 0.8)
        assert t.transforms == (self.JITTER, T.GaussianBlur(3)) and t.p == 0.8
        assert t == T.RandomApply((self.JITTER, T.GaussianBlur(3)), p=0.8) and hash(t) == hash(T.RandomApply(
            (self.JITTER, T.GaussianBlur(3)), p=0.8))  # fmt: skip
        with pytest.raises(dataclasses.FrozenInstanceError):
            t.p = 0.5  # type: ignore[misc]
        assert "factor_slices" not in repr(t)

    def test_draws_are_the_decision_and_the_inner_draws(self):
        from gpupipe.core._random import step_factors

        inner = [self.JITTER, Posterize(bits=3), T.GaussianBlur(3), T.RandomApply([T.RandomSolarize(128)], p=0.3)]
        t = T.RandomApply(inner, p=0.8)
        assert t.random and t.draws == 1 + 8 + 0 + 1 + 2 and T.RandomApply.draws == 1
        assert t.factor_slices == ((1, 9), (9, 9), (9, 10), (10, 12))
        u = np.random.default_rng(0).random((50, t.draws))
        f = t.sample(u)
        np.testing.assert_array_equal(f[:, 0], u[:, 0] < 0.8)
        np.testing.assert_array_equal(f[:, 1:9], self.JITTER.sample(u[:, 1:9]))
        np.testing.assert_array_equal(f[:, 9:10], inner[2].sample(u[:, 9:10]))
        np.testing.assert_array_equal(f[:, 10:12], inner[3].sample(u[:, 10:12]))
        drawn = step_factors(t, seed=1, epoch=0, samples=range(4), step=2)  # what every backend draws
        assert drawn is not None and drawn.shape == (4, 12)
        p = t.make_params(120, 160, f[0])
        assert p.apply == bool(u[0, 0] < 0.8) and p.params[1] is None
        assert p.params[0] == self.JITTER.make_params(120, 160, f[0, 1:9])
        assert p.params[3] == inner[3].make_params(120, 160, f[0, 10:12])

    @pytest.mark.parametrize("p", [0.0, 1.0, 0.5])
    def test_matches_the_inner_transform_applied_or_not(self, photo, p):
        jitter = _jitter_reference(v2.ColorJitter(0.4, 0.4, 0.2, 0.1))
        results = check_transform(
            T.RandomApply([self.JITTER], p=p),
            photo,
            lambda img, prm: jitter(img, prm.params[0]) if prm.apply else img,
            seeds=range(20),
        )
        applied = {prm.apply for prm, _ in results}
        assert applied == ({False} if p == 0.0 else {True} if p == 1.0 else {True, False})
        assert all(torch.equal(out, photo) for prm, out in results if not prm.apply)

    def test_nested(self, photo):
        solarize, blur = v2.RandomSolarize(128, p=1.0), v2.GaussianBlur(3)
        t = T.RandomApply([T.RandomApply([T.RandomSolarize(128, p=1.0)], p=0.5), T.GaussianBlur(3)], p=0.7)

        def reference(img, prm):
            if not prm.apply:
                return img
            if prm.params[0].apply:
                img = solarize(img)
            return blur.transform(img, dict(sigma=[prm.params[1].sigma] * 2))

        results = check_transform(t, photo, reference, seeds=range(30))
        assert {(prm.apply, prm.params[0].apply) for prm, _ in results} == {
            (False, False), (False, True), (True, False), (True, True)
        }  # fmt: skip

    @pytest.mark.parametrize(
        "inner, changes",
        [
            (T.Resize(256), "the size"),
            (T.CenterCrop(24), "the size"),
            (T.RandomCrop(24), "the size"),
            (T.RandomResizedCrop(24), "the size"),
            (EveryOtherColumn(), "the size"),
            (T.ToDtype(torch.float32, scale=True), "the dtype"),
        ],
    )
    def test_needs_size_and_dtype_preserving_transforms(self, shards, inner, changes):
        with pytest.raises(gp.PipelineError, match=f"RandomApply: needs transforms that keep .*{changes}"):
            T.RandomApply([self.JITTER, inner]).output_spec(T.ImageSpec())
        with pytest.raises(gp.PipelineError, match="step 1: RandomApply: needs transforms that keep"):
            gp.Pipeline(shards, [T.RandomResizedCrop(32), T.RandomApply([inner])])

    def test_keeping_a_known_size_is_allowed(self, shards):
        spec = T.ImageSpec(3, 24, 24)
        assert T.RandomApply([T.CenterCrop(24), T.RandomSolarize(100)]).output_spec(spec) == spec
        float_spec = T.ImageSpec(dtype=torch.float32)
        assert T.RandomApply([T.Normalize([0.5], [0.5]), AddMult(add=1.0)]).output_spec(float_spec) == float_spec
        pipe = gp.Pipeline(shards, [T.RandomResizedCrop(32), T.RandomApply([self.JITTER], p=0.8), T.RandomGrayscale()])
        assert str(pipe.output_spec) == "[3, 32, 32] uint8"

    def test_inner_errors_are_the_inner_transforms(self):
        with pytest.raises(gp.PipelineError, match="Normalize: needs a float image"):
            T.RandomApply([T.Normalize([0.5], [0.5])]).output_spec(T.ImageSpec())
        with pytest.raises(gp.PipelineError, match="RandomSolarize: threshold 128"):
            T.RandomApply([T.RandomSolarize(128)]).output_spec(T.ImageSpec(dtype=torch.float32))

    def test_a_deterministic_inner_transform(self, photo):
        t = T.RandomApply([Posterize(bits=3)], p=0.5)
        assert t.draws == 1 and t.factor_slices == ((1, 1),)
        results = check_transform(t, photo, lambda img, prm: img & 0xE0 if prm.apply else img, seeds=range(10))
        assert {prm.params for prm, _ in results} == {(None,)} and len({prm.apply for prm, _ in results}) == 2

    def test_an_inner_transform_a_backend_cannot_run_is_reported(self):
        import dataclasses

        from gpupipe import backends

        @dataclasses.dataclass(frozen=True)
        class NoLowering(T.Transform):
            pass

        steps = [T.CenterCrop(16), T.RandomApply([self.JITTER, NoLowering()])]
        for name in ("torch", "dali"):
            with pytest.raises(gp.UnsupportedTransformError, match=r"RandomApply.*step 1.*transforms\[1\].*NoLowering"):
                backends.get(name).require_supported(steps)
        reflect = T.RandomApply([T.RandomApply([T.RandomCrop(16, padding=2, padding_mode="reflect")])])
        backends.get("torch").require_supported([T.CenterCrop(16), reflect])
        with pytest.raises(gp.UnsupportedTransformError, match=r"RandomApply.*step 1.*padding_mode='reflect'"):
            backends.get("dali").require_supported([T.CenterCrop(16), reflect])


class TestToDtype:
    def test_invalid_arguments(self):
        check_invalid(lambda: T.ToDtype(torch.int32), "dtype")
        check_invalid(lambda: T.ToDtype(torch.float32, scale=1), "scale")  # type: ignore[arg-type]

    def test_scale_is_keyword_only(self):
        with pytest.raises(TypeError):
            T.ToDtype(torch.float32, True)  # type: ignore[call-arg]

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8])
    @pytest.mark.parametrize("scale", [False, True])
    def test_matches_torchvision(self, photo, dtype, scale):
        tv = v2.ToDtype(dtype, scale=scale)
        check_transform(T.ToDtype(dtype, scale=scale), photo, lambda img, p: tv(img), seeds=[0])

    def test_float_to_uint8(self, photo):
        tv = v2.ToDtype(torch.uint8, scale=True)
        check_transform(T.ToDtype(torch.uint8, scale=True), as_float(photo), lambda img, p: tv(img), seeds=[0])


class TestNormalize:
    @pytest.mark.parametrize(
        "kwargs, name",
        [
            (dict(mean=[0.5], std=[0.0]), "std"),
            (dict(mean="abc", std=[1.0]), "mean"),
            (dict(mean=[0.5], std=[]), "std"),
            (dict(mean=[0.5], std=[1.0], inplace="yes"), "inplace"),
        ],
    )
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.Normalize(**kwargs), name)

    @pytest.mark.parametrize("mean, std", [((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), ([0.5], [0.25])])
    def test_matches_torchvision(self, photo, mean, std):
        tv = v2.Normalize(mean * (3 // len(mean)), std * (3 // len(std)))
        check_transform(T.Normalize(mean, std), as_float(photo), lambda img, p: tv(img), seeds=[0])

    def test_needs_float_input(self):
        with pytest.raises(gp.PipelineError, match="ToDtype"):
            T.Normalize([0.5], [0.5]).output_spec(T.ImageSpec())

    def test_channel_count_checked(self, photo):
        with pytest.raises(gp.PipelineError, match="mean has 2 values"):
            T.Normalize([0.5, 0.5], [0.5]).output_spec(spec_of(as_float(photo)))


class TestArithmetic:
    def test_matches_plain_torch(self, photo):
        t = AddMult(add=0.25, mult=0.5)
        check_transform(t, as_float(photo), lambda img, p: (img + 0.25) * 0.5, seeds=[0])

    def test_needs_float_input(self):
        with pytest.raises(gp.PipelineError, match="needs a float image"):
            AddMult().output_spec(T.ImageSpec())

    def test_needs_float_input_in_a_pipeline(self, shards):
        with pytest.raises(gp.PipelineError, match="AddMult: needs a float image"):
            gp.Pipeline(shards, [AddMult(add=1.0)])

    def test_apply_is_required(self, photo):
        with pytest.raises(NotImplementedError, match="apply"):
            T.Arithmetic().apply(photo)


class TestArrayFunction:
    def test_matches_numpy(self, photo):
        import numpy as np

        check_transform(Posterize(bits=3), photo, lambda img, p: img & 0xE0, seeds=[0])
        out = check_transform(EveryOtherColumn(), photo, lambda img, p: img[:, :, ::2].contiguous(), seeds=[0])
        assert out[0][1].shape == (3, 120, 80)
        assert isinstance(Posterize().apply(np.zeros((2, 2, 3), np.uint8), np), np.ndarray)

    def test_declared_output_spec(self, shards):
        pipe = gp.Pipeline(shards, [T.CenterCrop((32, 31)), EveryOtherColumn()])
        assert (pipe.output_spec.height, pipe.output_spec.width) == (32, 16)

    def test_apply_is_required(self, photo):
        with pytest.raises(NotImplementedError, match="apply"):
            T.ArrayFunction().apply(photo, None)


def test_every_transform_has_a_test_class():
    """Here, or in a test module of its own (tests/test_erasing.py: TestRandomErasing)."""
    import glob
    import os
    import re

    tested = set()
    for path in glob.glob(os.path.join(os.path.dirname(__file__), "test_*.py")):
        with open(path) as f:
            tested |= set(re.findall(r"^class Test(\w+)", f.read(), re.MULTILINE))
    defined = {
        n
        for n in T.__all__
        if isinstance(getattr(T, n), type) and issubclass(getattr(T, n), T.Transform) and n != "Transform"
    }
    assert defined <= tested, defined - tested


def test_transforms_are_frozen_and_hashable():
    t = T.RandomResizedCrop(224)
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        t.size = (1, 1)  # type: ignore[misc]
    assert hash(t) == hash(T.RandomResizedCrop((224, 224)))


class TestTransformFacts:
    """What the compilers and the masks need of a transform is declared on its class (issue 52):
    these sets are the lists ``_KEEPS_SIZE``, ``_FLIP_COMMUTES`` and ``MASK_GEOMETRY`` that the DALI
    compiler and the mask rules kept before, unchanged."""

    KEEPS = frozenset(
        [
            "RandomHorizontalFlip",
            "RandomVerticalFlip",
            "ToDtype",
            "Normalize",
            "ColorJitter",
            "RandomGrayscale",
            "GaussianBlur",
            "RandomSolarize",
            "RandomApply",
            "Arithmetic",
            "RandomErasing",
            "TrivialAugmentWide",
            "RandAugment",
            "AutoAugment",
            "AugMix",
            "TimmRandAugment",
            "RandomInvert",
            "RandomPosterize",
            "RandomAutocontrast",
            "RandomAdjustSharpness",
            "RandomAffine",
            "RandomEqualize",
            "RandomPhotometricDistort",
        ]
    )
    FLIP = frozenset(
        [
            "ColorJitter",
            "RandomGrayscale",
            "GaussianBlur",
            "RandomSolarize",
            "RandomPosterize",
            "RandomInvert",
            "RandomEqualize",
            "RandomAutocontrast",
            "RandomAdjustSharpness",
        ]
    )
    MASKS = frozenset(
        [
            "RandomResizedCrop",
            "Resize",
            "RandomResize",
            "RandomShortestSize",
            "CenterCrop",
            "RandomCrop",
            "RandomHorizontalFlip",
            "RandomVerticalFlip",
            "RandomRotation",
            "RandomAffine",
            "RandomZoomOut",
            "RandomIoUCrop",
        ]
    )

    def classes(self) -> dict[str, type[T.Transform]]:
        import inspect

        return {n: c for n in T.__all__ if inspect.isclass(c := getattr(T, n)) and issubclass(c, T.Transform)}

    def test_each_class_declares_its_facts(self):
        classes = self.classes()
        assert set(classes) >= self.KEEPS | self.FLIP | self.MASKS
        assert {n for n, c in classes.items() if c.keeps_size} == self.KEEPS
        assert {n for n, c in classes.items() if c.commutes_with_flip} == self.FLIP
        assert {n for n, c in classes.items() if c.moves_masks} == self.MASKS

    def test_an_instance_whose_arguments_decide(self):
        assert T.RandomRotation(10).size_kept() and not T.RandomRotation(10, expand=True).size_kept()
        assert T.Normalize([0.5], [0.5]).size_kept() and not T.CenterCrop(8).size_kept()

    def test_a_subclass_inherits_all_but_commuting_with_a_flip(self):
        import dataclasses

        @dataclasses.dataclass(frozen=True)
        class Mine(T.ColorJitter):
            pass

        @dataclasses.dataclass(frozen=True)
        class Declared(T.ColorJitter):
            commutes_with_flip = True

        assert Mine.keeps_size and not Mine.commutes_with_flip and Declared.commutes_with_flip
