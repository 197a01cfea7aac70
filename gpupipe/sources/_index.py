"""The index of a source's samples: bookkeeping only, no I/O of its own.

An :class:`Index` numbers a source's samples ``0..N-1`` in shard order, then member order, and
says where each one is. Reading a sample is delegated to the source's :class:`Reader`, and a
shard's details (keys and per-sample columns) come from a loader function the source provides, so
that the index itself never touches storage.
"""

from __future__ import annotations

import abc
import collections
import operator
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..core._errors import Damage, DataError, SampleError, problem_error
from ..shards._shard import NO_LABEL, RawSample, Reader, ShardDetail, ShardIndex

__all__ = [
    "RawSample",
    "ShardIndex",
    "ShardDetail",
    "Reader",
    "Index",
    "Source",
    "Located",
    "NO_LABEL",
]


class Located(NamedTuple):
    """Where a batch of samples is, from the index alone (no I/O), vectorized.

    Attributes:
        shard: int64 ``[B]``, each sample's shard number.
        keys: the ``B`` keys.
        labels: int64 ``[B]`` (``NO_LABEL`` where a label is not an integer), from the shards'
            parsed ``label`` column; ``None`` for unlabeled sources, or where a shard has no such
            column (the labels then come from :meth:`Index.read`).
        ranges: int64 ``[B, 2]``, the encoded image's offset and size in its shard (its
            ``image_range`` column), or ``None`` where the source's samples are not byte ranges
            of their shards (ImageFolder).
        groups: the batch's positions shard by shard (int64 arrays, each in batch order).
    """

    shard: np.ndarray
    keys: list[str]
    labels: np.ndarray | None
    ranges: np.ndarray | None
    groups: list[np.ndarray]


