"""The fuzzer's inputs (issue 51): hypothesis strategies for one hostile shard, built member by
member so that any part may lie — tar headers (sizes, types, names, pax and GNU records, formats,
the end blocks, flipped bytes with or without a mended checksum, gzip), image headers (JPEG frame
and segment lengths, markers, PNG chunk lengths, dimensions, text chunks that inflate far) and
fields (numbers, nesting, encodings, ``.npy`` headers, a pickle) — and huge members as holes of a
sparse file. :func:`write_case` writes one to disk.

:func:`folders` draws hostile ImageFolder trees the same way (:class:`Folder`): the images of a
shard's members as files under odd names (not UTF-8, a newline, no extension, upper case), huge
sparse files, and what a tree may hold that a tar cannot: FIFOs, links to devices, dangling links,
links that loop back to a folder that holds them, empty class folders, folders named like images.
:func:`write_folder` writes one."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import io
import os
import struct
import tarfile
import zlib
from typing import Any

import numpy as np
from hypothesis import strategies as st

from .data import png16, tiff16
from .hostile import END, good_jpeg

__all__ = ["Case", "Folder", "cases", "folders", "write_case", "write_folder", "CANARY"]

CANARY = "GPUPIPE_FUZZ_CANARY"  # the environment variable naming the file a pickle payload would create
HOLES = (1 << 30, 1 << 31, (1 << 32) + 512)  # members of this many zero bytes that take no disk
Piece = bytes | tuple[str, int]  # bytes as they are, or (name, size): a member that is a hole


class _Canary:
    """An object whose unpickling creates the canary file: a ``.npy`` object array holding it
    must never be unpickled."""

    def __reduce__(self) -> Any:
        return (open, (os.environ.get(CANARY, os.devnull), "w"))


@functools.lru_cache(maxsize=1)
def _images() -> dict[str, bytes]:
    from PIL import Image

    from gpupipe.testing import synthetic_image

    photo = Image.fromarray(synthetic_image(3, size=(40, 56)))
    wide = np.random.default_rng(3).integers(0, 65536, (40, 56, 4)).astype(np.uint16)

    def save(fmt: str, image: Any = photo, **options: Any) -> bytes:
        out = io.BytesIO()
        image.save(out, fmt, **options)
        return out.getvalue()

    return {
        "jpg": good_jpeg(1),
        "jpg-progressive": save("JPEG", quality=80, progressive=True),
        "jpg-gray": save("JPEG", photo.convert("L"), quality=80),
        "png": save("PNG"),
        "png-palette": save("PNG", photo.convert("P")),
        "webp": save("WEBP", quality=80),
        "bmp": save("BMP"),
        "gif": save("GIF"),
        # 16-bit colour, read through Pillow's raw modes (runtime/_decode.py: _wide), and a PPM whose
        # maxval DALI's decoder does not scale (given to gpupipe's decoder on DALI)
        "png-16-bit": png16(wide[..., :3]),
        "png-16-bit-gray-alpha": png16(wide[..., :2], interlaced=True),
        "tiff-16-bit": tiff16(wide[..., :3], deflate=True),
        "ppm-maxval-100": b"P6\n56 40\n100\n" + (wide[..., :3] % 101).astype(np.uint8).tobytes(),
    }


@functools.lru_cache(maxsize=8)
def _deflated_zeros(n: int) -> bytes:
    return zlib.compress(b"\0" * n, 9)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def _segments(data: bytes | bytearray) -> list[int]:
    """Offsets of a JPEG's marker segments with a length (before its scan)."""
    out, i = [], 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker in (0xD9, 0xDA):
            break
        out.append(i)
        i += 2 + struct.unpack_from(">H", data, i + 2)[0]
    return out


@st.composite
def jpeg(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from([_images()[k] for k in ("jpg", "jpg-progressive", "jpg-gray")])))
    for _ in range(draw(st.integers(0, 3))):
        segments = _segments(data)
        sof = next((i for i in segments if data[i + 1] in (0xC0, 0xC1, 0xC2)), None)
        op = draw(st.sampled_from(["size", "precision", "marker", "length", "junk", "cut", "delete", "flip"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "size" and sof is not None:
            data[sof + 5 : sof + 9] = struct.pack(">HH", draw(st.integers(0, 65535)), draw(st.integers(0, 65535)))
        elif op == "precision" and sof is not None:
            data[sof + 4] = draw(st.sampled_from([0, 1, 8, 12, 16, 255]))
        elif op == "marker" and sof is not None:
            data[sof + 1] = draw(st.sampled_from(list(range(0xC0, 0xD0))))
        elif op == "length" and segments:
            i = draw(st.sampled_from(segments))
            data[i + 2 : i + 4] = struct.pack(">H", draw(st.integers(0, 65535)))
        elif op == "junk":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "cut":
            del data[at:]
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 64))]
        elif op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(data)


