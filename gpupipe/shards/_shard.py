"""One shard's samples: :class:`ShardIndex` (its size; keys and per-sample columns loaded on
first use), the :class:`RawSample` a :class:`Reader` reads from it, and ``NO_LABEL``. The floor's
other modules build a shard's index; :class:`~gpupipe.sources.Index` numbers many of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

import numpy as np

from ..core._errors import DataError, Problem, ShardError, problem_error
from ..storage import Storage

__all__ = ["NO_LABEL", "RawSample", "ShardDetail", "ShardIndex", "Reader", "FieldMembers", "field_column", "fields_id"]

NO_LABEL = np.iinfo(np.int64).min  # in a parsed ``label`` column: the label member is not an integer


class RawSample(NamedTuple):
    """One sample as stored: encoded image bytes, the label (``None`` for unlabeled data) and,
    for a source with ``fields=``, each other field's member bytes by name (``None``: absent,
    under ``missing="empty"``)."""

    key: str
    shard: str
    data: bytes
    label: int | None
    fields: Mapping[str, bytes | None] | None = None


class FieldMembers(NamedTuple):
    """A field beyond the image and the label, as a shard's index knows it: its name, the member
    extensions it is read from (the first present) and what a sample without one is
    (``"error"``, ``"skip"``, ``"empty"``: ``gpupipe.core._fields.Missing``)."""

    name: str
    exts: tuple[str, ...]
    missing: str


def fields_id(fields: tuple[FieldMembers, ...]) -> str:
    """A set of fields as one string (``""``: none): what an index cache file is keyed on and a
    bad-sample list names, since both number samples by the fields asked for."""
    return ",".join(f"{f.name}={';'.join(f.exts)}/{f.missing}" for f in fields)


def field_column(name: str) -> str:
    """The index column of the field ``name``'s member ranges: int64 ``[N, 2]`` offset and size,
    ``(-1, -1)`` where the sample has none."""
    return f"field:{name}"


ShardDetail = tuple[list[str], Mapping[str, np.ndarray]]  # keys, per-sample columns (first axis: sample)


class ShardIndex:
    """The samples of one shard: ``size``, and (loaded on first use) their keys and per-sample
    columns, named by the source (a tar shard's ``image_range`` and ``label_range``, ``[N, 2]``
    offset and size; an ImageFolder class's ``label``, ``[N]``).

    Details are given directly (``keys=``, ``columns=``) or loaded lazily by ``loader`` — from a
    cached index file, say — so that a loader over thousands of shards starts from the shard
    sizes alone and each rank only loads the details of the shards it reads.

    Args:
        path: the shard's URL (or the ImageFolder root).
        keys, columns: the details, when known now.
        size: the number of samples, when the details load later.
        loader: returns ``(keys, columns)``, when the details load later.
        dali_index: the shard's cached index file in DALI's format, where there is one.
        records: where what a loader learns of the shard's samples is recorded (their images'
            sizes), for a shard without ``dali_index`` (an ImageFolder class): a function giving
            the record's path, called once when first needed (``None`` from it: nowhere).
        problems: damage found when the shard was indexed (:class:`Problem`); samples listed
            there are not numbered.

    Attributes:
        bad: ``(sample number, problem)`` of numbered samples known to be bad (listed by
            ``gpupipe check`` beside the shard), sorted; loaders leave them out of their plans.
        nbytes: the shard file's size in bytes, where the source knows it (``None`` elsewhere).
        detail_needs_data: whether loading the details reads the shard's data (a remote shard
            known from its sample count alone: it is downloaded whole to be scanned).
    """

    def __init__(
        self,
        path: str,
        keys: list[str] | None = None,
        columns: Mapping[str, np.ndarray] | None = None,
        *,
        size: int | None = None,
        loader: Callable[[], ShardDetail] | None = None,
        dali_index: str | None = None,
        records: Callable[[], str | None] | None = None,
        problems: tuple[Problem, ...] = (),
    ) -> None:
        if keys is None and (loader is None or size is None):
            raise ValueError("ShardIndex needs keys, or a size and a loader")
        self.path = path
        self.dali_index = dali_index
        self._records = records
        self._record: str | None = None  # records(), once called
        self.problems = tuple(problems)
        self.bad: tuple[tuple[int, Problem], ...] = ()
        self.nbytes: int | None = None  # the shard file's size, where the source knows it
        self.detail_needs_data = False
        self.size = len(keys) if keys is not None else int(size)  # type: ignore[arg-type]
        self._loader = loader
        self._detail: ShardDetail | None = None if keys is None else (keys, dict(columns or {}))

    def __len__(self) -> int:
        return self.size

    def errors(self) -> list[DataError]:
        """The :attr:`problems` as errors naming this shard (and the sample)."""
        return [problem_error(self.path, p) for p in self.problems]

    @property
    def lazy(self) -> bool:
        """Whether the details load on demand (and may be released)."""
        return self._loader is not None

    @property
    def loaded(self) -> bool:
        return self._detail is not None

    def release(self) -> None:
        """Forgets lazily loaded details (they are loaded again when needed)."""
        if self._loader is not None:
            self._detail = None

    def detail(self) -> ShardDetail:
        """``(keys, columns)``, loaded if need be."""
        if self._detail is None:
            assert self._loader is not None
            detail = self._loader()
            if len(detail[0]) != self.size:
                raise ShardError(
                    f"the index of shard {self.path!r} changed while in use ({len(detail[0])} samples, "
                    f"{self.size} expected)",
                    shard=self.path,
                )
            self._detail = detail
        return self._detail

    @property
    def keys(self) -> list[str]:
        return self.detail()[0]

    def record(self) -> str | None:
        """The path under which what a loader learns of this shard's samples is recorded (beside
        which their sizes are saved: ``_indexcache.save_sizes``): its index cache file, else its
        ``records`` path; ``None`` where there is none."""
        if self.dali_index is not None:
            return self.dali_index
        records = self._records  # (reader threads may ask at once: each gets the path)
        if records is not None:
            self._record = records()
            self._records = None
        return self._record

    def column(self, name: str) -> np.ndarray:
        """The per-sample column ``name`` (first axis: sample)."""
        return self.detail()[1][name]


class Reader(Protocol):
    """How a source reads one sample; the index delegates :meth:`Index.read` to it.

    ``storage`` is what the shards' bytes are read through. :meth:`Index.locate_batch` gives each
    sample's byte ranges in it (``Located.ranges``: image data, where the source knows them), so
    a backend may read a batch's encoded images itself, range by range, instead of sample by
    sample through :meth:`read`: the DALI backend does (``Storage.read_ranges_into``, or
    ``Storage.map`` for local shards). A reader of whole files (``ImageFolder``'s) may also have
    ``read_files_into(items, take)``: a batch of them read into one buffer
    (``Index.read_files_into``).

    ``max_image_bytes`` (set by the loader: ``Index.max_image_bytes``; ``None``: no limit) is the
    largest image member :meth:`read` reads: a larger one raises ``SampleError`` (``too-large``,
    ``gpupipe.core._errors.too_many_bytes``) from its size alone, before any of it is read.
    """

    storage: Storage
    max_image_bytes: int | None

    def read(self, shard: ShardIndex, i: int) -> RawSample:
        """Sample ``i`` of ``shard``; raises DataError naming the shard and the key."""

    def close(self) -> None:
        """Releases what the reader holds open (it reopens on demand)."""
