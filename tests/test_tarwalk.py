"""The fast walk over tar headers (``gpupipe.shards._tarwalk``) against :mod:`tarfile`'s reading:
the walk takes the well-formed tars that real writers make, refuses what it does not read, and
the index scan gives every shard — well-formed, written oddly, or damaged at random — the same
index and the same problems whichever reads it."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpupipe.shards import _tar
from gpupipe.shards._tar import scan_tar
from gpupipe.shards._tarwalk import Unusual, walk
from gpupipe.storage import LocalStorage


def tar_bytes(members: list[tuple[str, bytes]], *, fmt: int = tarfile.USTAR_FORMAT, mtime: float = 0,
              extra: list[tarfile.TarInfo] | None = None) -> bytes:  # fmt: skip
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for info in extra or []:
            tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def samples(n: int = 6, prefix: str = "") -> list[tuple[str, bytes]]:
    found = []
    for i in range(n):
        image = bytes([i % 256]) * (100 + 37 * (i % 50))
        found += [(f"{prefix}{i:04d}.jpg", image), (f"{prefix}{i:04d}.cls", str(i).encode())]
    return found


def scanned(path: str, *, fast: bool, size: int | None = None) -> tuple:
    """``scan_tar``'s index of ``path`` as comparable values, read by the walk where it takes the
    shard (``fast``) or by tarfile."""
    real = _tar.walk

    def refused(*args, **kwargs):
        raise Unusual("tarfile, for the comparison")

    _tar.walk = real if fast else refused
    try:
        index, exts = scan_tar(LocalStorage(), path, ("jpg", "png"), "cls", size=size)
    finally:
        _tar.walk = real
    keys, found = index.detail()
    columns = {k: np.asarray(v).tolist() for k, v in sorted(found.items())}
    return list(keys), columns, [(p.kind, p.key, p.detail) for p in index.problems], exts


def same_either_way(path: str, size: int | None = None) -> tuple:
    fast = scanned(path, fast=True, size=size)
    assert fast == scanned(path, fast=False, size=size)
    return fast


def walked(data: bytes) -> list:
    return walk(io.BytesIO(data), len(data), small=32)


class TestWellFormedTars:
    """What writers make is walked, not left to tarfile."""

    @pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
    def test_each_format(self, tmp_path, fmt):
        data = tar_bytes(samples(), fmt=fmt)
        got = walked(data)
        assert [m[0] for m in got] == [name for name, _ in samples()]
        assert all(m[3] == str(i // 2).encode() for i, m in enumerate(got) if m[0].endswith(".cls"))
        path = tmp_path / "a.tar"
        path.write_bytes(data)
        keys, columns, problems, _ = same_either_way(str(path))
        assert keys == [f"{i:04d}" for i in range(6)] and columns["label"] == list(range(6)) and not problems

    def test_pax_headers_for_fractional_times_and_long_names(self, tmp_path):
        """Python's writer (webdataset's TarWriter) adds a pax header per member for a float
        ``mtime``, and one with the path for a name over 100 characters."""
        long = "d" * 60 + "/" + "k" * 70 + "/"
        data = tar_bytes(samples(4, prefix=long), fmt=tarfile.PAX_FORMAT, mtime=1764340000.25)
        assert data.count(b"mtime=") == 8 and data.count(b" path=") == 8
        assert [m[0] for m in walked(data)] == [name for name, _ in samples(4, prefix=long)]
        path = tmp_path / "a.tar"
        path.write_bytes(data)
        assert same_either_way(str(path))[0] == [f"{long}{i:04d}" for i in range(4)]

    def test_ustar_prefixes_directories_and_links(self, tmp_path):
        folder = tarfile.TarInfo("sub")
        folder.type = tarfile.DIRTYPE
        link = tarfile.TarInfo("sub/link")
        link.type, link.linkname = tarfile.SYMTYPE, "0000.jpg"
        long = "p" * 120 + "/"  # over 100: USTAR splits it into prefix and name
        data = tar_bytes(samples(3, prefix=long), extra=[folder, link])
        assert [m[0] for m in walked(data)] == [name for name, _ in samples(3, prefix=long)]
        path = tmp_path / "a.tar"
        path.write_bytes(data)
        same_either_way(str(path))

    def test_webdatasets_writer(self, tmp_path):
        wds = pytest.importorskip("webdataset")
        path = str(tmp_path / "w.tar")
        with wds.TarWriter(path) as sink:
            for i in range(5):
                sink.write({"__key__": f"s{i}", "jpg": b"\xff\xd8" + bytes(50 * i), "cls": str(i)})
        with open(path, "rb") as f:
            assert len(walk(f)) == 10
        assert same_either_way(path)[1]["label"] == list(range(5))

    def test_a_well_formed_shard_never_reaches_tarfile(self, tmp_path, monkeypatch):
        """The scan of what writers make is the walk's alone (its speed: bench/startup.py)."""
        path = tmp_path / "big.tar"
        path.write_bytes(tar_bytes(samples(400), fmt=tarfile.PAX_FORMAT, mtime=3.5))

        def refused(*args, **kwargs):
            raise AssertionError("read by tarfile")

        monkeypatch.setattr(_tar, "_read_tarfile", refused)
        keys, columns, problems, _ = scanned(str(path), fast=True)
        assert len(keys) == 400 and columns["label"] == list(range(400)) and not problems


