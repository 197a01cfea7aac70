"""``gp.Mix``: several sources in one loader, each with its count per epoch, on every backend.

Source ``a`` (the 16-sample ``shards``) and source ``b`` (6 samples in 2 shards) carry the same
keys, so their samples are told apart by label: ``b``'s get ``label_offsets=[0, 100]``.
"""

from __future__ import annotations

import collections
import itertools
import os

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.plan._mix import select
from gpupipe.sources._mix import MixIndex, counts_of

from .support.checkers import check_exact_resume
from .support.data import SHARD_SIZES, label_of, write_webdataset_shards

A = sum(SHARD_SIZES)  # 16
B = 6
EPOCH = 2


@pytest.fixture(scope="module")
def b_shards(tmp_path_factory) -> list[str]:
    return write_webdataset_shards(str(tmp_path_factory.mktemp("mix_b")), (3, 3), prefix="b")


def mix(shards, b_shards, **options) -> gp.Mix:
    options.setdefault("label_offsets", [0, 100])
    return gp.Mix([gp.WebDataset(shards), gp.WebDataset(b_shards)], **options)


def pipeline(source) -> gp.Pipeline:
    return gp.Pipeline(source, [T.RandomResizedCrop(12), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)])


def entries(loader: gp.Loader, epoch: int = EPOCH) -> collections.Counter:
    """``{(key, label): times}`` of the valid samples of an epoch, from its plan alone."""
    plan = loader.plan(epoch)
    index = loader.index
    got: collections.Counter = collections.Counter()
    for s in plan.samples[plan.valid].tolist():
        raw_label = index.locate_batch(np.array([s])).labels
        assert raw_label is not None
        got[index.key(s), int(raw_label[0])] += 1
    return got


def per_source(counter: collections.Counter) -> tuple[int, int]:
    a = sum(n for (_, label), n in counter.items() if label < 100)
    return a, sum(counter.values()) - a


def plan_loaders(source, world: int, batch_size: int = 4, **options) -> list[gp.Loader]:
    return [
        gp.Loader(pipeline(source), batch_size, backend="torch", num_workers=0, shuffle=True, seed=3, rank=r,
                  world_size=world, **options)
        for r in range(world)
    ]  # fmt: skip


def epoch_images(loader: gp.Loader, epoch: int = EPOCH, batches: int | None = None) -> list[tuple]:
    """``[(key, label, image)]`` of the valid samples of (the first ``batches`` batches of) an epoch."""
    loader.set_epoch(epoch)
    out = []
    iteration = iter(loader)
    try:
        for batch in itertools.islice(iteration, batches):
            assert batch.labels is not None
            for key, label, ok, image in zip(batch.keys, batch.labels.tolist(), batch.valid.tolist(), batch.images,
                                             strict=True):  # fmt: skip
                if ok:
                    out.append((key, label, image.cpu().clone()))
    finally:
        iteration.close()
    return out


def as_multiset(rows) -> collections.Counter:
    return collections.Counter((k, lab, image.numpy().tobytes()) for k, lab, image in rows)


class TestMixArguments:
    @pytest.mark.parametrize(
        ("options", "match"),
        [
            (dict(weights=[1, 1], counts=[1, 1]), "not both"),
            (dict(weights=[1]), "1 entries for 2 sources"),
            (dict(weights=[1, -1]), ">= 0"),
            (dict(weights=[0, 0]), "not all 0"),
            (dict(weights=[1, float("nan")]), "finite"),
            (dict(counts=[1, 0.5]), "integers"),
            (dict(counts=[0, 0]), "not all 0"),
            (dict(counts=[3, 3], num_samples=10), "num_samples goes with weights"),
            (dict(weights=[1, 1], num_samples=0), "positive integer"),
            (dict(replacement=1), "True or False"),
            (dict(label_offsets=[0, -1]), "label_offsets"),
            (dict(weights="ab"), "list of numbers"),
        ],
    )
    def test_bad_arguments_are_config_errors(self, shards, b_shards, options, match):
        with pytest.raises(gp.ConfigError, match=match):
            gp.Mix([gp.WebDataset(shards), gp.WebDataset(b_shards)], **options)

    def test_sources_must_be_a_list_of_sources_other_than_a_mix(self, shards, b_shards):
        with pytest.raises(gp.ConfigError, match="list of sources"):
            gp.Mix(gp.WebDataset(shards))  # type: ignore[arg-type]
        with pytest.raises(gp.ConfigError, match="empty"):
            gp.Mix([])
        inner = gp.Mix([gp.WebDataset(shards)])
        with pytest.raises(gp.ConfigError, match="other than a Mix"):
            gp.Mix([inner, gp.WebDataset(b_shards)])

    def test_patterns_are_webdatasets_and_a_mix_is_hashable(self, shards, b_shards):
        m = gp.Mix([shards, b_shards], weights=[2, 1])
        assert m.sources == (gp.WebDataset(shards), gp.WebDataset(b_shards))
        same = gp.Mix([shards, b_shards], weights=[2.0, 1.0])
        assert m == same and hash(m) == hash(same)

    def test_labeled_and_unlabeled_sources_do_not_mix(self, shards, unlabeled_shards):
        m = gp.Mix([gp.WebDataset(shards), gp.WebDataset(unlabeled_shards, label=None)])
        with pytest.raises(gp.ConfigError, match="unlabeled"):
            m.index()


