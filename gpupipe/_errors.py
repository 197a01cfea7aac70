"""The gpupipe exception hierarchy, in one place.

Every exception gpupipe raises on purpose derives from :class:`GpupipeError`. Argument errors
also derive from :class:`ValueError` (or :class:`TypeError`) so that code written against
torchvision's exceptions keeps working.

All constructors take a single message as their first argument, so the exceptions survive being
re-raised across DataLoader worker processes.
"""

from __future__ import annotations

__all__ = [
    "GpupipeError",
    "ConfigError",
    "PipelineError",
    "UnsupportedTransformError",
    "BackendUnavailableError",
    "ClosedError",
    "DataError",
    "ShardError",
    "SampleError",
]


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


class DataError(GpupipeError):
    """Bad input data. Subclasses name the shard and, where known, the sample key."""

    def __init__(self, message: str, *, shard: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.shard = shard
        self.key = key


class ShardError(DataError):
    """A shard (tar file, directory) cannot be read or is malformed."""


class SampleError(DataError):
    """One sample cannot be used: image missing or undecodable, label missing or not an integer,
    too small for a transform."""

    @classmethod
    def at(cls, message: str, *, shard: str, key: str, size: tuple[int, int] | None = None) -> SampleError:
        """``"sample '<key>' in shard '<shard>' (<h>x<w>): <message>"``, the same on every backend."""
        where = f" ({size[0]}x{size[1]})" if size is not None else ""
        return cls(f"sample {key!r} in shard {shard!r}{where}: {message}", shard=shard, key=key)
