"""Issue 36: what DALI's decoders do not read is delivered as gpupipe's decoder reads it
(``gpupipe/backends/_dali/_fallback.py``): the header's routing, nvImageCodec's parser as the gate
in front of DALI, the PPM that carries gpupipe's pixels into the graph, and the probe that finds
the samples a failed batch fails on. The corpus runs through every backend in
``tests/test_odd_files.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.backends._dali import _fallback
from gpupipe.core._imageinfo import jpeg_ended
from gpupipe.runtime._decode import decode_rgb, read_header, transcoded

from .support.corpus import SIZE, corpus
from .support.headers import header_reads

pytest.importorskip("nvidia.dali")

FILES = {name: data for name, (data, _) in corpus().items()}


def header(name: str):
    return read_header(FILES[name], None, shard="s.tar", key=name)


class TestRouting:
    """Which files DALI's decoders are given, from the header alone."""

    @pytest.mark.parametrize("name", ["jpeg", "jpeg-progressive", "png", "webp", "bmp", "ppm"])
    def test_the_formats_dali_reads_go_to_dali(self, name):
        assert _fallback.native(header(name))

    @pytest.mark.parametrize("name", ["jpeg-junk-before-dqt", "jpeg-short-app14"])
    def test_junk_before_the_frame_header_is_irregular(self, name):
        got = header(name)
        assert got.format == "jpeg" and got.irregular and not _fallback.native(got)
        assert got.size == header("jpeg").size  # the size libjpeg reads past the junk

    def test_a_jpeg_cut_short_is_irregular(self):
        """nvJPEG decodes a cut JPEG without a word (seen on an H100: its missing rows grey), so
        such a file is never given to DALI's decoders: gpupipe's decoder judges it, as on torch."""
        got = header("jpeg-truncated")
        assert got.format == "jpeg" and got.irregular and not _fallback.native(got)

    def test_where_a_jpeg_ends(self):
        whole = FILES["jpeg"]
        assert jpeg_ended(whole) and jpeg_ended(whole + b"\x00" * 40 + b"\r\n") and jpeg_ended(memoryview(whole))
        assert not jpeg_ended(whole + b"appended data") and not jpeg_ended(b"") and not jpeg_ended(b"\xd9")
        assert not any(jpeg_ended(whole[:n]) for n in range(2, len(whole) - 1, 7))  # every cut is seen
        assert not jpeg_ended(whole[:-1]) and not header("jpeg").irregular

    def test_an_animated_png_is_irregular(self):
        assert header("png-animated").irregular and not header("png").irregular

    @pytest.mark.parametrize("name", ["jpeg2000", "tga", "pcx", "sgi", "ico", "tiff", "tiff-16-bit-rgb"])
    def test_other_formats_jpeg_2000_and_tiff_never_reach_dali(self, name):
        assert not _fallback.native(header(name))


class TestParsed:
    """nvImageCodec's parser (DALI's decoders parse with it first) decides what reaches DALI."""

    @pytest.mark.parametrize("name", ["jpeg", "jpeg-cmyk", "png-palette", "webp-lossless", "bmp", "tiff", "ppm"])
    def test_what_it_reads_has_the_headers_size(self, name):
        assert _fallback.parsed(FILES[name]) == header(name).size

    @pytest.mark.parametrize(
        "name", ["jpeg-junk-before-dht", "jpeg-junk-before-sos", "bmp-16-bit", "bmp-rle4", "png-no-iend"],
    )  # fmt: skip
    def test_what_it_refuses_or_dali_cannot_take(self, name):
        assert _fallback.native(header(name)) and _fallback.parsed(FILES[name]) is None

    def test_without_nvimagecodecs_module_the_header_decides_and_says_so(self, monkeypatch, caplog):
        import sys

        import nvidia

        monkeypatch.setattr(_fallback, "_nvimgcodec", None)
        monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # import fails
        monkeypatch.delattr(nvidia, "nvimgcodec", raising=False)
        assert _fallback.parsed(FILES["jpeg-junk-before-dht"]) == header("jpeg").size
        assert _fallback.parsed(FILES["png"]) == header("png").size
        (record,) = [r for r in caplog.records if "nvidia.nvimgcodec" in r.getMessage()]  # said once
        assert "install nvidia-nvimgcodec-cu12" in record.getMessage()

    def test_a_view_of_a_larger_buffer(self):
        data = FILES["jpeg"]
        buffer = np.zeros(len(data) + 64, np.uint8)
        buffer[32 : 32 + len(data)] = np.frombuffer(data, np.uint8)
        assert _fallback.parsed(buffer[32 : 32 + len(data)]) == header("jpeg").size