class TestCounts:
    def test_largest_remainders_add_up_exactly(self):
        assert counts_of([10, 10, 10], weights=[1, 1, 1], counts=None, num_samples=10) == (4, 3, 3)
        assert counts_of([5, 7], weights=[0.25, 0.75], counts=None, num_samples=None) == (3, 9)
        assert counts_of([5, 7], weights=None, counts=None, num_samples=None) == (5, 7)
        assert counts_of([5, 7], weights=None, counts=[1, 2], num_samples=None) == (1, 2)
        for total in range(1, 50):
            assert sum(counts_of([3, 4, 5], weights=[0.1, 0.3, 0.6], counts=None, num_samples=total)) == total

    @pytest.mark.parametrize("world", [1, 2, 3])
    @pytest.mark.parametrize(
        ("options", "expected"),
        [
            (dict(), (A, B)),  # a concatenation: every sample once
            (dict(counts=[10, 4]), (10, 4)),  # fewer than each has: distinct samples
            (dict(counts=[5, 15]), (5, 15)),  # b 2.5 times: each sample 2 or 3 times
            (dict(weights=[1, 3], num_samples=30), (8, 22)),  # 7.5 / 22.5: the first remainder rounds up
            (dict(counts=[7, 20], replacement=True), (7, 20)),
        ],
        ids=["concat", "subsets", "repeats", "weights", "replacement"],
    )
    def test_every_epoch_holds_exactly_the_counts_over_the_ranks(self, shards, b_shards, world, options, expected,
                                                                 clean_env):  # fmt: skip
        loaders = plan_loaders(mix(shards, b_shards, **options), world)
        try:
            for epoch in (EPOCH, EPOCH + 1):
                got = sum((entries(loader, epoch) for loader in loaders), collections.Counter())
                assert per_source(got) == expected
                if not options.get("replacement"):  # each sample count // size or that + 1 times
                    for source, size in ((0, A), (1, B)):
                        mine = [n for (_, label), n in got.items() if (label >= 100) == bool(source)]
                        times = collections.Counter(mine)
                        q, r = divmod(expected[source], size)
                        want = {q: size - r, q + 1: r} if q else {1: r}
                        assert times == {n: k for n, k in want.items() if k}, (source, times)
            lengths = {len(loader) for loader in loaders}
            assert len(lengths) == 1
            stats = [loader.stats()["sources"] for loader in loaders]
            assert [sum(s[i]["planned"] for s in stats) for i in range(2)] == list(expected)
            assert all(s[i]["per_epoch"] == expected[i] for s in stats for i in range(2))
        finally:
            for loader in loaders:
                loader.close()

    def test_draws_are_a_function_of_seed_and_epoch(self, shards, b_shards, clean_env):
        source = mix(shards, b_shards, counts=[6, 9])
        (one,), (two,) = plan_loaders(source, 1), plan_loaders(source, 1)
        with one, two:
            assert entries(one, 1) == entries(two, 1)
            assert np.array_equal(one.plan(1).samples, two.plan(1).samples)
            assert any(entries(one, e) != entries(one, 1) for e in (2, 3, 4))

    def test_replacement_draws_spread_over_the_source(self, shards, b_shards):
        """4,000 draws with replacement from 16 + 6 samples: every sample drawn, none far from
        its expected 250 / 333 times (a binomial's 5 sigma)."""
        index = mix(shards, b_shards, counts=[4000, 2000], replacement=True).index()
        assert isinstance(index, MixIndex)
        sel = select(index.mix, index.shard_sizes, np.zeros(0, np.int64), seed=0, epoch=0)
        samples, draws = sel.resolve(np.arange(int(sel.sizes.sum())))
        times = np.bincount(samples, minlength=A + B)
        assert times[:A].sum() == 4000 and times[A:].sum() == 2000
        assert np.all(np.abs(times[:A] - 250) < 5 * np.sqrt(250)) and np.all(np.abs(times[A:] - 333) < 5 * 18)
        assert len(np.unique(draws)) == len(draws)  # every copy its own draws

    def test_a_state_of_another_mix_is_refused(self, shards, b_shards, clean_env):
        (one,), (two,) = (
            plan_loaders(mix(shards, b_shards, counts=[5, 5]), 1),
            plan_loaders(mix(shards, b_shards, counts=[5, 6]), 1),
        )
        with one, two, pytest.raises(gp.ConfigError, match="mix="):
            two.load_state_dict(one.state_dict())


