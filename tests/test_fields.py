"""Fields beyond the image and its class (issue 39, step 1): their definitions and safe decoders
(``gpupipe/core/_fields.py``), checked against webdataset's own decoders on the members its own
writer wrote, and on bad members: each refused with one verdict naming the shard and the key."""

from __future__ import annotations

import importlib.util
import io
import json
import pickle
import tarfile
from typing import Any

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe.core import _fields as F
from gpupipe.core import _npy as npy

wds = pytest.importorskip("webdataset")


def written(sample: dict, tmp_path) -> dict[str, bytes]:
    """``sample`` through webdataset's TarWriter (its own encoders), read back as raw members."""
    path = str(tmp_path / "fields.tar")
    with wds.TarWriter(path) as sink:
        sink.write({"__key__": "k0", **sample})
    with tarfile.open(path) as tar:
        return {m.name.partition(".")[2]: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]


def reference(ext: str, data: bytes):
    from webdataset.autodecode import decoders

    return decoders[ext.rpartition(".")[2]](data)


def bad(field: F.Field, data: bytes, match: str, kind: gp.Damage = gp.Damage.BAD_FIELD) -> None:
    with pytest.raises(gp.SampleError, match=match) as e:
        field.decode(data, shard="s-3.tar", key="k7")
    assert (e.value.shard, e.value.key, e.value.kind) == ("s-3.tar", "k7", kind)
    assert "'k7'" in str(e.value) and "'s-3.tar'" in str(e.value)


class TestText:
    def test_as_webdataset_reads_it(self, tmp_path):
        members = written({"txt": "a caption, ünïcode ✓", "transcript": "x"}, tmp_path)
        for ext in ("txt", "transcript"):
            assert F.Text(ext).decode(members[ext], shard="s", key="k") == reference(ext, members[ext])

    def test_refused(self):
        bad(F.Text("txt"), b"\xff\xfe caption", "is not UTF-8 text")
        bad(F.Text("txt", max_bytes=8), b"123456789", "is 9 bytes, over its max_bytes=8")
        assert F.Text("txt").empty() == "" and F.Text("txt").max_bytes == 1 << 20


class TestJson:
    def test_as_webdataset_reads_it(self, tmp_path):
        meta = {"url": "https://x/y.jpg", "width": 640, "height": 480, "tags": ["a", "b"], "score": 0.5}
        members = written({"json": meta}, tmp_path)
        assert F.Json("json").decode(members["json"], shard="s", key="k") == reference("json", members["json"]) == meta

    def test_refused(self):
        bad(F.Json("json"), b'{"a": 1', "is not JSON")
        bad(F.Json("json"), b"\xff{}", "is not UTF-8 JSON")
        bad(F.Json("json", max_bytes="1KB"), b"[" + b"0," * 600 + b"0]", "over its max_bytes=1000")
        bad(F.Json("json", max_bytes="1MB"), b"[" * 200_000 + b"]" * 200_000, "nested too deeply")

    def test_an_integer_over_pythons_digit_limit_is_a_bad_field(self):
        # int() refuses more than sys.get_int_max_str_digits() digits with a plain ValueError
        for number in (b"1" * 5000, b"-" + b"9" * 5000, b"[" + b"7" * 4301 + b"]"):
            bad(F.Json("json"), b'{"n": ' + number + b"}", "is not JSON")

    def test_a_huge_member_is_not_parsed(self, monkeypatch):
        monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed"))
        bad(F.Json("json"), b" " * ((1 << 20) + 1), "over its max_bytes")


class TestLabel:
    def test_as_webdataset_reads_it(self, tmp_path):
        members = written({"cls": 7, "id": "-12"}, tmp_path)
        for ext in ("cls", "id"):
            assert F.Label(ext).decode(members[ext], shard="s", key="k") == reference(ext, members[ext])

    def test_refused(self):
        bad(F.Label("cls"), b"seven", "is not an ASCII integer")
        bad(F.Label("cls"), str(1 << 63).encode(), "out of the int64 range")


