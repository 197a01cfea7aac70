"""Decoding encoded images to uint8 RGB ``[3, H, W]`` tensors on the CPU (torch backend).

JPEG, PNG, WebP and GIF go through ``torchvision.io.decode_image`` (libjpeg-turbo, libpng): twice
as fast as Pillow here, and bit-identical on JPEG. torchvision 0.29 deprecated its decoders in
favour of TorchCodec; gpupipe silences that one warning around its own call and falls back to
Pillow (libjpeg-turbo too) where the decoders are gone. Other formats of an ImageFolder tree (BMP,
TIFF, PPM/PGM) are decoded with Pillow. Grayscale, CMYK and palette images come out RGB.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch

from ._errors import Damage, SampleError

__all__ = ["decode_rgb"]

_TORCHVISION_MAGIC = (b"\xff\xd8", b"\x89PNG", b"RIFF", b"GIF8")

try:
    from torchvision.io import ImageReadMode, decode_image
except ImportError:  # pragma: no cover - a torchvision without image decoders
    decode_image = None


def _decode_torchvision(data: bytes) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The image decoding and encoding capabilities of TorchVision", category=DeprecationWarning
        )
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def _decode_pillow(data: bytes) -> torch.Tensor:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        rgb = im.convert("RGB")
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).contiguous()


def decode_rgb(data: bytes, *, shard: str, key: str) -> torch.Tensor:
    """Decodes ``data`` to a uint8 ``[3, H, W]`` tensor; raises SampleError naming shard and key."""
    if not data:
        message = f"the image of sample {key!r} in shard {shard!r} is empty"
        raise SampleError(message, shard=shard, key=key, kind=Damage.EMPTY_IMAGE)
    try:
        if decode_image is not None and data.startswith(_TORCHVISION_MAGIC):
            return _decode_torchvision(data)
        return _decode_pillow(data)
    except Exception as e:
        raise SampleError(
            f"cannot decode the image of sample {key!r} in shard {shard!r}: {type(e).__name__}: {e}",
            shard=shard,
            key=key,
            kind=Damage.UNDECODABLE,
        ) from e