class TestTranscoded:
    """gpupipe's pixels, as a PPM, come out of DALI's decoders exactly."""

    def decode_with_dali(self, encoded: list[bytes], start=(0, 0), shape=None):
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=len(encoded), num_threads=1, device_id=None, prefetch_queue_depth=1)
        def pipe():
            data = fn.external_source(name="data", dtype=types.UINT8)
            whole = fn.decoders.image(data, device="cpu", output_type=types.RGB)
            if shape is None:
                return whole
            return whole, fn.decoders.image_slice(data, device="cpu", output_type=types.RGB, start=list(start),
                                                  shape=list(shape), axis_names="HW")  # fmt: skip

        p = pipe()
        p.build()
        p.feed_input("data", [np.frombuffer(e, np.uint8) for e in encoded])
        return [np.asarray(out.as_tensor()) for out in p.run()]

    @pytest.mark.parametrize("name", ["jpeg-junk-before-dht", "bmp-rle4", "tiff-1-bit", "png-animated", "tga"])
    def test_whole_and_region_decode_to_gpupipes_pixels(self, name):
        (ppm,) = transcoded([(FILES[name], "s.tar", name)])
        assert isinstance(ppm, bytes) and ppm.startswith(b"P6\n")
        expected = decode_rgb(FILES[name], shard="s.tar", key=name).permute(1, 2, 0).numpy()
        h, w = _fallback.ppm_size(ppm)
        assert (h, w) == expected.shape[:2]
        whole, region = self.decode_with_dali([ppm], start=(1, 1), shape=(h - 2, w - 2))
        assert np.array_equal(whole[0], expected) and np.array_equal(region[0], expected[1 : h - 1, 1 : w - 1])

    def test_upright_with_exif_orientation(self):
        (ppm,) = transcoded([(FILES["jpeg-exif-rotated"], "s.tar", "k")], apply_exif_orientation=True)
        assert isinstance(ppm, bytes)
        expected = decode_rgb(FILES["jpeg-exif-rotated"], shard="s.tar", key="k", apply_exif_orientation=True)
        assert _fallback.ppm_size(ppm) == tuple(expected.shape[1:])
        assert np.array_equal(self.decode_with_dali([ppm])[0][0], expected.permute(1, 2, 0).numpy())

    @pytest.mark.parametrize(("name", "kind"), [("png-cut-in-idat", gp.Damage.UNDECODABLE),
                                                ("tga-truncated", gp.Damage.UNDECODABLE),
                                                ("png-bad-filter", gp.Damage.UNDECODABLE)])  # fmt: skip
    def test_a_refused_file_is_its_verdict(self, name, kind):
        (out,) = transcoded([(FILES[name], "s.tar", name)])
        assert isinstance(out, gp.SampleError) and (out.key, out.shard, out.kind) == (name, "s.tar", kind)


def shard_of(tmp_path, names: list[str]) -> str:
    """One shard of ``names``' files, each with a ``txt`` member holding its key."""
    import webdataset as wds

    path = str(tmp_path / "odd-000000.tar")
    with wds.TarWriter(path) as sink:
        for i, name in enumerate(names):
            sink.write({"__key__": f"{i:03d}-{name}", "jpg": FILES[name], "cls": b"1", "txt": f"{i:03d}-{name}"})
    return path