class TestArray:
    @pytest.mark.parametrize("array", [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        np.zeros((0, 5), np.uint8),
        np.float64(2.5),
        np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
    ], ids=["float32", "fortran", "empty", "scalar", "structured"])  # fmt: skip
    def test_as_webdataset_reads_it(self, tmp_path, array):
        members = written({"npy": array}, tmp_path)
        got = F.Array("npy").decode(members["npy"], shard="s", key="k")
        want = reference("npy", members["npy"])
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)

    def test_a_view_of_the_bytes_not_a_copy(self):
        buf = io.BytesIO()
        np.save(buf, np.arange(1000, dtype=np.float32))
        data = buf.getvalue()
        got = F.Array("npy").decode(data, shard="s", key="k")
        assert got.base is not None and not got.flags.writeable and np.shares_memory(got, np.frombuffer(data, np.uint8))

    def test_versions_2_and_3_and_numpys_header_limit(self):
        """Headers of NPY 2.0 and 3.0 are read; one over NumPy's safe size (10,000 bytes, parsed
        with ``literal_eval``) is refused, as NumPy refuses it without ``allow_pickle``."""
        for version in ((2, 0), (3, 0)):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.arange(5, dtype=np.int32), version=version)
            assert F.Array("npy").decode(buf.getvalue(), shard="s", key="k").tolist() == [0, 1, 2, 3, 4]
        buf = io.BytesIO()
        np.lib.format.write_array(buf, np.zeros(3, dtype=[(f"f{i}", "<f4") for i in range(4000)]), version=(2, 0))
        bad(F.Array("npy"), buf.getvalue(), "is not a .npy array .*large")

    def test_a_pickle_is_never_unpickled(self, monkeypatch):
        """An object array (a pickle inside the .npy) is refused from its header: ``pickle`` is
        never called, whatever the payload."""
        buf = io.BytesIO()
        np.save(buf, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
        monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
        monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
        bad(F.Array("npy"), buf.getvalue(), "object array")

    def test_refused(self):
        buf = io.BytesIO()
        np.save(buf, np.arange(100, dtype=np.float64))
        whole = buf.getvalue()
        bad(
            F.Array("npy"), whole[:-8], "is truncated: its header announces 800 bytes of float64 \\(100,\\), 792 follow"
        )
        bad(F.Array("npy"), whole + b"\0" * 8, "longer than its header says")
        bad(F.Array("npy"), whole[:20], "is not a .npy array")
        bad(F.Array("npy"), b"not an array at all", "is not a .npy array")
        bad(F.Array("npy", dtype=np.float32), whole, "is a float64 array, not float32")
        bad(F.Array("npy", shape=(10, 10)), whole, "has shape \\(100,\\), not \\(10, 10\\)")
        bad(F.Array("npy", max_bytes=500), whole, "over its max_bytes=500")

    def test_expected_dtype_and_shape(self):
        buf = io.BytesIO()
        np.save(buf, np.ones((2, 3), np.float32))
        got = F.Array("npy", dtype="float32", shape=(2, 3)).decode(buf.getvalue(), shard="s", key="k")
        assert got.shape == (2, 3) and F.Array("npy", dtype="float32").empty().dtype == np.float32
        with pytest.raises(gp.ConfigError, match="object arrays are pickles"):
            F.Array("npy", dtype=object)
        with pytest.raises(gp.ConfigError, match="shape must be a tuple"):
            F.Array("npy", shape=(2, -1))


class TestNpyHeaders:
    """``.npy`` headers are parsed one thread at a time, and once more after CPython's spurious
    ``SystemError`` (gh-106905: numpy parses them with ``ast``, which CPython before 3.11.8 does
    not make safe for threads), as seen in this suite on 3.11.7."""

    @staticmethod
    def npy(value: np.ndarray) -> io.BytesIO:
        out = io.BytesIO()
        np.save(out, value, allow_pickle=False)
        out.seek(0)
        return out

    @pytest.mark.parametrize("version", [(1, 0), (2, 0)])
    def test_the_header_and_where_the_data_starts(self, version):
        from numpy.lib import format as npy_format

        out = io.BytesIO()
        value = np.arange(6, dtype="<f4").reshape(2, 3)
        npy_format.write_array(out, value, version=version)
        out.seek(0)
        got = npy.read_header(out)
        assert got == (version, (2, 3), False, np.dtype("<f4"))
        assert np.array_equal(np.frombuffer(out.read(), "<f4").reshape(2, 3), value)

    def test_under_the_lock_and_tried_once_more_after_a_system_error(self, monkeypatch):
        from numpy.lib import format as npy_format

        real, calls = npy_format.read_array_header_1_0, []

        def flaky(stream, *args, **kwargs):
            calls.append(npy.HEADER.locked())
            if len(calls) == 1:
                stream.read(5)  # part of the header consumed before the failure
                raise SystemError("AST constructor recursion depth mismatch (before=45, after=41)")
            return real(stream, *args, **kwargs)

        monkeypatch.setattr(npy_format, "read_array_header_1_0", flaky)
        assert npy.read_header(self.npy(np.zeros(4, np.int16)))[1:] == ((4,), False, np.dtype("<i2"))
        assert calls == [True, True] and not npy.HEADER.locked()

    def test_a_second_system_error_is_raised(self, monkeypatch):
        from numpy.lib import format as npy_format

        def failing(stream, *args, **kwargs):
            raise SystemError("AST constructor recursion depth mismatch")

        monkeypatch.setattr(npy_format, "read_array_header_1_0", failing)
        with pytest.raises(SystemError):
            npy.read_header(self.npy(np.zeros(4)))
        assert not npy.HEADER.locked()

    @staticmethod
    def flaky_load(monkeypatch) -> list[bool]:
        """``np.load`` failing once with gh-106905's error; the lock's state at each call."""
        real, calls = np.load, []

        def flaky(*args, **kwargs):
            calls.append(npy.HEADER.locked())
            if len(calls) == 1:
                raise SystemError("AST constructor recursion depth mismatch")
            return real(*args, **kwargs)

        monkeypatch.setattr(np, "load", flaky)
        return calls

    def test_load_is_tried_once_more(self, monkeypatch, tmp_path):
        path = str(tmp_path / "labels.npy")
        np.save(path, np.arange(5), allow_pickle=False)
        calls = self.flaky_load(monkeypatch)
        assert np.array_equal(npy.load(path), np.arange(5)) and calls == [True, True]

    def test_the_index_caches_labels_load_through_it(self, monkeypatch, tmp_path):
        from gpupipe.shards import _indexcache

        idx = str(tmp_path / "train-000000.idx")
        _indexcache.save_labels(idx, np.arange(5))
        calls = self.flaky_load(monkeypatch)
        labels = _indexcache.load_labels(idx, 5)
        assert labels is not None and np.array_equal(labels, np.arange(5)) and calls == [True, True]
        assert _indexcache.load_labels(idx, 6) is None  # not the count the index has

    def test_threads_decoding_fields_at_once(self):
        """Array fields decoded in many threads at once (what the DALI runner's reader threads
        do) all come out right."""
        import concurrent.futures

        field = gp.fields.Array("npy")
        members = [self.npy(np.full((3, i + 1), i, np.float32)).getvalue() for i in range(64)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            out = list(pool.map(lambda m: field.decode(m, shard="s.tar", key="k"), members * 8))
        want = [np.full((3, i % 64 + 1), i % 64, np.float32) for i in range(len(out))]
        assert all(np.array_equal(np.asarray(o), w) for o, w in zip(out, want, strict=True))


class TestParseFields:
    def test_kinds_from_extensions(self):
        got = F.parse_fields({"image": "jpg;png", "label": "cls", "text": "txt", "meta": "json", "x": "npy",
                              "mask": F.Image("seg.png", missing="skip")})  # fmt: skip
        assert {n: type(f).__name__ for n, f in got.items()} == {
            "image": "Image", "label": "Label", "text": "Text", "meta": "Json", "x": "Array", "mask": "Image",
        }  # fmt: skip
        assert got["image"].exts == ("jpg", "png") and got["mask"].missing is F.Missing.SKIP

    @pytest.mark.parametrize(("fields", "match"), [
        ({}, "non-empty mapping"),
        ({"a b": "txt"}, "identifier"),
        ({"x": "xyz"}, "does not know how to decode .xyz"),
        ({"x": "txt;json"}, "mixes kinds"),
        ({"a": "txt", "b": "txt"}, "read by both 'a' and 'b'"),
        ({"x": "pyd"}, "pickle .*never"),
        ({"x": "pth"}, "torch.load"),
        (lambda: {"x": F.Json("pickle")}, "pickle .*never"),
        (lambda: {"x": F.Text(";")}, "exts must be extensions"),
    ])  # fmt: skip
    def test_refused(self, fields, match):
        with pytest.raises(gp.ConfigError, match=match):
            F.parse_fields(fields() if callable(fields) else fields)

    def test_options_are_validated(self):
        with pytest.raises(gp.ConfigError, match="missing"):
            F.Text("txt", missing="ignore")
        with pytest.raises(gp.ConfigError, match="max_bytes"):
            F.Text("txt", max_bytes=0)
        assert F.Text("txt", max_bytes="2KiB").max_bytes == 2048

    def test_a_missing_fields_error(self):
        e = F.Text("txt;text").missing_error("caption", shard="s.tar", key="k1")
        assert e.kind is gp.Damage.MISSING_FIELD and e.shard == "s.tar" and e.key == "k1"
        assert "has no 'caption' field (txt/text)" in str(e)


# ------------------------------------------------------------ through a WebDataset --


def _jpeg(i: int) -> bytes:
    from gpupipe.testing import encode_jpeg, synthetic_image

    return encode_jpeg(synthetic_image(i, size=(40, 48)))


def shard_with_fields(tmp_path, n: int = 10, *, drop: dict[int, str] | None = None,
                      replace: dict[int, dict] | None = None) -> str:  # fmt: skip
    """One shard by webdataset's writer: ``n`` samples ``k000..`` of jpg, cls, txt, json and npy;
    ``drop`` leaves a member out of a sample, ``replace`` gives a sample other members (bytes)."""
    path = str(tmp_path / "fields-000000.tar")
    with wds.TarWriter(path) as sink:
        for i in range(n):
            sample = {"__key__": f"k{i:03d}", "jpg": _jpeg(i), "cls": i % 3, "txt": f"caption {i}, ünï",
                      "json": {"i": i, "tags": ["t"] * (i % 4)}, "npy": np.arange(6, dtype=np.float32) * i}  # fmt: skip
            if drop and i in drop:
                del sample[drop[i]]
            sample.update((replace or {}).get(i, {}))
            sink.write(sample)
    return path


FIELDS = {"image": "jpg", "label": "cls", "text": "txt", "meta": "json", "emb": "npy"}


BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.skipif(
    importlib.util.find_spec("nvidia.dali") is None, reason="needs DALI"))]  # fmt: skip


