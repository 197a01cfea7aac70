"""A corpus of odd image files, generated (no third-party files, so no licences to track): the
cases real datasets and decoder test suites hold — other formats named ``.jpg``, animations,
decompression bombs, damaged bitstreams that crash decoders, JPEG kinds no backend decodes — each
with the verdict gpupipe's file-acceptance rules give it (``gpupipe/runtime/_decode.py``): ``None`` for a
good file, else the :class:`~gpupipe.Damage` value of its refusal. Every backend, at every batch
size, must reach the same verdicts, and ``gpupipe check`` must list exactly the bad ones.

``python -m tests.support.corpus DIR`` writes the files to look at them.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from gpupipe.testing import encode_jpeg, synthetic_image

from .data import png16, tiff16

SIZE = (48, 64)  # (height, width) of the good files


def _photo(seed: int = 1, size: tuple[int, int] = SIZE) -> Image.Image:
    return Image.fromarray(synthetic_image(seed, size=size))


def _save(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _animation(fmt: str) -> bytes:
    out = io.BytesIO()
    _photo(1).save(out, fmt, save_all=True, append_images=[_photo(2)], duration=100, loop=0)
    return out.getvalue()


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, i = [], 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i : i + 4])
        chunks.append((data[i + 4 : i + 8], data[i + 8 : i + 8 + n]))
        i += 12 + n
    return chunks


def _png(chunks: list[tuple[bytes, bytes]]) -> bytes:
    out = b"\x89PNG\r\n\x1a\n"
    for kind, body in chunks:
        out += struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    return out


def _damaged_pngs() -> dict[str, bytes]:
    """PNGs whose image data is damaged three ways (valid CRCs: only the bitstream is wrong) —
    torchvision 0.29's PNG decoder kills the process (SIGSEGV) on each."""
    rng = np.random.default_rng(0)
    good = _save(Image.fromarray(rng.integers(0, 255, (*SIZE, 3), dtype=np.uint8)), "PNG")
    chunks = _png_chunks(good)
    header, idat = chunks[0], b"".join(body for kind, body in chunks if kind == b"IDAT")
    rows = bytearray(zlib.decompress(idat))
    stride = SIZE[1] * 3 + 1
    for r in range(SIZE[0]):
        rows[r * stride] = 9  # no such filter type ("bad adaptive filter value")
    scrambled = bytearray(idat)
    for _ in range(50):
        scrambled[int(rng.integers(10, len(scrambled)))] = int(rng.integers(0, 256))
    end = (b"IEND", b"")
    return {
        "png-bad-filter": _png([header, (b"IDAT", zlib.compress(bytes(rows))), end]),
        "png-short-data": _png([header, (b"IDAT", idat[: len(idat) // 3]), end]),
        "png-scrambled-data": _png([header, (b"IDAT", bytes(scrambled)), end]),
    }


def png_text_bomb(where: str = "before", kind: bytes = b"zTXt", inflated: int = 200 << 20) -> bytes:
    """A 64x48 PNG with a compressed chunk (``zTXt``, ``iTXt`` or ``iCCP``) that inflates to
    ``inflated`` bytes, ``"before"`` or ``"after"`` its image data: Pillow refuses it past 1 MB
    (``MAX_TEXT_CHUNK``), DALI's decoder skips the chunk."""
    chunks = _png_chunks(_save(_photo(5, size=(48, 64)), "PNG"))
    packed = zlib.compress(b"\0" * inflated, 9)
    body = {b"zTXt": b"Comment\0\0", b"iTXt": b"Comment\0\1\0\0\0", b"iCCP": b"icc\0\0"}[kind] + packed
    at = 1 if where == "before" else len(chunks) - 1
    return _png([*chunks[:at], (kind, body), *chunks[at:]])


def _patched_sof(
    *, marker: int | None = None, precision: int | None = None, size: tuple[int, int] | None = None
) -> bytes:
    """A real baseline JPEG whose frame header is changed: its kind (SOF marker), sample precision
    or declared size."""
    data = bytearray(encode_jpeg(synthetic_image(3, size=SIZE), quality=90))
    sof = data.index(b"\xff\xc0")
    if marker is not None:
        data[sof + 1] = marker
    if precision is not None:
        data[sof + 4] = precision
    if size is not None:
        data[sof + 5 : sof + 9] = size[0].to_bytes(2, "big") + size[1].to_bytes(2, "big")
    return bytes(data)


def _called_baseline(data: bytes) -> bytes:
    sof = data.index(b"\xff\xc2")
    return data[:sof] + b"\xff\xc0" + data[sof + 2 :]


def stray_marker(data: bytes, marker: int = 0x63) -> bytes:
    """``data`` (a JPEG) with ``FF marker`` put in the middle of its scan data: a marker
    libjpeg-turbo refuses ("Unsupported marker type"), where nvImageCodec decodes on."""
    sos = data.index(b"\xff\xda")
    at = sos + (len(data) - sos) // 2
    return data[:at] + bytes([0xFF, marker]) + data[at:]


def _junk_before_sof(data: bytes) -> bytes:
    """One junk byte before the frame header: libjpeg skips it (a warning) and decodes on."""
    sof = data.index(b"\xff\xc0")
    return data[:sof] + b"\x00" + data[sof:]


def _without_sof(data: bytes) -> bytes:
    """A JPEG whose frame header segment is gone."""
    sof = data.index(b"\xff\xc0")
    length = int.from_bytes(data[sof + 2 : sof + 4], "big")
    return data[:sof] + data[sof + 2 + length :]


def _junk_before(data: bytes, marker: int, junk: bytes = b"\x00") -> bytes:
    """``junk`` before the first segment of ``marker``: libjpeg skips it (a warning) and decodes
    on; nvImageCodec refuses the file."""
    at = data.index(bytes((0xFF, marker)))
    return data[:at] + junk + data[at:]


def _short_app14(data: bytes) -> bytes:
    """An Adobe APP14 segment whose length is one byte short, so its last byte is junk before the
    next marker (photo tools write such files)."""
    body = b"Adobe\x00\x64\x00\x00\x00\x00\x01"
    return data[:2] + b"\xff\xee" + struct.pack(">H", len(body) + 1) + body + data[2:]


def _pnm(seed: int, maxval: int, channels: int) -> bytes:
    """A binary PGM (``channels=1``) or PPM of random values up to ``maxval`` (16 bits above 255)."""
    values = np.random.default_rng(seed).integers(0, maxval + 1, (*SIZE, channels))
    magic = b"P5" if channels == 1 else b"P6"
    header = b"%s\n# gpupipe's corpus\n%d %d\n%d\n" % (magic, SIZE[1], SIZE[0], maxval)
    return header + values.astype(">u2" if maxval > 255 else np.uint8).tobytes()


def _wide(seed: int, channels: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 65536, (*SIZE, channels)).astype(np.uint16)


def _bmp16(image: Image.Image) -> bytes:
    """A 16-bit (5-5-5) uncompressed BMP: Pillow reads it, DALI's BMP decoder does not."""
    a = np.asarray(image.convert("RGB")).astype(np.uint16)
    h, w, _ = a.shape
    pixels = ((a[..., 0] >> 3) << 10) | ((a[..., 1] >> 3) << 5) | (a[..., 2] >> 3)
    pad = b"\0" * (-(w * 2) % 4)
    data = b"".join(pixels[y].astype("<u2").tobytes() + pad for y in range(h - 1, -1, -1))
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 16, 0, len(data), 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + 40 + len(data), 0, 0, 54) + info + data


def _bmp_rle4() -> bytes:
    """A 4x4 BMP in 4-bit run-length encoding: Pillow reads it, DALI's BMP decoder does not."""
    palette = b"".join(bytes((i * 16, 255 - i * 16, i * 8, 0)) for i in range(16))
    rows = b"\x04\x12\x00\x00" * 4 + b"\x00\x01"  # each row 4 pixels of colours 1, 2; end of bitmap
    info = struct.pack("<IiiHHIIiiII", 40, 4, 4, 1, 4, 2, len(rows), 2835, 2835, 16, 0)
    offset = 14 + 40 + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(rows), 0, 0, offset) + info + palette + rows


def bmp_info_size(data: bytes, size: int = 41) -> bytes:
    """A BMP whose info header claims ``size`` bytes (its pixels where they were): Pillow refuses
    it ("Unsupported BMP header type (41)"), OpenCV's decoder in DALI read it (found by the
    fuzzer, 2026-11-29: one bit flipped)."""
    return data[:14] + struct.pack("<I", size) + data[18:]


def _apng() -> bytes:
    out = io.BytesIO()
    _photo(1).save(out, "PNG", save_all=True, append_images=[_photo(2)], duration=100)
    return out.getvalue()


def _png_bomb(height: int = 30000, width: int = 30000) -> bytes:
    """A tiny PNG whose header declares ``height`` x ``width``."""
    good = _png_chunks(_save(_photo(4, size=(8, 8)), "PNG"))
    header = struct.pack(">II", width, height) + good[0][1][8:]
    return _png([(b"IHDR", header), *good[1:]])


def corpus() -> dict[str, tuple[bytes, str | None]]:
    """name -> (the file's bytes, its verdict: ``None`` good, else the Damage value)."""
    photo = _photo(1)
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = encode_jpeg(synthetic_image(1, size=SIZE), quality=90)
    png = _save(Image.fromarray(np.random.default_rng(1).integers(0, 255, (*SIZE, 3), dtype=np.uint8)), "PNG")
    files: dict[str, tuple[bytes, str | None]] = {
        # good: what datasets hold
        "jpeg": (jpeg, None),
        "jpeg-progressive": (_save(photo, "JPEG", quality=90, progressive=True), None),
        "jpeg-gray": (_save(photo.convert("L"), "JPEG", quality=90), None),
        "jpeg-cmyk": (_save(photo.convert("CMYK"), "JPEG", quality=90), None),
        "jpeg-exif-rotated": (_save(photo, "JPEG", quality=90, exif=exif), None),
        "jpeg-1x1": (_save(photo.resize((1, 1)), "JPEG", quality=90), None),
        "png": (_save(photo, "PNG"), None),
        "png-gray": (_save(photo.convert("L"), "PNG"), None),
        "png-palette": (_save(photo.convert("P"), "PNG"), None),
        "png-rgba": (_save(photo.convert("RGBA"), "PNG"), None),
        "webp": (_save(photo, "WEBP", quality=90), None),
        "webp-lossless": (_save(photo, "WEBP", lossless=True), None),
        "webp-animated": (_animation("WEBP"), None),  # its first frame, everywhere
        "bmp": (_save(photo, "BMP"), None),
        "tiff": (_save(photo, "TIFF"), None),
        "ppm": (_save(photo, "PPM"), None),
        "png-16-bit-rgb": (png16(_wide(2, 3)), None),
        "png-16-bit-gray-alpha": (png16(_wide(3, 2), interlaced=True), None),
        "tiff-16-bit-rgb": (tiff16(_wide(4, 3), deflate=True), None),
        # good, though DALI's decoders refuse them: delivered as gpupipe's decoder reads them (on
        # DALI, as PPMs: backends/_dali/_fallback.py). nvImageCodec's parser refuses most; fed to
        # DALI at a batch of 32 or more, one of those killed the process.
        "jpeg-junk-before-dqt": (_junk_before(jpeg, 0xDB, b"hello"), None),  # seen in the header
        "jpeg-short-app14": (_short_app14(jpeg), None),  # seen in the header
        "ppm-maxval-100": (_pnm(4, 100, 3), None),  # DALI's decoder does not scale to 255: seen in the header
        "pgm-16-bit-maxval-1000": (_pnm(5, 1000, 1), None),  # likewise
        "jpeg-junk-before-dht": (_junk_before(jpeg, 0xC4), None),  # found when DALI fails
        "jpeg-junk-before-sos": (_junk_before(jpeg, 0xDA, b"\x00\x00"), None),  # found when DALI fails
        "bmp-16-bit": (_bmp16(photo), None),
        "bmp-rle4": (_bmp_rle4(), None),
        "tiff-1-bit": (_save(photo.convert("1"), "TIFF"), None),
        "tiff-32-bit-int": (_save(photo.convert("I"), "TIFF"), None),
        "png-no-iend": (png[:-12], None),
        "png-animated": (_apng(), None),  # its first frame, as Pillow reads it
        "png-ztxt-bomb": (png_text_bomb("before", inflated=64 << 20), None),  # Pillow refused it
        "png-itxt-bomb-after-idat": (png_text_bomb("after", b"iTXt", inflated=8 << 20), None),
        "png-iccp-bomb": (png_text_bomb("before", b"iCCP", inflated=8 << 20), None),
        "jpeg2000": (_save(photo, "JPEG2000"), None),  # never given to DALI: its decoder crashed on one
        "tga": (_save(photo, "TGA"), None),  # formats only Pillow reads
        "pcx": (_save(photo, "PCX"), None),
        "sgi": (_save(photo, "SGI"), None),
        "ico": (_save(photo, "ICO", sizes=[(32, 32)]), None),
        # refused
        "empty": (b"", "empty-image"),
        "text": (b"this is not an image, whatever its name says\n" * 4, "undecodable"),
        "jpeg-truncated": (jpeg[: len(jpeg) // 2], "undecodable"),
        "jpeg-magic-then-noise": (b"\xff\xd8\xff\xe0" + np.random.default_rng(5).bytes(3000), "undecodable"),
        **{name: (data, "undecodable") for name, data in _damaged_pngs().items()},
        "gif": (_save(photo, "GIF"), "unsupported-format"),
        "gif-animated": (_animation("GIF"), "unsupported-format"),
        "jpeg-lossless": (_patched_sof(marker=0xC3), "unsupported-format"),
        "jpeg-12-bit": (_patched_sof(precision=12), "unsupported-format"),
        "jpeg-bomb": (_patched_sof(size=(30000, 30000)), "too-large"),
        "jpeg-bomb-after-junk": (_junk_before_sof(_patched_sof(size=(20000, 20000))), "too-large"),
        "jpeg-no-frame": (_without_sof(jpeg), "undecodable"),
        # a progressive JPEG whose frame header says baseline: libjpeg-turbo refuses its second
        # scan, nvImageCodec decoded the first alone (found by the fuzzer)
        "jpeg-stray-marker": (stray_marker(jpeg), "undecodable"),  # libjpeg-turbo refuses it (found by the fuzzer)
        "bmp-info-header-41": (bmp_info_size(_save(photo, "BMP")), "undecodable"),  # Pillow refuses it (the fuzzer)
        "jpeg-progressive-called-baseline": (
            _called_baseline(_save(photo, "JPEG", quality=90, progressive=True)),
            "undecodable",
        ),
        "png-bomb": (_png_bomb(), "too-large"),
        # refused, last: some in the short last batch of 16, several in one batch
        "jpeg-400-mpx": (_save(Image.new("L", (20000, 20000), 128), "JPEG", quality=50), "too-large"),
        "png-cut-in-idat": (png[: len(png) // 2], "undecodable"),
        "tga-truncated": (_save(photo, "TGA")[:1000], "undecodable"),
        "zero-bytes": (b"", "empty-image"),
        "json": (b'{"caption": "a photo of a cat", "width": 64}', "undecodable"),
        "gif-last": (_save(_photo(3), "GIF"), "unsupported-format"),
        "jpeg-last": (_save(_photo(4), "JPEG", quality=90), None),  # good, in the short last batch of 16
    }
    return files


if __name__ == "__main__":  # pragma: no cover - a tool
    import os
    import sys

    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for name, (data, verdict) in corpus().items():
        with open(os.path.join(out, f"{name}.jpg"), "wb") as f:
            f.write(data)
        print(f"{name}: {verdict or 'good'}")


def write_shard(path: str) -> dict[str, str | None]:
    """The corpus as one WebDataset shard (every file a ``.jpg`` member, in corpus order, with a
    label); returns key -> verdict."""
    import webdataset as wds

    verdicts = {}
    with wds.TarWriter(path) as sink:
        for i, (name, (data, verdict)) in enumerate(corpus().items()):
            sink.write({"__key__": name, "jpg": data, "cls": str(i % 10).encode()})
            verdicts[name] = verdict
    return verdicts


# The child a corpus run happens in (tests/test_odd_files.py): a crash ends the child, not the tests.
RUN = """
import json, sys
import gpupipe as gp
from gpupipe import transforms as T

shard, backend, batch, on_error = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
steps = {  # the decode each makes on DALI: a region, the whole image resized, the whole image to a size
    "crop": [T.RandomResizedCrop(16), T.RandomHorizontalFlip()],
    "center": [T.Resize(20), T.CenterCrop(16)],
    "resize": [T.Resize((16, 16))],
}[sys.argv[7] if len(sys.argv) > 7 else "crop"]
pipe = gp.Pipeline(gp.WebDataset([shard]), steps)
result = {"delivered": [], "skipped": {}, "raised": None}
try:
    with gp.Loader(pipe, batch, backend=backend, device=device, num_workers=int(sys.argv[5]), on_error=on_error,
                   max_skipped=None) as loader:
        for b in loader:
            assert tuple(b.images.shape[1:]) == (3, 16, 16)
            result["delivered"] += [k for k, v in zip(b.keys, b.valid.tolist()) if v]
        result["skipped"] = {s.key: str(s.kind) for s in loader.skipped}
except gp.DataError as e:
    result["raised"] = {"key": e.key, "kind": str(e.kind), "message": str(e)[:300]}
print("RESULT " + json.dumps(result))
"""
