"""Issue 37's augmentation policies: TrivialAugmentWide, RandAugment, AutoAugment and AugMix.

- Every operation at every magnitude bin, both signs: the torch backend equals torchvision's own
  ``_apply_image_or_video_transform`` at the magnitude of torchvision's own table; DALI-CPU equals
  it within the kernels' stated differences (exact for most operations).
- The draws: the operation, bin, sign, sub-policy and AugMix's weights follow their laws
  (chi-square at p = 0.001), and every backend draws the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.backends._torch._kernels import apply_pipeline
from gpupipe.testing import encode_jpeg, synthetic_image
from gpupipe.transforms._policies import OPS, slot_magnitudes

from .support import checkers
from .support.checkers import check_invalid, check_torchvision_signature, drawn_params, run_dali

CODE = {name: i for i, name in enumerate(OPS)}


def chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / len(counts)
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square's 0.999 quantiles, by degrees of freedom
CHI_999 = {1: 10.83, 9: 27.88, 13: 34.53, 24: 51.18, 30: 59.70}


def reference(tv: type, space: dict, name: str, bins: int, index: int, negative: bool, image, **kw):
    """torchvision's own operation ``name`` at bin ``index`` of its own table."""
    table = space[name][0](bins, image.shape[-2], image.shape[-1])
    magnitude = 0.0 if table is None else float(table[index])
    if space[name][1] and negative:
        magnitude = -magnitude
    instance = tv(**kw)
    return instance._apply_image_or_video_transform(image, name, magnitude, interpolation=instance.interpolation,
                                                    fill=instance._fill)  # fmt: skip


def forced(t, rows):
    """Factors of ``t`` for each row of ``(code, bin, sign)`` per slot."""
    return np.array(rows, dtype=np.float64).reshape(len(rows), -1)


# (ours, torchvision's, the space name of slot_magnitudes, bins, torchvision's space)
SPACES = [
    (T.TrivialAugmentWide(), v2.TrivialAugmentWide, "wide", 31, v2.TrivialAugmentWide._AUGMENTATION_SPACE),
    (T.RandAugment(num_ops=1), v2.RandAugment, "standard", 31, v2.RandAugment._AUGMENTATION_SPACE),
    (T.AutoAugment(), v2.AutoAugment, "standard", 10, v2.AutoAugment._AUGMENTATION_SPACE),
    (T.AugMix(), v2.AugMix, "augmix", 10, v2.AugMix._AUGMENTATION_SPACE),
]


class TestEveryOperationAtEveryBin:
    @pytest.mark.parametrize(("ours", "tv", "space", "bins", "theirs"), SPACES, ids=[s[1].__name__ for s in SPACES])
    @pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
    def test_torch_is_torchvision(self, photo, ours, tv, space, bins, theirs, interpolation):
        """Our table and kernel, at every bin and both signs, equal torchvision's own."""
        from gpupipe.backends._torch._policies import apply_op

        image = photo[:, :40, :56]
        t = type(ours)(interpolation=interpolation, fill=None) if not isinstance(ours, T.RandAugment) else \
            T.RandAugment(num_ops=1, interpolation=interpolation)  # fmt: skip
        checked = 0
        for name in theirs:
            for index in range(bins):
                for negative in (False, True):
                    mag = slot_magnitudes(space, bins, [CODE[name]], [index], [-1 if negative else 1], 40, 56)[0]
                    got = apply_op(image, name, float(mag), t)
                    want = reference(tv, theirs, name, bins, index, negative, image, interpolation=interpolation)
                    torch.testing.assert_close(got, want, atol=0, rtol=0, msg=f"{name} bin {index} {negative}")
                    checked += 1
        assert checked == len(theirs) * bins * 2

    @pytest.mark.parametrize("t", [T.TrivialAugmentWide(fill=(10, 20, 30)), T.AutoAugment(fill=7)])
    def test_fill_reaches_the_geometric_operations(self, photo, t):
        from gpupipe.backends._torch._policies import apply_op

        image = photo[:, :40, :56]
        out = apply_op(image, "TranslateX", 20.0, t)
        assert out[:, 0, 0].tolist() == (list(t.fill) if isinstance(t.fill, tuple) else [int(t.fill)] * 3)


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [encode_jpeg(synthetic_image(70 + i, size=(44 + 4 * (i % 3), 60 - 4 * (i % 2)))) for i in range(62)]