def read_all(source, *, backend: str = "torch", workers: int = 0, on_error: str = "raise", batch_size: int = 4,
             shuffle: bool = False):  # fmt: skip
    """Every batch of an epoch (DALI: its CPU operators)."""
    pipe = gp.Pipeline(source, [gp.transforms.CenterCrop(32)])
    out = []
    options: dict = {"max_skipped": 0.5} if on_error == "skip" else {}
    if backend == "dali":
        options["device"] = "cpu"
    with gp.Loader(pipe, batch_size, backend=backend, num_workers=workers or (1 if backend == "dali" else 0),
                   shuffle=shuffle, seed=3, on_error=on_error, **options) as loader:  # fmt: skip
        for batch in loader:
            out.append(batch)
    return out


class TestWebDatasetFields:
    """``gp.WebDataset(..., fields=)`` read through the torch backend (in its workers) and the DALI
    backend (in its reader threads): values as webdataset's decoders give them, batched by kind,
    with the image and label as before, the same on both."""

    @pytest.mark.parametrize(("backend", "workers"), [("torch", 0), ("torch", 2), ("dali", 2)])
    def test_values_are_webdatasets(self, tmp_path, backend, workers):
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        path = shard_with_fields(tmp_path)
        batches = read_all(gp.WebDataset(path, fields=FIELDS), backend=backend, workers=workers)
        expected: dict[str, dict] = {}
        with tarfile.open(path) as tar:  # webdataset's decoders on the members its writer wrote
            for m in tar:
                key, _, ext = m.name.partition(".")
                if ext != "jpg":
                    expected.setdefault(key, {})[ext] = reference(ext, tar.extractfile(m).read())  # type: ignore[union-attr]
        seen = 0
        for batch in batches:
            images, labels = batch
            assert images.shape[1:] == (3, 32, 32) and isinstance(batch["text"], list)
            assert isinstance(batch["emb"], torch.Tensor) and batch["emb"].shape == (len(batch.keys), 6)
            for j, key in enumerate(batch.keys):
                ref = expected[key]
                assert int(labels[j]) == ref["cls"] and batch["text"][j] == ref["txt"]
                assert batch["meta"][j] == ref["json"]
                assert np.array_equal(batch["emb"][j].numpy(), ref["npy"])
                seen += 1
        assert seen == 10 and set(batches[0].fields) == {"text", "meta", "emb"}

    def test_the_same_batches_on_every_backend(self, tmp_path):
        pytest.importorskip("nvidia.dali")
        path = shard_with_fields(tmp_path, n=13)
        got = {b: read_all(gp.WebDataset(path, fields=FIELDS), backend=b, shuffle=True) for b in ("torch", "dali")}
        for t, d in zip(got["torch"], got["dali"], strict=True):
            assert t.keys == d.keys and t["text"] == d["text"] and t["meta"] == d["meta"]
            assert torch.equal(t["emb"], d["emb"]) and torch.equal(t.labels, d.labels)

    def test_the_cached_index_reads_the_same_and_other_fields_get_their_own(self, tmp_path):
        path = shard_with_fields(tmp_path)
        first = read_all(gp.WebDataset(path, fields=FIELDS))
        again = gp.WebDataset(path, fields=FIELDS).index()
        assert again.shards[0].lazy  # from the node's index cache
        second = read_all(gp.WebDataset(path, fields=FIELDS))
        assert [b["meta"] for b in first] == [b["meta"] for b in second]
        assert all(torch.equal(a["emb"], b["emb"]) for a, b in zip(first, second, strict=True))
        fewer = read_all(gp.WebDataset(path, fields={"image": "jpg", "label": "cls", "text": "txt"}))
        assert set(fewer[0].fields) == {"text"} and fewer[0]["text"] == first[0]["text"]
        plain = read_all(gp.WebDataset(path))
        assert plain[0].fields == {} and [b.keys for b in plain] == [b.keys for b in first]

    def test_a_label_field_an_unlabeled_source_and_arrays_of_several_shapes(self, tmp_path):
        path = str(tmp_path / "x-000000.tar")
        with wds.TarWriter(path) as sink:
            for i in range(4):
                sink.write({"__key__": f"k{i}", "png": _jpeg(i), "idx": str(10 + i).encode(),
                            "npy": np.ones((i + 1, 2), np.int16)})  # fmt: skip
        (batch,) = read_all(gp.WebDataset(path, fields={"image": "png;jpg", "id": gp.fields.Label("idx"),
                                                        "boxes": "npy"}))  # fmt: skip
        assert batch.labels is None and batch["id"].tolist() == [10, 11, 12, 13]
        assert [tuple(b.shape) for b in batch["boxes"]] == [(1, 2), (2, 2), (3, 2), (4, 2)]
        assert all(b.dtype == torch.int16 for b in batch["boxes"])
        moved = batch.to("cpu")
        assert isinstance(moved["boxes"], list) and moved["id"].tolist() == [10, 11, 12, 13]

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_arrays_of_several_shapes_padded_with_their_lengths(self, tmp_path, backend):
        path = str(tmp_path / "x-000000.tar")
        with wds.TarWriter(path) as sink:
            for i in range(4):
                boxes = np.arange(4 * (i + 1), dtype=np.float32).reshape(i + 1, 4)
                sink.write({"__key__": f"k{i}", "jpg": _jpeg(i), "cls": i, "npy": boxes})
        fields = {"image": "jpg", "label": "cls", "boxes": gp.fields.Array("npy", pad=-1)}
        (batch,) = read_all(gp.WebDataset(path, fields=fields), backend=backend)
        padded = batch["boxes"]
        assert isinstance(padded, gp.fields.Padded) and padded.data.shape == (4, 4, 4)
        assert padded.lengths.tolist() == [[1, 4], [2, 4], [3, 4], [4, 4]] and padded.data.dtype == torch.float32
        for j, key in enumerate(batch.keys):
            k = int(key[1:]) + 1
            assert torch.equal(padded.data[j, :k], torch.arange(4 * k, dtype=torch.float32).reshape(k, 4))
            assert bool((padded.data[j, k:] == -1).all())
        moved = batch.to("cpu")
        assert isinstance(moved["boxes"], gp.fields.Padded) and torch.equal(moved["boxes"].data, padded.data)
        with pytest.raises(gp.ConfigError, match="pad must be a number"):
            gp.fields.Array("npy", pad="zero")  # type: ignore[arg-type]


