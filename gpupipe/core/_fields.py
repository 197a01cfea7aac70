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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ._errors import ConfigError, Damage, SampleError
from ._imageinfo import MAX_IMAGE_BYTES
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
        try:
            return self._decode(data, shard=shard, key=key)
        except SampleError:
            raise
        except Exception as e:  # a decoder's error no rule above names: still this field's, never the epoch's
            raise _bad(self, shard, key, f"cannot be decoded ({type(e).__name__}: {e})") from None

    def empty(self) -> Any:
        """The value of a sample without the field, under ``missing="empty"``."""
        return None

    def missing_error(self, name: str, *, shard: str, key: str) -> SampleError:
        """The error of a sample without the field ``name`` (``missing="error"``)."""
        return SampleError(f"sample {key!r} in shard {shard!r} has no {name!r} field ({'/'.join(self.exts)})",
                           shard=shard, key=key, kind=Damage.MISSING_FIELD)  # fmt: skip

    def _decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        return bytes(data)

    @property
    def arrays(self) -> bool:
        """Whether the values are arrays, batched as tensors (``gpupipe.backends._fields``)."""
        return False

    def require_fits(self, size: int, *, shard: str, key: str) -> None:
        """Raises the bad field's error if a member of ``size`` bytes is over ``max_bytes``:
        checked before the member is read."""
        assert isinstance(self.max_bytes, int)
        if size > self.max_bytes:
            raise _bad(self, shard, key, f"is {size} bytes, over its max_bytes={self.max_bytes}")


@dataclasses.dataclass(frozen=True)
class Image(Field):
    """The image: decoded by the backend (nvJPEG, or the CPU decoders), not here. Its byte limit
    is the loader's ``max_image_bytes`` (and ``gpupipe check``'s), beside ``max_image_pixels``:
    ``max_bytes`` is not taken here."""

    kind: ClassVar[str] = "image"
    default_max_bytes: ClassVar[int] = MAX_IMAGE_BYTES

    def __post_init__(self) -> None:
        if self.max_bytes is not None:
            raise ConfigError("Image: an image's byte limit is the loader's max_image_bytes= (default 256 MiB), "
                              "as its pixel limit is max_image_pixels=; drop max_bytes here")  # fmt: skip
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class Text(Field):
    """UTF-8 text (``str``), as webdataset's ``txt``; invalid UTF-8 is a bad field. Default
    ``max_bytes``: 1 MiB.

    Args:
        tokenizer: ``str -> token ids`` (a list, NumPy array or tensor of integers: open_clip's
            ``tokenize``, a Hugging Face tokenizer's ``input_ids``), run where the field is decoded:
            the torch backend's worker processes, the DALI backend's reader threads, never the
            training thread. The value is then an int64 array (a ``[1, L]`` result, open_clip's
            for one string, is taken as ``[L]``), batched as an :class:`Array`'s: ``[B, L]`` when
            every sample has the same length. A tokenizer that raises makes the sample's field
            bad. The torch backend's workers need it picklable (a module-level function, or an
            object with its tokenizer). ``None`` (default): the text itself.
        pad: with a tokenizer, as :class:`Array`'s ``pad`` (token ids of different lengths in one
            :class:`Padded`).
    """

    tokenizer: Callable[[str], Any] | None = None
    pad: int | None = None

    kind: ClassVar[str] = "text"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is not None and not callable(self.tokenizer):
            raise ConfigError(f"Text: tokenizer must be a function of a str, got {self.tokenizer!r}")
        if self.pad is not None and (self.tokenizer is None or isinstance(self.pad, bool)
                                     or not isinstance(self.pad, int)):  # fmt: skip
            raise ConfigError(f"Text: pad must be None, or an int token id with a tokenizer, got {self.pad!r}")

    @property
    def arrays(self) -> bool:
        return self.tokenizer is not None

    def empty(self) -> Any:
        return "" if self.tokenizer is None else self._tokens("", shard="", key="")

    def _decode(self, data: bytes | memoryview, *, shard: str, key: str) -> Any:
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad(self, shard, key, f"is not UTF-8 text ({e.reason} at byte {e.start})") from None
        return text if self.tokenizer is None else self._tokens(text, shard=shard, key=key)

    def _tokens(self, text: str, *, shard: str, key: str) -> np.ndarray:
        assert self.tokenizer is not None
        try:
            ids = self.tokenizer(text)
            if hasattr(ids, "numpy"):  # a tensor
                ids = ids.numpy()
            tokens = np.asarray(ids)
        except Exception as e:  # the user's tokenizer: any failure is this field's
            raise _bad(self, shard, key, f"fails its tokenizer ({type(e).__name__}: {e})") from None
        if tokens.ndim == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.dtype.kind not in "iub" or tokens.ndim != 1:
            raise _bad(self, shard, key, f"tokenizes to a {tokens.dtype} array of shape {tokens.shape}, not [L] "
                                         "integers")  # fmt: skip
        return tokens.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Json(Field):
    """JSON (``json.loads`` of UTF-8: a ``dict``, ``list``, ...), as webdataset's ``json``.
    Default ``max_bytes``: 1 MiB; nesting deeper than Python's recursion limit, or an integer of more
    digits than Python converts (``sys.get_int_max_str_digits()``, 4,300), is a bad field."""

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
        except ValueError as e:  # int(): more digits than sys.get_int_max_str_digits() (4300)
            raise _bad(self, shard, key, f"is not JSON gpupipe reads ({e})") from None


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
    describe exactly the bytes that follow. Default ``max_bytes``: 256 MiB, as the images'.

    Args:
        dtype: what every sample's array's dtype must be (``None``: any); a mismatch is a bad field.
        shape: what every sample's array's shape must be (``None``: any); likewise.
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
    default_max_bytes: ClassVar[int] = MAX_IMAGE_BYTES

    @property
    def arrays(self) -> bool:
        return True

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


def _npy_header(field: Field, data: bytes | memoryview, *, shard: str, key: str) -> tuple[np.dtype, tuple[int, ...],
                                                                                           bool, int]:  # fmt: skip
    """The dtype, shape, order and data offset of a ``.npy`` member, checked: versions 1-3, no
    object dtype, and exactly the bytes the header announces after it."""
    import io

    from ._npy import read_header

    stream = io.BytesIO(data)
    try:
        _, shape, fortran, dtype = read_header(stream)
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
    ``"txt"``: :class:`Text`; ``"json"``: :class:`Json`; ``"npy"``: :class:`Array`; masks and
    boxes are named: ``Mask("seg.png")``, ``Boxes("boxes.npy")``, ``gpupipe.core._targets``).

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
    for name, field in out.items():  # boxes name the field of their labels (gpupipe.core._targets.Boxes)
        labels = getattr(field, "labels", None)
        if labels is not None and labels not in out:
            raise ConfigError(f"fields: the {name!r} boxes' labels={labels!r} names no field")
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
