"""The fields that follow the image's geometry (``gp.fields.Mask``, ``gp.fields.Boxes``): how
they are read and checked. How each transform moves them is ``gpupipe.transforms._masks``; the
backends that move them say so (``Backend.reads_targets``)."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any, ClassVar

import numpy as np

from ._errors import ConfigError, SampleError
from ._fields import Array, Field, Missing, _bad
from ._validate import valid_enum

__all__ = ["Mask", "Boxes", "BoxFormat", "TARGETS"]

_MASK_MODES = {"1": np.uint8, "L": np.uint8, "P": np.uint8, "I;16": np.int32, "I;16B": np.int32, "I": np.int32}


@dataclasses.dataclass(frozen=True)
class Mask(Field):
    """A segmentation mask: a one-channel label map (PNG, 8- or 16-bit; a palette PNG gives its
    indices, as torchvision's segmentation reference reads them), ``[H, W]`` uint8 (int32 for
    16-bit, or with a ``fill`` outside 0-255). It must have the image's size, and follows the image
    through every geometric transform with the image's draws, sampled nearest and filled with
    ``fill`` where the image is padded, rotated or shifted in; other transforms leave it as it is
    (torchvision v2's rules for ``tv_tensors.Mask``, save that its ``CenterCrop`` pads a mask with
    0, which labels the padding as class 0: gpupipe's pads with ``fill``, as every other transform
    does). A batch holds ``[B, H, W]`` (a list where sizes differ). Read by every backend (the DALI
    backend moves it on the host, from the image's header size, exactly as the torch backend does;
    on no backend with ``apply_exif_orientation=True``: a mask is in the stored image's pixels).
    Default ``max_bytes``: 256 MB; the pixel limit of images applies.

    Args:
        fill: the value brought in by padding (``CenterCrop``'s too), rotation and affine shifts
            (default 255, the ignore index of torchvision's segmentation reference); any int32
            (``-100``: ``CrossEntropyLoss``'s default ``ignore_index``), the masks then int32.
    """

    fill: int = 255

    kind: ClassVar[str] = "mask"
    default_max_bytes: ClassVar[int] = 256 << 20

    @property
    def arrays(self) -> bool:
        return True

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.fill, bool) or not isinstance(self.fill, int) or not -(1 << 31) <= self.fill < 1 << 31:
            raise ConfigError(f"Mask: fill must be an int32 (a label), got {self.fill!r}")
        if self.missing == Missing.EMPTY:
            raise ConfigError("Mask: missing='empty' has no mask of the image's size to give: use 'error' or 'skip'")

    @property
    def _wide_fill(self) -> bool:
        """Whether ``fill`` is outside 0-255, the masks then int32."""
        return not 0 <= self.fill <= 255

    def blank(self, size: tuple[int, int]) -> np.ndarray:
        """A mask of ``size`` that stands in for none (a batch with no good sample, whose image is
        zeros): zeros, of the dtype the masks have where the fill needs int32."""
        return np.zeros(size, np.int32 if self._wide_fill else np.uint8)

    def _decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        import io
        import warnings

        from PIL import Image as PILImage

        from ._imageinfo import MAX_IMAGE_PIXELS, header_size

        size = header_size(bytes(data[:65536]))
        if size is not None and size[0] * size[1] > MAX_IMAGE_PIXELS:
            raise _bad(self, shard, key, f"declares {size[0]}x{size[1]} pixels, over the pixel limit")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
                with PILImage.open(io.BytesIO(data)) as im:
                    if im.mode not in _MASK_MODES:
                        raise _bad(self, shard, key, f"is a {im.mode} image: a mask has one channel of labels")
                    im.load()
                    return np.asarray(im, dtype=np.int32 if self._wide_fill else _MASK_MODES[im.mode])
        except SampleError:
            raise
        except Exception as e:  # Pillow's errors for a damaged or foreign file
            raise _bad(self, shard, key, f"cannot be decoded as a mask ({type(e).__name__}: {e})") from None


class BoxFormat(str, enum.Enum):
    """How a box's four numbers are laid out (torchvision's ``BoundingBoxFormat``)."""

    XYXY = "XYXY"  # left, top, right, bottom
    XYWH = "XYWH"  # left, top, width, height
    CXCYWH = "CXCYWH"  # centre x, centre y, width, height


@dataclasses.dataclass(frozen=True)
class Boxes(Field):
    """Bounding boxes: a ``[K, 4]`` array (``.npy``) or a JSON list of ``[4]`` lists, in pixels of
    the image, laid out as ``format``. They follow every geometric transform of the image with the
    image's draws (torchvision v2's box kernels), are clamped to the output image, and a box left
    narrower or lower than ``min_size``, or smaller than ``min_area``, is dropped, with the same
    rows of the ``labels`` field (torchvision's ``SanitizeBoundingBoxes``). Read by every backend,
    as a :class:`Mask` is.

    A batch holds a :class:`Padded` ``(data [B, K, 4] float32, lengths [B, 2])`` (``pad``, default
    0; ``lengths[:, 0]`` each sample's number of boxes), or with ``pad=None`` a list of ``[K, 4]``
    (one ``[B, K, 4]`` tensor for a batch whose samples all have ``K`` boxes, as :class:`Array`'s).

    Args:
        format: a :class:`BoxFormat` (default ``"XYXY"``); the output keeps it.
        min_size: the smallest width and height a box keeps (default 1.0, torchvision's).
        min_area: the smallest area a box keeps (default 1.0, torchvision's): with ``min_size``
            below 1, a box of no area (such as those ``RandomIoUCrop`` zeroes) still goes.
        labels: the name of the field whose rows (an array's first axis, or a JSON list) go with
            the boxes, dropped with them; ``None``: none.
        pad: as :class:`Array`'s (default 0).
    """

    format: BoxFormat | str = BoxFormat.XYXY
    min_size: float = 1.0
    labels: str | None = None
    pad: float | None = 0
    min_area: float = 1.0

    kind: ClassVar[str] = "boxes"
    default_max_bytes: ClassVar[int] = 64 << 20

    @property
    def arrays(self) -> bool:
        return True

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "format", valid_enum("Boxes", self.format, "format", BoxFormat))
        if isinstance(self.min_size, bool) or not isinstance(self.min_size, (int, float)) or self.min_size < 0:
            raise ConfigError(f"Boxes: min_size must be a number >= 0, got {self.min_size!r}")
        if isinstance(self.min_area, bool) or not isinstance(self.min_area, (int, float)) or not self.min_area >= 0:
            raise ConfigError(f"Boxes: min_area must be a number >= 0, got {self.min_area!r}")
        if self.labels is not None and not (isinstance(self.labels, str) and self.labels.isidentifier()):
            raise ConfigError(f"Boxes: labels must be None or the name of a field, got {self.labels!r}")
        if self.pad is not None and (isinstance(self.pad, bool) or not isinstance(self.pad, (int, float))):
            raise ConfigError(f"Boxes: pad must be a number or None, got {self.pad!r}")

    def empty(self) -> Any:
        return np.zeros((0, 4), np.float32)

    def _decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        if bytes(data[:6]) == b"\x93NUMPY":
            boxes = Array("npy")._decode(data, shard=shard, key=key)
        else:
            try:
                boxes = np.asarray(json.loads(bytes(data).decode("utf-8")), dtype=np.float64)
            except (ValueError, UnicodeDecodeError, TypeError) as e:
                raise _bad(self, shard, key, f"is neither .npy nor a JSON list of boxes ({e})") from None
        if boxes.size == 0:
            return self.empty()
        if boxes.ndim != 2 or boxes.shape[1] != 4 or boxes.dtype.kind not in "iuf":
            raise _bad(self, shard, key, f"holds a {boxes.dtype} array of shape {boxes.shape}, not [K, 4] numbers")
        boxes = boxes.astype(np.float32)
        if not np.isfinite(boxes).all():
            raise _bad(self, shard, key, "holds a box that is not finite")
        return boxes


TARGETS = (Mask, Boxes)  # the field kinds that follow the image