class TestMissingAndBadFields:
    def test_missing_error_names_shard_and_key_or_is_skipped_and_counted(self, tmp_path):
        path = shard_with_fields(tmp_path, drop={3: "txt"})
        with pytest.raises(gp.SampleError, match=r"'k003'.*has no 'text' field") as e:
            gp.WebDataset(path, fields=FIELDS).index()
        assert e.value.kind is gp.Damage.MISSING_FIELD and e.value.shard == path
        index = gp.WebDataset(path, fields=FIELDS).index(on_error="skip")
        assert len(index) == 9 and [p.kind for p in index.problems] == [gp.Damage.MISSING_FIELD]
        keys = [k for b in read_all(gp.WebDataset(path, fields=FIELDS), on_error="skip") for k in b.keys]
        assert "k003" not in keys and len(keys) == 9

    def test_missing_skip_leaves_the_sample_out_without_raising(self, tmp_path):
        path = shard_with_fields(tmp_path, drop={3: "txt"})
        fields = {**FIELDS, "text": gp.fields.Text("txt", missing="skip")}
        index = gp.WebDataset(path, fields=fields).index()  # on_error="raise": no error
        assert len(index) == 9 and "missing='skip'" in str(index.problems[0])

    def test_missing_empty_gives_the_empty_value(self, tmp_path):
        path = shard_with_fields(tmp_path, drop={1: "txt", 2: "json", 5: "npy"})
        e = "empty"
        fields = {"image": "jpg", "label": "cls", "text": gp.fields.Text("txt", missing=e),
                  "meta": gp.fields.Json("json", missing=e), "emb": gp.fields.Array("npy", missing=e)}  # fmt: skip
        batches = read_all(gp.WebDataset(path, fields=fields))
        text = [t for b in batches for t in b["text"]]
        meta = [m for b in batches for m in b["meta"]]
        assert (
            text[1] == "" and text[0] == "caption 0, ünï" and meta[2] is None and meta[3] == {"i": 3, "tags": ["t"] * 3}
        )
        assert [tuple(e.shape) for e in batches[1]["emb"]] == [(6,), (0,), (6,), (6,)]  # k005: empty

    @pytest.mark.parametrize(
        ("member", "match"),
        [
            ({"json": b'{"i": 1,'}, "is not JSON"),
            ({"txt": b"\xff\xfe"}, "is not UTF-8 text"),
            ({"npy": pickle.dumps([1, 2])}, "is not a .npy array"),
        ],
        ids=["json", "text", "npy"],
    )
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_a_bad_field_raises_naming_the_sample_or_is_skipped(self, tmp_path, member, match, backend):
        path = shard_with_fields(tmp_path, replace={6: member})
        with pytest.raises(gp.SampleError, match=f"{match}") as e:
            read_all(gp.WebDataset(path, fields=FIELDS), backend=backend)
        assert (e.value.key, e.value.shard, e.value.kind) == ("k006", path, gp.Damage.BAD_FIELD)
        batches = read_all(gp.WebDataset(path, fields=FIELDS), on_error="skip", backend=backend)
        valid = [k for b in batches for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
        assert "k006" not in valid and len(valid) == 9
        (batch,) = [b for b in batches if not bool(b.valid.all())]
        bad, good = batch.valid.tolist().index(False), batch.valid.tolist().index(True)
        assert batch["text"][bad] == batch["text"][good] and batch["meta"][bad] == batch["meta"][good]
        assert torch.equal(batch["emb"][bad], batch["emb"][good])  # the donor's, as its image and label

    def test_over_max_bytes_is_refused_before_it_is_read(self, tmp_path):
        path = shard_with_fields(tmp_path, replace={2: {"txt": b"x" * 100}})
        fields = {**FIELDS, "text": gp.fields.Text("txt", max_bytes=64)}
        with pytest.raises(gp.SampleError, match=r"'k002'.*is 100 bytes, over its max_bytes=64"):
            read_all(gp.WebDataset(path, fields=fields))


class TestFieldsConfig:
    def test_a_backend_that_does_not_read_fields_says_so_and_auto_passes_it_by(self, tmp_path, monkeypatch):
        from gpupipe import backends

        path = shard_with_fields(tmp_path, n=4)
        pipe = gp.Pipeline(gp.WebDataset(path, fields=FIELDS), [gp.transforms.CenterCrop(32)])
        assert pipe.fields == ("text", "meta", "emb")
        first = backends.get(next(iter(backends.TABLE)))
        monkeypatch.setattr(type(first), "reads_fields", False)  # as if the first backend did not read them
        if first.available():
            with pytest.raises(
                gp.UnsupportedTransformError, match=f"{first.name} backend does not read a source's fields="
            ):
                gp.Loader(pipe, 4, backend=first.name, device="cpu")
            chosen, why = backends.auto_choice("cpu", pipe.views, fields=pipe.fields)
            assert chosen.name != first.name and f"{first.name} does not read a source's fields= yet" in why

    def test_refused_declarations(self, tmp_path):
        path = shard_with_fields(tmp_path, n=2)
        assert not gp.WebDataset(path, fields={"label": "cls", "text": "txt"}).has_image  # fields alone
        with pytest.raises(gp.ConfigError, match="takes one image field"):
            gp.WebDataset(path, fields={"a": "jpg", "b": "png"})
        with pytest.raises(gp.ConfigError, match="not also as image= and label="):
            gp.WebDataset(path, image="png", fields={"image": "jpg"})
        with pytest.raises(gp.ConfigError, match="the class label"):
            gp.WebDataset(path, fields={"image": "jpg", "label": "txt"})
        with pytest.raises(gp.ConfigError, match="other fields than sources"):
            gp.Mix([gp.WebDataset(path, fields=FIELDS), gp.WebDataset(path)])
        source = gp.WebDataset(path, fields={"image": "jpg;png", "label": "cls", "text": "txt"})
        assert source.image == "jpg;png" and source.label == "cls" and list(source.extra_fields()) == ["text"]


class TestCheckKnowsFields:
    def test_a_bad_field_is_found_listed_and_left_out_by_loaders_of_those_fields(self, tmp_path):
        path = shard_with_fields(tmp_path, replace={6: {"json": b'{"i": 6,'}}, drop={2: "txt"})
        source = gp.WebDataset(path, fields=FIELDS)
        report = gp.check(source, workers=0)
        kinds = {f.key: f.kind for f in report.findings}
        assert kinds == {"k002": gp.Damage.MISSING_FIELD, "k006": gp.Damage.BAD_FIELD}, report.summary()
        assert report.written == (path + ".bad.json",)
        with open(report.written[0]) as f:
            assert json.load(f)["fields"] == "text=txt/error,meta=json/error,emb=npy/error"
        keys = [k for b in read_all(gp.WebDataset(path, fields=FIELDS), on_error="skip") for k in b.keys]
        assert sorted(keys) == [f"k{i:03d}" for i in range(10) if i not in (2, 6)]  # k006: the list; k002: the index
        plain = [k for b in read_all(gp.WebDataset(path)) for k in b.keys]  # the list is not for loaders without fields
        assert sorted(plain) == [f"k{i:03d}" for i in range(10)]
        assert gp.check(gp.WebDataset(path), workers=0, write=False).ok  # image and label alone: sound

    def test_the_command_line_indexes_and_checks_fields(self, tmp_path, capsys, monkeypatch):
        from gpupipe.cli._main import main

        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "cache"))
        path = shard_with_fields(tmp_path, replace={6: {"json": b"[1, "}})
        assert main(["index", path, "--workers", "0", "--image", "jpg", "--fields", "text=txt,meta=json,emb=npy"]) == 0
        index = gp.WebDataset(path, fields=FIELDS).index()
        assert index.shards[0].lazy and "10 samples in 1 shards" in capsys.readouterr().out  # from the cache
        assert main(["check", path, "--workers", "0", "--fields", "text=txt, meta=json ,emb=npy", "--no-write"]) == 1
        assert "k006" in capsys.readouterr().out
        assert main(["check", path, "--workers", "0", "--no-write"]) == 0  # without the fields: sound
        assert main(["check", path, "--fields", "text", "--no-write"]) != 0
        assert "NAME=EXTS pairs" in capsys.readouterr().err


