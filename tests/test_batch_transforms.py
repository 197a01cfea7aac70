"""Issue 37, batch transforms: MixUp, CutMix and RandomChoice of them, as torchvision v2 applies
them (one λ per batch, the neighbour as partner, CutMix's λ corrected to its box), timm's
per-sample mode and label smoothing, drawn from ``(seed, epoch, rank, batch)``, and padding kept
out of real samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.backends._stage._mix import apply_batch, mix, soft_labels
from gpupipe.core._random import batch_generator
from gpupipe.runtime import _threads
from gpupipe.transforms._batch import MixParams

from .support.data import write_webdataset_shards

K = 10


def batch(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 10, 12, generator=g), torch.randint(0, K, (n,), generator=g)


def all_valid(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


class TestMixUp:
    def test_equals_torchvisions_for_the_same_lambda(self):
        images, labels = batch()
        lam = 0.3141
        params = MixParams(np.full(8, lam), np.zeros(8, bool), np.zeros((8, 4), np.int64))
        got, soft = mix(images.clone(), labels, all_valid(8), params, num_classes=K)
        tv = v2.MixUp(alpha=1.0, num_classes=K)
        p = {"lam": lam, "labels": labels, "batch_size": 8}
        assert torch.equal(got, tv.transform(images, p)) and torch.equal(soft, tv.transform(labels, p))

    def test_a_uint8_image_is_refused(self, tmp_path):
        with pytest.raises(gp.PipelineError, match="MixUp blends images: it needs a float image"):
            gp.Pipeline(["a.tar"], [T.Resize(8)], batch_transform=T.MixUp(num_classes=K))

    @pytest.mark.parametrize(("kwargs", "message"), [
        (dict(alpha=0.0, num_classes=K), "alpha must be a number > 0"),
        (dict(alpha=1.0), "num_classes is required"),
        (dict(num_classes=0), "num_classes must be an int >= 1"),
        (dict(num_classes=K, label_smoothing=1.0), r"label_smoothing must be in \[0, 1\)"),
        (dict(num_classes=K, mode="pair"), "mode"),
    ])  # fmt: skip
    def test_arguments_are_checked(self, kwargs, message):
        with pytest.raises(gp.ConfigError, match=message):
            T.MixUp(**kwargs)

    def test_arguments_are_keyword_only_as_torchvisions(self):
        with pytest.raises(TypeError):
            T.MixUp(1.0, K)  # type: ignore[call-arg]


class TestCutMix:
    def test_the_box_and_corrected_lambda_are_torchvisions(self, monkeypatch):
        """Given the same λ and centre, torchvision's CutMix makes the same box and λ."""
        for seed in range(40):
            rng = batch_generator(seed, 0, 0, 0)
            params = T.CutMix(alpha=0.7, num_classes=K).sample(rng, 4, 37, 53)
            rng = batch_generator(seed, 0, 0, 0)
            lam, r_x, r_y = rng.beta(0.7, 0.7), int(rng.integers(53)), int(rng.integers(37))
            tv = v2.CutMix(alpha=0.7, num_classes=K)
            drawn = torch.tensor(lam)
            monkeypatch.setattr(tv, "_dist", type("Dist", (), {"sample": lambda self, shape, _d=drawn: _d})())
            centres = iter([torch.tensor([r_x]), torch.tensor([r_y])])
            monkeypatch.setattr(torch, "randint", lambda high, size, _c=centres: next(_c))
            expected = tv.make_params([torch.zeros(4, 3, 37, 53)])
            monkeypatch.undo()
            assert tuple(params.box[0]) == expected["box"] and params.lam[0] == expected["lam_adjusted"]
            assert params.cut.all() and (params.box == params.box[0]).all()

    def test_applied_as_torchvision_applies_it(self):
        images, labels = batch(seed=3)
        params = T.CutMix(num_classes=K).sample(batch_generator(1, 2, 3, 4), 8, 10, 12)
        got, soft = mix(images.clone(), labels, all_valid(8), params, num_classes=K)
        p = {"box": tuple(int(v) for v in params.box[0]), "lam_adjusted": float(params.lam[0]), "labels": labels,
             "batch_size": 8}  # fmt: skip
        tv = v2.CutMix(num_classes=K)
        assert torch.equal(got, tv.transform(images, p)) and torch.equal(soft, tv.transform(labels, p))

    @pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.float16])
    def test_any_dtype(self, dtype):
        """CutMix only moves pixels: on an image of any dtype it pastes the neighbour's box, values
        and dtype as they were — torchvision's CutMix on that image; in a batch with padding too."""
        images, labels = batch()
        images = (images * 255).to(dtype)
        params = T.CutMix(num_classes=K).sample(batch_generator(0, 0, 0, 1), 8, 10, 12)
        x1, y1, x2, y2 = (int(v) for v in params.box[0])
        assert 0 < (x2 - x1) * (y2 - y1) < 10 * 12  # some pixels pasted, not all
        tv = v2.CutMix(num_classes=K)
        for n in (8, 7):  # every row valid (in place), and the last one padding
            valid = torch.arange(8) < n
            got, soft = mix(images.clone(), labels, valid, params, num_classes=K)
            mine = labels[:n]
            p = {"box": (x1, y1, x2, y2), "lam_adjusted": float(params.lam[0]), "labels": mine, "batch_size": n}
            assert got.dtype == dtype and torch.equal(got[:n], tv.transform(images[:n], p))
            assert torch.equal(got[n:], images[n:])  # padding untouched
            assert not torch.equal(got[:n], images[:n])
            assert torch.equal(soft[:n], tv.transform(mine, p))


