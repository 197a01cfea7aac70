"""A sample's fields beyond the image and its class: their definitions and their safe decoders.

A field names the members of a sample it is read from (``exts``: ``"txt"``, ``"json;jsn"``,
``"seg.png"``: WebDataset's rule, the extension is what follows the key's first dot, lower-cased)
and how its bytes become a value. The decoders are webdataset's, made safe:

- :class:`Text`: UTF-8, strict (``str``); :class:`Json`: ``json.loads`` of UTF-8 (``dict``,
  ``list``, ...); :class:`Label`: an ASCII integer (int64), as a ``.cls`` member;
- :class:`Array`: a ``.npy`` through NumPy's own format reader, never unpickled: an object
  array is refused (``allow_pickle=False``), the header is checked against the bytes that follow
  (a truncated array is refused before anything is read), and the array is a view of the bytes
  (no copy);
- every field has a size limit (``max_bytes``) checked before decoding: a 2 GB JSON does not
  reach the parser.

A bad field raises :class:`~gpupipe.SampleError` naming the shard and the key, of kind
``Damage.BAD_FIELD`` (``Damage.MISSING_FIELD`` for one that is absent under ``missing="error"``),
so that ``on_error`` counts it as it counts a bad image. ``missing`` says what a sample without
the field is (DALI's ``missing_component_behavior``): an error, left out of the numbering
(``"skip"``), or given the field's empty value (``"empty"``).

Pure functions of bytes: no I/O, no backend.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ._errors import ConfigError, Damage, SampleError
from ._validate import valid_bytes, valid_enum

__all__ = [
    "Padded",
    "Missing",
    "Field",
    "Image",
    "Text",
    "Json",
    "Label",
    "Array",
    "Mask",
    "Boxes",
    "BoxFormat",
    "parse_fields",
    "field_values",
    "ascii_int",
    "IMAGE_EXTS",
]

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "pbm", "pnm", "bmp", "tif", "tiff")
_LABEL_EXTS = ("cls", "cls2", "class", "index", "inx", "id")  # webdataset's integer extensions
_TEXT_EXTS = ("txt", "text", "transcript")
_JSON_EXTS = ("json", "jsn")
_REFUSED = {  # webdataset decodes these by unpickling or torch.load: never here
    "pkl": "pickle", "pickle": "pickle", "pyd": "pickle", "pth": "torch.load", "pt": "torch.load",
}  # fmt: skip
_INT64 = (-(1 << 63), (1 << 63) - 1)


def ascii_int(raw: bytes, *, low: int = _INT64[0], high: int = _INT64[1]) -> int:
    """``raw`` as an ASCII integer in ``[low, high]`` (surrounding whitespace allowed): a ``.cls``
    member's rule, the class label's and a :class:`Label` field's. ``ValueError`` saying what is
    wrong (``"is not an ASCII integer"``, ``"is out of the int64 range"``) otherwise."""
    try:
        value = int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ValueError("is not an ASCII integer") from None
    if not low <= value <= high:
        raise ValueError("is out of the int64 range")
    return value


class Padded(NamedTuple):
    """Arrays of different shapes in one batch (``Array(..., pad=value)``): ``data``
    ``[B, *largest]``, each sample's array at its start and ``pad`` beyond it; ``lengths`` int64
    ``[B, ndim]``, each array's shape. ``Batch.to`` moves both."""

    data: Any  # torch.Tensor [B, *largest]
    lengths: Any  # torch.Tensor int64 [B, ndim]


class Missing(str, enum.Enum):
    """What a sample without the field is: ``"error"`` (a bad sample, ``Damage.MISSING_FIELD``),
    ``"skip"`` (left out of the numbering, as a sample without an image is) or ``"empty"`` (the
    field's empty value: ``""``, ``None``, an array of zero elements)."""

    ERROR = "error"
    SKIP = "skip"
    EMPTY = "empty"