class TestMixOnEveryBackend:
    def test_labels_keys_and_copies(self, backend, shards, b_shards, clean_env):
        """b (6 samples) taken 12 times: each sample twice, its copies augmented apart; a's
        samples are augmented as an unmixed loader of a augments them (copy 0 draws the same)."""
        source = mix(shards, b_shards, counts=[A, 2 * B])
        with backend.loader(pipeline(source), 4, shuffle=True, seed=3, num_workers=1) as loader:
            rows = epoch_images(loader)
            stats = loader.stats()
        assert stats["sources"][0]["yielded"] == A and stats["sources"][1]["yielded"] == 2 * B
        with backend.loader(pipeline(gp.WebDataset(shards)), 4, shuffle=True, seed=3, num_workers=1) as alone:
            reference = {key: image for key, _, image in epoch_images(alone)}
        copies: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
        for key, label, image in rows:
            n = int(key.rsplit("/", 1)[1])
            if label < 100:
                assert label == label_of(n)
                torch.testing.assert_close(image, reference[key], rtol=0, atol=0, msg=key)
            else:
                assert label == 100 + label_of(n)
                copies[key].append(image)
        assert len(copies) == B and all(len(c) == 2 for c in copies.values())
        assert all(not torch.equal(*c) for c in copies.values())

    def test_exact_resume(self, backend, shards, b_shards, clean_env):
        source = mix(shards, b_shards, weights=[1, 2], num_samples=20)
        check_exact_resume(
            lambda: backend.loader(pipeline(source), 3, shuffle=True, seed=3, num_workers=1), epoch=EPOCH, at=2
        )

    @pytest.mark.parametrize(("old", "new"), [(1, 3), (3, 2), (2, 4)])
    def test_elastic_resume_yields_each_entry_once_with_its_image(self, backend, shards, b_shards, old, new,
                                                                   clean_env):  # fmt: skip
        """An epoch with repeats (b 2.5 times) stopped after one step at ``old`` ranks, finished
        at ``new``: the multiset of (key, label, image) equals an uninterrupted run's."""
        source = mix(shards, b_shards, counts=[9, 15])

        def ranks(world: int, batch_size: int) -> list[gp.Loader]:
            return [backend.loader(pipeline(source), batch_size, shuffle=True, seed=3, rank=r, world_size=world,
                                   num_workers=0) for r in range(world)]  # fmt: skip

        (whole,) = ranks(1, 4)
        with whole:
            expected = as_multiset(epoch_images(whole))
        got: list[tuple] = []
        first = ranks(old, 2)
        for loader in first:
            got += epoch_images(loader, batches=1)
        state = first[-1].state_dict()
        for loader in first:
            loader.close()
        for loader in ranks(new, 3):
            with loader:
                loader.load_state_dict(state)
                got += epoch_images(loader)
        assert as_multiset(got) == expected and sum(expected.values()) == 24

    def test_an_imagefolder_with_tar_shards(self, backend, shards, image_folder, clean_env):
        source = gp.Mix([gp.WebDataset(shards), gp.ImageFolder(image_folder)], counts=[5, 7], label_offsets=[0, 10])
        with backend.loader(pipeline(source), 4, shuffle=True, seed=1, num_workers=1) as loader:
            assert not loader.index.sequential  # an ImageFolder's classes are not read as shards
            rows = epoch_images(loader, 0)
        labels = [label for _, label, _ in rows]
        assert sum(label < 10 for label in labels) == 5 and sum(label >= 10 for label in labels) == 7
        assert {key.split("/")[0] for key, label, _ in rows if label >= 10} <= {"zebra", "ant", "moose"}