class TestRandomChoice:
    def test_one_of_them_per_batch_uniform_by_default(self):
        choice = T.RandomChoice([T.MixUp(num_classes=K), T.CutMix(num_classes=K)])
        cuts = np.array([choice.sample(batch_generator(0, 0, 0, b), 4, 8, 8).cut.all() for b in range(2000)])
        chi2 = ((cuts.sum() - 1000) ** 2 + ((~cuts).sum() - 1000) ** 2) / 1000
        assert chi2 < 10.8  # p = 0.001, 1 degree of freedom

    def test_p_and_each_sample_its_own_in_elem_mode(self):
        choice = T.RandomChoice([T.MixUp(num_classes=K, mode="elem"), T.CutMix(num_classes=K, mode="elem")],
                                p=[0.2, 0.8])  # fmt: skip
        params = choice.sample(batch_generator(5, 0, 0, 0), 4000, 8, 8)
        blended = params.lam[~params.cut]  # CutMix's λ on an 8x8 image takes few values
        assert abs(params.cut.mean() - 0.8) < 0.03 and len(set(blended.tolist())) == len(blended) > 700
        x1, y1, x2, y2 = params.box[params.cut].T
        assert (params.box[~params.cut] == 0).all() and np.array_equal(params.lam[params.cut],
                                                                       1 - (x2 - x1) * (y2 - y1) / 64)  # fmt: skip

    @pytest.mark.parametrize("mode", ["batch", "elem"])
    def test_the_in_place_path_of_full_batches_is_row_by_row_mixing(self, mode):
        """Every row valid (nearly every batch): one roll, in place; the same values as mixing row by
        row with the row before (blend ``λ·x + (1 − λ)·x_prev``, or the box pasted)."""
        choice = T.RandomChoice([T.MixUp(num_classes=K, mode=mode), T.CutMix(num_classes=K, mode=mode)])
        for b in range(12):
            params = choice.sample(batch_generator(3, 0, 0, b), 8, 12, 16)
            images, labels = batch(8, seed=b)
            images = torch.rand(8, 3, 12, 16, generator=torch.Generator().manual_seed(b))
            got, soft = mix(images.clone(), labels, all_valid(8), params, num_classes=K)
            for i in range(8):
                j, lam = i - 1, float(np.float32(params.lam[i]))
                if params.cut[i]:
                    x1, y1, x2, y2 = params.box[i]
                    want = images[i].clone()
                    want[:, y1:y2, x1:x2] = images[j, :, y1:y2, x1:x2]
                else:
                    want = images[i] * lam + images[j] * float(np.float32(1 - params.lam[i]))
                torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
                one_hot = torch.nn.functional.one_hot(labels, K).float()
                torch.testing.assert_close(soft[i], one_hot[i] * lam + one_hot[j] * (1 - lam), rtol=0, atol=1e-6)

    @pytest.mark.parametrize("members", [
        [T.MixUp(num_classes=K), T.CutMix(num_classes=K + 1)],
        [T.MixUp(num_classes=K), T.CutMix(num_classes=K, mode="elem")],
    ])  # fmt: skip
    def test_members_must_agree(self, members):
        with pytest.raises(gp.ConfigError, match="must share"):
            T.RandomChoice(members)

    def test_p_is_normalized_as_torchvisions(self):
        """torchvision divides p by its sum (``p=[1, 1]`` is uniform); a NaN, a negative or an
        infinite p is refused here, not when a batch draws."""
        members = [T.MixUp(num_classes=K), T.CutMix(num_classes=K)]
        tv = v2.RandomChoice([v2.MixUp(num_classes=K), v2.CutMix(num_classes=K)], p=[1, 3])
        assert T.RandomChoice(members, p=[1, 3]).p == tuple(tv.p)
        for p in ([float("nan"), 1.0], [-1.0, 2.0], [math.inf, 1.0], [0, 0], [1.0]):
            with pytest.raises(gp.ConfigError, match="p must be"):
                T.RandomChoice(members, p=p)

    def test_per_sample_transforms_make_the_per_sample_choice(self):
        """(tests/test_policies.py::TestRandomChoiceOfTransforms); not a batch transform."""
        choice = T.RandomChoice([T.RandomHorizontalFlip()])
        assert isinstance(choice, T.Transform) and not isinstance(choice, T.BatchTransform)
        with pytest.raises(gp.ConfigError, match="batch_transform"):
            gp.Pipeline(["a.tar"], [T.CenterCrop(8)], batch_transform=choice)  # type: ignore[arg-type]


