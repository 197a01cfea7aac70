"""The tests' data: small synthetic-photo JPEGs (sample ``n`` labelled ``label_of(n)``), damaged
ones, and WebDataset shards of them written with webdataset's own TarWriter (independent of
gpupipe's writer). The session's shared shards are conftest's fixtures (``shards``,
``uneven_shards``, ...), built from these."""

from __future__ import annotations

import os

import numpy as np

from gpupipe.testing import encode_jpeg, synthetic_image

SHARD_SIZES = (7, 5, 4)  # uneven on purpose
UNEVEN_SIZES = (7, 2, 5, 3)


def label_of(i: int) -> int:
    return (i * 7) % 5


def small_image(n: int) -> np.ndarray:
    return synthetic_image(n, label=label_of(n), size=(64 + 8 * (n % 5), 80 + 4 * (n % 3)))


def truncated_jpeg(n: int) -> bytes:
    """The first half of sample ``n``'s JPEG: every decoder refuses it."""
    data = encode_jpeg(small_image(n), quality=90)
    return data[: len(data) // 2]


def bomb_jpeg(height: int = 30000, width: int = 30000) -> bytes:
    """A small real JPEG whose frame header declares ``height`` x ``width``: a decompression bomb
    (a decoder that trusts it allocates ``height * width * 3`` bytes)."""
    data = bytearray(encode_jpeg(small_image(0), quality=90))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def write_webdataset_shards(root, sizes, *, prefix="train", label=True, image=small_image, patch=None):
    """Writes shards with webdataset's own TarWriter (independent of gpupipe's writer); sample
    ``n`` is ``image(n)`` as a JPEG, labelled ``label_of(n)``. ``patch`` maps a sample number to
    members that replace its own (bytes; ``None`` leaves the member out): damaged samples."""
    import webdataset as wds

    paths, n = [], 0
    for s, size in enumerate(sizes):
        path = os.path.join(root, f"{prefix}-{s:06d}.tar")
        with wds.TarWriter(path) as sink:
            for _ in range(size):
                img = image(n)
                sample = {"__key__": f"img/{s:02d}/{n:06d}", "jpg": encode_jpeg(img, quality=90)}
                if label:
                    sample["cls"] = str(label_of(n)).encode()
                for ext, value in (patch or {}).get(n, {}).items():
                    if value is None:
                        sample.pop(ext, None)
                    else:
                        sample[ext] = value
                sink.write(sample)
                n += 1
        paths.append(path)
    return paths


def png16(values: np.ndarray, *, interlaced: bool = False, exif: bytes | None = None) -> bytes:
    """A 16-bit PNG of ``values`` (uint16 ``[H, W]`` gray, ``[H, W, 2]`` gray and alpha,
    ``[H, W, 3]`` RGB or ``[H, W, 4]`` RGBA; Pillow writes only gray at 16 bits), each row with
    the Sub filter (the row's own unfiltering depends on the pixel size), Adam7-interlaced on
    request, with an ``eXIf`` chunk of ``exif``'s bytes."""
    import struct
    import zlib

    grid = values if values.ndim == 3 else values[..., None]
    height, width, channels = grid.shape
    color = {1: 0, 2: 4, 3: 2, 4: 6}[channels]

    def rows(image: np.ndarray) -> bytes:
        raw = image.astype(">u2").reshape(image.shape[0], -1).view(np.uint8)
        bpp = 2 * channels
        sub = raw.copy()
        sub[:, bpp:] = raw[:, bpp:] - raw[:, :-bpp]  # uint8: modulo 256
        return b"".join(b"\x01" + row.tobytes() for row in sub)

    if interlaced:
        passes = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
        parts = [grid[y::dy, x::dx] for x, y, dx, dy in passes]
        data = b"".join(rows(p) for p in parts if p.size)
    else:
        data = rows(grid)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 16, color, 0, 0, int(interlaced))
    extra = chunk(b"eXIf", exif) if exif is not None else b""
    body = chunk(b"IHDR", header) + extra + chunk(b"IDAT", zlib.compress(data)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def tiff16(values: np.ndarray, *, deflate: bool = False, big_endian: bool = False, strips: int = 2) -> bytes:
    """A 16-bit RGB TIFF of uint16 ``values`` ``[H, W, 3]`` (Pillow does not write one), in
    ``strips`` strips, raw or Deflate-compressed (which Pillow reads through libtiff)."""
    import struct
    import zlib

    height, width, _ = values.shape
    order = ">" if big_endian else "<"
    rows = -(-height // strips)
    chunks = [values[i : i + rows].astype(f"{order}u2").tobytes() for i in range(0, height, rows)]
    chunks = [zlib.compress(c) for c in chunks] if deflate else chunks
    count, tags = len(chunks), 10
    bits_at = 8 + 2 + tags * 12 + 4
    offsets_at = bits_at + 6
    counts_at = offsets_at + 4 * count
    first = counts_at + 4 * count
    offsets = [first + sum(len(c) for c in chunks[:i]) for i in range(count)]

    def tag(code: int, kind: int, n: int, value: int) -> bytes:  # kind 3: SHORT, 4: LONG
        short = kind == 3 and n == 1
        return struct.pack(f"{order}HHIHH" if short else f"{order}HHII", code, kind, n, value, *((0,) if short else ()))

    strip_offsets = offsets_at if count > 1 else offsets[0]
    strip_bytes = counts_at if count > 1 else len(chunks[0])
    entries = [
        tag(256, 4, 1, width), tag(257, 4, 1, height), tag(258, 3, 3, bits_at), tag(259, 3, 1, 8 if deflate else 1),
        tag(262, 3, 1, 2), tag(273, 4, count, strip_offsets), tag(277, 3, 1, 3), tag(278, 4, 1, rows),
        tag(279, 4, count, strip_bytes), tag(284, 3, 1, 1),
    ]  # fmt: skip
    head = (b"MM\x00*" if big_endian else b"II*\x00") + struct.pack(f"{order}IH", 8, tags) + b"".join(entries)
    sizes = [len(c) for c in chunks]
    tables = struct.pack(f"{order}I3H", 0, 16, 16, 16) + struct.pack(f"{order}{count}I{count}I", *offsets, *sizes)
    return head + tables + b"".join(chunks)