class TestWithoutImages:
    """A source of fields alone (``.npy`` arrays, the project's seed): no image member, no
    transforms; ``images`` is ``None`` and the arrays come batched."""

    def arrays(self, tmp_path, n: int = 10, shape=(3, 5)) -> str:
        path = str(tmp_path / "arrays-000000.tar")
        with wds.TarWriter(path) as sink:
            for i in range(n):
                sink.write({"__key__": f"a{i:03d}", "npy": np.full(shape, i, np.float32), "cls": i % 4})
        return path

    @pytest.mark.parametrize("workers", [0, 2])
    def test_arrays_and_labels_batched(self, tmp_path, workers):
        path = self.arrays(tmp_path)
        source = gp.WebDataset(path, fields={"x": gp.fields.Array("npy", dtype="float32"), "label": "cls"})
        assert not source.has_image and source.extensions() == ((), "cls")
        pipe = gp.Pipeline(source)
        assert pipe.output_specs == () and not pipe.has_image
        with gp.Loader(pipe, 4, num_workers=workers, shuffle=True, seed=1) as loader:
            assert loader.backend == "torch"  # auto: the one backend that runs a source without images
            batches = list(loader)
        seen = []
        for batch in batches:
            images, labels = batch
            assert images is None and batch["x"].shape == (len(batch.keys), 3, 5) and "images=None" in repr(batch)
            for j, key in enumerate(batch.keys):
                i = int(key[1:])
                assert bool((batch["x"][j] == i).all()) and int(labels[j]) == i % 4
                seen.append(i)
        assert sorted(seen) == list(range(10))
        assert gp.check(source, workers=0, write=False).ok  # no image to decode
        cached = gp.WebDataset(path, fields={"x": "npy", "label": "cls"}).index()
        assert cached.shards[0].lazy and len(cached) == 10 and not cached.images  # its index from the cache

    def test_refused_where_it_cannot_run(self, tmp_path):
        path = self.arrays(tmp_path, n=4)
        source = gp.WebDataset(path, fields={"x": "npy"})
        with pytest.raises(gp.ConfigError, match="have no image"):
            gp.Pipeline(source, [gp.transforms.CenterCrop(2)])
        if importlib.util.find_spec("nvidia.dali") is not None:
            with pytest.raises(gp.UnsupportedTransformError, match="dali backend does not read a source without"):
                gp.Loader(gp.Pipeline(source), 2, backend="dali", device="cpu")