class TestRemoteInAMix:
    def test_a_remote_source_beside_a_local_one(self, shards, b_shards, http_server, tmp_path, clean_env):
        server = http_server(os.path.dirname(b_shards[0]))
        remote = gp.WebDataset([f"{server.url}/{os.path.basename(p)}" for p in b_shards], cache_dir=str(tmp_path))
        local = mix(shards, b_shards, counts=[8, 8])
        for backend in ("torch", "dali"):
            if not gp.backends.get(backend).available():
                continue
            got = []
            for source in (gp.Mix([gp.WebDataset(shards), remote], counts=[8, 8], label_offsets=[0, 100]), local):
                with gp.Loader(pipeline(source), 4, backend=backend, shuffle=True, seed=2, num_workers=1) as loader:
                    got.append(as_multiset(epoch_images(loader)))
            assert got[0] == got[1] and sum(got[0].values()) == 16


def per_source_pipeline(source) -> gp.Pipeline:
    """Source a: a fixed center crop; source b: a random crop and flip; both [3, 12, 12] float32."""
    return gp.Pipeline(source, per_source=[
        [T.CenterCrop(12), T.ToDtype(torch.float32)],
        [T.RandomResizedCrop(12), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)],
    ])  # fmt: skip


class TestPerSourcePipelines:
    def test_arguments(self, shards, b_shards):
        m = mix(shards, b_shards)
        pipe = per_source_pipeline(m)
        assert pipe.output_specs == (pipe.output_spec,) and str(pipe.output_spec) == "[3, 12, 12] float32"
        assert "per_source=[" in repr(pipe) and not pipe.has_views
        with pytest.raises(gp.PipelineError, match="per_source"):
            _ = pipe.transforms
        with pytest.raises(gp.ConfigError, match=r"needs a gp\.Mix"):
            gp.Pipeline(gp.WebDataset(shards), per_source=[[T.CenterCrop(8)]])
        with pytest.raises(gp.ConfigError, match="1 lists for 2 sources"):
            gp.Pipeline(m, per_source=[[T.CenterCrop(8)]])
        with pytest.raises(gp.ConfigError, match="one of transforms"):
            gp.Pipeline(m, [T.CenterCrop(8)], per_source=[[T.CenterCrop(8)], [T.CenterCrop(8)]])
        with pytest.raises(gp.PipelineError, match=r"same shape and dtype .*per_source\[1\]: \[3, 9, 9\]"):
            gp.Pipeline(m, per_source=[[T.CenterCrop(8)], [T.CenterCrop(9)]])

    def test_each_source_gets_its_own_list(self, backend, shards, b_shards, clean_env):
        source = mix(shards, b_shards, counts=[A, 2 * B])
        with backend.loader(per_source_pipeline(source), 4, shuffle=True, seed=3, num_workers=1) as loader:
            rows = epoch_images(loader)
        alone = gp.Pipeline(gp.WebDataset(shards), [T.CenterCrop(12), T.ToDtype(torch.float32)])
        with backend.loader(alone, 4, num_workers=1) as plain:
            centered = {key: image for key, _, image in epoch_images(plain)}
        copies: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
        for key, label, image in rows:
            assert image.shape == (3, 12, 12)
            if label < 100:
                torch.testing.assert_close(image, centered[key], rtol=0, atol=0, msg=key)
            else:
                copies[key].append(image)
        assert len(copies) == B and all(not torch.equal(*c) for c in copies.values())  # random, drawn apart

    def test_torch_and_dali_agree_per_sample(self, shards, b_shards, clean_env):
        pytest.importorskip("nvidia.dali")
        source = mix(shards, b_shards, counts=[8, 8])
        got = []
        for backend in ("torch", "dali"):
            with gp.Loader(per_source_pipeline(source), 4, backend=backend, shuffle=True, seed=3,
                           num_workers=1) as loader:  # fmt: skip
                got.append(epoch_images(loader))
        for (k1, l1, i1), (k2, l2, i2) in zip(*got, strict=True):
            assert (k1, l1) == (k2, l2)
            assert float((i1 - i2).abs().mean()) <= 1.0, k1  # the standard tolerance (0-255 units)

    def test_exact_resume(self, backend, shards, b_shards, clean_env):
        source = mix(shards, b_shards, counts=[6, 9])
        check_exact_resume(
            lambda: backend.loader(per_source_pipeline(source), 3, shuffle=True, seed=3, num_workers=1), epoch=1, at=2
        )

    STAGED = (
        [T.CenterCrop(16), T.TrivialAugmentWide(), T.ToDtype(torch.float32, scale=True)],
        [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True),
         T.Normalize([0.5] * 3, [0.5] * 3)],
    )  # fmt: skip

    def test_lists_with_a_policy_are_staged_together(self, shards, b_shards, clean_env):
        """Each list's tail in the stage (the second's ToDtype and Normalize, with the first's
        policy): the rows of each source through their own list, as the torch backend applies it
        sample by sample; DALI, which runs the policy in the stage only, agrees."""
        source = mix(shards, b_shards, counts=[8, 8])
        pipe = gp.Pipeline(source, per_source=[list(steps) for steps in self.STAGED])
        got = {}
        for backend, stage in (("torch", True), ("torch", False), ("dali", None)):
            if backend == "dali" and not gp.backends.get("dali").available():
                continue
            with gp.Loader(pipe, 4, backend=backend, device="cpu", stage=stage, shuffle=True, seed=3,
                           num_workers=1) as loader:  # fmt: skip
                if stage is not False:
                    assert loader._stage(pipe).starts == (1, 2)  # type: ignore[union-attr]
                got[backend, stage] = epoch_images(loader)
        for (k1, l1, i1), (k2, l2, i2) in zip(got["torch", True], got["torch", False], strict=True):
            assert (k1, l1) == (k2, l2)
            torch.testing.assert_close(i1, i2, rtol=0, atol=0, msg=k1)
        for (k1, l1, i1), (k2, l2, i2) in zip(got["torch", True], got.get(("dali", None), ()), strict=True):
            assert (k1, l1) == (k2, l2)
            scale = 255.0 if l1 < 100 else 127.5  # 0-255 units: [0, 1] images, or normalized to [-1, 1]
            assert float((i1 - i2).abs().mean()) * scale <= 1.0, k1

    def test_lists_whose_tails_start_apart_are_not(self, shards, b_shards):
        """The second list hands over a float image (its flip after ToDtype is not the stage's):
        the lists cannot be batched at their tails, so none is staged, and DALI refuses the
        policy, saying why."""
        pytest.importorskip("nvidia.dali")
        source = mix(shards, b_shards, counts=[8, 8])
        pipe = gp.Pipeline(source, per_source=[
            list(self.STAGED[0]),
            [T.RandomResizedCrop(16), T.ToDtype(torch.float32, scale=True), T.RandomHorizontalFlip()],
        ])  # fmt: skip
        with gp.Loader(pipe, 4, backend="torch", device="cpu", stage=True, num_workers=0) as loader:
            assert loader._stage(pipe) is None
        with pytest.raises(gp.UnsupportedTransformError, match="per_source lists are staged together only where"):
            gp.Loader(pipe, 4, backend="dali", device="cpu", num_workers=1)

    @pytest.mark.parametrize("channels_last", [False, True])
    def test_the_gpu_graph(self, channels_last):
        pytest.importorskip("nvidia.dali")
        from gpupipe.backends._dali._graph import define_graph

        from .support.dali_graph import check_gpu_placement, parse

        views = per_source_pipeline(mix(["unused-a.tar"], ["unused-b.tar"])).views
        graph = define_graph(views, gpu=True, device_id=None, batch_size=4, num_threads=2, prefetch=2, seed=1,
                             channels_last=channels_last, decoder_args={}, per_source=True)  # fmt: skip
        ops, outputs = parse(graph.pipe.serialize())
        check_gpu_placement(ops, outputs)  # one mixed decoder; one image output, on the GPU
        assert len(graph.lowered.images) == 1 and "source" in {f.value.name for f in graph.lowered.feeds.values()}


