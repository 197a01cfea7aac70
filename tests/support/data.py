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
