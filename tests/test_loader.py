"""Pipeline checking and the Loader's epoch semantics on the torch backend."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import AddMult, EveryOtherColumn, Posterize
from .support.data import SHARD_SIZES, label_of

N = sum(SHARD_SIZES)


def small_train(source, size=32):
    return gp.Pipeline(
        source,
        [
            T.RandomResizedCrop(size),
            T.RandomHorizontalFlip(),
            T.ColorJitter(0.2, 0.2, 0.2),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize([0.5] * 3, [0.25] * 3),
        ],
    )


def small_val(source, size=32):
    return gp.Pipeline(source, [T.Resize(40), T.CenterCrop(size), T.ToDtype(torch.float32, scale=True)])


def collect(loader):
    keys, labels, shapes = [], [], []
    for batch in loader:
        images, lab = batch
        keys += batch.keys
        labels += lab.tolist()
        shapes.append(tuple(images.shape))
    return keys, labels, shapes


class TestPipeline:
    def test_output_spec(self, shards):
        assert str(small_train(shards).output_spec) == "[3, 32, 32] float32"
        assert small_val(shards).specs[1].height is None

    def test_source_forms(self, shards, image_folder):
        assert isinstance(gp.Pipeline(shards, []).source, gp.WebDataset)
        assert isinstance(gp.Pipeline(shards[0], []).source, gp.WebDataset)
        with pytest.raises(gp.ConfigError, match="ImageFolder"):
            gp.Pipeline(image_folder, [])
        with pytest.raises(gp.ConfigError, match="source must be"):
            gp.Pipeline(42, [])  # type: ignore[arg-type]

    def test_step_errors_name_the_step(self, shards):
        with pytest.raises(gp.PipelineError, match=r"step 1: Normalize.*ToDtype"):
            gp.Pipeline(shards, [T.CenterCrop(8), T.Normalize([0.5], [0.5])])

    def test_torchvision_transforms_rejected(self, shards):
        from torchvision.transforms import v2

        with pytest.raises(gp.ConfigError, match=r"use gpupipe\.transforms"):
            gp.Pipeline(shards, [v2.CenterCrop(8)])

    def test_load_pipeline_by_path(self, shards):
        root = os.path.join(os.path.dirname(__file__), "..", "pipelines", "imagenet.py")
        train = gp.load_pipeline(f"{root}:train")(shards, size=64)
        assert str(train.output_spec) == "[3, 64, 64] float32"
        val = gp.load_pipeline(f"{root}:val")(shards)
        assert [type(t).__name__ for t in val.transforms] == ["Resize", "CenterCrop", "ToDtype", "Normalize"]
        with pytest.raises(gp.ConfigError, match="no function"):
            gp.load_pipeline(f"{root}:nope")
        with pytest.raises(gp.ConfigError, match=r"file\.py:function"):
            gp.load_pipeline("pipelines/imagenet.py")


class TestLoaderArguments:
    """Each option's validation is tested on LoaderConfig (tests/test_config.py); these go through
    the Loader."""

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            (dict(batch_size=0), "batch_size"),
            (dict(batch_size=2, shuffle=1), "shuffle"),
            (dict(batch_size=2, seed=1.5), "seed"),
            (dict(batch_size=2, backend="tensorflow"), "backend"),
            (dict(batch_size=2, device="tpu"), "device"),
            (dict(batch_size=2, num_workers=-1), "num_workers"),
            (dict(batch_size=2, prefetch=0), "prefetch"),
        ],
    )
    def test_invalid(self, shards, kwargs, match):
        with pytest.raises(gp.ConfigError, match=match):
            gp.Loader(small_val(shards), **kwargs)

    def test_variable_size_output_is_refused(self, shards):
        with pytest.raises(gp.PipelineError, match="fixed size"):
            gp.Loader(gp.Pipeline(shards, [T.Resize(40)]), 2)

    def test_cuda_without_cuda(self, shards):
        if torch.cuda.is_available():
            pytest.skip("CUDA present")
        with pytest.raises(gp.BackendUnavailableError, match="CUDA"):
            gp.Loader(small_val(shards), 2, device="cuda")

    def test_options_are_keyword_only(self, shards):
        with pytest.raises(TypeError):
            gp.Loader(small_val(shards), 2, True)  # type: ignore[call-arg]


class TestEpoch:
    """Epoch semantics, the same on every backend of the table (DALI runs on its CPU operators here)."""

    @pytest.mark.parametrize("num_workers", [0, 2])
    def test_every_sample_once_in_order(self, backend, shards, num_workers):
        loader = backend.loader(small_val(shards), 5, num_workers=num_workers)
        keys, labels, shapes = collect(loader)
        index = loader.index
        assert keys == [index.key(i) for i in range(N)]  # shard order, then member order
        assert labels == [label_of(i) for i in range(N)]
        assert shapes == [(5, 3, 32, 32)] * 3 + [(1, 3, 32, 32)]
        assert len(loader) == len(shapes)

    @pytest.mark.parametrize("batch_size", [1, 3, 4, 16, 17, 40])
    @pytest.mark.parametrize("drop_last", [False, True])
    def test_len_matches_iteration(self, backend, shards, batch_size, drop_last):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # drop_last with fewer samples than a batch warns
            loader = backend.loader(
                small_val(shards), batch_size, drop_last=drop_last, shuffle=True, seed=1, num_workers=0
            )
        keys, _, shapes = collect(loader)
        assert len(shapes) == len(loader)
        expected = N // batch_size if drop_last else math.ceil(N / batch_size)
        assert len(loader) == expected
        assert all(s[0] == batch_size for s in (shapes if drop_last else shapes[:-1]))
        assert len(set(keys)) == len(keys) == (expected * batch_size if drop_last else N)

    def test_drop_last_with_too_few_samples_warns(self, backend, shards):
        with pytest.warns(UserWarning, match="every epoch is empty"):
            backend.loader(small_val(shards), 100, drop_last=True, num_workers=0)

    def test_labels_follow_samples_when_shuffled(self, backend, shards):
        loader = backend.loader(small_train(shards), 4, shuffle=True, seed=3, num_workers=2)
        keys, labels, _ = collect(loader)
        number = {loader.index.key(i): i for i in range(N)}
        assert labels == [label_of(number[k]) for k in keys]
        assert sorted(keys) == sorted(number)

    def test_set_epoch_changes_order_and_seed_repeats_it(self, backend, shards):
        def order(seed, epoch):
            loader = backend.loader(small_val(shards), 4, shuffle=True, seed=seed, num_workers=0)
            loader.set_epoch(epoch)
            return collect(loader)[0]

        e0, e1 = order(5, 0), order(5, 1)
        assert e0 != e1 and sorted(e0) == sorted(e1)
        assert order(5, 0) == e0 and order(5, 1) == e1
        assert order(6, 0) != e0

    def test_shuffle_is_two_level_on_shards(self, backend, shards):
        loader = backend.loader(
            small_val(shards), 4, shuffle=True, seed=0, shuffle_buffer=1, interleave=1, num_workers=0
        )
        orders = {tuple(loader.plan(e).samples) for e in range(12)}
        bounds = np.cumsum((0, *SHARD_SIZES))
        for o in orders:  # with a buffer of 1, each shard is read as one contiguous run
            runs = [o[bounds[i] : bounds[i + 1]] for i in range(3)]
            assert sorted(np.concatenate(runs)) == list(range(N))
        assert len(orders) > 1

    def test_augmentation_reproducible_across_worker_counts(self, backend, shards):
        if backend.backend == "dali":
            pytest.skip("DALI draws augmentation parameters with its own generators, per pipeline")

        def images(workers, epoch=0):
            loader = backend.loader(small_train(shards), 8, shuffle=True, seed=11, num_workers=workers)
            loader.set_epoch(epoch)
            return torch.cat([b[0] for b in loader])

        a, b = images(0), images(2)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        assert not torch.equal(a, images(0, epoch=1))

    def test_unlabeled_batches_have_no_labels(self, backend, unlabeled_shards):
        loader = backend.loader(small_val(gp.WebDataset(unlabeled_shards, label=None)), 2, num_workers=0)
        batches = list(loader)
        assert all(b.labels is None and b.valid.all() for b in batches)
        assert [images.shape[0] for images, _ in batches] == [2, 2, 1]
        assert [k for b in batches for k in b.keys] == [loader.index.key(i) for i in range(5)]

    def test_image_folder(self, backend, image_folder):
        loader = backend.loader(
            small_val(gp.ImageFolder(image_folder), size=24), 4, shuffle=True, seed=0, num_workers=2
        )
        keys, labels, shapes = collect(loader)
        index = loader.index
        truth = {index.key(i): index.read(i).label for i in range(len(index))}
        assert sorted(keys) == sorted(truth) and labels == [truth[k] for k in keys]
        assert shapes[0] == (4, 3, 24, 24)

    def test_an_image_folder_file_gone_after_indexing(self, backend, tmp_path):
        """One verdict on every backend: the file is a ``no-image`` sample named by its key,
        raised in its batch, or skipped and counted."""
        for c in range(2):
            (tmp_path / f"c{c}").mkdir()
            for i in range(3):
                (tmp_path / f"c{c}" / f"{i}.jpg").write_bytes(encode_jpeg(synthetic_image(3 * c + i, size=(32, 32))))
        pipe = small_val(gp.ImageFolder(str(tmp_path)), size=24)
        loader = backend.loader(pipe, 4, num_workers=1, on_error="skip", max_skipped=None)
        raising = backend.loader(pipe, 4, num_workers=1)
        os.remove(tmp_path / "c1" / "1.jpg")
        with loader:
            keys = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
            assert sorted(keys) == ["c0/0.jpg", "c0/1.jpg", "c0/2.jpg", "c1/0.jpg", "c1/2.jpg"]
            assert [(s.key, s.kind) for s in loader.skipped] == [("c1/1.jpg", gp.Damage.NO_IMAGE)]
        with raising, pytest.raises(gp.SampleError, match=r"cannot read sample 'c1/1\.jpg'") as e:
            list(raising)
        assert (e.value.key, e.value.kind) == ("c1/1.jpg", gp.Damage.NO_IMAGE)

    def test_bad_sample_names_shard_and_key(self, backend, tmp_path):
        good = encode_jpeg(synthetic_image(0, size=(40, 40)))
        with gp.ShardWriter(str(tmp_path / "bad-%d.tar")) as w:
            w.write("ok", {"jpg": good, "cls": 0})
            w.write("broken", {"jpg": good[:200], "cls": 1})
        messages = []
        for workers in (0, 1):
            loader = backend.loader(small_val(w.shards), 2, num_workers=workers)
            with pytest.raises(gp.SampleError, match=r"'broken' in shard '.*bad-0\.tar'") as info:
                list(loader)
            assert (info.value.key, info.value.shard) == ("broken", w.shards[0])  # from a worker process too
            messages.append(str(info.value))
        assert messages[0] == messages[1]

    @pytest.mark.parametrize(
        "label, problem", [("cat", "is not an ASCII integer"), ("99999999999999999999", "is out of the int64 range")]
    )
    def test_bad_label_names_shard_and_key(self, backend, tmp_path, label, problem):
        """Labels are parsed when the shard is indexed; a bad one fails only its sample, when read."""
        good = encode_jpeg(synthetic_image(0, size=(40, 40)))
        with gp.ShardWriter(str(tmp_path / "lab-%d.tar")) as w:
            w.write("ok", {"jpg": good, "cls": 0})
            w.write("bad", {"jpg": good, "cls": label})
        with pytest.raises(gp.SampleError, match=rf"label of sample 'bad' in shard '.*lab-0\.tar' {problem}") as info:
            list(backend.loader(small_val(w.shards), 2, num_workers=0))
        assert (info.value.key, info.value.shard) == ("bad", w.shards[0])

    def test_batch_object(self, backend, shards):
        batch = next(iter(backend.loader(small_val(shards), 3, num_workers=0)))
        images, labels = batch
        assert batch.images is images and batch.labels is labels and len(batch.keys) == 3
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert batch.valid.dtype == torch.bool and batch.valid.tolist() == [True] * 3


class TestHandOff:
    def test_channels_last(self, backend, shards):
        pipe = gp.Pipeline(shards, [T.Resize(40), T.CenterCrop(32), T.ToDtype(torch.float32, scale=True)])
        a = torch.cat([b[0] for b in backend.loader(pipe, 4)])
        loader = backend.loader(pipe, 4, memory_format=torch.channels_last)
        batches = [b[0] for b in loader]
        assert all(b.is_contiguous(memory_format=torch.channels_last) and b.shape[1] == 3 for b in batches)
        torch.testing.assert_close(torch.cat(batches), a)

    def test_device(self, backend, shards):
        images, labels = next(iter(backend.loader(small_val(shards), 4, num_workers=0)))
        device = torch.device(backend.device)
        assert images.device.type == labels.device.type == device.type


class TestArrayFunction:
    """A user transform written once over arrays runs on every backend."""

    def test_in_a_loader(self, backend, shards):
        if (backend.backend, backend.device) == ("dali", "cuda"):
            pytest.importorskip("cupy")  # make test-gpu installs it (extras cupy12 / cupy13)
        base = [T.CenterCrop(16)]
        plain, _ = next(iter(backend.loader(gp.Pipeline(shards, base), 4, num_workers=0)))
        pipe = gp.Pipeline(shards, [*base, Posterize(bits=2), EveryOtherColumn()])
        images, _ = next(iter(backend.loader(pipe, 4, num_workers=0)))
        assert images.shape == (4, 3, 16, 8) and images.dtype == torch.uint8
        torch.testing.assert_close(images, plain[..., ::2] & 0xC0)


class TestArithmetic:
    """A user transform written once runs on every backend."""

    def test_in_a_loader(self, backend, shards):
        base = [T.CenterCrop(16), T.ToDtype(torch.float32, scale=True)]
        plain, _ = next(iter(backend.loader(gp.Pipeline(shards, base), 4)))
        pipe = gp.Pipeline(shards, [*base, AddMult(add=-0.5, mult=2.0)])
        images, _ = next(iter(backend.loader(pipe, 4)))
        assert images.dtype == torch.float32
        torch.testing.assert_close(images, (plain - 0.5) * 2.0)
