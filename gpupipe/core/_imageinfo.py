"""An encoded image's size from its header alone, without decoding: JPEG, PNG, GIF and WebP
(:func:`image_size`), and any other format Pillow identifies (:func:`header_size`).

Used to refuse images over the pixel limit (``LoaderConfig.max_image_pixels``) before any decoder
allocates what a header claims (a "decompression bomb": a few KB declaring 60000 x 60000). A
header that cannot be parsed gives ``None``: the decoder then judges the data.
"""

from __future__ import annotations

import io
import re
import struct
import warnings
from collections.abc import Iterator

import numpy as np

__all__ = [
    "image_size",
    "header_size",
    "image_format",
    "jpeg_frame",
    "jpeg_walk",
    "jpeg_ended",
    "jpeg_scans_disagree",
    "jpeg_stray_marker",
    "png_animated",
    "png_without_metadata",
    "pnm_maxval",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_BYTES",
]

MAX_IMAGE_PIXELS = 89_478_485  # Pillow's Image.MAX_IMAGE_PIXELS (about 0.25 GB as RGB)
MAX_IMAGE_BYTES = 256 << 20  # the largest image member read: MAX_IMAGE_PIXELS as raw RGB (3 x 89,478,485 + 1)

# JPEG start-of-frame markers (baseline, extended, progressive, lossless; arithmetic too), whose
# segment holds the frame's height and width; not C4 (DHT), C8 (JPG) or CC (DAC).
_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))
_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))  # markers without a length: TEM, RSTn


def jpeg_frame(data: bytes | memoryview) -> tuple[int, int, int, int] | None:
    """``(height, width, SOF marker, sample precision)`` of a JPEG's frame header, or ``None``.

    Read as libjpeg reads it: bytes between segments that are not a marker are skipped (libjpeg
    warns "extraneous bytes before marker" and decodes on), so one junk byte cannot hide a
    declared size from the pixel limit."""
    return jpeg_walk(data)[0]


def _segments(data: bytes | memoryview) -> Iterator[tuple[int, int, bool]]:
    """``(offset, marker, junk)`` of a JPEG's marker segments, in order, up to the first scan
    (``DA``) or the end of the image (``D9``), which are the last yielded; ``junk``: whether
    bytes that belong to no segment came before this one. Walked as libjpeg walks them: junk
    between segments is skipped (libjpeg warns "extraneous bytes before marker"), as are fill
    bytes and markers without a length."""
    i, n, junk = 2, len(data), False
    while i + 4 <= n:
        if data[i] != 0xFF:  # junk between segments: on to the next 0xFF
            i += 1
            junk = True
            continue
        marker = int(data[i + 1])
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        yield i, marker, junk
        if marker in (0xD9, 0xDA):
            return
        i += 2 + struct.unpack_from(">H", data, i + 2)[0]


def jpeg_walk(data: bytes | memoryview) -> tuple[tuple[int, int, int, int] | None, bool]:
    """:func:`jpeg_frame`'s frame header, and whether bytes that belong to no segment lie before
    it (junk libjpeg skips; nvImageCodec's parser refuses the file)."""
    junk, n = False, len(data)
    for i, marker, junk in _segments(data):
        if marker in (0xD9, 0xDA):  # end of image, or start of scan before any frame header
            return None, junk
        if marker in _SOF:
            if i + 9 > n:
                return None, junk
            precision = data[i + 4]
            height, width = struct.unpack_from(">HH", data, i + 5)
            return (height, width, marker, precision), junk
    return None, junk


_SEQUENTIAL = frozenset((0xC0, 0xC1, 0xC9))  # baseline, extended, arithmetic sequential


def jpeg_scans_disagree(data: bytes | memoryview) -> bool:
    """Whether a sequential JPEG's first scan is a progressive one (spectral selection or
    successive approximation): a progressive file whose frame header says baseline, found by the
    fuzzer. libjpeg-turbo refuses its second scan ("Didn't expect more than one scan") where
    nvImageCodec decodes the first alone and delivers. Reads the segments up to the first scan's
    header only: a second scan after an ordinary first one is not looked for (finding it means
    reading the whole file, 0.3 ms per MB)."""
    n, sof = len(data), None
    for i, marker, _ in _segments(data):
        if marker in _SOF and sof is None:
            sof = marker
        elif marker == 0xDA:
            end = i + 5 + 2 * (int(data[i + 4]) if i + 4 < n else 0)  # past the scan's component selectors
            return sof in _SEQUENTIAL and end + 3 <= n and bytes(data[end : end + 3]) != b"\x00\x3f\x00"
    return False