@st.composite
def png(draw: st.DrawFn) -> bytes:
    seeds = ("png", "png-palette", "png-16-bit", "png-16-bit-gray-alpha")
    data = bytearray(draw(st.sampled_from([_images()[k] for k in seeds])))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["size", "depth", "length", "kind", "text", "chunk", "cut", "flip", "no-iend"]))
        at = draw(st.integers(8, max(8, len(data) - 1)))
        if op == "size":
            data[16:24] = struct.pack(">II", draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2**32 - 1)))
        elif op == "depth":
            data[24:26] = bytes([draw(st.sampled_from([0, 1, 8, 16, 3, 255])), draw(st.integers(0, 7))])
        elif op == "length":
            data[8:12] = struct.pack(">I", draw(st.integers(0, 2**32 - 1)))
        elif op == "kind":
            data[12:16] = draw(st.binary(min_size=4, max_size=4))
        elif op == "text":  # a compressed chunk that inflates far, before or after the image data
            kind = draw(st.sampled_from([b"zTXt", b"iTXt", b"iCCP"]))
            head = {b"zTXt": b"k\0\0", b"iTXt": b"k\0\1\0\0\0", b"iCCP": b"icc\0\0"}[kind]
            chunk = _chunk(kind, head + _deflated_zeros(draw(st.sampled_from([1 << 10, 2 << 20, 64 << 20]))))
            where = 33 if draw(st.booleans()) else len(data) - 12
            data[where:where] = chunk
        elif op == "chunk":
            data[33:33] = _chunk(draw(st.binary(min_size=4, max_size=4)), draw(st.binary(max_size=64)))
        elif op == "cut":
            del data[at:]
        elif op == "flip" and at < len(data):  # (an earlier cut may have left 8 bytes or fewer)
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "no-iend" and len(data) > 20:
            del data[-12:]
    return bytes(data)


def _other_image(draw: st.DrawFn) -> bytes:
    seeds = ("webp", "bmp", "gif", "tiff-16-bit", "ppm-maxval-100")
    data = bytearray(draw(st.sampled_from([_images()[k] for k in seeds])))
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(data)


def _label(draw: st.DrawFn) -> bytes:
    return draw(st.one_of(
        st.integers(-(2**63), 2**63 - 1).map(lambda n: str(n).encode()),
        st.sampled_from([b" 7\n", b"9223372036854775808", b"-9223372036854775808", b"1" * 5000, b"", b"\xff7"]),
        st.binary(max_size=80),
    ))  # fmt: skip


_JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _json(draw: st.DrawFn) -> bytes:
    import json

    return draw(st.one_of(
        _JSON.map(lambda v: json.dumps(v).encode()),
        st.integers(4000, 6000).map(lambda n: b'{"n": ' + b"7" * n + b"}"),
        st.integers(10, 100_000).map(lambda n: b"[" * n + b"]" * n),
        st.sampled_from([b"NaN", b"[Infinity, -Infinity]", b"1e999999", b"\xff{}", b'{"a": 1', b""]),
        st.binary(max_size=64),
    ))  # fmt: skip


def _npy(draw: st.DrawFn) -> bytes:
    out = io.BytesIO()
    if draw(st.integers(0, 9)) == 0:  # an object array: a pickle, never to be unpickled
        np.save(out, np.array([_Canary()], dtype=object), allow_pickle=True)
        return out.getvalue()
    dtype = draw(st.sampled_from(["<f4", "<i8", "|u1", ">f8", "<c8"]))
    np.save(out, np.zeros(draw(st.lists(st.integers(0, 5), max_size=3)), dtype=dtype))
    data = bytearray(out.getvalue())
    if draw(st.booleans()):  # a lying header: its text edited in place
        header = bytes(data[10 : 10 + struct.unpack_from("<H", data, 8)[0]])
        edit = draw(st.sampled_from([(b"'shape': (", b"'shape': (99999999999, "), (b"<f4", b"O"), (b"False", b"True"),
                                     (b"'descr'", b"'dxxcr'"), (b"{", b"[")]))  # fmt: skip
        header = header.replace(*edit, 1)
        data[10:] = header + data[10 + struct.unpack_from("<H", data, 8)[0] :]
        data[8:10] = struct.pack("<H", len(header))
    if draw(st.booleans()) and data:
        del data[draw(st.integers(0, len(data) - 1)) :]
    return bytes(data)


