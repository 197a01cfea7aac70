"""Issue 37: RandomErasing, torchvision v2's, on every backend: the same box from the same draws,
torchvision's kernel on the torch backend, DALI's ``erase`` after the fused tail on DALI, and the
box's laws (area fraction, log-uniform aspect, uniform position)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.core._geometry import ATTEMPTS, erasing_window, erasing_windows
from gpupipe.core._random import uniforms
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import (
    check_invalid,
    check_torchvision_signature,
    check_transform,
    drawn_params,
    reference_outputs,
    run_dali,
)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class TestRandomErasing:
    @pytest.mark.parametrize(("kwargs", "name"), [
        (dict(p=1.5), "p"),
        (dict(scale=(0.5, 0.2)), "scale"),
        (dict(scale=(0.1, 1.5)), "scale"),
        (dict(ratio=(0.0, 3.0)), "ratio"),
        (dict(value="noise"), "value"),
        (dict(value=[]), "value"),
        (dict(value=None), "value"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandomErasing(**kwargs), name)

    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandomErasing, v2.RandomErasing)

    def test_value_must_fit_the_channels(self):
        with pytest.raises(gp.PipelineError, match="value has 2 numbers: give 1 or 3"):
            gp.Pipeline(["a.tar"], [T.RandomErasing(value=(1, 2))])

    @pytest.mark.parametrize("value", [0, (0.5, -1.0, 2.0), "random"])
    def test_matches_torchvision(self, photo, value):
        image = photo.to(torch.float32) / 255
        t = T.RandomErasing(p=0.5, value=value)

        def reference(img, p):
            if not p.erase:
                return img
            v = (torch.empty([3, p.h, p.w]).normal_(generator=torch.Generator().manual_seed(p.seed))
                 if t.noise else torch.tensor(t.value)[:, None, None])  # fmt: skip
            return v2.RandomErasing(value=0).transform(img, dict(i=p.top, j=p.left, h=p.h, w=p.w, v=v))

        results = check_transform(t, image, reference, seeds=range(12))
        assert {p.erase for p, _ in results} == {True, False}

    def test_noise_is_standard_normal(self):
        t = T.RandomErasing(p=1.0, scale=(0.3, 0.33), value="random")
        params = drawn_params(t, 120, 160, 1, seed=3)[0]
        assert params.erase
        from gpupipe.backends._torch._kernels import LOWERINGS

        box = LOWERINGS.lookup(t)(t, torch.zeros(3, 120, 160), params)[:, params.top :, params.left :]
        noise = box[:, : params.h, : params.w]
        assert abs(noise.mean()) < 0.02 and abs(noise.std() - 1) < 0.02


class TestTheBox:
    def test_the_batch_rule_is_the_sample_rule(self):
        t = T.RandomErasing(p=0.7, scale=(0.02, 0.9), ratio=(0.1, 10.0))
        factors = t.sample(uniforms(0, 0, range(2000), 0, t.draws))
        heights, widths = np.resize([7, 31, 120, 500], 2000), np.resize([9, 300, 160, 17], 2000)
        batch = erasing_windows(heights, widths, factors)
        for f, h, w, row in zip(factors, heights, widths, batch, strict=True):
            p = t.make_params(int(h), int(w), f)
            assert tuple(row) == ((p.top, p.left, p.h, p.w) if p.erase else (0, 0, 0, 0))

    def test_torchvisions_sides_and_first_fit(self):
        """A box of area fraction s and ratio r has sides round(sqrt(s·A·r)) and round(sqrt(s·A/r)),
        half to even; the first attempt smaller than the image wins; none: nothing erased."""
        n = ATTEMPTS
        area = [0.9] * n
        area[3] = 0.25
        f = [*area, *([4.0] * n), 0.5, 0.5]
        # 0.9·10000·4 → h = 190 > 100: no fit until attempt 3: 0.25·10000 = 2500, h = round(100) = 100: no
        assert erasing_window(100, 100, f) is None
        f[3], f[n + 3] = 0.25, 1.0  # h = w = 50
        assert erasing_window(100, 100, f) == (25, 25, 50, 50)
        # 12.5·2 → h = 5; 12.5/2 = 6.25 → w = round(2.5) = 2 (half to even); left = floor(0.999·9)
        assert erasing_window(10, 10, [0.125] + [0.0] * (n - 1) + [2.0] * n + [0.0, 0.999]) == (0, 8, 5, 2)

    def test_laws(self):
        t = T.RandomErasing(p=1.0, scale=(0.05, 0.25), ratio=(0.5, 2.0))
        params = [p for p in drawn_params(t, 200, 200, 4000, seed=1) if p.erase]
        fractions = np.array([p.h * p.w / 40000 for p in params])
        ratios = np.log([p.h / p.w for p in params])
        assert len(params) == 4000  # every first attempt fits at these scales
        assert abs(fractions.mean() - 0.15) < 0.01  # uniform in [0.05, 0.25], up to rounding
        assert abs(ratios.mean()) < 0.03 and abs(ratios.std() - math.log(4) / math.sqrt(12)) < 0.02
        tops = np.array([p.top / (200 - p.h + 1) for p in params])
        counts = np.histogram(tops, bins=10, range=(0, 1))[0]
        assert ((counts - 400) ** 2 / 400).sum() < 27.9  # chi-square, 9 degrees of freedom, p = 0.001


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [encode_jpeg(synthetic_image(i, size=(60 + 7 * i, 80 - 3 * i))) for i in range(10)]


class TestOnDali:
    @pytest.fixture(autouse=True)
    def _dali(self):
        pytest.importorskip("nvidia.dali")

    @pytest.mark.parametrize("steps", [
        [T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True),
         T.Normalize(MEAN, STD), T.RandomErasing(p=0.5, value=(7.5, 8.5, 9.5))],
        [T.Resize(40), T.CenterCrop(32), T.ToDtype(torch.float32, scale=True), T.RandomErasing(p=0.5, value=7.5)],
        [T.CenterCrop(32), T.RandomErasing(p=0.5, value=250), T.RandomHorizontalFlip()],
    ])  # fmt: skip
    def test_the_same_boxes_as_the_torch_backend(self, images, steps):
        from .support.checkers import reference_outputs

        fill = steps[-1].value if isinstance(steps[-1], T.RandomErasing) else steps[-2].value
        expected, got = reference_outputs(steps, images), run_dali(steps, images)
        erased = 0
        for e, g in zip(expected, got, strict=True):
            mask = (e == torch.tensor(fill, dtype=e.dtype).view(-1, 1, 1)).all(0)
            erased += int(mask.any())
            assert torch.equal(mask, (g == torch.tensor(fill, dtype=g.dtype).view(-1, 1, 1)).all(0))
        assert 0 < erased < len(images)

    def test_it_runs_after_the_fused_tail(self):
        from .support.dali_graph import parse
        from .test_gpu_graph import define

        steps = [T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True),
                 T.Normalize(MEAN, STD), T.RandomErasing()]  # fmt: skip
        graph = define(steps)
        names = [op.schema for op in parse(graph.pipe.serialize())[0]]
        assert names.count("CropMirrorNormalize") == 1 and names[-1] == "Erase"

    @pytest.mark.parametrize("steps", [
        [T.RandomResizedCrop(24), T.ToDtype(torch.float32, scale=True), T.Normalize([0.5] * 3, [0.25] * 3),
         T.RandomErasing(p=0.7, value="random")],  # after the fused tail: CHW
        [T.CenterCrop(24), T.ToDtype(torch.float32, scale=True), T.RandomErasing(p=1.0, value="random"),
         T.GaussianBlur(3)],  # before a step: HWC
    ])  # fmt: skip
    def test_noise_is_the_torch_backends_own(self, steps):
        """The host draws each box's noise with the torch backend's generator, seeded alike; DALI
        erases the box to 0 and adds it: the same values, in either layout."""
        images = [encode_jpeg(synthetic_image(30 + i, size=(32 + 4 * i, 40))) for i in range(8)]
        got, want = run_dali(steps, images), reference_outputs(steps, images)
        plain = [s if not isinstance(s, T.RandomErasing) else T.RandomErasing(p=0.0) for s in steps]
        base = max(
            float((g - w).abs().max())
            for g, w in zip(run_dali(plain, images), reference_outputs(plain, images), strict=True)
        )
        assert max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) <= base + 1e-5

    def test_noise_takes_a_float_image_on_dali(self):
        with pytest.raises(gp.BackendUnavailableError, match="float image"):
            run_dali([T.CenterCrop(16), T.RandomErasing(value="random")], [encode_jpeg(synthetic_image(1))])

    def test_noise_channels_last_through_the_loader(self, shards, clean_env):
        pipe = gp.Pipeline(shards[0], [T.CenterCrop(16), T.ToDtype(torch.float32, scale=True),
                                       T.RandomErasing(p=1.0, value="random")])  # fmt: skip
        got = {}
        for backend, fmt in (("torch", torch.contiguous_format), ("dali", torch.channels_last)):
            with gp.Loader(pipe, 4, seed=2, backend=backend, device="cpu", num_workers=1, memory_format=fmt) as loader:
                got[backend] = next(iter(loader)).images.contiguous()
        assert float((got["torch"] - got["dali"]).abs().max()) < 1e-5