class TestMixOfFields:
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_sources_with_the_same_fields_mix(self, tmp_path, backend):
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        a, b = shard_with_fields(tmp_path / "a", n=6), shard_with_fields(tmp_path / "b", n=6)
        mix = gp.Mix([gp.WebDataset(a, fields=FIELDS), gp.WebDataset(b, fields=FIELDS)], counts=[6, 6])
        assert list(mix.extra_fields()) == ["text", "meta", "emb"] and mix.has_image
        seen = 0
        for batch in read_all(mix, backend=backend):
            for j, key in enumerate(batch.keys):
                i = int(key[1:])
                assert batch["text"][j] == f"caption {i}, ünï" and batch["meta"][j]["i"] == i
                assert torch.equal(batch["emb"][j], torch.arange(6, dtype=torch.float32) * i)
                seen += 1
        assert seen == 12


def test_every_tensor_of_the_fields_is_moved_as_the_images_are():
    """``map_tensors``: how the runners move a batch's fields to the loader's device (and how
    ``Batch.to`` moves them): tensors, lists of tensors and ``Padded`` alike; text and JSON kept."""
    from gpupipe.core._batch import map_tensors

    t, lengths = torch.zeros(2, 3), torch.ones(2, 1, dtype=torch.int64)
    text, meta = ["a", "b"], [{"i": 1}, {"i": 2}]
    moved = map_tensors(
        {"x": t, "boxes": gp.fields.Padded(t, lengths), "parts": [t, t], "text": text, "meta": meta, "none": None},
        lambda v: v + 1,
    )
    assert isinstance(moved["boxes"], gp.fields.Padded) and torch.equal(moved["boxes"].lengths, lengths + 1)
    assert all(torch.equal(v, t + 1) for v in (moved["x"], moved["boxes"].data, *moved["parts"]))
    assert moved["text"] is text and moved["meta"] is meta and moved["none"] is None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_fields_arrive_on_the_gpu_with_the_images(tmp_path, backend):
    """On a GPU, every tensor of a batch's fields is on the loader's device (arrays stacked,
    padded arrays and their lengths, lists of arrays, labels), text and JSON as they were."""
    path = str(tmp_path / "x-000000.tar")
    with wds.TarWriter(path) as sink:
        for i in range(4):
            sink.write({"__key__": f"k{i}", "jpg": _jpeg(i), "cls": i, "txt": f"c{i}",
                        "npy": np.ones((i + 1, 4), np.float32), "parts.npy": np.ones(i + 1, np.int16),
                        "emb.npy": np.full(3, i, np.float32)})  # fmt: skip
    fields = {"image": "jpg", "label": "cls", "text": "txt", "boxes": gp.fields.Array("npy", pad=-1),
              "parts": "parts.npy", "emb": "emb.npy"}  # fmt: skip
    pipe = gp.Pipeline(gp.WebDataset(path, fields=fields), [gp.transforms.CenterCrop(32)])
    with gp.Loader(pipe, 4, backend=backend, device="cuda", num_workers=1, shuffle=False) as loader:
        (batch,) = list(loader)
    images, labels = batch
    assert images.is_cuda and labels.is_cuda and batch["text"] == ["c0", "c1", "c2", "c3"]
    assert batch["boxes"].data.is_cuda and batch["boxes"].lengths.is_cuda
    assert batch["boxes"].lengths[:, 0].tolist() == [1, 2, 3, 4]
    assert all(p.is_cuda for p in batch["parts"]) and batch["emb"].is_cuda
    assert batch["emb"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


class TestShardWriterWritesFields:
    """``gp.ShardWriter`` encodes arrays and JSON as webdataset's writer does: its shards read the
    same through webdataset's decoders and through ``fields=``."""

    def test_as_webdataset_decodes_them(self, tmp_path):
        array = np.arange(12, dtype=np.int16).reshape(3, 4)
        sample: dict[str, Any] = {"npy": array, "json": {"caption": "ünï", "n": [1, 2]}, "txt": "a cat", "cls": 2,
                                  "emb.npy": np.ones(5, np.float32)}  # fmt: skip
        with gp.ShardWriter(str(tmp_path / "w-%06d.tar")) as w:
            w.write("k0", sample)
        with tarfile.open(w.shards[0]) as tar:
            members = {m.name.partition(".")[2]: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
        assert np.array_equal(reference("npy", members["npy"]), array)
        assert reference("json", members["json"]) == sample["json"] and reference("txt", members["txt"]) == "a cat"
        fields = {"x": "npy", "meta": "json", "text": "txt", "label": "cls", "emb": "emb.npy"}
        with gp.Loader(gp.Pipeline(gp.WebDataset(w.shards[0], fields=fields)), 1, num_workers=0) as loader:
            (batch,) = list(loader)
        assert batch["x"].dtype == torch.int16 and batch["x"][0].tolist() == array.tolist()
        assert batch["meta"] == [sample["json"]] and batch["text"] == ["a cat"]
        assert batch.labels is not None and batch.labels.tolist() == [2]

    def test_refused(self, tmp_path):
        with gp.ShardWriter(str(tmp_path / "w-%06d.tar")) as w:
            with pytest.raises(gp.ConfigError, match=r"Python objects, which \.npy stores pickled"):
                w.write("k0", {"npy": np.array([{"a": 1}], dtype=object)})
            with pytest.raises(gp.ConfigError, match="a NumPy array under an extension ending in npy"):
                w.write("k1", {"jpg": np.zeros((2, 2), np.uint8)})
            with pytest.raises(gp.ConfigError, match="a dict or list under one ending in json"):
                w.write("k2", {"txt": {"a": 1}})
