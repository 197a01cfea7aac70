"""Decoding encoded images to uint8 RGB ``[3, H, W]`` tensors on the CPU (torch backend).

JPEG, PNG, WebP and GIF go through ``torchvision.io.decode_image`` (libjpeg-turbo, libpng): twice
as fast as Pillow here, and bit-identical on JPEG. torchvision 0.29 deprecated its decoders in
favour of TorchCodec; gpupipe silences that one warning around its own call and falls back to
Pillow (libjpeg-turbo too) where the decoders are gone. Other formats of an ImageFolder tree (BMP,
TIFF, PPM/PGM) are decoded with Pillow. Grayscale, CMYK and palette images come out RGB.

EXIF orientation is ignored by default, as torchvision and Pillow do (the pixels as stored);
``apply_exif_orientation=True`` turns the image upright (DALI's ``adjust_orientation``). Images
whose header declares more than ``max_pixels`` are refused before anything is allocated.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch

from ._errors import Damage, SampleError
from ._imageinfo import MAX_IMAGE_PIXELS, image_size

__all__ = ["decode_rgb", "check_pixels", "MAX_IMAGE_PIXELS"]

_TORCHVISION_MAGIC = (b"\xff\xd8", b"\x89PNG", b"RIFF", b"GIF8")

try:
    from torchvision.io import ImageReadMode, decode_image
except ImportError:  # pragma: no cover - a torchvision without image decoders
    decode_image = None


def _decode_torchvision(data: bytes, exif: bool) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The image decoding and encoding capabilities of TorchVision", category=DeprecationWarning
        )
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return decode_image(encoded, mode=ImageReadMode.RGB, apply_exif_orientation=exif)


def _decode_pillow(data: bytes, exif: bool, max_pixels: int | None, shard: str, key: str) -> torch.Tensor:
    from PIL import Image, ImageOps

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # gpupipe applies its own limit
        try:
            im = Image.open(io.BytesIO(data))
        except Image.UnidentifiedImageError:
            raise ValueError(f"not an image in a format gpupipe reads; it starts with {data[:12]!r}") from None
        with im:
            check_pixels((im.height, im.width), max_pixels, shard=shard, key=key)
            rgb = (ImageOps.exif_transpose(im) if exif else im).convert("RGB")
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).contiguous()


def check_pixels(size: tuple[int, int] | None, max_pixels: int | None, *, shard: str, key: str) -> None:
    """Raises SampleError (``Damage.TOO_LARGE``) where ``size`` (height, width) exceeds
    ``max_pixels`` (``None``: no limit)."""
    if size is not None and max_pixels is not None and size[0] * size[1] > max_pixels:
        raise SampleError(
            f"the image of sample {key!r} in shard {shard!r} declares {size[0]}x{size[1]} pixels, more than "
            f"max_image_pixels={max_pixels} (a damaged file or a decompression bomb; raise the limit if it is real)",
            shard=shard,
            key=key,
            kind=Damage.TOO_LARGE,
        )


def decode_rgb(
    data: bytes,
    *,
    shard: str,
    key: str,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
    apply_exif_orientation: bool = False,
) -> torch.Tensor:
    """Decodes ``data`` to a uint8 ``[3, H, W]`` tensor; raises SampleError naming shard and key
    (and the kind of damage: empty, undecodable, over ``max_pixels``)."""
    if not data:
        message = f"the image of sample {key!r} in shard {shard!r} is empty"
        raise SampleError(message, shard=shard, key=key, kind=Damage.EMPTY_IMAGE)
    check_pixels(image_size(data), max_pixels, shard=shard, key=key)
    try:
        if decode_image is not None and data.startswith(_TORCHVISION_MAGIC):
            return _decode_torchvision(data, apply_exif_orientation)
        return _decode_pillow(data, apply_exif_orientation, max_pixels, shard, key)
    except SampleError:
        raise
    except Exception as e:
        raise SampleError(
            f"cannot decode the image of sample {key!r} in shard {shard!r}: {type(e).__name__}: {e}",
            shard=shard,
            key=key,
            kind=Damage.UNDECODABLE,
        ) from e
