"""The gpupipe exception hierarchy, in one place.

Every exception gpupipe raises on purpose derives from :class:`GpupipeError`. Argument errors
also derive from :class:`ValueError` (or :class:`TypeError`) so that code written against
torchvision's exceptions keeps working.

All constructors take a single message as their first argument, so the exceptions survive being
re-raised across DataLoader worker processes.
"""

from __future__ import annotations

import enum
import re
from typing import NamedTuple

__all__ = [
    "redact",
    "Damage",
    "GpupipeError",
    "ConfigError",
    "PipelineError",
    "UnsupportedTransformError",
    "BackendUnavailableError",
    "ClosedError",
    "WorkerError",
    "DataError",
    "ShardError",
    "SampleError",
    "Problem",
    "problem_error",
    "SHARD_DAMAGE",
    "truncated",
    "unreadable",
    "too_many_bytes",
    "counted",
]


_CREDENTIALS = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s'\"?#]+@")  # to the authority's last @
_QUERY = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s?#'\"]*)\?[^\s#'\"]*")
# in text naming a URL: a query string right after a name, wherever its URL starts (a path may
# hold spaces: "my data/s.tar?sig=...", which _QUERY does not see as one URL); its first parameter
# with a value or not ("?download&sig=...")
_PARAMETERS = re.compile(r"(?<=[^\s?#'\"])\?(?=[^\s#'\"=&?]+[=&])[^\s#'\"]*")