@dataclasses.dataclass(frozen=True)
class Field:
    """A sample's field, read from the member whose extension is one of ``exts`` (the first
    present, in the order given).

    Args:
        exts: extensions, ``"json;jsn"`` or a sequence, compared lower-cased without the dot.
        missing: a :class:`Missing` (default ``"error"``).
        max_bytes: the largest member accepted (an int, or ``"16MB"``); ``None``: the kind's default.
    """

    exts: str | Sequence[str]
    missing: Missing | str = Missing.ERROR
    max_bytes: int | str | None = None

    kind: ClassVar[str] = "field"
    default_max_bytes: ClassVar[int] = 1 << 20

    def __post_init__(self) -> None:
        owner = type(self).__name__
        object.__setattr__(self, "exts", _exts(owner, self.exts))
        object.__setattr__(self, "missing", valid_enum(owner, self.missing, "missing", Missing))
        limit = valid_bytes(owner, self.max_bytes, "max_bytes")
        if limit is not None and limit < 1:
            raise ConfigError(f"{owner}: max_bytes must be at least 1, got {self.max_bytes!r}")
        object.__setattr__(self, "max_bytes", self.default_max_bytes if limit is None else limit)
        for ext in self.exts:
            _refuse_code(owner, ext)

    def decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        """The value of the member's ``data``; :class:`~gpupipe.SampleError` if it is bad."""
        self.require_fits(len(data), shard=shard, key=key)
        return self._decode(data, shard=shard, key=key)

    def empty(self) -> Any:
        """The value of a sample without the field, under ``missing="empty"``."""
        return None

    def missing_error(self, name: str, *, shard: str, key: str) -> SampleError:
        """The error of a sample without the field ``name`` (``missing="error"``)."""
        return SampleError(f"sample {key!r} in shard {shard!r} has no {name!r} field ({'/'.join(self.exts)})",
                           shard=shard, key=key, kind=Damage.MISSING_FIELD)  # fmt: skip

    def _decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        return bytes(data)

    def require_fits(self, size: int, *, shard: str, key: str) -> None:
        """Raises the bad field's error if a member of ``size`` bytes is over ``max_bytes``:
        checked before the member is read."""
        assert isinstance(self.max_bytes, int)
        if size > self.max_bytes:
            raise _bad(self, shard, key, f"is {size} bytes, over its max_bytes={self.max_bytes}")


@dataclasses.dataclass(frozen=True)
class Image(Field):
    """The image: decoded by the backend (nvJPEG, or the CPU decoders), not here."""

    kind: ClassVar[str] = "image"
    default_max_bytes: ClassVar[int] = 1 << 31


@dataclasses.dataclass(frozen=True)
class Text(Field):
    """UTF-8 text (``str``), as webdataset's ``txt``; invalid UTF-8 is a bad field. Default
    ``max_bytes``: 1 MiB."""

    kind: ClassVar[str] = "text"

    def empty(self) -> Any:
        return ""

    def _decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad(self, shard, key, f"is not UTF-8 text ({e.reason} at byte {e.start})") from None