class TestProbe:
    """A file DALI fails on after it was fed — here one the parser gate is told to let through, at
    a batch under 32, where DALI 2.4 fails cleanly — is found by the probe and decoded by gpupipe."""

    @pytest.fixture
    def lenient_gate(self, monkeypatch):
        """The gate lets every file through that has a header size (as before issue 36)."""
        from gpupipe.backends._dali import _headers

        monkeypatch.setattr(_headers, "parsed", lambda view: read_header(view, None, shard="", key="").size)

    @pytest.mark.parametrize("on_error", ["skip", "raise"])
    def test_a_file_dali_refuses_is_delivered_as_gpupipe_reads_it(self, tmp_path, lenient_gate, on_error):
        names = ["jpeg", "jpeg-junk-before-dht", "bmp-rle4", "jpeg-progressive", "tiff-1-bit", "png"]
        pipe = gp.Pipeline(gp.WebDataset([shard_of(tmp_path, names)]), [T.Resize((16, 16))])
        with gp.Loader(pipe, 4, backend="dali", device="cpu", on_error=on_error, num_workers=1) as loader:
            got = {k: image for b in loader for k, image in zip(b.keys, b.images, strict=True)}
            assert not loader.skipped and getattr(loader._runner, "builds", None) == 1  # no rebuild: it ran on
        with gp.Loader(pipe, 4, backend="torch", on_error=on_error, num_workers=0) as loader:
            expected = {k: image for b in loader for k, image in zip(b.keys, b.images, strict=True)}
        assert got.keys() == expected.keys()
        for key in expected:  # resized by each backend's own kernel: parity as tests/test_dali.py checks it
            assert (got[key].float() - expected[key].float()).abs().mean() <= 2.5, key

    def test_a_file_both_refuse_is_skipped_or_raised(self, tmp_path, lenient_gate):
        names = ["jpeg", "jpeg-junk-before-dht", "png-cut-in-idat", "png", "jpeg-progressive"]
        pipe = gp.Pipeline(gp.WebDataset([shard_of(tmp_path, names)]), [T.RandomResizedCrop(16)])
        with gp.Loader(pipe, 5, backend="dali", device="cpu", on_error="skip", max_skipped=None) as loader:
            delivered = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
            assert [s.key for s in loader.skipped] == ["002-png-cut-in-idat"]
        assert sorted(delivered) == sorted(f"{i:03d}-{n}" for i, n in enumerate(names) if n != "png-cut-in-idat")
        with (
            gp.Loader(pipe, 5, backend="dali", device="cpu", on_error="raise") as loader,
            pytest.raises(gp.SampleError) as raised,
        ):
            list(loader)
        assert raised.value.key == "002-png-cut-in-idat" and raised.value.kind == gp.Damage.UNDECODABLE

    def test_fields_follow_the_donor_of_a_file_both_refuse(self, tmp_path, lenient_gate):
        """A sample the probe finds bad after it was fed stands in as its donor: fields too."""
        names = ["jpeg", "jpeg-junk-before-dht", "png-cut-in-idat", "png", "jpeg-progressive"]
        source = gp.WebDataset([shard_of(tmp_path, names)], fields={"image": "jpg", "label": "cls", "text": "txt"})
        pipe = gp.Pipeline(source, [T.RandomResizedCrop(16)])
        with gp.Loader(pipe, 5, backend="dali", device="cpu", on_error="skip", max_skipped=None) as loader:
            (batch,) = list(loader)
        valid = batch.valid.tolist()
        assert valid.count(False) == 1 and batch["text"][valid.index(False)] == batch["text"][valid.index(True)]
        assert all(t == k for t, k, v in zip(batch["text"], batch.keys, valid, strict=True) if v)

    def test_the_probe_names_the_failing_positions(self):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.tensors import TensorCPU

        @pipeline_def(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1)
        def pipe():
            data = fn.external_source(name="encoded", dtype=types.UINT8, no_copy=True)
            return fn.decoders.image(data, device="cpu", output_type=types.RGB)

        def define():
            p = pipe()
            p.build()
            return p

        names = ["jpeg", "jpeg-junk-before-dht", "png", "bmp-16-bit", "jpeg-truncated"]
        encoded = [TensorCPU(np.frombuffer(FILES[n], np.uint8)) for n in names]
        probe = _fallback.Probe(define)
        assert probe.refused(encoded, {}, range(len(names)), batch=0) == [1, 3, 4]
        assert probe.refused(encoded, {}, [0, 2], batch=0) == []  # the pipeline is used on after failures
        probe.close()