class TestWhatTheWalkLeavesToTarfile:
    @pytest.mark.parametrize("damage", ["checksum", "size", "mode", "cut-header", "cut-member", "no-end", "garbage",
                                        "base-256"])  # fmt: skip
    def test_damage(self, damage):
        data = bytearray(tar_bytes(samples(3)))
        second = 512 + 512  # the .cls header after the first .jpg (100 bytes: one block)
        if damage == "checksum":
            data[second + 150] = ord("7") if data[second + 150] != ord("7") else ord("6")
        elif damage == "size":
            data[second + 124 : second + 136] = b"0000000000x\0"
        elif damage == "mode":
            data[second + 100 : second + 108] = b"00 0644\0"  # a space between digits: tarfile refuses it
        elif damage == "base-256":
            data[second + 108 : second + 116] = b"\x80" + bytes(6) + b"\x01"
        elif damage == "cut-header":
            del data[second + 300 :]
        elif damage == "cut-member":
            del data[second - 50 :]
        elif damage == "no-end":  # cut where the last member's data ends: no zero block
            with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
                last = tar.getmembers()[-1]
            del data[last.offset_data + 512 :]
        else:
            data[second : second + 512] = b"\x07" * 512
        with pytest.raises(Unusual):
            walked(bytes(data))

    def test_gnu_long_names_and_global_pax_headers(self):
        long = "n" * 150 + "/"
        with pytest.raises(Unusual):
            walked(tar_bytes(samples(1, prefix=long), fmt=tarfile.GNU_FORMAT))
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "x"}) as tar:
            info = tarfile.TarInfo("a.jpg")
            tar.addfile(info, io.BytesIO(b""))
        with pytest.raises(Unusual):
            walked(out.getvalue())

    def test_a_stat_size_under_the_file_is_left_to_tarfile(self, tmp_path):
        data = tar_bytes(samples(3))
        with pytest.raises(Unusual):
            walk(io.BytesIO(data), 1000)
        path = tmp_path / "a.tar"
        path.write_bytes(data)
        problems = same_either_way(str(path), size=1000)[2]
        assert problems and "truncated" in problems[0][2]


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    """A well-formed tar (USTAR, GNU or pax with fractional times), with a few bytes changed,
    bytes cut from its end or a block dropped."""
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    data = bytearray(tar_bytes(samples(draw(st.integers(1, 3))), fmt=fmt, mtime=draw(st.sampled_from([0, 7.5]))))
    while data.endswith(bytes(1024)) and len(data) > 4096:  # (tarfile pads to 10 KiB: keep two zero blocks)
        del data[-512:]
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.sampled_from([0, 32, ord("0"), ord("7"), ord("9"), ord("/"), ord("."), 0x80, 0xFF,
                                         draw(st.integers(0, 255))]))  # fmt: skip
    action = draw(st.sampled_from(["none", "cut", "drop"]))
    if action == "cut":
        del data[draw(st.integers(0, len(data))) :]
    elif action == "drop" and len(data) > 1024:
        block = draw(st.integers(0, len(data) // 512 - 1))
        del data[block * 512 : block * 512 + 512]
    return bytes(data)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=damaged())
def test_every_shard_gets_the_same_index_either_way(tmp_path_factory, data):
    path = os.path.join(tmp_path_factory.mktemp("fuzz"), "a.tar")
    with open(path, "wb") as f:
        f.write(data)
    same_either_way(path, size=len(data))
    same_either_way(path)
    try:
        walked(data)
        event("the walk read it")
    except Unusual:
        event("left to tarfile")