class Index:
    """All samples of a source, numbered 0..N-1 in shard order, then member order.

    Attributes:
        shards: one :class:`ShardIndex` per shard, in order.
        sequential: ``True`` where shards are best read front to back (tar files); ``False`` where
            every sample is its own file (ImageFolder).
        labeled: whether samples carry labels.
        images: whether samples have an image (``False``: a source of fields alone, ``.npy``
            arrays say; ``RawSample.data`` is then empty).
        fields: the samples' fields beyond the image and the label (a source's ``fields=``), by
            name: how each is decoded (``gpupipe.core._fields.Field``); empty for most sources.
        shard_sizes: int64 ``[S]``, samples per shard; ``offsets``: int64 ``[S + 1]``, cumulative.
        num_classes: the classes a label must lie in, ``0 .. num_classes - 1`` (``None``: any
            int64). The loader sets it from the pipeline's ``batch_transform`` (MixUp, CutMix:
            their ``num_classes``); a label outside is a sample of kind ``bad-label``
            (:meth:`read`, :meth:`refused_labels`), skipped or raised as the loader's
            ``on_error`` says, never a one-hot error that ends the epoch.

    Reading (:meth:`read`) is thread-safe and goes through the source's reader.
    """

    MAX_LOADED = 1024  # lazily loaded shard details kept per process

    def __init__(self, shards: list[ShardIndex], *, reader: Reader, sequential: bool, labeled: bool,
                 fields: dict[str, Any] | None = None, images: bool = True) -> None:  # fmt: skip
        self.shards = shards
        self.reader = reader
        self.sequential = sequential
        self.labeled = labeled
        self.fields: dict[str, Any] = dict(fields or {})  # name -> gpupipe.core._fields.Field, beyond image and label
        self.images = images  # whether samples have an image (not: a source of fields alone)
        self.shard_sizes = np.array([len(s) for s in shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self.num_classes: int | None = None
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._lock = threading.Lock()
        self._loaded: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_loaded")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def problems(self) -> list[DataError]:
        """Damage found when indexing, shard by shard: whole shards refused, in part (truncated)
        or whole (missing, unreadable, empty), and samples left out of the numbering (no image,
        no label, duplicate key). ``Source.index(on_error="raise")`` raises the first."""
        return [e for s in self.shards for e in s.errors()]

    @property
    def bad(self) -> np.ndarray:
        """int64 ``[K]``, sorted: the global numbers of the samples listed as bad beside their
        shards (``ShardIndex.bad``), which loaders leave out of their plans."""
        parts = [np.array([n for n, _ in s.bad], np.int64) + self.offsets[i] for i, s in enumerate(self.shards)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def bad_errors(self) -> list[DataError]:
        """The errors of :attr:`bad`, in order."""
        return [problem_error(s.path, p) for s in self.shards for _, p in s.bad]

    @property
    def max_image_bytes(self) -> int | None:
        """The largest image member read (``None``: no limit): a larger one is refused from its size
        alone, before any of it is read (``SampleError`` of kind ``too-large``): by :meth:`read`
        (the source's reader) and by a backend reading :meth:`locate_batch`'s ranges itself. The
        loader sets it from ``LoaderConfig.max_image_bytes``."""
        return self.reader.max_image_bytes

    @max_image_bytes.setter
    def max_image_bytes(self, limit: int | None) -> None:
        self.reader.max_image_bytes = limit

    def close(self) -> None:
        """Closes what the reader holds open (it reopens on the next read)."""
        self.reader.close()

    def locate(self, sample: int) -> tuple[int, int]:
        """Global sample number → (shard number, sample number in the shard)."""
        shard = int(np.searchsorted(self.offsets, sample, side="right")) - 1
        return shard, sample - int(self.offsets[shard])

    def shard(self, s: int) -> ShardIndex:
        """Shard ``s`` with its details loaded; keeps at most ``MAX_LOADED`` lazily loaded."""
        shard = self.shards[s]
        if shard.lazy:
            with self._lock:
                self._loaded[s] = None
                self._loaded.move_to_end(s)
                while len(self._loaded) > self.MAX_LOADED:
                    self.shards[self._loaded.popitem(last=False)[0]].release()
        shard.detail()
        return shard

    def key(self, sample: int) -> str:
        s, i = self.locate(sample)
        return self.shard(s).keys[i]

    def locate_batch(self, samples: np.ndarray) -> Located:
        """Shards, keys, labels and byte ranges of ``samples`` (global numbers, int64 ``[B]``),
        with a few array operations per shard the batch touches."""
        samples = np.asarray(samples, dtype=np.int64)
        shard = np.searchsorted(self.offsets, samples, side="right") - 1
        local = samples - self.offsets[shard]
        n = len(samples)
        keys: list[str] = [""] * n
        labels = np.empty(n, np.int64) if self.labeled else None
        ranges: np.ndarray | None = np.empty((n, 2), np.int64)
        order = np.argsort(shard, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(shard[order])) + 1) if n else []
        for group in groups:
            detail = self.shard(int(shard[group[0]]))
            rows = local[group]
            got = operator.itemgetter(*rows.tolist())(detail.keys) if len(rows) > 1 else (detail.keys[int(rows[0])],)
            for j, key in zip(group.tolist(), got, strict=True):
                keys[j] = key
            columns = detail.detail()[1]
            if labels is not None:
                labels = labels if "label" in columns else None
                if labels is not None:
                    labels[group] = columns["label"][rows]
            if ranges is not None:
                ranges = ranges if "image_range" in columns else None
                if ranges is not None:
                    ranges[group] = columns["image_range"][rows]
        return Located(shard, keys, labels, ranges, groups)

    def read(self, sample: int) -> RawSample:
        """Reads sample number ``sample``: its key, shard, encoded image and parsed label (a
        ``SampleError`` of kind ``bad-label`` where the label is outside :attr:`num_classes`)."""
        s, i = self.locate(sample)
        return self.label_checked(self.reader.read(self.shard(s), i))

    def label_checked(self, raw: RawSample) -> RawSample:
        """``raw``, or the ``SampleError`` (``bad-label``) of its label outside :attr:`num_classes`."""
        n = self.num_classes
        if n is not None and raw.label is not None and not 0 <= raw.label < n:
            raise SampleError(
                f"the label of sample {raw.key!r} in shard {raw.shard!r} is {raw.label}, not a class of the "
                f"pipeline's batch_transform (num_classes={n}: 0 to {n - 1})",
                shard=raw.shard,
                key=raw.key,
                kind=Damage.BAD_LABEL,
            )
        return raw

    def refused_labels(self, labels: np.ndarray) -> np.ndarray:
        """bool ``[B]``: which of :meth:`locate_batch`'s ``labels`` :meth:`read` refuses (not an
        integer: ``NO_LABEL``; outside :attr:`num_classes`), for a backend that reads the labels
        from the index: it reads those samples to raise their errors."""
        refused = labels == NO_LABEL
        if self.num_classes is not None:
            refused |= (labels < 0) | (labels >= self.num_classes)
        return refused

    def read_files_into(self, samples: np.ndarray, take: Callable[[int], np.ndarray]) -> Any:
        """``samples`` (global numbers) read whole into one buffer of ``take(total)``, where the
        source's samples are whole files and its reader reads a batch of them at once
        (``FileReader.read_files_into``: a ``WholeFiles``); ``None`` where not (read each with
        :meth:`read`)."""
        read = getattr(self.reader, "read_files_into", None)
        if read is None:
            return None
        samples = np.asarray(samples, dtype=np.int64)
        shard = np.searchsorted(self.offsets, samples, side="right") - 1
        local = (samples - self.offsets[shard]).tolist()
        shards = {s: self.shard(s) for s in set(shard.tolist())}
        return read([(shards[s], i) for s, i in zip(shard.tolist(), local, strict=True)], take)

    def read_fields(self, sample: int) -> dict[str, bytes | None] | None:
        """The bytes of sample ``sample``'s :attr:`fields` by name (``None``: no member), without
        its image; ``None`` for a source without fields."""
        if not self.fields:
            return None
        s, i = self.locate(sample)
        return self.reader.read_fields(self.shard(s), i)  # type: ignore[attr-defined]


class Source(abc.ABC):
    """Base class of data sources: a cheap, picklable description whose :meth:`index` reads the
    metadata (tar headers, a directory tree) and returns an :class:`Index`.

    A new source implements :meth:`index`: its shards as :class:`ShardIndex` entries and a
    :class:`Reader` over a :class:`~gpupipe.sources.Storage`.
    """

    def listing(self) -> Any:
        """For a source that grows between epochs (``WebDataset(..., relist=True)``): the shards
        present now, as a hashable value (a tuple of URLs); ``None`` (the default): the source's
        shards are fixed. A loader asks again at each new epoch (``set_epoch``)."""
        return None

    def with_listing(self, listing: Any) -> Source:
        """The fixed source of ``listing`` (a value :meth:`listing` returned): what a loader
        indexes for an epoch."""
        return self

    @abc.abstractmethod
    def index(self, *, rank: int = 0, world_size: int = 1, on_error: Any = "raise") -> Index:
        """Indexes the source. ``rank`` and ``world_size`` only spread first-time work (scanning)
        between ranks; every rank gets the same index. Damage found while indexing raises its
        :class:`~gpupipe.DataError` under ``on_error="raise"``; under ``"skip"`` it is listed in
        ``Index.problems`` and the damaged samples are not in the index."""