class TestDraws:
    @pytest.mark.parametrize("alpha", [0.2, 1.0])
    def test_lambda_is_beta_alpha_alpha(self, alpha):
        lam = np.array([T.MixUp(alpha=alpha, num_classes=K).sample(batch_generator(7, e, 0, b), 1, 4, 4).lam[0]
                        for e in range(4) for b in range(1000)])  # fmt: skip
        reference = np.sort(np.random.default_rng(123).beta(alpha, alpha, size=20000))
        cdf = np.searchsorted(reference, np.sort(lam), side="right") / len(reference)
        ks = np.max(np.abs(cdf - np.arange(1, len(lam) + 1) / len(lam)))
        assert ks < 1.63 * math.sqrt((len(lam) + len(reference)) / (len(lam) * len(reference)))  # p = 0.01
        assert abs(lam.var() - 1 / (4 * (2 * alpha + 1))) < 0.01

    def test_keyed_by_seed_epoch_rank_and_batch_only(self):
        t = T.MixUp(num_classes=K, mode="elem")

        def lam(*key):
            return t.sample(batch_generator(*key), 16, 8, 8).lam

        assert np.array_equal(lam(1, 2, 3, 4), lam(1, 2, 3, 4))
        others = [lam(2, 2, 3, 4), lam(1, 3, 3, 4), lam(1, 2, 4, 4), lam(1, 2, 3, 5)]
        assert all(not np.array_equal(lam(1, 2, 3, 4), o) for o in others)


class TestPadding:
    """Rows that are not valid (padding, skipped samples) are neither mixed nor partners."""

    @pytest.mark.parametrize("t", [T.MixUp(num_classes=K), T.CutMix(num_classes=K, mode="elem")])
    def test_only_valid_rows_mix_with_the_valid_row_before(self, t):
        images, labels = batch(8, seed=5)
        valid = torch.tensor([True, False, True, True, False, True, True, False])
        params = t.sample(batch_generator(0, 0, 0, 9), 8, 10, 12)
        got, soft = mix(images.clone(), labels, valid, params, num_classes=K)
        rows = [0, 2, 3, 5, 6]
        expected_images, expected_soft = mix(images[rows].clone(), labels[rows], all_valid(5),
                                             MixParams(*(f[rows] for f in params)), num_classes=K)  # fmt: skip
        assert torch.equal(got[rows], expected_images) and torch.equal(soft[rows], expected_soft)
        padding = [1, 4, 7]
        assert torch.equal(got[padding], images[padding]) and torch.equal(
            soft[padding], soft_labels(labels[padding], K)
        )

    def test_a_lone_valid_sample_is_unchanged(self):
        images, labels = batch(4)
        valid = torch.tensor([False, True, False, False])
        got, soft = apply_batch(T.MixUp(num_classes=K), images.clone(), labels, valid, seed=0, epoch=0, rank=0, batch=0)
        assert torch.equal(got, images) and torch.equal(soft, soft_labels(labels, K))


