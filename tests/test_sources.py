"""WebDataset and ImageFolder sources: keys, grouping, extensions, labels, errors, decoding."""

from __future__ import annotations

import io
import os
import tarfile
from typing import Any

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.core._errors import Damage
from gpupipe.runtime._decode import decode_rgb
from gpupipe.sources import split_key
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.data import SHARD_SIZES, label_of


def write_tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


JPEG = encode_jpeg(synthetic_image(1, size=(20, 30)))


class TestWebDataset:
    def test_brace_pattern_and_order(self, shards):
        root = os.path.dirname(shards[0])
        src = gp.WebDataset(os.path.join(root, "train-{000000..000002}.tar"))
        assert list(src.urls) == shards
        index = src.index()
        assert len(index) == sum(SHARD_SIZES)
        keys = [index.key(i) for i in range(len(index))]
        assert keys[0] == "img/00/000000" and keys[7] == "img/01/000007" and keys[-1] == "img/02/000015"

    def test_several_braces_and_lists(self, tmp_path):
        assert gp.WebDataset("{a,b}-{0..1}.tar").urls == ("a-0.tar", "a-1.tar", "b-0.tar", "b-1.tar")
        assert gp.WebDataset(["x.tar", "y-{00..01}.tar"]).urls == ("x.tar", "y-00.tar", "y-01.tar")

    def test_labels_are_ascii_ints(self, shards):
        index = gp.WebDataset(shards).index()
        assert [index.read(i).label for i in range(len(index))] == [label_of(i) for i in range(len(index))]

    @pytest.mark.parametrize(
        "member, key, ext",
        [
            ("img/00/000123.jpg", "img/00/000123", "jpg"),
            ("./a/b.seg.PNG", "a/b", "seg.png"),
            ("x.y.z/k.cls", "x.y.z/k", "cls"),
            ("noext", "noext", ""),
        ],
    )
    def test_key_rule(self, member, key, ext):
        assert split_key(member) == (key, ext)

    def test_image_extension_preference(self, tmp_path):
        png = io.BytesIO()
        from PIL import Image

        Image.new("RGB", (5, 4)).save(png, format="PNG")
        path = write_tar(
            tmp_path / "s.tar",
            [
                ("a.png", png.getvalue()),
                ("a.jpg", JPEG),
                ("a.cls", b"1"),
                ("a.json", b"{}"),
                ("b.png", png.getvalue()),
                ("b.cls", b" 2\n"),
            ],
        )
        index = gp.WebDataset(path).index()
        assert index.read(0).data == JPEG and index.read(0).label == 1
        assert index.read(1).data == png.getvalue() and index.read(1).label == 2
        index = gp.WebDataset(path, image="png;jpg").index()
        assert index.read(0).data == png.getvalue()

    def test_missing_image_names_shard_and_key(self, tmp_path):
        path = write_tar(tmp_path / "s.tar", [("a.jpg", JPEG), ("a.cls", b"1"), ("b.txt", b"x"), ("b.cls", b"1")])
        with pytest.raises(gp.SampleError, match=r"'b'.*s\.tar.*no image") as info:
            gp.WebDataset(path).index()
        assert info.value.key == "b" and info.value.shard == path

    def test_missing_label(self, tmp_path):
        path = write_tar(tmp_path / "s.tar", [("a.jpg", JPEG)])
        with pytest.raises(gp.SampleError, match=r"no \.cls label.*label=None"):
            gp.WebDataset(path).index()
        assert gp.WebDataset(path, label=None).index().read(0).label is None

    def test_bad_label(self, tmp_path):
        path = write_tar(tmp_path / "s.tar", [("a.jpg", JPEG), ("a.cls", b"cat")])
        with pytest.raises(gp.SampleError, match=r"label of sample 'a' in shard .*s\.tar.*not an ASCII integer"):
            gp.WebDataset(path).index().read(0)

    def test_missing_or_corrupt_shard(self, tmp_path):
        with pytest.raises(gp.ShardError, match=r"nope\.tar"):
            gp.WebDataset(str(tmp_path / "nope.tar")).index()
        (tmp_path / "bad.tar").write_bytes(b"not a tar file at all" * 40)
        with pytest.raises(gp.ShardError, match=r"bad\.tar"):
            gp.WebDataset(str(tmp_path / "bad.tar")).index()

    @pytest.mark.parametrize(
        "cut, match",
        [
            ("in a header", r"ends inside the header after sample 's0002'"),
            ("at a member boundary", r"ends after sample 's0002' without the tar's end-of-archive block"),
            ("garbage after a member", r"has a header that cannot be read after sample 's0002'"),
        ],
    )
    def test_a_tar_that_does_not_end_as_a_tar_ends_is_truncated(self, tmp_path, cut, match):
        """tarfile stops silently at a header it cannot read past the first and at a missing end
        block: the samples after the cut are lost, so the shard is truncated, never quietly short."""
        path = str(tmp_path / "s-000000.tar")
        with gp.ShardWriter(str(tmp_path / "s-%06d.tar")) as w:
            for i in range(6):
                w.write(f"s{i:04d}", {"jpg": encode_jpeg(synthetic_image(i, size=(8, 8))), "cls": i})
        with tarfile.open(path) as tar:
            header = next(m for m in tar if m.name == "s0003.jpg").offset  # after the 3 samples s0000..s0002
        data = (tmp_path / "s-000000.tar").read_bytes()
        damaged = {"in a header": data[: header + 200], "at a member boundary": data[:header],
                   "garbage after a member": data[:header] + b"\x7f" * 4096}[cut]  # fmt: skip
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(gp.ShardError, match=match) as e:
            gp.WebDataset(path).index()
        assert e.value.kind is gp.Damage.TRUNCATED_SHARD and "its 3 complete samples before the cut" in str(e.value)
        index = gp.WebDataset(path).index(on_error="skip")
        assert len(index) == 3
        index.close()

    @pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
    def test_whole_tars_of_every_format_are_whole(self, tmp_path, fmt):
        """Directories, links, long names (GNU and pax extended headers) and an empty last member
        end where tarfile says: no false truncation."""
        path = tmp_path / "w.tar"
        jpeg = encode_jpeg(synthetic_image(0, size=(8, 8)))
        long = "d/" + "x" * (60 if fmt == tarfile.USTAR_FORMAT else 150)
        with tarfile.open(path, "w", format=fmt) as tar:
            for name, data, kind in [("d", b"", tarfile.DIRTYPE), (f"{long}.jpg", jpeg, tarfile.REGTYPE),
                                     (f"{long}.cls", b"3", tarfile.REGTYPE), ("link", b"", tarfile.SYMTYPE),
                                     ("empty.txt", b"", tarfile.REGTYPE)]:  # fmt: skip
                info = tarfile.TarInfo(name)
                info.type, info.size, info.linkname = kind, len(data), "d" if kind == tarfile.SYMTYPE else ""
                tar.addfile(info, io.BytesIO(data) if data else None)
        index = gp.WebDataset(str(path)).index(on_error="skip")
        assert len(index) == 1 and not [p for p in index.problems if p.kind is gp.Damage.TRUNCATED_SHARD]
        index.close()

    def test_one_zero_block_ends_a_tar(self, tmp_path):
        """Writers that end with one zero block (the standard asks for two) are whole."""
        path = str(tmp_path / "s-000000.tar")
        with gp.ShardWriter(str(tmp_path / "s-%06d.tar")) as w:
            w.write("a", {"jpg": encode_jpeg(synthetic_image(0, size=(8, 8))), "cls": 1})
        with tarfile.open(path) as tar:
            end = max(m.offset_data + -(-m.size // 512) * 512 for m in tar)
        os.truncate(path, end + 512)
        index = gp.WebDataset(path).index()
        assert len(index) == 1
        index.close()

    @pytest.mark.parametrize("on_error", ["raise", "skip"])
    def test_a_pattern_that_names_no_existing_shard_says_so(self, tmp_path, monkeypatch, on_error):
        """Not one shard exists: a wrong path, not damage to skip, whatever the policy."""
        monkeypatch.chdir(tmp_path)
        with pytest.raises(gp.ShardError, match=r"none of the 3 shards exists: 'd/t-0\.tar', relative to the working "
                           r"directory .*$") as e:  # fmt: skip
            gp.WebDataset("d/t-{0..2}.tar").index(on_error=on_error)
        assert e.value.kind is gp.Damage.MISSING_SHARD and "relist" not in str(e.value)
        with pytest.raises(gp.ShardError, match=r"globs are listed with WebDataset\(\.\.\., relist=True\)"):
            gp.WebDataset(str(tmp_path / "d" / "*.tar")).index(on_error=on_error)

    def test_a_gzipped_tar_under_a_tar_name_says_so(self, tmp_path, shards):
        import gzip

        path = tmp_path / "a.tar"
        with open(shards[0], "rb") as f:
            path.write_bytes(gzip.compress(f.read()))
        with pytest.raises(gp.ShardError, match=r"not a tar file: .*; it is gzip-compressed: name it \.tar\.gz"):
            gp.WebDataset(str(path)).index()

    def test_a_urls_query_is_not_a_glob(self):
        from gpupipe.sources._webdataset import _none_missing_all

        missing: list[gp.DataError] = [gp.ShardError("gone", shard="u", kind=gp.Damage.MISSING_SHARD)]
        with pytest.raises(gp.ShardError) as e:
            _none_missing_all(["https://host/a.tar?X-Amz-Signature=1&x[0]=2"], missing)
        assert "the shard does not exist: 'https://host/a.tar?" in str(e.value) and "glob" not in str(e.value)
        assert "working directory" not in str(e.value)

    @pytest.mark.parametrize(
        "url, match", [("pipe:curl http://x | cat", "never runs a shell"), ("nosuch://bucket/a.tar", "local paths")]
    )
    def test_refused_urls(self, url, match):
        with pytest.raises(gp.ConfigError, match=match):
            gp.WebDataset(url)

    def test_invalid_arguments(self):
        with pytest.raises(gp.ConfigError, match="image"):
            gp.WebDataset("a.tar", image=";")
        with pytest.raises(TypeError):
            gp.WebDataset("a.tar", "jpg")  # type: ignore[call-arg]

    def test_reads_our_own_writer(self, tmp_path):
        with gp.ShardWriter(str(tmp_path / "o-%03d.tar"), max_count=2) as w:
            w.write_all((f"k{i}", {"jpg": JPEG, "cls": i}) for i in range(5))
        assert w.shards == [str(tmp_path / f"o-{i:03d}.tar") for i in range(3)]
        index = gp.WebDataset(w.shards).index()
        assert [index.read(i).label for i in range(5)] == list(range(5))
        assert list(index.shard_sizes) == [2, 2, 1]


class TestImageFolder:
    def test_matches_torchvision(self, image_folder):
        from torchvision.datasets import ImageFolder as TVImageFolder

        tv = TVImageFolder(image_folder)
        src = gp.ImageFolder(image_folder)
        index = src.index()
        assert src.classes == tv.classes
        got = [(os.path.join(image_folder, index.key(i)), index.read(i).label) for i in range(len(index))]
        assert got == [(os.path.normpath(p), c) for p, c in tv.samples]

    def test_not_a_directory(self, tmp_path):
        with pytest.raises(gp.ConfigError, match="not a directory"):
            gp.ImageFolder(str(tmp_path / "missing"))

    def test_empty(self, tmp_path):
        (tmp_path / "cls").mkdir()
        with pytest.raises(gp.ShardError, match="no image files"):
            gp.ImageFolder(str(tmp_path)).index()


class TestImageFolderBatchRead:
    """``Index.read_files_into``: a batch of an ImageFolder's files read whole into one buffer
    (the DALI backend's reader), with :meth:`Index.read`'s bytes and errors."""

    @staticmethod
    def tree(tmp_path, sizes=(1, 2, 3, 4)):
        for n in sizes:
            (tmp_path / f"c{n % 2}").mkdir(exist_ok=True)
            (tmp_path / f"c{n % 2}" / f"{n}.jpg").write_bytes(encode_jpeg(synthetic_image(n, size=(20 + n, 30))))
        return gp.ImageFolder(str(tmp_path)).index()

    @staticmethod
    def take(sizes):
        def take(n):
            sizes.append(n)
            return np.zeros(n + 7, np.uint8)  # a pool's buffer is larger than asked

        return take

    @pytest.mark.parametrize("storage", ["local", "default"])
    def test_the_bytes_of_read(self, tmp_path, storage, monkeypatch):
        index = self.tree(tmp_path)
        if storage == "default":  # the Storage base class's way, for storages without their own
            from gpupipe.storage._base import Storage

            for name in ("sizes", "read_files_into"):
                monkeypatch.setattr(type(index.reader.storage), name, getattr(Storage, name))
        taken: list[int] = []
        samples = np.array([3, 0, 2, 1, 3])
        whole = index.read_files_into(samples, self.take(taken))
        assert whole.errors == {}
        assert [bytes(v) for v in whole.views] == [index.read(int(s)).data for s in samples]
        assert all(v.base is not None and np.shares_memory(v, whole.buffer) for v in whole.views)
        assert taken == [sum(len(index.read(int(s)).data) + 1 for s in samples)]

    def test_a_missing_file_and_one_over_the_limit_are_named_and_not_read(self, tmp_path, monkeypatch):
        (tmp_path / "c0").mkdir()
        (tmp_path / "c0" / "big.jpg").write_bytes(JPEG + b"\0" * 5000)
        index = self.tree(tmp_path)  # c0/2, c0/4, c0/big, c1/1, c1/3
        assert [index.key(i) for i in range(5)] == ["c0/2.jpg", "c0/4.jpg", "c0/big.jpg", "c1/1.jpg", "c1/3.jpg"]
        os.remove(tmp_path / "c1" / "3.jpg")
        index.max_image_bytes = len(JPEG) + 4000
        read: list[str] = []
        storage = index.reader.storage
        original = type(storage).read_files_into

        def read_files_into(self, urls, *args):
            read.extend(urls)
            return original(self, urls, *args)

        monkeypatch.setattr(type(storage), "read_files_into", read_files_into)
        whole = index.read_files_into(np.arange(5), self.take([]))
        assert {i: (e.kind, e.key) for i, e in whole.errors.items()} == {
            2: (gp.Damage.TOO_LARGE, "c0/big.jpg"), 4: (gp.Damage.NO_IMAGE, "c1/3.jpg")}  # fmt: skip
        assert [whole.views[i] is None for i in range(5)] == [False, False, True, False, True]
        for i, e in whole.errors.items():
            with pytest.raises(gp.SampleError) as raised:
                index.read(i)
            assert str(e) == str(raised.value)  # Index.read's error, word for word
        assert [os.path.relpath(u, str(tmp_path)) for u in read] == ["c0/2.jpg", "c0/4.jpg", "c1/1.jpg"]  # not big

    def test_a_file_that_is_not_regular_gives_reads_own_error(self, tmp_path):
        """A file replaced by a directory after indexing: refused from its stat, unopened; the
        error is Index.read's, word for word."""
        index = self.tree(tmp_path)
        os.remove(tmp_path / "c0" / "2.jpg")
        os.mkdir(tmp_path / "c0" / "2.jpg")
        whole = index.read_files_into(np.arange(4), self.take([]))
        with pytest.raises(gp.SampleError) as raised:
            index.read(0)
        assert list(whole.errors) == [0] and str(whole.errors[0]) == str(raised.value)
        assert "not a regular file (a directory)" in str(raised.value) and raised.value.kind == Damage.NO_IMAGE

    def test_a_read_that_fails_is_read_again_alone(self, tmp_path, monkeypatch):
        """A ``pread`` that fails (an I/O error on one file): that file is read again alone,
        with Index.read's own error where that fails too."""
        from gpupipe.storage import _base

        index = self.tree(tmp_path)
        real = os.preadv
        failing = os.path.realpath(tmp_path / "c0" / "2.jpg")

        def preadv(fd: int, buffers: Any, offset: int) -> int:
            if os.path.realpath(f"/proc/self/fd/{fd}") == failing:
                raise OSError(5, "Input/output error")
            return real(fd, buffers, offset)

        monkeypatch.setattr(_base.os, "preadv", preadv)
        whole = index.read_files_into(np.arange(4), self.take([]))
        assert whole.errors == {}
        assert [bytes(v) for v in whole.views] == [index.read(i).data for i in range(4)]

    @pytest.mark.parametrize("change", [-5, 5])
    def test_a_file_that_changed_after_its_stat_is_read_again(self, tmp_path, monkeypatch, change):
        index = self.tree(tmp_path)
        storage = index.reader.storage
        true = type(storage).sizes
        monkeypatch.setattr(type(storage), "sizes", lambda self, urls: [n + change for n in true(self, urls)])
        whole = index.read_files_into(np.arange(4), self.take([]))
        assert whole.errors == {}
        assert [bytes(v) for v in whole.views] == [index.read(i).data for i in range(4)]


class TestDecode:
    def image(self):
        return synthetic_image(3, size=(40, 56))

    def test_jpeg_rgb(self):
        out = decode_rgb(encode_jpeg(self.image(), quality=95), shard="s", key="k")
        assert out.shape == (3, 40, 56) and out.dtype == torch.uint8
        assert np.abs(out.permute(1, 2, 0).numpy().astype(int) - self.image()).mean() < 4

    @pytest.mark.parametrize("mode", ["L", "CMYK"])
    def test_grayscale_and_cmyk_come_out_rgb(self, mode):
        out = decode_rgb(encode_jpeg(self.image(), quality=95, mode=mode), shard="s", key="k")
        assert out.shape == (3, 40, 56)
        if mode == "L":
            assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
        else:
            assert np.abs(out.permute(1, 2, 0).numpy().astype(int) - self.image()).mean() < 4

    @pytest.mark.parametrize("fmt", ["PNG", "BMP", "WEBP"])
    def test_other_formats(self, fmt):
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(self.image()).convert("RGBA" if fmt == "PNG" else "RGB").save(buf, format=fmt, lossless=True)
        out = decode_rgb(buf.getvalue(), shard="s", key="k")
        assert out.shape == (3, 40, 56)
        np.testing.assert_array_equal(out.permute(1, 2, 0).numpy(), self.image())

    @pytest.mark.parametrize("data", [b"", b"\xff\xd8garbage", JPEG[: len(JPEG) // 3] + b"\x00" * 10])
    def test_bad_data_names_shard_and_key(self, data):
        with pytest.raises(gp.SampleError, match=r"'k7'.*'shard-3\.tar'") as info:
            decode_rgb(data, shard="shard-3.tar", key="k7")
        assert (info.value.shard, info.value.key) == ("shard-3.tar", "k7")


class TestIndexCache:
    def test_written_once_reused_and_rebuilt_when_the_shard_changes(self, tmp_path, monkeypatch):
        from gpupipe.shards import _indexing as _sources

        path = str(tmp_path / "s-%d.tar")
        with gp.ShardWriter(path) as w:
            w.write_all((f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=(30, 30))), "cls": i}) for i in range(3))
        first = gp.WebDataset(w.shards).index().shards[0].dali_index
        assert first is not None
        with open(first) as f:
            assert f.readline() == "v1.2 3\n"
        real_scan = _sources.scan_tar
        monkeypatch.setattr(_sources, "scan_tar", lambda *a: pytest.fail("an unchanged shard was re-read"))
        again = gp.WebDataset(w.shards).index()
        assert again.shards[0].dali_index == first and again.read(2).label == 2
        monkeypatch.setattr(_sources, "scan_tar", real_scan)
        with gp.ShardWriter(path) as w2:  # same path, new content
            w2.write_all((f"n{i}", {"jpg": encode_jpeg(synthetic_image(i, size=(30, 30))), "cls": 9}) for i in range(5))
        changed = gp.WebDataset(w2.shards).index()
        assert changed.shards[0].dali_index != first and len(changed) == 5 and changed.key(0) == "n0"


def test_a_cached_index_pickles(shards):
    """Spawned DataLoader workers receive the index pickled; shards from the cache load lazily."""
    import pickle

    gp.WebDataset(shards).index()
    index = gp.WebDataset(shards).index()
    assert not any(s.loaded for s in index.shards)
    copy = pickle.loads(pickle.dumps(index))
    assert [copy.read(i) for i in (0, 8, 15)] == [index.read(i) for i in (0, 8, 15)]
    index.close()
    copy.close()


class TestFakeData:
    """gp.FakeData: torchvision.datasets.FakeData's arguments, real JPEGs every backend decodes."""

    def test_through_every_backend(self, backend):
        pipe = gp.Pipeline(gp.FakeData(20, image_size=(3, 40, 56), num_classes=3), [T.CenterCrop(16)])
        with backend.loader(pipe, 8, num_workers=1) as loader:
            batches = list(loader)
        keys = [k for b in batches for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
        labels = [int(x) for b in batches for x, v in zip(b.labels, b.valid.tolist(), strict=True) if v]
        assert keys == [f"fake/{n}" for n in range(20)] and labels == [n % 3 for n in range(20)]
        assert batches[0].images.shape == (8, 3, 16, 16)

    def test_the_images_are_the_sizes_asked_and_repeat_every_distinct(self):
        from gpupipe.runtime._decode import decode_rgb

        index = gp.FakeData(10, image_size=(3, 30, 50), distinct=4, random_offset=1).index()
        raws = [index.read(n) for n in range(10)]
        assert tuple(decode_rgb(raws[0].data, shard="s", key="k").shape) == (3, 30, 50)
        assert raws[0].data == raws[4].data != raws[1].data  # image (n + 1) % 4

    def test_a_large_one_indexes_at_once(self):
        index = gp.FakeData(10_000_000).index()  # keys are made per shard, when read
        assert len(index) == 10_000_000 and index.read(9_999_999).key == "fake/9999999"

    @pytest.mark.parametrize("kwargs", [dict(size=0), dict(image_size=(1, 8, 8)), dict(num_classes=0)])
    def test_bad_arguments(self, kwargs):
        with pytest.raises(gp.ConfigError):
            gp.FakeData(**kwargs)


class TestFirstIndexInParallel:
    """A new local dataset of many shards is scanned into the index cache in processes
    (``shards._indexing.scan_ahead``): the same index as one process makes, and nothing run
    where the cache is warm, the shards few or the rank has one core."""

    @pytest.fixture
    def many(self, shards, tmp_path, monkeypatch):
        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "cache"))
        urls = []
        for i in range(80):  # (links to the three shards: each path is a shard of its own to the cache)
            path = tmp_path / f"many-{i:03d}.tar"
            os.symlink(shards[i % 3], path)
            urls.append(str(path))
        return urls

    def test_the_same_index_as_one_process(self, many, tmp_path, monkeypatch):
        from gpupipe.shards import _indexing

        scanned: list[int] = []
        real = _indexing.scan_ahead

        def two(*args, **kwargs) -> int:  # (this machine may have one core for a rank)
            scanned.append(real(*args, **kwargs, workers=2))
            return scanned[-1]

        monkeypatch.setattr("gpupipe.sources._webdataset.scan_ahead", two)
        parallel = gp.WebDataset(many).index()
        assert scanned == [80]
        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "cache2"))
        monkeypatch.setattr(_indexing, "PARALLEL_SHARDS", 10**9)
        alone = gp.WebDataset(many).index()
        assert len(parallel) == len(alone) == sum(SHARD_SIZES[i % 3] for i in range(80))
        located, truth = parallel.locate_batch(np.arange(len(parallel))), alone.locate_batch(np.arange(len(alone)))
        assert located.keys == truth.keys
        np.testing.assert_array_equal(located.labels, truth.labels)
        np.testing.assert_array_equal(located.ranges, truth.ranges)
        parallel.close()
        alone.close()

    def test_it_runs_only_for_a_new_dataset_of_many_local_shards(self, many, monkeypatch):
        from gpupipe.shards._indexing import scan_ahead
        from gpupipe.storage import LocalStorage

        storage = LocalStorage()
        assert scan_ahead(storage, many[:63], ("jpg",), "cls", workers=2) == 0  # few shards
        assert scan_ahead(storage, many, ("jpg",), "cls", workers=1) == 0  # one core
        assert scan_ahead(storage, many, ("jpg",), "cls", workers=2) == 80
        assert scan_ahead(storage, many, ("jpg",), "cls", workers=2) == 0  # the cache is warm