class TestSpread:
    """How a source's remainder (``count % size`` samples, without replacement) falls on its shards."""

    @pytest.mark.parametrize("total", [10_000, 2_000_000_000], ids=["numpy", "halves"])
    def test_exact_within_bounds_and_proportional(self, total):
        from gpupipe.plan._mix import spread

        rng = np.random.default_rng(0)
        sizes = rng.integers(total // 2000, 3 * total // 2000, size=1000)
        for r in (0, 1, int(sizes.sum()) // 3, int(sizes.sum()) - 1, int(sizes.sum())):
            got = spread(np.random.default_rng(r), sizes, r)
            assert got.sum() == r and (got >= 0).all() and (got <= sizes).all()
        r = int(sizes.sum()) // 3
        got = spread(np.random.default_rng(1), sizes, r)
        expected = sizes * (r / sizes.sum())
        sd = np.sqrt(expected * (1 - r / sizes.sum()))
        assert np.abs(got - expected).max() < 6 * sd.max() + 1  # a binomial's spread, not more
        assert np.array_equal(got, spread(np.random.default_rng(1), sizes, r))  # a function of the generator


def test_a_source_that_fails_to_index_closes_those_indexed_before_it(shards, tmp_path, monkeypatch):
    closed = []
    monkeypatch.setattr(gp.sources.Index, "close", lambda self: closed.append(self))
    with pytest.raises(gp.ShardError, match="none of the 2 shards exists"):
        gp.Mix([gp.WebDataset(shards), gp.WebDataset(str(tmp_path / "gone-{0..1}.tar"))], weights=[1, 1]).index()
    assert len(closed) == 2  # the first source's index, and the missing one's


class TestReplacementSelection:
    """``replacement=True``: a source much smaller than its count (many copies of each sample)."""

    @staticmethod
    def reference(mix, shard_sizes, seed: int, epoch: int):
        """The selection as a loop over passes (the draws of pass ``p``: each sample's ``p``-th copy)."""
        from gpupipe.plan._mix import _rng

        out = []  # (pass, shard, entries) per virtual shard, in order
        for i, (c, shards) in enumerate(zip(mix.counts, mix.shards, strict=True)):
            if c == 0:
                continue
            g = np.asarray(shard_sizes, np.int64)[shards.start : shards.stop]
            drawn = np.sort(_rng(seed, epoch, 1 << 40, i).integers(0, int(g.sum()), size=c))
            copy = np.arange(c) - np.searchsorted(drawn, drawn, side="left")
            local = np.concatenate([[0], np.cumsum(g)])
            for p in range(int(copy.max()) + 1):
                these = drawn[copy == p]
                for j, shard in enumerate(shards):
                    out.append((p, shard, these[(these >= local[j]) & (these < local[j + 1])] - local[j]))
        return out

    def test_the_same_selection_as_pass_by_pass(self):
        from gpupipe.sources._mix import MixCounts

        sizes = np.array([7, 5, 4, 3, 3], np.int64)
        mix = MixCounts((9, 40), (range(0, 3), range(3, 5)), True)
        sel = select(mix, sizes, np.zeros(0, np.int64), seed=3, epoch=2)
        expected = self.reference(mix, sizes, 3, 2)
        assert len(sel.sizes) == len(expected)
        for v, (p, shard, entries) in enumerate(expected):
            assert (sel.passes[v], sel.shard[v], sel.sizes[v]) == (p, shard, len(entries))
            assert np.array_equal(sel.entries(v), entries)

    def test_many_copies_of_few_samples(self):
        """100,000 draws from 2 samples (50,000 passes): a loop over passes that scanned the whole
        draw each time took minutes (O(count^2 / size); one sort now). Its speed is
        ``bench/``'s to measure; here, what it selects."""
        from gpupipe.sources._mix import MixCounts

        mix = MixCounts((10, 100_000), (range(0, 1), range(1, 2)), True)
        sel = select(mix, np.array([16, 2], np.int64), np.zeros(0, np.int64), seed=0, epoch=0)
        mine = sel.shard == 1
        assert int(sel.sizes[mine].sum()) == 100_000 and int(sel.passes[mine].max()) >= 49_000
