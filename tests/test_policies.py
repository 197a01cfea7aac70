"""Issue 37's augmentation policies: TrivialAugmentWide, RandAugment, AutoAugment and AugMix.

- Every operation at every magnitude bin, both signs: the torch backend equals torchvision's own
  ``_apply_image_or_video_transform`` at the magnitude of torchvision's own table (the stage's
  batched kernels, which DALI runs them with: ``test_stage.py``).
- The draws: the operation, bin, sign, sub-policy and AugMix's weights follow their laws
  (chi-square at p = 0.001), and every backend draws the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import backends
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
        assert T.AutoAugment(policy).policy == T.AutoAugmentPolicy(policy.value)

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


class TestTimmRandAugment:
    def test_the_config_string_is_timms(self):
        t = T.TimmRandAugment.from_config("rand-m9-mstd0.5-inc1")
        assert (t.num_ops, t.magnitude, t.magnitude_std, t.increasing, t.p) == (2, 9.0, 0.5, True, 0.5)
        assert t.fill == (124.0, 116.0, 104.0) and t.interpolation == T.InterpolationMode.BILINEAR
        t = T.TimmRandAugment.from_config("rand-n3-m7-mstd101-mmax12", fill=0)
        assert (t.num_ops, t.magnitude, t.magnitude_std, t.magnitude_max, t.increasing, t.fill) == (
            3, 7.0, float("inf"), 12.0, False, 0.0)  # fmt: skip
        assert T.TimmRandAugment.from_config("rand").magnitude == 10.0  # timm's default magnitude

    @pytest.mark.parametrize(("config", "match"), [
        ("augmix-m3", "starts with 'rand'"), ("rand-x4", "unknown section"), ("rand-m", "cannot read"),
        ("rand-m12", "magnitude"),
    ])  # fmt: skip
    def test_a_bad_config_names_its_part(self, config, match):
        with pytest.raises(gp.ConfigError, match=match):
            T.TimmRandAugment.from_config(config)

    @pytest.mark.parametrize(("kwargs", "name"), [
        (dict(num_ops=-1), "num_ops"), (dict(magnitude_std=-1), "magnitude_std"), (dict(p=2), "p"),
        (dict(increasing=1), "increasing"),
    ])  # fmt: skip
    def test_invalid_arguments(self, kwargs, name):
        check_invalid(lambda: T.TimmRandAugment(**kwargs), name)

    def test_operation_probability_and_magnitude_noise_are_timms(self):
        t = T.TimmRandAugment()
        f = t.sample(np.random.default_rng(7).random((30_000, t.draws)))
        codes, levels = f[:, 0].astype(int), f[:, 1]
        applied = codes >= 0
        assert abs(applied.mean() - 0.5) < 0.01
        assert chi_square(np.bincount(codes[applied], minlength=18)[np.bincount(codes[applied]) > 0]) < 36.1  # 14 dof
        assert len(set(codes[applied])) == 15
        # N(9, 0.5) clipped to [0, 10]: timm's random.gauss, then max(0, min(m, 10))
        reference = np.clip(np.random.default_rng(0).normal(9.0, 0.5, 1_000_000), 0, 10)
        quantiles = [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.97]
        assert np.allclose(np.quantile(levels, quantiles), np.quantile(reference, quantiles), atol=0.02)
        assert levels.max() == 10.0 and abs((levels == 10).mean() - (reference == 10).mean()) < 0.005
        uniform = T.TimmRandAugment(magnitude_std=float("inf")).sample(np.random.default_rng(1).random((20_000, 10)))
        assert chi_square(np.histogram(uniform[:, 1], bins=10, range=(0, 9))[0]) < CHI_999[9]

    def test_level_functions_are_timms(self):
        t, at = T.TimmRandAugment(increasing=True), lambda name, level, sign=1: t.magnitudes(
            50, 60, np.array([CODE[name], level, sign]))[1][0]  # fmt: skip
        assert at("Posterize", 9) == 4 - int(9 / 10 * 4) == 1
        assert at("Solarize", 9) * 255 == pytest.approx(256 - int(9 / 10 * 256))
        assert at("SolarizeAdd", 9) == int(9 / 10 * 110)
        assert at("Brightness", 9, -1) == pytest.approx(max(0.1, 1 - 0.81) - 1)
        assert at("Rotate", 5, -1) == -15.0 and at("ShearY", 10) == pytest.approx(0.3)
        assert at("TranslateXRel", 10, -1) == pytest.approx(-0.45 * 60)
        assert at("TranslateYRel", 10) == pytest.approx(0.45 * 50)
        plain = T.TimmRandAugment(increasing=False)
        assert plain.magnitudes(8, 8, np.array([CODE["Posterize"], 9, 1]))[1][0] == int(9 / 10 * 4)
        assert plain.magnitudes(8, 8, np.array([CODE["Color"], 5, -1]))[1][0] == pytest.approx(5 / 10 * 1.8 + 0.1 - 1)

    def test_solarize_add_is_timms_table(self):
        from gpupipe.backends._torch._policies import apply_op

        image = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16).expand(3, 16, 16)
        out = apply_op(image, "SolarizeAdd", 99.0, T.TimmRandAugment())
        table = torch.tensor([min(255, v + 99) if v < 128 else v for v in range(256)], dtype=torch.uint8)
        assert torch.equal(out, table[image.long()])


THREE_AUGMENT: list[T.Transform] = [
    T.RandomGrayscale(p=1.0),
    T.RandomSolarize(128, p=1.0),
    T.GaussianBlur(9, sigma=(0.1, 2.0)),
]


class TestRandomChoiceOfTransforms:
    """``T.RandomChoice`` of per-sample transforms: one per sample (DeiT III's 3-Augment)."""

    def test_it_is_torchvisions_class_of_either_kind(self):
        """One class, called as torchvision's ``RandomChoice(transforms, p)``: per-sample
        transforms make the per-sample choice, MixUp and CutMix the batch's; each holds the
        transforms and ``p`` it was given (positionally too), ``p`` normalized as torchvision's."""
        from gpupipe.transforms._apply import RandomChoice as PerSample

        check_torchvision_signature(T.RandomChoice, v2.RandomChoice)
        per_sample = T.RandomChoice(THREE_AUGMENT, [2, 1, 1])
        assert type(per_sample) is PerSample and not isinstance(per_sample, T.BatchTransform)
        assert list(per_sample.transforms) == THREE_AUGMENT
        assert per_sample.p == tuple(v2.RandomChoice(THREE_AUGMENT, [2, 1, 1]).p) == (0.5, 0.25, 0.25)
        assert per_sample.draws == 1 + sum(t.draws for t in THREE_AUGMENT)  # the choice, then every member's
        mixing = [T.MixUp(num_classes=3), T.CutMix(num_classes=3)]
        batch = T.RandomChoice(mixing, [0.25, 0.75])
        assert type(batch) is T.RandomChoice and isinstance(batch, T.BatchTransform)
        assert batch.transforms == tuple(mixing) and batch.p == (0.25, 0.75)

    def test_the_choice_follows_p_normalized(self):
        t = T.RandomChoice(THREE_AUGMENT, p=[2, 1, 1])
        assert t.p == (0.5, 0.25, 0.25)
        index = t.sample(np.random.default_rng(3).random((8000, t.draws)))[:, 0].astype(int)
        counts = np.bincount(index, minlength=3)
        assert (((counts - 8000 * np.array(t.p)) ** 2) / (8000 * np.array(t.p))).sum() < 13.8  # 2 d.o.f.

    @pytest.mark.parametrize(("transforms", "match"), [
        ([T.CenterCrop(10), T.RandomInvert()], "keep the image's size"),
        ([T.MixUp(num_classes=3), T.RandomInvert()], "MixUp and CutMix"),
    ])  # fmt: skip
    def test_refused(self, transforms, match):
        with pytest.raises(gp.GpupipeError, match=match):
            gp.Pipeline(["a.tar"], [T.CenterCrop(32), T.RandomChoice(transforms)])

    def test_torch_applies_the_chosen_one_with_its_params(self, photo):
        t = T.RandomChoice(THREE_AUGMENT)
        for seed in range(6):
            f = checkers.draw(t, seed)
            height, width = photo.shape[-2:]
            p = t.make_params(height, width, f)
            inner = t.transforms[p.chosen]
            want = apply_pipeline([inner], photo, [f[slice(*t.factor_slices[p.chosen])] if inner.draws else None])
            assert torch.equal(apply_pipeline([t], photo, [f]), want)

    def test_on_dali_each_sample_its_own_branch(self, photos):
        pytest.importorskip("nvidia.dali")
        nested = T.RandomChoice([T.RandomChoice([T.RandomInvert(p=1.0), T.RandomPosterize(2, p=1.0)]),
                                 T.RandomAutocontrast(p=1.0)], p=[3, 1])  # fmt: skip
        for steps, worst in (([T.RandomChoice(THREE_AUGMENT)], 2), ([T.CenterCrop(40), nested], 0)):
            got, want = run_dali(steps, photos[:24]), checkers.reference_outputs(steps, photos[:24])
            assert max(int((g.int() - w.int()).abs().max()) for g, w in zip(got, want, strict=True)) <= worst


class TestRecipes:
    """pipelines/imagenet.py's V2, timm and 3-Augment recipes through the loader."""

    @pytest.mark.parametrize(("name", "size", "soft"), [
        ("train_v2", 176, True), ("train_timm", 224, True), ("train_3augment", 224, False),
    ])  # fmt: skip
    def test_a_recipe_runs_and_the_backends_agree(self, shards, clean_env, name, size, soft):
        """Each recipe on each backend; ``auto`` on the CPU passes DALI over (measured slower
        there: ``Backend.slower``) and says so."""
        import os

        root = os.path.join(os.path.dirname(__file__), "..")
        recipe = gp.load_pipeline(os.path.join(root, "pipelines", f"imagenet.py:{name}"))
        pipe = recipe(shards[0], num_classes=5) if soft else recipe(shards[0])
        dali = backends.get("dali").available()
        with gp.Loader(pipe, 4, backend="auto", device="cpu", num_workers=0) as loader:
            assert loader.backend == "torch"
            assert ("runs slower" in (loader.chosen or "")) == dali
        got = {}
        for backend in ("torch", "dali") if dali else ("torch",):
            with gp.Loader(pipe, 4, seed=1, backend=backend, device="cpu", num_workers=1) as loader:
                batch = next(iter(loader))
                got[loader.backend] = batch
                assert batch.labels is not None
                assert tuple(batch.images.shape) == (4, 3, size, size)
                assert batch.labels.shape == ((4, 5) if soft else (4,))
        if "dali" in got:
            a, b = got["torch"], got["dali"]
            assert a.labels is not None and b.labels is not None
            assert a.keys == b.keys and torch.allclose(a.labels.float(), b.labels.float())
            assert float((a.images - b.images).abs().mean()) < 0.05  # normalized units


class TestAgreement:
    def test_draws_are_independent_across_samples_and_epochs(self):
        """TrivialAugmentWide's operation of a sample in epoch 0 says nothing of its operation in
        epoch 1, nor of the next sample's (chi-square of the 14 x 14 table, 169 d.o.f.)."""
        from gpupipe.core._random import step_factors

        t, n = T.TrivialAugmentWide(), 14 * 14 * 60
        first, later = (step_factors(t, 5, epoch, np.arange(n), 2) for epoch in (0, 1))
        assert first is not None and later is not None
        first, later = first[:, 0].astype(int), later[:, 0].astype(int)
        for a, b in ((first, later), (first[:-1], first[1:])):
            table = np.zeros((18, 18))
            np.add.at(table, (a, b), 1)
            table = table[table.sum(1) > 0][:, table.sum(0) > 0]
            expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
            assert ((table - expected) ** 2 / expected).sum() < 230  # 169 d.o.f.: 0.999 quantile 228.5

    def test_every_backend_draws_the_same(self, photos):
        """The DALI runner's host draws (per batch, vectorized) are the torch backend's (per
        sample): the same operations and magnitudes."""
        from gpupipe.backends._torch._kernels import sample_factors as one_sample

        for t in (T.TrivialAugmentWide(), T.RandAugment(), T.AutoAugment(), T.TimmRandAugment()):
            batch = checkers.sample_factors([t], 32, seed=9)[0]
            codes, mags = t.magnitudes(50, 60, batch)
            for i in range(32):
                factors = one_sample([t], 9, 0, i)[0]
                assert factors is not None
                alone = t.make_params(50, 60, factors)
                pairs = tuple((OPS[c], float(m)) for c, m in zip(codes[i], mags[i], strict=True) if c > 0)
                assert alone.ops == pairs


GPU_CASES = [  # (the policies run in the stage on DALI: test_stage_device.py)
    [T.RandomChoice(THREE_AUGMENT)],
    [
        T.CenterCrop(40),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize([0.5] * 3, [0.25] * 3),
        T.RandomErasing(p=0.7, value="random"),
    ],
]


@pytest.mark.gpu
@pytest.mark.parametrize("steps", GPU_CASES, ids=lambda s: type(s[-1]).__name__)
def test_on_the_gpu_graph(steps, photos):
    """The same lowerings on DALI's GPU operators (nvJPEG decodes a unit or two apart from
    libjpeg-turbo): per-image mean difference against torchvision within the decode's spread and
    Equalize's table (on DALI-CPU: worst image 14, Equalize twice; to settle on the first GPU run)."""
    unit = 255.0 * 0.25 if isinstance(steps[-1], T.RandomErasing) else None
    checkers.check_backend_parity(steps, photos[:24], device="gpu", unit=unit, mean_tol=3.0, max_tol=24.0)
