"""Helpers for tests and benchmarks: real JPEGs of photograph-like images, no dataset needed.

Example:
    >>> from gpupipe.testing import encode_jpeg, synthetic_image
    >>> jpeg = encode_jpeg(synthetic_image(0, label=3, size=(120, 160)))  # doctest: +SKIP
"""

from __future__ import annotations

import io

import numpy as np

__all__ = ["synthetic_image", "encode_jpeg", "encode_png", "label_map", "paint_boxes"]

BOX_COLOURS = ((255, 40, 40), (40, 200, 40), (40, 80, 255))  # paint_boxes' class 1, 2, 3


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


def synthetic_image(
    seed: int, *, label: int = 0, num_classes: int = 10, size: tuple[int, int] | None = None
) -> np.ndarray:
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
    image = Image.fromarray(np.clip(coarse, 0, 255).astype(np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(6, 16))):
        x0, y0 = int(rng.integers(-w // 4, w)), int(rng.integers(-h // 4, h))
        x1, y1 = x0 + int(rng.integers(w // 10, w // 2)), y0 + int(rng.integers(h // 10, h // 2))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = rng.integers(3)
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), fill=color)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=color)
        else:
            pts = [(x0 + int(rng.integers(0, w // 3)), y0 + int(rng.integers(0, h // 3))) for _ in range(5)]
            draw.polygon(pts, fill=color)
    image = image.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.5, 1.5))))
    pixels = np.asarray(image, dtype=np.float32)
    grain = (
        np.asarray(
            Image.fromarray(rng.normal(128, 40, (h // 2, w // 2)).clip(0, 255).astype(np.uint8)).resize(
                (w, h), Image.Resampling.BILINEAR
            ),
            dtype=np.float32,
        )
        - 128
    )
    pixels += grain[..., None] * 0.15 + rng.normal(0, 2.5, (h, w, 1)).astype(np.float32)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def encode_png(array: np.ndarray) -> bytes:
    """``array`` (``[H, W]`` or ``[H, W, C]``, uint8 or uint16) as a lossless PNG (Pillow): label
    maps, and images compared pixel for pixel."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def label_map(image: np.ndarray) -> np.ndarray:
    """A segmentation label map of an ``[H, W, 3]`` image, learnable from its pixels: each pixel's
    class (0-3) is the quartile of its brightness in the image. uint8 ``[H, W]``."""
    gray = image.astype(np.float32).mean(axis=2)
    return np.digitize(gray, np.quantile(gray, [0.25, 0.5, 0.75])).astype(np.uint8)


def paint_boxes(image: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Paints 1-3 rectangles on ``image`` (``[H, W, 3]`` uint8, in place), each a sixth to a third
    of the image a side, in its class's colour (1 red, 2 green, 3 blue): a detection sample whose
    boxes enclose what is drawn. Returns the boxes, float32 ``[K, 4]`` XYXY pixels, and their
    classes, int64 ``[K]``, drawn from ``seed``."""
    rng = np.random.default_rng([seed, 0xB0C5])
    h, w = image.shape[:2]
    boxes, classes = [], []
    for _ in range(int(rng.integers(1, 4))):
        bw, bh = int(rng.integers(w // 6, w // 3)), int(rng.integers(h // 6, h // 3))
        x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
        cls = int(rng.integers(1, 4))
        image[y : y + bh, x : x + bw] = BOX_COLOURS[cls - 1]
        boxes.append((x, y, x + bw, y + bh))
        classes.append(cls)
    return np.array(boxes, np.float32), np.array(classes, np.int64)