def dali_vs_torch(t, photos, rows, monkeypatch):
    """DALI-CPU's and the torch backend's outputs with forced factors (one row per image)."""
    factors = forced(t, rows)
    monkeypatch.setattr(checkers, "sample_factors", lambda transforms, n, seed=0: [factors[:n]])
    from gpupipe._decode import decode_rgb

    images = photos[: len(rows)]
    got = run_dali([t], images)
    want = [apply_pipeline([t], decode_rgb(e, shard="-", key="k"), [factors[i]]) for i, e in enumerate(images)]
    return list(zip(got, want, strict=True))


# DALI's kernels against torchvision's, per operation: (largest share of values apart, largest
# difference). Measured on 62 photographs of about 48 x 56 at every bin, both signs (2026-11-25).
# Rotations by ±45° and ±135° put many source points on ties (2.6% of the values at most).
TOLERANCE = {
    "ShearX": (2e-3, 255),
    "ShearY": (2e-3, 255),
    "Rotate": (0.03, 255),  # nearest-neighbour ties
    "Color": (4e-3, 1),  # luma's last rounding
    "Equalize": (1.0, 32),  # DALI's equalize is OpenCV's table, not PIL's (17 apart at most here)
}


class TestOnDali:
    @pytest.fixture(autouse=True)
    def _dali(self):
        pytest.importorskip("nvidia.dali")

    @pytest.mark.parametrize("name", OPS[:14])
    def test_every_bin_of_trivialaugment(self, photos, monkeypatch, name):
        rows = [(CODE[name], i // 2, -1 if i % 2 else 1) for i in range(62)]
        share_max, diff_max = TOLERANCE.get(name, (0.0, 0))
        for got, want in dali_vs_torch(T.TrivialAugmentWide(), photos, rows, monkeypatch):
            assert got.shape == want.shape and got.dtype == want.dtype
            d = (got.int() - want.int()).abs()
            assert float((d > 0).double().mean()) <= share_max and int(d.max()) <= diff_max, (name, int(d.max()))

    def test_two_operations_in_the_drawn_order(self, photos, monkeypatch):
        """RandAugment's slots run in order: Solarize then Rotate is not Rotate then Solarize."""
        t = T.RandAugment(num_ops=2, magnitude=30)
        rows = [(CODE["Solarize"], 30, 1, CODE["Rotate"], 30, 1), (CODE["Rotate"], 30, 1, CODE["Solarize"], 30, 1),
                (CODE["Posterize"], 30, 1, CODE["TranslateY"], 30, -1)]  # fmt: skip
        for got, want in dali_vs_torch(t, photos, rows, monkeypatch):
            assert float(((got.int() - want.int()) != 0).double().mean()) < 2e-3

    @pytest.mark.parametrize("t", [T.TrivialAugmentWide(), T.RandAugment(), T.AutoAugment(policy="svhn")])
    def test_drawn_policies_agree(self, photos, t):
        """Through the drawn factors of the backends' one draw: the same operations, the same
        pixels but for nearest-neighbour ties and equalize."""
        got, want = run_dali([t], photos[:24]), checkers.reference_outputs([t], photos[:24])
        drawn = checkers.sample_factors([t], 24)[0]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            codes, _ = t.magnitudes(w.shape[-2], w.shape[-1], drawn[i])
            if CODE["Equalize"] in codes:
                continue
            assert float(((g.int() - w.int()) != 0).double().mean()) < 0.05, (i, codes)  # ties: below

    def test_shears_differ_only_at_ties(self, photos, monkeypatch):
        """AutoAugment's shears (k/30) put source points exactly between two pixels (4% of the
        values at most): torch and DALI pick either. Every value apart is such a tie."""
        import math

        from gpupipe._geometry import affine_matrices

        rows = [(CODE["ShearX"], b, s, -1, 0, 1) for b in range(10) for s in (-1, 1)]
        apart = 0
        for (got, want), row in zip(dali_vs_torch(T.AutoAugment(policy="svhn"), photos, rows, monkeypatch), rows,
                                    strict=True):  # fmt: skip
            ys, xs = torch.nonzero((got.int() - want.int()).abs().amax(0), as_tuple=True)
            shear = math.degrees(math.atan(row[2] * float(np.float32(0.3 * row[1] / 9))))
            zero = np.zeros(1)
            m = affine_matrices(*got.shape[1:], zero, (0, 0), 1.0, (np.array([shear]), zero), center=(zero, zero))[0]
            source_x = m[0] * (xs.numpy() + 0.5) + m[1] * (ys.numpy() + 0.5) + m[2]
            assert np.abs(source_x - np.round(source_x)).max(initial=0) < 1e-6, row
            apart += len(ys)
        assert apart  # there are ties

    def test_the_graph_has_a_fixed_size(self):
        """The operators do not grow with operations or bins: a slot's families once each."""
        from .support.dali_graph import parse
        from .test_gpu_graph import define

        def count(policy):
            return len(parse(define([T.RandomResizedCrop(176), policy], gpu=False).pipe.serialize())[0])

        one = count(T.TrivialAugmentWide(num_magnitude_bins=31))
        more = count(T.TrivialAugmentWide(num_magnitude_bins=101))
        two = count(T.RandAugment(num_ops=2))
        assert one == more and two - 3 < 2 * (one - 3) and one <= 120  # 119 measured (2026-11-25)

    @pytest.mark.parametrize("t", [T.AugMix(), T.TrivialAugmentWide(fill=(1, 2, 3))])
    def test_what_dali_does_not_take_is_refused_at_build(self, t):
        from gpupipe import backends

        with pytest.raises(gp.UnsupportedTransformError, match=type(t).__name__):
            backends.get("dali").check([t])


def _codes(t, n, seed=0):
    drawn = t.sample(np.random.default_rng(seed).random((n, t.draws)))
    return drawn


class TestTrivialAugmentWide:
    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.TrivialAugmentWide, v2.TrivialAugmentWide)

    @pytest.mark.parametrize(("kwargs", "name"), [
        (dict(num_magnitude_bins=1), "num_magnitude_bins"),
        (dict(interpolation="bicubic"), "interpolation"),
        (dict(fill="x"), "fill"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.TrivialAugmentWide(**kwargs), name)

    def test_takes_uint8_only(self):
        with pytest.raises(gp.PipelineError, match="uint8"):
            gp.Pipeline(["a.tar"], [T.ToDtype(torch.float32, scale=True), T.TrivialAugmentWide()])

    def test_operation_bin_and_sign_are_uniform(self):
        params = drawn_params(T.TrivialAugmentWide(), 32, 32, 14_000)
        names = [p.ops[0][0] if p.ops else "Identity" for p in params]
        counts = np.array([names.count(n) for n in OPS[:14]])
        assert chi_square(counts) < CHI_999[13]
        f = _codes(T.TrivialAugmentWide(), 31_000)
        assert chi_square(np.bincount(f[:, 1].astype(int), minlength=31)) < CHI_999[30]
        assert chi_square(np.array([(f[:, 2] < 0).sum(), (f[:, 2] > 0).sum()])) < CHI_999[1]

    def test_magnitudes_are_torchvisions_table(self):
        t = T.TrivialAugmentWide()
        space = v2.TrivialAugmentWide._AUGMENTATION_SPACE
        for name in ("ShearX", "TranslateY", "Rotate", "Brightness", "Posterize", "Solarize"):
            table = space[name][0](31, 50, 60)
            for i in range(31):
                assert slot_magnitudes("wide", t.bins, [CODE[name]], [i], [1], 50, 60)[0] == float(table[i])


class TestRandAugment:
    def test_signature_is_torchvision(self):
        check_torchvision_signature(T.RandAugment, v2.RandAugment)

    @pytest.mark.parametrize(("kwargs", "name"), [
        (dict(num_ops=-1), "num_ops"),
        (dict(magnitude=31), "magnitude"),
        (dict(magnitude=5, num_magnitude_bins=5), "magnitude"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.RandAugment(**kwargs), name)

    def test_slots_are_independent_and_uniform(self):
        f = _codes(T.RandAugment(num_ops=2), 14 * 14 * 60)
        first, second = f[:, 0].astype(int), f[:, 3].astype(int)
        assert chi_square(np.bincount(first, minlength=14)) < CHI_999[13]
        pairs = np.bincount(first * 14 + second, minlength=196)
        assert pairs.min() > 20 and chi_square(pairs) < 260  # 195 d.o.f.: 0.999 quantile 259.4
        assert set(f[:, 1]) == {9.0}  # the one magnitude bin

    def test_translate_follows_the_size(self):
        t = T.RandAugment(num_ops=1, magnitude=30)
        assert slot_magnitudes("standard", 31, [CODE["TranslateX"]], [30], [1], 50, 331)[0] == pytest.approx(150.0)
        assert t.make_params(331, 662, np.array([CODE["TranslateY"], 30, -1])).ops == (("TranslateY", -150.0),)

    def test_no_operations_is_the_identity(self, photo):
        t = T.RandAugment(num_ops=0)
        assert t.draws == 0 and torch.equal(apply_pipeline([t], photo, [None]), photo)


class TestAutoAugment:
    def test_signature_is_torchvision(self):
        import inspect

        ours = [(p.name, p.default) for p in inspect.signature(T.AutoAugment).parameters.values()]
        theirs = [(p.name, p.default) for p in inspect.signature(v2.AutoAugment).parameters.values()]
        assert [n for n, _ in ours] == [n for n, _ in theirs]
        assert ours[0][1].value == theirs[0][1].value and ours[1:] == theirs[1:]

    @pytest.mark.parametrize("policy", list(v2.AutoAugmentPolicy))
    def test_policies_are_torchvisions(self, policy):
        from gpupipe.transforms._autoaugment_policies import POLICIES

        assert [tuple(sub) for sub in POLICIES[policy.value]] == [tuple(s) for s in v2.AutoAugment(policy)._policies]
        assert T.AutoAugment(policy).policy.value == policy.value

    def test_sub_policy_is_uniform_and_operations_apply_with_their_probability(self):
        from gpupipe.transforms._autoaugment_policies import POLICIES

        n = 25 * 400
        u = np.random.default_rng(1).random((n, 5))
        f = T.AutoAugment().sample(u)
        sub = np.minimum((u[:, 0] * 25).astype(int), 24)
        assert chi_square(np.bincount(sub, minlength=25)) < CHI_999[24]
        for k, (first, _) in enumerate(POLICIES["imagenet"]):
            applied = (f[sub == k, 0] >= 0).mean()
            assert abs(applied - first[1]) < 4.5 * np.sqrt(first[1] * (1 - first[1]) / (sub == k).sum()) + 1e-9

    def test_invalid_policy(self):
        check_invalid(lambda: T.AutoAugment(policy="mnist"), "policy")


class TestAugMix:
    def test_signature_is_torchvision_but_none_for_a_random_depth(self):
        import inspect

        ours = [(p.name, p.default) for p in inspect.signature(T.AugMix).parameters.values()]
        theirs = [(p.name, p.default) for p in inspect.signature(v2.AugMix).parameters.values()]
        assert [n for n, _ in ours] == [n for n, _ in theirs]
        assert dict(ours)["chain_depth"] is None and dict(theirs)["chain_depth"] == -1
        assert T.AugMix(chain_depth=-1).chain_depth is None

    @pytest.mark.parametrize(("kwargs", "name"), [
        (dict(severity=0), "severity"), (dict(severity=11), "severity"), (dict(mixture_width=0), "mixture_width"),
        (dict(chain_depth=0), "chain_depth"), (dict(alpha=0), "alpha"), (dict(all_ops=1), "all_ops"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.AugMix(**kwargs), name)

    def test_weights_are_dirichlet_and_depths_uniform(self):
        params = drawn_params(T.AugMix(), 32, 32, 6000)
        original = np.array([p.original for p in params])
        totals = np.array([p.original + sum(p.weights) for p in params])
        assert np.allclose(totals, 1.0)
        # alpha = 1: the original's weight is Beta(1, 1), uniform; each chain's share of the rest too
        assert chi_square(np.histogram(original, bins=10, range=(0, 1))[0]) < CHI_999[9]
        shares = np.array([p.weights[0] / sum(p.weights) for p in params])
        assert abs(shares.mean() - 1 / 3) < 0.01
        depths = np.array([len(c) for p in params for c in p.chains])
        assert chi_square(np.bincount(depths)[1:]) < 13.8  # 2 d.o.f.

    def test_mix_is_torchvisions_formula(self, photo):
        """The chains through torchvision's operations, mixed in float32, truncated to uint8."""
        from gpupipe.backends._torch._policies import apply_op

        t = T.AugMix(chain_depth=2)
        p = drawn_params(t, photo.shape[-2], photo.shape[-1], 1, seed=3)[0]
        want = p.original * photo.float()
        for w, chain in zip(p.weights, p.chains, strict=True):
            aug = photo
            for name, m in chain:
                aug = apply_op(aug, name, m, t)
            want = want + w * aug.float()
        out = apply_pipeline([t], photo, [checkers.draw(t, 3)])
        assert torch.equal(out, want.to(torch.uint8))

    def test_a_draw_is_the_same_every_time(self):
        t = T.AugMix()
        assert drawn_params(t, 40, 40, 5, seed=4) == drawn_params(t, 40, 40, 5, seed=4)