@dataclasses.dataclass(frozen=True)
class Json(Field):
    """JSON (``json.loads`` of UTF-8: a ``dict``, ``list``, ...), as webdataset's ``json``.
    Default ``max_bytes``: 1 MiB; nesting deeper than Python's recursion limit is a bad field."""

    kind: ClassVar[str] = "json"

    def _decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        try:
            return json.loads(bytes(data).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise _bad(self, shard, key, f"is not UTF-8 JSON ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise _bad(self, shard, key, f"is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        except RecursionError:
            raise _bad(self, shard, key, "is JSON nested too deeply to read") from None


@dataclasses.dataclass(frozen=True)
class Label(Field):
    """An ASCII integer in the int64 range (``int``), as a ``.cls`` member (webdataset's ``cls``,
    ``index``, ``id``). Default ``max_bytes``: 64."""

    kind: ClassVar[str] = "label"
    default_max_bytes: ClassVar[int] = 64

    def _decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        raw = bytes(data)
        try:
            return ascii_int(raw)
        except ValueError as e:
            raise _bad(self, shard, key, f"{e}: {raw[:40]!r}") from None


@dataclasses.dataclass(frozen=True)
class Array(Field):
    """A NumPy ``.npy`` array (``np.ndarray``, a read-only view of the member's bytes), read by
    NumPy's format reader without unpickling: object arrays are refused, and the header must
    describe exactly the bytes that follow. Default ``max_bytes``: 2 GiB.

    Args:
        dtype, shape: what every sample's array must be (``None``: any); a mismatch is a bad field.
        pad: how a batch holds arrays whose shapes differ. ``None`` (default): a list of
            tensors (a batch of one shape is one ``[B, ...]`` tensor). A number: always a
            :class:`Padded` ``(data, lengths)``, ``data`` ``[B, *largest]`` filled with ``pad``
            beyond each array, ``lengths`` int64 ``[B, ndim]`` each array's shape (boxes:
            ``Array("npy", pad=0)`` gives ``[B, K, 4]`` and how many ``K`` each sample has).
    """

    dtype: Any = None
    shape: tuple[int, ...] | None = None
    pad: float | None = None

    kind: ClassVar[str] = "array"
    default_max_bytes: ClassVar[int] = 1 << 31

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype is not None:
            try:
                dtype = np.dtype(self.dtype)
            except TypeError:
                raise ConfigError(f"Array: dtype must be a NumPy dtype, got {self.dtype!r}") from None
            if dtype.hasobject:
                raise ConfigError("Array: dtype=object arrays are pickles: gpupipe never reads them")
            object.__setattr__(self, "dtype", dtype)
        if self.shape is not None:
            shape = tuple(self.shape) if isinstance(self.shape, Sequence) else None
            if shape is None or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                raise ConfigError(f"Array: shape must be a tuple of ints >= 0, got {self.shape!r}")
            object.__setattr__(self, "shape", shape)
        if self.pad is not None and (isinstance(self.pad, bool) or not isinstance(self.pad, (int, float))):
            raise ConfigError(f"Array: pad must be a number (the value beyond each array) or None, got {self.pad!r}")

    def empty(self) -> Any:
        return np.zeros((0,), self.dtype if self.dtype is not None else np.float32)

    def _decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        dtype, shape, fortran, offset = _npy_header(self, data, shard=shard, key=key)
        if self.dtype is not None and dtype != self.dtype:
            raise _bad(self, shard, key, f"is a {dtype} array, not {self.dtype}")
        if self.shape is not None and shape != self.shape:
            raise _bad(self, shard, key, f"has shape {shape}, not {self.shape}")
        count = math.prod(shape)
        array = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
        return array.reshape(shape, order="F" if fortran else "C")


_MASK_MODES = {"1": np.uint8, "L": np.uint8, "P": np.uint8, "I;16": np.int32, "I;16B": np.int32, "I": np.int32}


@dataclasses.dataclass(frozen=True)
class Mask(Field):
    """A segmentation mask: a one-channel label map (PNG, 8- or 16-bit; a palette PNG gives its
    indices, as torchvision's segmentation reference reads them), ``[H, W]`` uint8 (int32 for
    16-bit). It must have the image's size, and follows the image through every geometric
    transform with the image's draws, sampled nearest and filled with ``fill`` where the image
    is padded, rotated or shifted in; other transforms leave it as it is (torchvision v2's rules
    for ``tv_tensors.Mask``). A batch holds ``[B, H, W]`` (a list where sizes differ). Read by
    the torch and Ray backends. Default ``max_bytes``: 256 MB; the pixel limit of images applies.

    Args:
        fill: the value brought in by padding, rotation and affine shifts (default 255, the ignore
            index of torchvision's segmentation reference).
    """

    fill: int = 255

    kind: ClassVar[str] = "mask"
    default_max_bytes: ClassVar[int] = 256 << 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.fill, bool) or not isinstance(self.fill, int):
            raise ConfigError(f"Mask: fill must be an int (a label), got {self.fill!r}")
        if self.missing == Missing.EMPTY:
            raise ConfigError("Mask: missing='empty' has no mask of the image's size to give: use 'error' or 'skip'")

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
                    return np.asarray(im, dtype=_MASK_MODES[im.mode])
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
    narrower or lower than ``min_size`` is dropped, with the same rows of the ``labels`` field
    (torchvision's ``SanitizeBoundingBoxes``). Read by the torch and Ray backends.

    A batch holds a :class:`Padded` ``(data [B, K, 4] float32, lengths [B, 2])`` (``pad``, default
    0; ``lengths[:, 0]`` each sample's number of boxes), or with ``pad=None`` a list of ``[K, 4]``.

    Args:
        format: a :class:`BoxFormat` (default ``"XYXY"``); the output keeps it.
        min_size: the smallest width and height a box keeps (default 1.0, torchvision's).
        labels: the name of the field whose rows (an array's first axis, or a JSON list) go with
            the boxes, dropped with them; ``None``: none.
        pad: as :class:`Array`'s (default 0).
    """

    format: BoxFormat | str = BoxFormat.XYXY
    min_size: float = 1.0
    labels: str | None = None
    pad: float | None = 0

    kind: ClassVar[str] = "boxes"
    default_max_bytes: ClassVar[int] = 64 << 20

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "format", valid_enum("Boxes", self.format, "format", BoxFormat))
        if isinstance(self.min_size, bool) or not isinstance(self.min_size, (int, float)) or self.min_size < 0:
            raise ConfigError(f"Boxes: min_size must be a number >= 0, got {self.min_size!r}")
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


def _npy_header(field: Field, data: bytes | memoryview, *, shard: str, key: str) -> tuple[np.dtype, tuple[int, ...],
                                                                                           bool, int]:  # fmt: skip
    """The dtype, shape, order and data offset of a ``.npy`` member, checked: versions 1-3, no
    object dtype, and exactly the bytes the header announces after it."""
    import io

    from numpy.lib import format as npy

    stream = io.BytesIO(data)
    try:
        version = npy.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = npy.read_array_header_1_0(stream)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = npy.read_array_header_2_0(stream)
        else:
            raise ValueError(f"NPY version {version[0]}.{version[1]}")
    except (ValueError, EOFError, SyntaxError, TypeError) as e:
        raise _bad(field, shard, key, f"is not a .npy array ({e})") from None
    if dtype.hasobject:
        raise _bad(field, shard, key, "is an object array (a pickle): refused, never unpickled")
    offset = stream.tell()
    need = math.prod(shape) * dtype.itemsize
    if len(data) - offset != need:
        what = "truncated" if len(data) - offset < need else "longer than its header says"
        raise _bad(field, shard, key, f"is {what}: its header announces {need} bytes of {dtype} {shape}, "
                                      f"{len(data) - offset} follow")  # fmt: skip
    return dtype, tuple(shape), bool(fortran), offset


def _bad(field: Field, shard: str, key: str, what: str) -> SampleError:
    exts = "/".join(field.exts)
    return SampleError(f"the .{exts} field of sample {key!r} in shard {shard!r} {what}", shard=shard, key=key,
                       kind=Damage.BAD_FIELD)  # fmt: skip


def _exts(owner: str, value: Any) -> tuple[str, ...]:
    parts = value.split(";") if isinstance(value, str) else list(value) if isinstance(value, Sequence) else None
    exts = tuple(p.strip().lower().lstrip(".") for p in parts or () if isinstance(p, str) and p.strip())
    if not parts or len(exts) != len(parts):
        raise ConfigError(f"{owner}: exts must be extensions separated by ';' (e.g. 'json;jsn'), got {value!r}")
    return exts


def _inferred(name: str, exts: str | Sequence[str]) -> Field:
    """The field a plain extension string stands for, by its extensions' kind."""
    found = _exts(f"fields[{name!r}]", exts)
    kinds = {_kind_of(e) for e in found}
    if len(kinds) > 1:
        raise ConfigError(f"fields[{name!r}]: {exts!r} mixes kinds of member ({', '.join(sorted(map(str, kinds)))}): "
                          "give one kind per field")  # fmt: skip
    (kind,) = kinds
    if kind is None:
        raise ConfigError(
            f"fields[{name!r}]: gpupipe does not know how to decode .{found[0]} members: give the field as "
            "gp.fields.Text, Json, Label, Array or Image with its extensions"
        )
    return kind(found)


def _refuse_code(owner: str, ext: str) -> None:
    """Refuses an extension webdataset decodes by running code (unpickling, ``torch.load``)."""
    last = ext.rpartition(".")[2]
    if last in _REFUSED:
        raise ConfigError(f"{owner}: .{ext} members are decoded with {_REFUSED[last]} (arbitrary code): gpupipe "
                          "never does; store .npy, .json or .txt instead")  # fmt: skip


def _kind_of(ext: str) -> type[Field] | None:
    _refuse_code("fields", ext)
    last = ext.rpartition(".")[2]
    for exts, kind in ((IMAGE_EXTS, Image), (_LABEL_EXTS, Label), (_TEXT_EXTS, Text), (_JSON_EXTS, Json)):
        if last in exts:
            return kind
    return Array if last == "npy" else None


def parse_fields(fields: Mapping[str, Any]) -> dict[str, Field]:
    """``{name: Field}`` of a source's ``fields=``: each value a :class:`Field`, or extensions
    whose kind says the field's (``"jpg;png"``: :class:`Image`; ``"cls"``: :class:`Label`;
    ``"txt"``: :class:`Text`; ``"json"``: :class:`Json`; ``"npy"``: :class:`Array`; a mask is
    named: ``Mask("seg.png")``).

    Raises:
        ConfigError: not a mapping of identifiers; an extension of no known kind, or decoded by
            unpickling (``pyd``, ``pth``); two fields reading the same extension.
    """
    if not isinstance(fields, Mapping) or not fields:
        raise ConfigError(f"fields must be a non-empty mapping of names to extensions or fields, got {fields!r}")
    out: dict[str, Field] = {}
    owner: dict[str, str] = {}
    for name, spec in fields.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"fields: a field's name must be an identifier (batch[name]), got {name!r}")
        field = spec if isinstance(spec, Field) else _inferred(name, spec)
        for ext in field.exts:
            if ext in owner:
                raise ConfigError(f"fields: .{ext} is read by both {owner[ext]!r} and {name!r}")
            owner[ext] = name
        out[name] = field
    for name, field in out.items():
        if isinstance(field, Boxes) and field.labels is not None and field.labels not in out:
            raise ConfigError(f"fields: the {name!r} boxes' labels={field.labels!r} names no field")
    return out


def field_values(fields: Mapping[str, Field], stored: Mapping[str, bytes | None] | None, *, shard: str,
                 key: str) -> dict[str, Any] | None:  # fmt: skip
    """The values of a sample's ``fields`` (``Index.fields``) from its members' bytes
    (``stored``, by name), decoded safely (``gpupipe.core._fields``); a field without a member
    gets its empty value. ``None`` for a source without fields."""
    if not fields:
        return None
    stored = stored or {}
    out = {}
    for name, field in fields.items():
        data = stored.get(name)
        out[name] = field.empty() if data is None else field.decode(data, shard=shard, key=key)
    return out