def _payload(draw: st.DrawFn, ext: str) -> Piece:
    if ext in ("jpg", "png", "cls") and draw(st.integers(0, 11)) == 0:
        return ("hole", draw(st.sampled_from(HOLES)))
    if ext == "jpg":
        return draw(jpeg())
    if ext == "png":
        return draw(png())
    if ext == "cls":
        return _label(draw)
    if ext == "json":
        return _json(draw)
    if ext == "txt":
        return draw(st.binary(max_size=64) | st.text(max_size=32).map(str.encode))
    if ext == "npy":
        return _npy(draw)
    if ext in ("webp", "bmp"):
        return _other_image(draw)
    return draw(st.binary(max_size=256))


_TYPES = [tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE,
          tarfile.FIFOTYPE, tarfile.CONTTYPE, tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
          tarfile.GNUTYPE_LONGLINK, tarfile.GNUTYPE_SPARSE, b"Z"]  # fmt: skip
_SIZES = [0, 1, 511, 512, 1 << 20, (1 << 20) + 1, 1 << 31, (1 << 33) + 1, 1 << 62]
_KEYS = st.one_of(
    st.sampled_from(["k0", "k1", "d/k2", "./k3", "../../k4", "/abs/k5", "k" * 300, "ké", "k\x00x", "a.b", ""]),
    st.text(max_size=40),
)


def _header(name: str, size: int, kind: bytes, fmt: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mtime, info.mode = size, kind, 0, 0o644
    for form in (fmt, tarfile.GNU_FORMAT):
        try:
            return info.tobuf(format=form, encoding="utf-8", errors="surrogateescape")  # type: ignore[arg-type]
        except (ValueError, UnicodeError):
            continue
    info.name = "unnamed"
    return info.tobuf(format=tarfile.GNU_FORMAT)


@dataclasses.dataclass
class Case:
    """One generated shard: its pieces (headers and data as bytes, holes as ``(name, size)``),
    whether it is gzipped, and what the loaders read (fields or not)."""

    pieces: list[Piece]
    gzipped: bool
    fields: bool

    def __repr__(self) -> str:  # what hypothesis prints of a failing case: each piece's size and start
        shown = [f"<{len(p)} bytes {p[:64]!r}>" if isinstance(p, bytes) else f"<hole {p[0]!r} {p[1]}>"
                 for p in self.pieces]  # fmt: skip
        return f"Case(gzipped={self.gzipped}, fields={self.fields}, pieces=[{', '.join(shown)}])"


@st.composite
def cases(draw: st.DrawFn) -> Case:
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    pieces: list[Piece] = []
    for _ in range(draw(st.integers(0, 5))):
        key = draw(_KEYS)
        default = ["jpg", "cls"] if draw(st.integers(0, 3)) else draw(st.sampled_from([["png", "cls"], ["jpg"]]))
        exts = default + draw(st.lists(st.sampled_from(["json", "txt", "npy", "webp", "bmp", "cls", "jpg", "bin"]),
                                       max_size=3))  # fmt: skip
        for ext in exts:
            data = _payload(draw, ext)
            name = f"{key}.{ext}" if draw(st.integers(0, 15)) else draw(_KEYS)
            if isinstance(data, tuple):
                pieces.append((name, data[1]))
                continue
            kind = tarfile.REGTYPE if draw(st.integers(0, 7)) else draw(st.sampled_from(_TYPES))
            claim = len(data) if draw(st.integers(0, 7)) else draw(st.sampled_from(_SIZES))
            header = bytearray(_header(name, claim, kind, fmt))
            _flip(draw, header)
            pieces.append(bytes(header) + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE))
    if draw(st.integers(0, 3)) == 0:  # a pax or GNU record of its own, lying or not
        kind = draw(st.sampled_from([tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME]))
        body = draw(st.binary(max_size=100) | st.sampled_from([b"30 size=99999999999999999999\n", b"9 path=\n",
                                                              b"99999 x=y\n", b"12 hdrcharset=BINARY\n"]))  # fmt: skip
        claim = len(body) if draw(st.booleans()) else draw(st.sampled_from(_SIZES))
        at = draw(st.integers(0, len(pieces)))
        pieces.insert(at, _header("././@PaxHeader", claim, kind, fmt) + body + b"\0" * (-len(body) % 512))
    if draw(st.integers(0, 3)):
        pieces.append(END)
    elif pieces and isinstance(pieces[-1], bytes):
        pieces[-1] = pieces[-1][: draw(st.integers(0, len(pieces[-1])))]
    gzipped = draw(st.integers(0, 5)) == 0 and all(isinstance(p, bytes) for p in pieces)
    if gzipped and draw(st.booleans()):  # a thousandfold inflation
        pieces.insert(0, _header("z.bin", 32 << 20, tarfile.REGTYPE, fmt) + b"\0" * (32 << 20))
    return Case(pieces, gzipped, fields=draw(st.booleans()))