def counted(n: int, noun: str) -> str:
    """``"1 shard"``, ``"3 shards"``: a count and its noun, for messages."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def redact(text: str) -> str:
    """``text`` with the secrets a URL can carry masked: ``user:password@`` and the whole query
    string (presigned URLs sign there: ``X-Amz-Signature=``, ``sig=``, tokens). Every message
    and every shard name gpupipe reports about remote data goes through it."""
    text = _QUERY.sub(r"\1?<redacted>", _CREDENTIALS.sub(r"\1<redacted>@", text))
    return _PARAMETERS.sub("?<redacted>", text) if "://" in text else text


class GpupipeError(Exception):
    """Base class of every error gpupipe raises."""


class ConfigError(GpupipeError, ValueError):
    """An invalid argument: a transform, source or loader option out of range or of the wrong type."""


class PipelineError(ConfigError):
    """The pipeline as a whole cannot run: found when it is checked, before any data is read."""


class UnsupportedTransformError(PipelineError):
    """A backend has no lowering for a transform of the pipeline."""


class BackendUnavailableError(GpupipeError, RuntimeError):
    """The requested backend or device is not installed or not present on this machine."""


class ClosedError(GpupipeError, RuntimeError):
    """The loader (or its runner) was closed: it cannot be iterated again."""


class WorkerError(GpupipeError, RuntimeError):
    """A process gpupipe started (a torch-backend worker, a ``gpupipe check`` process) ended
    unexpectedly: killed (often by the kernel's out-of-memory killer: see ``dmesg``) or crashed in
    native code. Raised instead of waiting for it.

    Attributes:
        pid: the process id (``None`` where unknown).
        exitcode: its ``multiprocessing`` exit code: negative for a signal (``-9``: SIGKILL),
            ``None`` where unknown.
    """

    def __init__(self, message: str, *, pid: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode


class Damage(str, enum.Enum):
    """What is wrong with a shard or a sample: :attr:`DataError.kind`, the kinds
    ``gpupipe check`` counts, and :attr:`~gpupipe.SkippedSample.kind`.

    Shards: ``MISSING_SHARD`` (no such file), ``UNREADABLE_SHARD`` (an I/O error, or not a tar
    file), ``EMPTY_SHARD`` (no samples), ``TRUNCATED_SHARD`` (the file ends inside a member; the
    complete samples before the cut are usable, and a shard that shrank after indexing is one too).
    Samples: ``NO_IMAGE``, ``NO_LABEL``, ``DUPLICATE_KEY`` (a key seen before in the shard; the
    first one is used), ``BAD_LABEL`` (not an ASCII int64, or outside the ``num_classes`` of the
    pipeline's ``batch_transform``), ``EMPTY_IMAGE`` (zero bytes),
    ``UNDECODABLE`` (not an image the decoders read, or corrupt), ``UNSUPPORTED`` (a format or
    kind of image gpupipe does not accept: GIF, lossless JPEG), ``TOO_LARGE`` (over the pixel
    limit or the byte limit), ``TOO_SMALL`` (smaller than a transform needs). The rules:
    ``gpupipe/runtime/_decode.py``.
    Fields beyond the image and its class (``gpupipe/core/_fields.py``): ``MISSING_FIELD`` (absent,
    under ``missing="error"``), ``BAD_FIELD`` (over its size limit, not UTF-8 or JSON, a ``.npy``
    that is truncated or an object array).
    """

    MISSING_SHARD = "missing-shard"
    UNREADABLE_SHARD = "unreadable-shard"
    EMPTY_SHARD = "empty-shard"
    TRUNCATED_SHARD = "truncated-shard"
    NO_IMAGE = "no-image"
    NO_LABEL = "no-label"
    DUPLICATE_KEY = "duplicate-key"
    BAD_LABEL = "bad-label"
    EMPTY_IMAGE = "empty-image"
    UNDECODABLE = "undecodable"
    UNSUPPORTED = "unsupported-format"
    TOO_LARGE = "too-large"
    TOO_SMALL = "too-small"
    MISSING_FIELD = "missing-field"
    BAD_FIELD = "bad-field"

    def __str__(self) -> str:
        return self.value


class DataError(GpupipeError):
    """Bad input data. Subclasses name the shard and, where known, the sample key.

    Attributes:
        shard, key: where (``None`` where unknown).
        kind: what is wrong, a :class:`Damage` (``None`` where not classified).
    """

    def __init__(
        self, message: str, *, shard: str | None = None, key: str | None = None, kind: Damage | None = None
    ) -> None:
        super().__init__(redact(message))
        self.shard = None if shard is None else redact(shard)
        self.key = key
        self.kind = kind


class ShardError(DataError):
    """A shard (tar file, directory) cannot be read or is malformed."""


class SampleError(DataError):
    """One sample cannot be used: image missing or undecodable, label missing or not an integer,
    too small for a transform."""

    @classmethod
    def at(
        cls,
        message: str,
        *,
        shard: str,
        key: str,
        size: tuple[int, int] | None = None,
        kind: Damage | None = Damage.TOO_SMALL,
    ) -> SampleError:
        """``"sample '<key>' in shard '<shard>' (<h>x<w>): <message>"``, the same on every backend."""
        where = f" ({size[0]}x{size[1]})" if size is not None else ""
        return cls(f"sample {key!r} in shard {shard!r}{where}: {message}", shard=shard, key=key, kind=kind)


SHARD_DAMAGE = frozenset({Damage.MISSING_SHARD, Damage.UNREADABLE_SHARD, Damage.EMPTY_SHARD, Damage.TRUNCATED_SHARD})


class Problem(NamedTuple):
    """Damage a shard's index found: a whole shard's (``key`` ``None``) or a sample's that the index
    leaves out of its numbering (no image, no label, a duplicate key). ``detail`` completes the
    sentence ``"sample '<key>' in shard '<shard>' ..."`` (or ``"shard '<shard>' ..."``)."""

    kind: Damage
    key: str | None
    detail: str


def problem_error(shard: str, problem: Problem) -> DataError:
    """The error of ``problem`` in ``shard``: a ShardError for a shard's damage, else a SampleError."""
    kind, key, detail = problem
    where = f"shard {shard!r}" if key is None else f"sample {key!r} in shard {shard!r}"
    cls = ShardError if kind in SHARD_DAMAGE else SampleError
    return cls(f"{where} {detail}", shard=shard, key=key, kind=kind)


def unreadable(shard: str, key: str, error: OSError) -> ShardError:
    """The error of a sample's byte range that storage could not read."""
    return ShardError(
        f"cannot read shard {shard!r} at sample {key!r}: {error}", shard=shard, key=key, kind=Damage.UNREADABLE_SHARD
    )


def too_many_bytes(shard: str, key: str, size: int, limit: int) -> SampleError:
    """The error of an image member over the byte limit (``max_image_bytes``), found from its size
    in the tar header (or the file's stat) before any of it is read."""
    return SampleError(
        f"the image of sample {key!r} in shard {shard!r} is {size} bytes, more than max_image_bytes={limit}: "
        "not read (a damaged or crafted member; raise the limit if it is real)",
        shard=shard,
        key=key,
        kind=Damage.TOO_LARGE,
    )


def truncated(shard: str, key: str) -> ShardError:
    """The error of a sample's byte range that came back short: the shard shrank after indexing."""
    return ShardError(
        f"shard {shard!r} is truncated at sample {key!r} (it changed after it was indexed)",
        shard=shard,
        key=key,
        kind=Damage.TRUNCATED_SHARD,
    )