def test_label_smoothing_is_timms():
    labels = torch.tensor([0, 3])
    soft = soft_labels(labels, 4, 0.1)
    assert torch.allclose(soft, torch.tensor([[0.925, 0.025, 0.025, 0.025], [0.025, 0.025, 0.025, 0.925]]))
    images, labels = batch()
    _, mixed = apply_batch(T.CutMix(num_classes=K, label_smoothing=0.1), images, labels, all_valid(8), seed=0,
                           epoch=0, rank=0, batch=0)  # fmt: skip
    assert torch.allclose(mixed.sum(1), torch.ones(8)) and mixed.min() >= 0.01 - 1e-7


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return write_webdataset_shards(str(tmp_path_factory.mktemp("mix")), (12, 12), prefix="mix")


class TestInALoader:
    def pipeline(self, shards, **kwargs):
        mixing = T.RandomChoice([T.MixUp(alpha=0.2, num_classes=K), T.CutMix(alpha=1.0, num_classes=K)])
        return gp.Pipeline(shards, [T.Resize((16, 16)), T.ToDtype(torch.float32, scale=True)], batch_transform=mixing,
                           **kwargs)  # fmt: skip

    def labels(self, loader) -> list[torch.Tensor]:
        return [labels for _, labels in loader]

    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_soft_labels_the_same_on_every_backend(self, shards, backend):
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        pipe = self.pipeline(shards)
        with gp.Loader(pipe, 5, backend="torch", num_workers=0, seed=1) as reference:
            expected = self.labels(reference)
        with gp.Loader(pipe, 5, backend=backend, device="cpu", seed=1, num_workers=1) as loader:
            got = self.labels(loader)
        assert [tuple(g.shape) for g in got] == [(5, K)] * 4 + [(4, K)] and all(g.dtype == torch.float32 for g in got)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert all(torch.allclose(g.sum(1), torch.ones(len(g))) for g in got)

    def test_on_the_cpu_the_torch_backend_mixes_where_it_batches(self, shards, monkeypatch):
        """The stage owns the batch transform; on the CPU the torch backend runs it in its worker
        (one thread, as torchvision's reference collate does), not the training thread, whose
        intra-op threads would contend with the workers; the batches are those the loader's own
        run of the stage gives (the inline test backend's, same kernels)."""
        from gpupipe import backends
        from gpupipe.backends._stage import _delivered

        monkeypatch.setitem(backends.TABLE, "inline", "tests.support.inline_backend")
        pipe = self.pipeline(shards)
        with gp.Loader(pipe, 5, backend="inline", device="cpu", seed=3) as loader:
            loader.set_epoch(2)
            want = [(x.clone(), y.clone()) for x, y in loader]
        in_loader: list[int] = []
        real = _delivered.Stage.batches

        def counted(*args, **kwargs):
            in_loader.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(_delivered.Stage, "batches", counted)
        for workers in (0, 1):
            with gp.Loader(pipe, 5, backend="torch", device="cpu", seed=3, num_workers=workers) as loader:
                loader.set_epoch(2)
                got = [(x.clone(), y.clone()) for x, y in loader]
            assert in_loader == [] and len(got) == len(want)
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True))

    @pytest.mark.parametrize("workers", [0, 1])
    def test_set_pipeline_brings_its_batch_transform_or_none(self, shards, workers):
        """The same transform lists with another batch transform (or none) is another runner: the
        torch workers on the CPU hold the stage that mixes."""
        mixed = self.pipeline(shards)
        plain = gp.Pipeline(shards, [T.Resize((16, 16)), T.ToDtype(torch.float32, scale=True)])
        with gp.Loader(plain, 5, backend="torch", device="cpu", seed=3, num_workers=workers) as loader:
            assert all(y.dtype == torch.int64 for y in self.labels(loader))
            for epoch, pipe, soft in ((1, mixed, True), (2, plain, False)):
                loader.set_pipeline(pipe)
                loader.set_epoch(epoch)
                got = self.labels(loader)
                assert all((y.dtype == torch.float32 and y.shape[1:] == (K,)) == soft for y in got), epoch

    def test_a_resumed_epoch_mixes_as_the_uninterrupted_one(self, shards):
        pipe = self.pipeline(shards)
        with gp.Loader(pipe, 4, backend="torch", num_workers=0, seed=2) as loader:
            loader.set_epoch(1)
            whole = [(x.clone(), y.clone()) for x, y in loader]
        with gp.Loader(pipe, 4, backend="torch", num_workers=0, seed=2) as loader:
            loader.set_epoch(1)
            run = iter(loader)
            for _ in range(2):
                next(run)
            state = loader.state_dict()
        with gp.Loader(pipe, 4, backend="torch", num_workers=0, seed=2) as loader:
            loader.load_state_dict(state)
            rest = [(x.clone(), y.clone()) for x, y in loader]
        assert len(rest) == len(whole) - 2
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, whole[2:], strict=True))

    def test_an_unlabeled_source_and_views_are_refused(self, shards):
        import gpupipe.sources as S

        unlabeled = S.WebDataset(shards, label=None)
        with pytest.raises(gp.ConfigError, match="mixes labels: the source has none"):
            gp.Loader(self.pipeline(unlabeled), 4, backend="torch", num_workers=0)
        with pytest.raises(gp.ConfigError, match="not with views"):
            gp.Pipeline(shards, views=[[T.ToDtype(torch.float32)]] * 2, batch_transform=T.CutMix(num_classes=K))