# The bytes after 0xFF that libjpeg-turbo's marker reader takes in and after a scan: stuffing (00),
# TEM, DHT, DAC, RSTn, EOI, SOS, DQT, DRI, APPn, COM, and fill (FF). Any other (a second SOI or
# frame header, DNL, JPGn, a reserved code) ends its decode with an error ("Unsupported marker
# type 0x63"), where nvImageCodec decodes on and delivers.
_TAKEN = np.zeros(256, dtype=bool)
_TAKEN[[0x00, 0x01, 0xC4, 0xCC, *range(0xD0, 0xD8), 0xD9, 0xDA, 0xDB, 0xDD, *range(0xE0, 0xF0), 0xFE, 0xFF]] = True


def jpeg_stray_marker(data: bytes | memoryview) -> bool:
    """Whether a marker that libjpeg-turbo refuses stands in a JPEG's scans (from its first scan's
    data to its end-of-image marker): a damaged file that libjpeg-turbo refuses ("Unsupported
    marker type") and nvImageCodec delivered, found by the fuzzer (2026-11-29). Reads every byte
    of the scans, vectorized: 12 us for a JPEG of 43 KB, 100 us for 600 KB (2 cores), which DALI's
    reader pays once per file (the verdict is recorded with its size, ``_dali/_headers``). A
    segment between scans whose payload holds such a pair is reported too: the file then goes to
    gpupipe's decoder, which judges it as the torch backend does."""
    start = next((i for i, marker, _ in _segments(data) if marker == 0xDA), None)
    if start is None or start + 4 > len(data):
        return False
    scans = np.frombuffer(data, dtype=np.uint8)[start + 2 + struct.unpack_from(">H", data, start + 2)[0] :]
    following = scans[np.flatnonzero(scans[:-1] == 0xFF) + 1]
    end = np.flatnonzero(following == 0xD9)
    return bool((~_TAKEN[following[: end[0]] if len(end) else following]).any())


_PADDING = b"\x00\t\n\r "  # bytes some writers leave after a JPEG's end-of-image marker
_TAIL = 256  # how far back from a file's end its end-of-image marker is looked for


def jpeg_ended(data: bytes | memoryview) -> bool:
    """Whether a JPEG ends with its end-of-image marker (``FF D9``), padding after it allowed.

    A JPEG cut short does not: libjpeg-turbo then refuses it ("premature end"), while nvJPEG's
    decoders give its missing rows grey without a word. Only the last few hundred bytes are read.
    ``FF D9`` cannot occur inside entropy-coded data (a data byte ``FF`` is followed by ``00``),
    so the end of a cut file never passes for it."""
    n = len(data)
    if n >= 2 and data[n - 2] == 0xFF and data[n - 1] == 0xD9:
        return True
    return bytes(data[max(0, n - _TAIL) :]).rstrip(_PADDING).endswith(b"\xff\xd9")


def png_animated(data: bytes | memoryview) -> bool:
    """Whether a PNG is an animation (APNG: an ``acTL`` chunk before its image data)."""
    i, n = 8, len(data)
    while i + 8 <= n:
        (length,) = struct.unpack_from(">I", data, i)
        kind = bytes(data[i + 4 : i + 8])
        if kind == b"acTL":
            return True
        if kind == b"IDAT" or kind == b"IEND":
            return False
        i += 12 + length
    return False


# a PGM or PPM's header up to its largest value, which one whitespace byte ends (the pixels follow:
# bytes of any value, whitespace too); comments run to the end of their line
_PNM_HEADER = re.compile(rb"P[2356](?:(?:\s|#[^\r\n]*[\r\n])+([0-9]+)){3}\s")