def test_the_corpus_decodes_like_torch_where_dali_is_given_the_file(tmp_path):
    """The files that reach DALI's decoders come out as on torch (each backend's own resize)."""
    names = ["jpeg", "png", "png-palette", "webp-lossless", "bmp", "tiff", "ppm"]
    pipe = gp.Pipeline(gp.WebDataset([shard_of(tmp_path, names)]), [T.Resize((24, 24))])
    out = {}
    for backend in ("dali", "torch"):
        with gp.Loader(pipe, 7, backend=backend, device="cpu", num_workers=0 if backend == "torch" else 1) as loader:
            out[backend] = torch.cat([b.images for b in loader])
    assert (out["dali"].float() - out["torch"].float()).abs().mean(dim=(1, 2, 3)).max() <= 2.5


def test_scaled_values_are_gpupipes_on_every_backend(tmp_path):
    """16-bit colour PNGs and TIFFs (DALI reads them) and PGM/PPMs of another largest value than 255 or
    65535 (gpupipe's decoder on DALI too: DALI's does not scale them) come out equal."""
    names = ["ppm", "png-16-bit-rgb", "png-16-bit-gray-alpha", "tiff-16-bit-rgb", "ppm-maxval-100",
             "pgm-16-bit-maxval-1000"]  # fmt: skip
    assert [_fallback.native(header(name)) for name in names] == [True, True, True, False, False, False]
    pipe = gp.Pipeline(gp.WebDataset([shard_of(tmp_path, names)]), [T.CenterCrop(SIZE)])
    out = {}
    for backend in ("dali", "torch"):
        with gp.Loader(pipe, 5, backend=backend, device="cpu", num_workers=0 if backend == "torch" else 1) as loader:
            out[backend] = torch.cat([b.images for b in loader])
    assert torch.equal(out["dali"], out["torch"])
    assert out["torch"][4].max() > 250 and out["torch"][5].max() > 250  # scaled to 255, not 100 or 1000 >> 8


def test_a_tiff_damaged_below_the_crop_window_is_refused_on_dali_too(tmp_path):
    """DALI decodes a region of a TIFF reading its rows down to the window only (libtiff), so a
    Deflate strip damaged below it passed, where the torch backend refused the file (found by the
    fuzzer, seed 7159): a TIFF is decoded by gpupipe's decoder on DALI too."""
    import webdataset as wds

    from .support.data import tiff16

    values = np.random.default_rng(7).integers(0, 65536, (40, 56, 3)).astype(np.uint16)
    data = bytearray(tiff16(values, deflate=True, strips=2))
    data[-1] ^= 0x01  # the last strip's checksum
    path = str(tmp_path / "t-000000.tar")
    with wds.TarWriter(path) as sink:
        for i in range(12):  # 8 damaged TIFFs, 4 good JPEGs
            sink.write({"__key__": f"{i:03d}", "jpg": bytes(data) if i < 8 else FILES["jpeg"], "cls": b"1"})
    pipe = gp.Pipeline(gp.WebDataset([path]), [T.RandomResizedCrop(16, scale=(0.01, 0.05))])
    for backend in ("torch", "dali"):
        with gp.Loader(pipe, 4, backend=backend, device="cpu", on_error="skip", max_skipped=None, seed=0,
                       num_workers=0 if backend == "torch" else 1) as loader:  # fmt: skip
            delivered = sorted(k for b in loader for k, ok in zip(b.keys, b.valid.tolist(), strict=True) if ok)
            assert delivered == ["008", "009", "010", "011"], backend
            assert sorted((s.key, str(s.kind)) for s in loader.skipped) == [(f"{i:03d}", "undecodable") for i in
                                                                            range(8)], backend  # fmt: skip