@pytest.fixture(scope="module", params=[b"10", b"-3"])
def damaged(request, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("classes")
    return write_webdataset_shards(str(root), (6, 6), prefix="cls", patch={8: {"cls": request.param}})


class TestLabelsOutsideTheClasses:
    """A label outside ``0 .. num_classes - 1`` (a ``.cls`` of 10 with ``num_classes=10``, or a
    negative one, which the int64 rule accepts) ended the epoch with one_hot's bare
    ``RuntimeError``, under ``on_error="skip"`` too (found by a review, 2026-11-29). It is a
    sample of kind ``bad-label`` on every backend: skipped and counted, or raised naming it."""

    def pipeline(self, shards):
        return gp.Pipeline(shards, [T.Resize((16, 16)), T.ToDtype(torch.float32, scale=True)],
                           batch_transform=T.MixUp(alpha=0.2, num_classes=K))  # fmt: skip

    @pytest.mark.parametrize(("backend", "workers"), [("torch", 0), ("torch", 2), ("dali", 1)])
    def test_it_is_skipped_and_counted(self, damaged, backend, workers):
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        with gp.Loader(self.pipeline(damaged), 4, backend=backend, device="cpu", num_workers=workers,
                       on_error="skip", max_skipped=None) as loader:  # fmt: skip
            labels = [y for _, y in loader]
            skipped = [(s.key, s.kind) for s in loader.skipped]
        assert sum(len(y) for y in labels) == 12 and all(y.shape[1:] == (K,) for y in labels)
        assert skipped == [("img/01/000008", "bad-label")]

    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_it_is_raised_naming_the_sample(self, damaged, backend):
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        with (gp.Loader(self.pipeline(damaged), 4, backend=backend, device="cpu", num_workers=1) as loader,
              pytest.raises(gp.SampleError, match=r"'img/01/000008'.*num_classes=10: 0 to 9") as raised):  # fmt: skip
            list(loader)
        assert raised.value.kind == "bad-label" and str(raised.value.shard).endswith("cls-000001.tar")

    def test_without_a_batch_transform_any_label_is_kept(self, damaged):
        plain = gp.Pipeline(damaged, [T.Resize((16, 16))])
        with gp.Loader(plain, 4, backend="torch", num_workers=0) as loader:
            labels = torch.cat([y for _, y in loader])
        assert len(labels) == 12 and not loader.skipped


@pytest.mark.skipif(_threads.openmp() is None, reason="torch's intra-op threads are not OpenMP's here")
def test_on_the_cpu_the_mix_runs_on_the_calling_thread_alone(monkeypatch, two_threads):
    """MixUp/CutMix in the training process (DALI, Ray) run on that thread, not on torch's
    intra-op team, whose spinning would take the cores from the loader's threads; the thread's
    count is restored after, and the values are the same."""
    from gpupipe.backends._stage import _mix

    seen = []
    real = _mix.mix

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(_mix, "mix", recording)
    images, labels = batch(8, seed=3)
    args = dict(seed=0, epoch=0, rank=0, batch=4)
    got, soft = apply_batch(T.MixUp(num_classes=K), images.clone(), labels, all_valid(8), **args)
    assert seen == [1] and torch.get_num_threads() == 2
    params = T.MixUp(num_classes=K).sample(batch_generator(0, 0, 0, 4), 8, 10, 12)
    expected, expected_soft = real(images.clone(), labels, all_valid(8), params, num_classes=K)
    assert torch.equal(got, expected) and torch.equal(soft, expected_soft)
