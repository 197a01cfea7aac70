"""Writing WebDataset shards, and photograph-like synthetic images to fill them.

Shared by ``python -m gpupipe make-shards``, the demo, the benchmarks and the tests.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._errors import ConfigError
from ._validate import check_int

__all__ = ["ShardWriter", "synthetic_image", "encode_jpeg"]


class ShardWriter:
    """Writes samples into numbered tar shards in WebDataset layout.

    Args:
        pattern: output path with one ``%d``-style field for the shard number, e.g.
            ``"data/train-%06d.tar"``.
        max_count: samples per shard. Default 1000.
        start: number of the first shard. Default 0.

    Members are written in sample order, ``key.ext`` each; ``bytes`` are stored as they are,
    ``int`` and ``str`` as ASCII/UTF-8 text (a ``.cls`` label is an ``int``). Tar headers carry no
    time or owner, so the same samples always give the same bytes.

    Example:
        >>> with ShardWriter("out/train-%06d.tar", max_count=256) as w:  # doctest: +SKIP
        ...     w.write("000001", {"jpg": jpeg_bytes, "cls": 3})
        >>> w.shards  # doctest: +SKIP
        ['out/train-000000.tar']
    """

    def __init__(self, pattern: str, *, max_count: int = 1000, start: int = 0) -> None:
        if "%" not in pattern:
            raise ConfigError(f"ShardWriter: pattern needs a %d field for the shard number, got {pattern!r}")
        self.max_count = check_int("ShardWriter", max_count, "max_count", minimum=1)
        self.next_shard = check_int("ShardWriter", start, "start", minimum=0)
        self.pattern = pattern
        self.shards: list[str] = []
        self._tar: tarfile.TarFile | None = None
        self._count = 0
        self.samples = 0

    def write(self, key: str, members: Mapping[str, Any]) -> None:
        if not key or "." in key.rpartition("/")[2]:
            raise ConfigError(f"ShardWriter: key must be non-empty with no '.' in its file name, got {key!r}")
        if self._tar is None or self._count >= self.max_count:
            self._open_next()
        for ext, value in members.items():
            if isinstance(value, (bool, np.bool_)):
                raise ConfigError(f"ShardWriter: member {key}.{ext} is a bool")
            if isinstance(value, (int, np.integer)):
                value = str(int(value)).encode("ascii")
            elif isinstance(value, str):
                value = value.encode("utf-8")
            elif not isinstance(value, (bytes, bytearray, memoryview)):
                raise ConfigError(f"ShardWriter: member {key}.{ext} must be bytes, int or str, got {type(value).__name__}")
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mode, info.mtime = len(value), 0o444, 0
            self._tar.addfile(info, io.BytesIO(bytes(value)))
        self._count += 1
        self.samples += 1

    def _open_next(self) -> None:
        self.close()
        path = self.pattern % self.next_shard
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)
        self.shards.append(path)
        self.next_shard += 1
        self._count = 0

    def write_all(self, samples: Iterable[tuple[str, Mapping[str, Any]]]) -> list[str]:
        for key, members in samples:
            self.write(key, members)
        return self.shards

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode_jpeg(image: np.ndarray, *, quality: int = 90, mode: str | None = None) -> bytes:
    """Encodes an ``[H, W, 3]`` (or ``[H, W]``) uint8 array with libjpeg (Pillow).

    ``mode="CMYK"`` writes a CMYK JPEG, ``"L"`` a grayscale one.
    """
    from PIL import Image

    im = Image.fromarray(image)
    if mode is not None:
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def synthetic_image(seed: int, *, label: int = 0, num_classes: int = 10,
                    size: tuple[int, int] | None = None) -> np.ndarray:
    """A photograph-like ``[H, W, 3]`` uint8 image: smooth shading, objects with sharp and soft
    edges, and fine texture — costs a JPEG codec about what a photo does, unlike noise.

    The shorter side is 300–500 px (aspect up to 1.5) unless ``size=(h, w)`` is given. The
    background's hue follows ``label``, so a model can learn the classes.
    """
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng([seed, label, 0x5EED])
    if size is None:
        short = int(rng.integers(300, 501))
        long = int(short * rng.uniform(1.0, 1.5))
        size = (short, long) if rng.random() < 0.7 else (long, short)
    h, w = size
    hue = (label % max(num_classes, 1)) / max(num_classes, 1)
    base = np.array([np.cos(2 * np.pi * (hue + k / 3)) for k in range(3)]) * 70 + 128
    coarse = base + rng.normal(0, 35, (4, 6, 3))
    image = Image.fromarray(np.clip(coarse, 0, 255).astype(np.uint8)).resize((w, h), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(6, 16))):
        x0, y0 = rng.integers(-w // 4, w), rng.integers(-h // 4, h)
        x1, y1 = x0 + rng.integers(w // 10, w // 2), y0 + rng.integers(h // 10, h // 2)
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = rng.integers(3)
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), fill=color)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=color)
        else:
            pts = [(int(x0 + rng.integers(0, w // 3)), int(y0 + rng.integers(0, h // 3))) for _ in range(5)]
            draw.polygon(pts, fill=color)
    image = image.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.5, 1.5))))
    pixels = np.asarray(image, dtype=np.float32)
    grain = np.asarray(Image.fromarray(rng.normal(128, 40, (h // 2, w // 2)).clip(0, 255).astype(np.uint8))
                       .resize((w, h), Image.BILINEAR), dtype=np.float32) - 128
    pixels += grain[..., None] * 0.15 + rng.normal(0, 2.5, (h, w, 1)).astype(np.float32)
    return np.clip(pixels, 0, 255).astype(np.uint8)