def _flip(draw: st.DrawFn, header: bytearray) -> None:
    """Flips bytes of a member's header, now and then, and mends its checksum or not."""
    if draw(st.integers(0, 5)):
        return
    for _ in range(draw(st.integers(1, 4))):
        header[draw(st.integers(0, len(header) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()) and len(header) >= 512:
        block = header[-512:]
        block[148:156] = b" " * 8
        header[-512 + 148 : -512 + 156] = b"%06o\0 " % sum(block)


def write_case(case: Case, path: str) -> str:
    """Writes ``case`` at ``path`` (``.tgz`` appended where gzipped); returns the shard's path."""
    if case.gzipped:
        path += ".tgz"
        with open(path, "wb") as f:
            f.write(gzip.compress(b"".join(p for p in case.pieces if isinstance(p, bytes)), 6))
        return path
    path += ".tar"
    with open(path, "wb") as f:
        for piece in case.pieces:
            if isinstance(piece, bytes):
                f.write(piece)
            else:
                name, size = piece
                f.write(_header(name, size, tarfile.REGTYPE, tarfile.GNU_FORMAT))
                f.seek(size + (-size % tarfile.BLOCKSIZE), io.SEEK_CUR)
        f.truncate()
    return path


# What a tree's entry may be besides a file of bytes: made by write_folder
_SPECIAL = ["fifo", "dev-zero", "dangling", "loop", "alias", "dir", "empty-class"]
_NAMES = st.one_of(
    st.sampled_from(["a.jpg", "B.JPG", "c.jpeg", "d.png", "e.webp", "f.bmp", "g", "h.txt", ".hidden.jpg", "x\ny.jpg",
                     "sp ace.jpg", "k" * 200 + ".jpg"]),
    st.binary(min_size=1, max_size=12).map(lambda b: os.fsdecode(b.replace(b"/", b"_").replace(b"\0", b"_")) + ".jpg"),
)  # fmt: skip


@dataclasses.dataclass
class Folder:
    """One generated ImageFolder tree: ``entries`` of ``(class, name, what)``, ``what`` a file's
    bytes, a hole ``("hole", size)`` or one of :data:`_SPECIAL` (a FIFO, a link, ...)."""

    entries: list[tuple[str, str, Piece | str]]

    def __repr__(self) -> str:
        shown = [f"{c}/{n!r}: " + (f"<{len(w)} bytes {w[:32]!r}>" if isinstance(w, bytes) else repr(w))
                 for c, n, w in self.entries]  # fmt: skip
        return f"Folder([{', '.join(shown)}])"


@st.composite
def folders(draw: st.DrawFn) -> Folder:
    entries: list[tuple[str, str, Piece | str]] = []
    for _ in range(draw(st.integers(0, 6))):
        cls = draw(st.sampled_from(["c0", "c1", "c1/sub", "Ünï", "c\udcff"]))
        name = draw(_NAMES)
        if draw(st.integers(0, 4)) == 0:
            entries.append((cls, name, draw(st.sampled_from(_SPECIAL))))
            continue
        ext = draw(st.sampled_from(["jpg", "jpg", "png", "webp", "bmp", "bin"]))
        entries.append((cls, name, _payload(draw, ext)))
    return Folder(entries)


def write_folder(folder: Folder, root: str) -> str:
    """Writes ``folder`` under ``root`` (made here); returns ``root``. A name the file system
    refuses (too long) is left out: no tree can hold it."""
    os.makedirs(root)
    for cls, name, what in folder.entries:
        where = os.path.join(root, cls)
        os.makedirs(where, exist_ok=True)
        path = os.path.join(where, name)
        if os.path.lexists(path):
            continue
        try:
            if isinstance(what, bytes):
                with open(path, "wb") as f:
                    f.write(what)
            elif isinstance(what, tuple):  # a hole: a sparse file of that many zero bytes
                with open(path, "wb") as f:
                    f.truncate(what[1])
            elif what == "fifo":
                os.mkfifo(path)
            elif what == "dev-zero":
                os.symlink("/dev/zero", path)
            elif what == "dangling":
                os.symlink(os.path.join(root, "nowhere", "x.jpg"), path)
            elif what == "loop":
                os.symlink("..", path)
            elif what == "alias":  # another class folder, listed again under this one
                os.symlink(os.path.join(root, "c0"), path)
            elif what == "dir":
                os.makedirs(path)
            elif what == "empty-class":
                os.makedirs(os.path.join(root, f"{cls.split('/')[0]}-empty"), exist_ok=True)
        except OSError as e:
            if e.errno != 36:  # ENAMETOOLONG
                raise
    return root