class TestHeadersReadOnce:
    """Issue 36, the input path: a sample's header is read once in a runner's life; later epochs
    gather the sizes from memory (no Python per sample, no page touched), and the samples that
    failed are judged again each epoch (their verdict is counted every epoch)."""

    def test_the_second_epoch_reads_only_the_bad_headers(self, tmp_path, monkeypatch):
        calls = header_reads(monkeypatch)
        names = ["jpeg", "png", "text", "jpeg-progressive", "bmp-rle4", "webp", "gif", "tiff"]
        pipe = gp.Pipeline(gp.WebDataset([shard_of(tmp_path, names)]), [T.RandomResizedCrop(16)])
        epochs = []
        with gp.Loader(pipe, 3, backend="dali", device="cpu", on_error="skip", max_skipped=None) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                calls.clear()
                images = torch.cat([b.images[b.valid] for b in loader])
                epochs.append((sorted(calls), sorted(str(s.key) for s in loader.skipped), images))
        first, second = epochs
        assert first[0] == sorted(f"{i:03d}-{n}" for i, n in enumerate(names))
        assert second[0] == ["002-text", "004-bmp-rle4", "006-gif", "007-tiff"]  # bad, or gpupipe's each epoch
        assert first[1] == second[1] == ["002-text", "006-gif"]
        assert first[2].shape == second[2].shape == (6, 3, 16, 16)

    def test_what_is_remembered_is_bounded(self, tmp_path):
        from gpupipe.backends._dali._headers import Sizes

        index = gp.WebDataset([shard_of(tmp_path, ["jpeg"] * 4)]).index()
        sizes = Sizes(index)
        sizes.LIMIT = 3  # an index over the limit is remembered by shard
        where = index.locate_batch(np.arange(4))
        sizes.remember(where, np.arange(4), np.array([[1, 2], [3, 4], [5, 6], [7, 8]]), np.array([0, 2]))
        assert sizes.known(where, np.arange(4)).tolist() == [[1, 2], [0, 0], [5, 6], [0, 0]]
        sizes.LIMIT = 2  # a shard of 4 is over it; the last shard is kept
        sizes.remember(where, np.arange(4), np.array([[1, 2], [3, 4], [5, 6], [7, 8]]), np.array([1]))
        assert sizes.known(where, np.arange(4)).tolist() == [[1, 2], [3, 4], [5, 6], [0, 0]]