class TestShardWriter:
    """What gp.ShardWriter writes is what readers (gpupipe's and webdataset's) read back, a sample
    whole or not at all."""

    JPG = encode_jpeg(synthetic_image(0, size=(16, 16)))

    def test_a_key_written_twice_into_a_shard_is_refused(self, tmp_path):
        with gp.ShardWriter(str(tmp_path / "s-%d.tar"), max_count=2) as w:
            w.write("a", {"jpg": self.JPG, "cls": 0})
            with pytest.raises(gp.ConfigError, match="already in shard"):
                w.write("a", {"jpg": self.JPG, "cls": 1})
            w.write("b", {"jpg": self.JPG, "cls": 1})
            w.write("a", {"jpg": self.JPG, "cls": 2})  # another shard: its own keys
        assert [len(s) for s in gp.WebDataset(w.shards).index().shards] == [2, 1]

    @pytest.mark.parametrize(
        "members, match",
        [
            ({"txt": "first", "jpg": 3.5}, "must be bytes"),
            ({"txt": "first", "e" * 120: b"."}, "does not fit a tar header"),
            ({"txt": "first", "json": {"n": np.int64(1)}}, "not JSON"),
            ({"txt": "first", "a/b": b"."}, "extension"),
            ({"txt": "first", "": b"."}, "extension"),
            ({"txt": "first", "TXT": "again"}, "repeats an extension"),
            ({}, "no members"),
        ],
    )
    def test_a_refused_sample_leaves_nothing_of_it(self, tmp_path, members, match):
        with gp.ShardWriter(str(tmp_path / "s-%d.tar")) as w:
            w.write("ok", {"cls": 0})
            with pytest.raises(gp.ConfigError, match=match):
                w.write("bad", members)
        with tarfile.open(w.shards[0]) as tar:
            assert tar.getnames() == ["ok.cls"] and w.samples == 1

    @pytest.mark.parametrize("pattern", ["s.tar", "100%-%d.tar", "s-%d-%d.tar", "s-%%d.tar"])
    def test_a_pattern_without_one_shard_number_is_refused(self, tmp_path, pattern):
        with pytest.raises(gp.ConfigError, match="one %d field"):
            gp.ShardWriter(str(tmp_path / pattern))

    def test_a_literal_percent_and_a_missing_folder(self, tmp_path):
        with gp.ShardWriter(str(tmp_path / "50%%" / "new" / "s-%03d.tar"), max_count=1) as w:
            w.write("a", {"cls": 1})
            w.write("b", {"cls": 2})
        assert w.shards == [str(tmp_path / "50%" / "new" / f"s-00{i}.tar") for i in range(2)]

    def test_a_writer_left_unclosed_still_ends_its_shard(self, tmp_path):
        import subprocess
        import sys

        pattern = str(tmp_path / "s-%d.tar")
        code = (f"import gpupipe as gp\nw = gp.ShardWriter({pattern!r}, max_count=9)\n"
                f"for i in range(3): w.write(str(i), {{'jpg': {self.JPG!r}, 'cls': i}})\n")  # fmt: skip
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        index = gp.WebDataset(str(tmp_path / "s-0.tar")).index()
        assert len(index) == 3 and not index.shards[0].problems

    def test_reads_back_identically_through_gpupipe_and_webdataset(self, tmp_path):
        wds = pytest.importorskip("webdataset")
        keys = ["plain", "dir.with.dots/k", "a/b/c", "ключ-é", "x" * 90]
        samples = [(k, {"jpg": self.JPG, "cls": i, "txt": f"caption {k} ✓", "json": {"k": k, "i": i},
                        "npy": np.arange(i + 1, dtype=np.float32)}) for i, k in enumerate(keys)]  # fmt: skip
        with gp.ShardWriter(str(tmp_path / "s-%d.tar"), max_count=2) as w:
            w.write_all(samples)
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "label": "cls", "text": "txt", "meta": "json",
                                                 "emb": gp.fields.Array("npy", pad=0)})  # fmt: skip
        got = {}
        pipeline = gp.Pipeline(source, [T.Resize((8, 8))])
        with gp.Loader(pipeline, 2, backend="torch", num_workers=0, device="cpu") as loader:
            for b in loader:
                for j, k in enumerate(b.keys):
                    if b.valid[j]:
                        emb = b["emb"].data[j][: int(b["emb"].lengths[j][0])].tolist()
                        assert b.labels is not None
                        got[k] = (int(b.labels[j]), b["text"][j], b["meta"][j], emb)
        import gc
        import warnings

        with warnings.catch_warnings():  # webdataset leaves its shard files to the collector
            warnings.simplefilter("ignore", ResourceWarning)
            theirs = {s["__key__"]: s for s in wds.WebDataset(w.shards, shardshuffle=False).decode()}
            gc.collect()
        for k, m in samples:
            want = (m["cls"], m["txt"], m["json"], np.asarray(m["npy"]).tolist())
            assert got[k] == want
            s = theirs[k]
            assert (s["cls"], s["txt"], s["json"], s["npy"].tolist()) == want