def pnm_maxval(data: bytes | memoryview) -> int | None:
    """The largest value a PGM or PPM (``P2``, ``P3``, ``P5``, ``P6``) declares, its fourth header
    field (comments skipped); ``None`` for a bitmap (``P1``, ``P4``: no such field) or a header
    that does not tell."""
    found = _PNM_HEADER.match(data)  # (read in place: a memoryview is not copied)
    return int(found.group(1)) if found else None


_PNG_METADATA = frozenset((b"tEXt", b"zTXt", b"iTXt", b"iCCP"))  # text and colour profile: no pixels


def png_without_metadata(data: bytes) -> bytes:
    """A PNG without its text chunks (``tEXt``, ``zTXt``, ``iTXt``) and colour profile (``iCCP``),
    or ``data`` itself where it has none: what gpupipe gives Pillow. Those chunks carry no pixels,
    and DALI's decoder skips them; Pillow inflates the compressed ones at open and refuses the
    file if one inflates past 1 MB (``MAX_TEXT_CHUNK``): a 64x48 PNG with a 200 MB ``zTXt`` would
    be refused by one backend and delivered by the other. A chunk whose length runs past the end
    ends the walk: the rest is kept as it is, for the decoder to judge."""
    i, n, kept, dropped = 8, len(data), [data[:8]], False
    while i + 12 <= n:
        (length,) = struct.unpack_from(">I", data, i)
        end = i + 12 + length
        if end > n:
            break
        if data[i + 4 : i + 8] in _PNG_METADATA:
            dropped = True
        else:
            kept.append(data[i:end])
        i = end
    if not dropped:
        return data
    kept.append(data[i:])
    return b"".join(kept)


def _jpeg(data: bytes | memoryview) -> tuple[int, int] | None:
    frame = jpeg_frame(data)
    return None if frame is None else (frame[0], frame[1])


def image_format(data: bytes | memoryview) -> str | None:
    """The format an encoded image's first bytes say it is (whatever its file name says):
    ``"jpeg"``, ``"png"``, ``"gif"``, ``"webp"``, ``"bmp"``, ``"tiff"``, ``"pnm"``, ``"jpeg2000"``,
    or ``None``."""
    head = bytes(data[:16])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "webp"
    if head.startswith(b"BM"):
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if len(head) > 2 and head[0:1] == b"P" and head[1:2] in b"123456" and head[2:3] in b" \t\r\n":
        return "pnm"
    if head.startswith(b"\x00\x00\x00\x0cjP  ") or head.startswith(b"\xff\x4f\xff\x51"):
        return "jpeg2000"
    return None


def image_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """``(height, width)`` from the header of a JPEG, PNG, GIF or WebP image; ``None`` for other
    formats or a header too short or malformed to tell."""
    head = bytes(data[:32])
    if head.startswith(b"\xff\xd8"):
        return _jpeg(data)
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR" and len(head) >= 24:
        width, height = struct.unpack_from(">II", head, 16)
        return height, width
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        width, height = struct.unpack_from("<HH", head, 6)
        return height, width
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP" and len(head) >= 30:
        chunk = head[12:16]
        if chunk == b"VP8X":
            width = 1 + int.from_bytes(head[24:27], "little")
            height = 1 + int.from_bytes(head[27:30], "little")
            return height, width
        if chunk == b"VP8L" and head[20] == 0x2F:
            bits = int.from_bytes(head[21:25], "little")
            return 1 + ((bits >> 14) & 0x3FFF), 1 + (bits & 0x3FFF)
        if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
            width, height = struct.unpack_from("<HH", head, 26)
            return height & 0x3FFF, width & 0x3FFF
    return None


def header_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """``(height, width)`` from an image's header: :func:`image_size`'s formats parsed here (a few
    microseconds), others (BMP, TIFF, PPM, JPEG 2000 of an ImageFolder tree) by Pillow, which
    reads the header only; ``None`` where neither can tell."""
    size = image_size(data)
    if size is not None or bytes(data[:2]) == b"\xff\xd8":
        return size
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DecompressionBombWarning: the caller applies its own limit
            with Image.open(io.BytesIO(bytes(data))) as im:
                return im.height, im.width
    except Exception:  # not an image Pillow identifies, or a corrupt header
        return None