class TestSizesRecorded:
    """Issue 53: the sizes an epoch checked are recorded beside the shard's index cache file, so a
    new loader's first epoch (a restarted job, another rank) reads only the headers it has not
    checked before, and a recorded size never bypasses a lower pixel limit."""

    NAMES = ("jpeg", "png", "text", "jpeg-progressive", "bmp-rle4", "webp", "gif", "tiff")

    @pytest.fixture
    def counted(self, monkeypatch):
        return header_reads(monkeypatch)

    def epoch(self, pipe, **options):
        with gp.Loader(pipe, 3, backend="dali", device="cpu", on_error="skip", max_skipped=None, seed=0,
                       **options) as loader:  # fmt: skip
            images = torch.cat([b.images[b.valid] for b in loader])
            return images, sorted(str(s.key) for s in loader.skipped)

    def test_a_new_loader_reads_only_headers_not_checked_before(self, tmp_path, counted):
        pipe = gp.Pipeline(gp.WebDataset([shard_of(tmp_path, list(self.NAMES))]), [T.RandomResizedCrop(16)])
        first = self.epoch(pipe)
        assert len(counted) == len(self.NAMES)
        counted.clear()
        again = self.epoch(pipe)  # a new runner: its first epoch
        assert sorted(counted) == ["002-text", "004-bmp-rle4", "006-gif", "007-tiff"]  # bad, or gpupipe's
        assert again[1] == first[1] == ["002-text", "006-gif"]
        assert torch.equal(again[0], first[0])

    def test_a_recorded_size_over_a_lower_pixel_limit_is_checked_again(self, tmp_path, counted):
        import io

        import webdataset as wds
        from PIL import Image

        path = str(tmp_path / "sizes-000000.tar")
        with wds.TarWriter(path) as sink:
            for key, side in (("small", 32), ("large", 64)):
                out = io.BytesIO()
                Image.new("RGB", (side, side), (200, 90, 10)).save(out, "JPEG")
                sink.write({"__key__": key, "jpg": out.getvalue(), "cls": b"1"})
        pipe = gp.Pipeline(gp.WebDataset([path]), [T.RandomResizedCrop(16)])
        assert self.epoch(pipe)[1] == []
        counted.clear()
        images, skipped = self.epoch(pipe, max_image_pixels=32 * 32)
        assert counted == ["large"] and skipped == ["large"] and len(images) == 1

    def test_an_image_folder_records_them_by_class(self, tmp_path, counted):
        """An ImageFolder's class folder keeps its record under a digest of its files' names,
        sizes and modification times: a new loader reads only the headers it has not checked,
        and a class whose file was rewritten is checked again, the others not."""
        import os

        for cls in ("a", "b"):
            os.makedirs(tmp_path / "tree" / cls)
        for i, name in enumerate(self.NAMES):
            (tmp_path / "tree" / "ab"[i % 2] / f"{i:03d}-{name}.jpg").write_bytes(FILES[name])
        pipe = gp.Pipeline(gp.ImageFolder(str(tmp_path / "tree")), [T.RandomResizedCrop(16)])
        first = self.epoch(pipe)
        assert len(counted) == len(self.NAMES)
        counted.clear()
        again = self.epoch(pipe)  # a new runner: its first epoch
        assert sorted(counted) == ["a/002-text.jpg", "a/004-bmp-rle4.jpg", "a/006-gif.jpg", "b/007-tiff.jpg"]
        assert again[1] == first[1] and torch.equal(again[0], first[0])
        rewritten = tmp_path / "tree" / "b" / "001-png.jpg"
        rewritten.write_bytes(FILES["jpeg"])
        os.utime(rewritten, ns=(1, 1))
        counted.clear()
        self.epoch(pipe)
        assert sorted(c for c in counted if c.startswith("b/")) == [f"b/{i:03d}-{n}.jpg" for i, n in
                                                                     enumerate(self.NAMES) if i % 2]  # fmt: skip

    def test_records_merge_and_a_damaged_one_is_ignored(self, tmp_path):
        from gpupipe.shards import _indexcache

        idx = str(tmp_path / "s.idx")
        assert _indexcache.save_sizes(idx, "r", np.array([[1, 2], [0, 0], [5, 6]]))
        assert _indexcache.save_sizes(idx, "r", np.array([[0, 0], [3, 4], [0, 0]]))  # another rank's
        merged = _indexcache.load_sizes(idx, "r", 3)
        assert merged is not None and merged.tolist() == [[1, 2], [3, 4], [5, 6]]
        assert _indexcache.load_sizes(idx, "other rules", 3) is None
        assert _indexcache.load_sizes(idx, "r", 4) is None  # not this index's
        with open(_indexcache.sizes_path(idx, "r"), "wb") as f:
            f.write(b"\x93NUMPY garbage")
        assert _indexcache.load_sizes(idx, "r", 3) is None

    def test_recalled_by_shard_over_the_limit(self, tmp_path):
        from gpupipe.backends._dali._headers import Sizes

        index = gp.WebDataset([shard_of(tmp_path, ["jpeg"] * 4)]).index()
        where, samples = index.locate_batch(np.arange(4)), np.arange(4)
        writer = Sizes(index)
        writer.remember(where, samples, np.array([[1, 2], [3, 4], [5, 6], [7, 8]]), np.array([0, 1, 3]))
        writer.save()
        for limit in (Sizes.LIMIT, 3):
            reader = Sizes(index, max_pixels=20)
            reader.LIMIT = limit
            reader.begin()
            assert reader.known(where, samples).tolist() == [[1, 2], [3, 4], [0, 0], [0, 0]]  # 7 x 8 > 20


class TestFeed:
    def test_another_dali_goes_through_feed_input(self):
        from gpupipe.backends._dali._graph import feed

        class Pipe:
            _pipe = object()  # no SetExternalTensorInput

            def __init__(self):
                self.fed = []

            def feed_input(self, name, data):
                self.fed.append((name, data))

        pipe = Pipe()
        feed(pipe, "encoded", [1, 2])
        assert pipe.fed == [("encoded", [1, 2])]
