"""Fields beyond the image and its class (issue 39, step 1): their definitions and safe decoders
(``gpupipe/core/_fields.py``), checked against webdataset's own decoders on the members its own
writer wrote, and on bad members: each refused with one verdict naming the shard and the key."""

from __future__ import annotations

import io
import json
import pickle
import tarfile

import numpy as np
import pytest

import gpupipe as gp
from gpupipe.core import _fields as F

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
