"""Several sources in one loader: ``gp.Mix``, its index (the sources' shards one after another)
and the storage that serves each shard from its own source's storage. Which samples of each
source an epoch takes is the plan layer's (``gpupipe.plan._mix``)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import IO, Any, NamedTuple, cast

import numpy as np

from ..core._errors import ConfigError
from ..core._validate import is_int
from ..shards._shard import NO_LABEL, RawSample, ShardIndex
from ..storage import MappedFile, Stat, Storage
from ._index import Index, Located, Source

__all__ = ["Mix", "MixIndex", "MixCounts", "SourceOf", "counts_of"]


@dataclasses.dataclass(frozen=True)
class Mix(Source):
    """Several sources read as one, each taking its share of every epoch.

    Args:
        sources: the sources to mix (:class:`~gpupipe.WebDataset`, :class:`~gpupipe.ImageFolder`,
            :class:`~gpupipe.FakeData`, local or remote; a shard pattern or list of shard paths is
            taken as a ``WebDataset``). All labeled, or all unlabeled.
        weights: keyword-only: each source's share of an epoch of ``num_samples`` samples
            (positive numbers, normalized; rounded to whole counts that add up exactly, largest
            remainders first).
        counts: keyword-only, instead of ``weights``: each source's number of samples per epoch.
            Default (neither given): every sample of every source once per epoch, as a
            concatenation of the sources.
        num_samples: keyword-only, with ``weights``: samples per epoch in all. Default: the
            sources' sizes added up.
        replacement: keyword-only. ``False`` (default): a source whose count is ``c`` and size
            ``n`` gives each of its samples ``c // n`` times, and ``c % n`` more of them, drawn at
            random without replacement — every sample at most once where ``c <= n``. ``True``:
            ``c`` samples drawn independently, uniformly, with replacement (as
            ``torch.utils.data.WeightedRandomSampler(..., replacement=True)``).
        label_offsets: keyword-only: added to each source's labels (``[0, 1000]`` puts a second
            1,000-class dataset's classes after the first's). Default: labels as each source
            has them.

    Each epoch's draw is a pure function of ``(seed, epoch)``: every rank computes the same
    one, and takes its share of it as of any source (shards in a shuffled order, samples
    interleaved and shuffled in a window; a full permutation where a source is an
    ImageFolder). Counts are exact per epoch. A sample taken twice in an epoch is augmented
    independently each time (its copies draw their own parameters). Draws are keyed by the
    sample's number in the mix (the sources' samples numbered one source after another): the
    first copy of a sample of ``sources[0]`` draws what an unmixed loader of it draws; a later
    source's samples draw otherwise than unmixed. Samples known bad (``gpupipe check``'s lists)
    are never drawn, and sizes and counts are of the good ones. ``loader.stats()`` reports each source's samples per
    epoch and those yielded so far. Resuming, also on another world size, is exact; a state saved
    under other weights, counts or sources is refused.

    Plan cost: the epoch's draw is made per shard when a rank reads it, except with
    ``replacement=True``, which draws a source's whole count up front (``O(count)`` per rank,
    NumPy; about 1.2 s per 10 M samples on one core of the 2-core development machine).

    Example:
        >>> import gpupipe as gp
        >>> mix = gp.Mix(  # doctest: +SKIP
        ...     [gp.WebDataset("web/train-{000000..000999}.tar"), gp.ImageFolder("curated/train")],
        ...     weights=[0.8, 0.2], num_samples=1_000_000, label_offsets=[0, 1000])
        >>> pipe = gp.Pipeline(mix, [...])  # doctest: +SKIP
    """

    sources: Sequence[Source | str]
    _: dataclasses.KW_ONLY
    weights: Sequence[float] | None = None
    counts: Sequence[int] | None = None
    num_samples: int | None = None
    replacement: bool = False
    label_offsets: Sequence[int] | None = None

    def __post_init__(self) -> None:
        from ._webdataset import WebDataset

        if isinstance(self.sources, (str, os.PathLike, Source)) or not isinstance(self.sources, Sequence):
            raise ConfigError("Mix: sources must be a list of sources")
        sources = tuple(WebDataset(s) if isinstance(s, (str, list, tuple)) else s for s in self.sources)
        if not sources:
            raise ConfigError("Mix: sources is empty")
        for i, s in enumerate(sources):
            if not isinstance(s, Source) or isinstance(s, Mix):
                raise ConfigError(f"Mix: sources[{i}] must be a source other than a Mix, got {type(s).__name__}")
        object.__setattr__(self, "sources", sources)
        fields: list[dict[str, Any]] = [getattr(s, "extra_fields", dict)() for s in sources]
        images = [bool(getattr(s, "has_image", True)) for s in sources]
        for i in range(1, len(sources)):
            if fields[i] != fields[0] or images[i] != images[0]:
                raise ConfigError(
                    f"Mix: sources[{i}] has other fields than sources[0] ({sorted(fields[i])}, images {images[i]}; "
                    f"{sorted(fields[0])}, images {images[0]}): a batch holds one set of fields"
                )
        n = len(sources)
        if self.weights is not None and self.counts is not None:
            raise ConfigError("Mix: give weights or counts, not both")
        if self.weights is not None:
            weights = _numbers("weights", self.weights, n)
            if not all(math.isfinite(w) and w >= 0 for w in weights) or not sum(weights) > 0:
                raise ConfigError(f"Mix: weights must be finite, >= 0 and not all 0, got {list(self.weights)}")
            object.__setattr__(self, "weights", weights)
        if self.counts is not None:
            counts = _numbers("counts", self.counts, n)
            if not all(is_int(c) and c >= 0 for c in counts) or not sum(counts) > 0:
                raise ConfigError(f"Mix: counts must be integers >= 0, not all 0, got {list(self.counts)}")
            object.__setattr__(self, "counts", tuple(int(c) for c in counts))
        if self.num_samples is not None:
            if self.weights is None:
                raise ConfigError("Mix: num_samples goes with weights (counts say each source's number)")
            if not (is_int(self.num_samples) and self.num_samples > 0):
                raise ConfigError(f"Mix: num_samples must be a positive integer, got {self.num_samples!r}")
        if not isinstance(self.replacement, bool):
            raise ConfigError(f"Mix: replacement must be True or False, got {self.replacement!r}")
        if self.label_offsets is not None:
            offsets = _numbers("label_offsets", self.label_offsets, n)
            if not all(is_int(o) and o >= 0 for o in offsets):
                raise ConfigError(f"Mix: label_offsets must be integers >= 0, got {list(self.label_offsets)}")
            object.__setattr__(self, "label_offsets", tuple(int(o) for o in offsets))

    def listing(self) -> tuple[Any, ...] | None:
        """Each source's listing, where one of them grows between epochs (else ``None``)."""
        listings = tuple(s.listing() for s in cast("tuple[Source, ...]", self.sources))
        return listings if any(x is not None for x in listings) else None

    def with_listing(self, listing: Any) -> Mix:
        if listing is None:
            return self
        sources = cast("tuple[Source, ...]", self.sources)
        return dataclasses.replace(self, sources=[s.with_listing(x) for s, x in zip(sources, listing, strict=True)])

    def extra_fields(self) -> dict[str, Any]:
        """The sources' fields beyond image and label (the same for every source)."""
        return getattr(self.sources[0], "extra_fields", dict)()

    @property
    def has_image(self) -> bool:
        """Whether the sources' samples have an image (the same for every source)."""
        return bool(getattr(self.sources[0], "has_image", True))

    def index(self, *, rank: int = 0, world_size: int = 1, on_error: Any = "raise") -> Index:
        """Indexes each source, then numbers their samples one source after another."""
        sources = cast("tuple[Source, ...]", self.sources)  # (made a tuple of sources in __post_init__)
        parts: list[Index] = []
        try:
            for s in sources:
                parts.append(s.index(rank=rank, world_size=world_size, on_error=on_error))
            labeled = {p.labeled for p in parts}
            if len(labeled) > 1:
                which = [i for i, p in enumerate(parts) if not p.labeled]
                raise ConfigError(f"Mix: sources {which} are unlabeled and the others labeled; mix like with like")
            sizes = [len(p) - len(p.bad) for p in parts]
            for i, size in enumerate(sizes):
                if size == 0:
                    raise ConfigError(f"Mix: sources[{i}] has no samples to draw from: {sources[i]!r}")
            counts = counts_of(sizes, weights=self.weights, counts=self.counts, num_samples=self.num_samples)
            return MixIndex(parts, counts=counts, replacement=self.replacement, label_offsets=self.label_offsets)
        except BaseException:
            for p in parts:  # the sources indexed before the one that raised
                p.close()
            raise


def _numbers(name: str, values: Any, n: int) -> tuple[Any, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ConfigError(f"Mix: {name} must be a list of numbers, one per source")
    if len(values) != n:
        raise ConfigError(f"Mix: {name} has {len(values)} entries for {n} sources")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"Mix: {name} must be numbers, got {list(values)}")
    return tuple(values)


def counts_of(
    sizes: Sequence[int],
    *,
    weights: Sequence[float] | None,
    counts: Sequence[int] | None,
    num_samples: int | None,
) -> tuple[int, ...]:
    """Each source's samples per epoch: ``counts``; else ``num_samples`` (default: the sizes added
    up) shared by ``weights``, rounded by largest remainders (ties: the first source) so that
    they add up exactly; else the sizes."""
    if counts is not None:
        return tuple(counts)
    if weights is None:
        return tuple(int(s) for s in sizes)
    total = int(num_samples) if num_samples is not None else int(sum(sizes))
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    out = np.floor(exact).astype(np.int64)
    short = total - int(out.sum())
    out[np.argsort(-(exact - out), kind="stable")[:short]] += 1
    return tuple(int(c) for c in out)


class MixCounts(NamedTuple):
    """What an epoch of a mix draws: ``counts[i]`` samples of source ``i``, whose shards are
    ``shards[i]`` (a ``range`` of the index's shard numbers)."""

    counts: tuple[int, ...]
    shards: tuple[range, ...]
    replacement: bool


@dataclasses.dataclass(frozen=True)
class SourceOf:
    """The source of each draw number of a mix's samples, from its index's shard bounds
    (``offsets``) and each shard's source (``shard_source``): small and picklable, for the stage
    the torch workers run too. A draw number is a sample number plus the index's length per
    copy (``Loader(repeats=...)``)."""

    offsets: np.ndarray = dataclasses.field(compare=False)
    shard_source: np.ndarray = dataclasses.field(compare=False)

    def __call__(self, draws: np.ndarray) -> np.ndarray:
        samples = np.asarray(draws, np.int64) % int(self.offsets[-1])
        return self.shard_source[np.searchsorted(self.offsets, samples, side="right") - 1]


class MixIndex(Index):
    """The sources' indexes one after another (shards and samples numbered on), with each
    source's reader, storage and label offset; ``mix`` says what an epoch draws of each."""

    def __init__(
        self,
        parts: Sequence[Index],
        *,
        counts: tuple[int, ...],
        replacement: bool,
        label_offsets: Sequence[int] | None,
    ) -> None:
        ends = np.cumsum([len(p.shards) for p in parts]).tolist()
        self.mix = MixCounts(counts, tuple(range(e - len(p.shards), e) for p, e in zip(parts, ends, strict=True)),
                             replacement)  # fmt: skip
        shards = [s for p in parts for s in p.shards]
        self.shard_source = np.repeat(np.arange(len(parts), dtype=np.int64), [len(p.shards) for p in parts])
        self.label_offsets = np.asarray(label_offsets if label_offsets is not None else [0] * len(parts), np.int64)
        reader = MixReader([p.reader for p in parts], {s.path: i for i, p in reversed(list(enumerate(parts)))
                                                       for s in p.shards})  # fmt: skip
        super().__init__(shards, reader=reader, sequential=all(p.sequential for p in parts), labeled=parts[0].labeled,
                         fields=parts[0].fields, images=parts[0].images)  # fmt: skip
        self.sources = SourceOf(self.offsets, self.shard_source)

    def source_of(self, samples: np.ndarray) -> np.ndarray:
        """The source number of each of ``samples`` (int64 ``[B]``; draw numbers too)."""
        return self.sources(samples)

    def locate_batch(self, samples: np.ndarray) -> Located:
        where = super().locate_batch(samples)
        if where.labels is not None and self.label_offsets.any():
            shifted = where.labels + self.label_offsets[self.shard_source[where.shard]]
            where = where._replace(labels=np.where(where.labels == NO_LABEL, NO_LABEL, shifted))
        return where

    def read(self, sample: int) -> RawSample:
        s, i = self.locate(sample)
        source = int(self.shard_source[s])
        raw = self.reader.readers[source].read(self.shard(s), i)  # type: ignore[attr-defined]
        offset = int(self.label_offsets[source])
        return self.label_checked(raw._replace(label=raw.label + offset) if raw.label is not None and offset else raw)


class MixReader:
    """The sources' readers; reads a shard with the reader of the source that has it."""

    def __init__(self, readers: list[Any], owners: dict[str, int]) -> None:
        self.readers, self.owners = readers, owners
        self.storage: Storage = MixStorage([r.storage for r in readers], owners)

    @property
    def max_image_bytes(self) -> int | None:
        return self.readers[0].max_image_bytes if self.readers else None

    @max_image_bytes.setter
    def max_image_bytes(self, value: int | None) -> None:
        for reader in self.readers:
            reader.max_image_bytes = value

    def read(self, shard: ShardIndex, i: int) -> RawSample:
        return self.readers[self.owners[shard.path]].read(shard, i)

    def read_fields(self, shard: ShardIndex, i: int) -> dict[str, bytes | None]:
        return self.readers[self.owners[shard.path]].read_fields(shard, i)

    def close(self) -> None:
        for r in self.readers:
            r.close()


class MixStorage(Storage):
    """The sources' storages behind one: each URL is served by the storage of the source whose
    shard it is (other URLs: the first source's)."""

    def __init__(self, storages: list[Storage], owners: dict[str, int]) -> None:
        self.storages, self.owners = storages, owners
        self.remote = any(s.remote for s in storages)

    def _of(self, url: str) -> Storage:
        return self.storages[self.owners.get(url, 0)]

    def _by_owner(self, urls: Sequence[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for url in urls:
            out.setdefault(self.owners.get(url, 0), []).append(url)
        return out

    @property
    def cache(self) -> Any:
        """The first remote storage's shard cache (for the loader's cache-size advice)."""
        return next((getattr(s, "cache", None) for s in self.storages if s.remote), None)

    @property
    def keep(self) -> int | None:
        return next((getattr(s, "keep", None) for s in self.storages if s.remote), None)

    @keep.setter
    def keep(self, value: int) -> None:
        for s in self.storages:
            if s.remote:
                s.keep = value  # type: ignore[attr-defined]

    def canonical(self, url: str) -> str:
        return self._of(url).canonical(url)

    def stat(self, url: str) -> Stat:
        return self._of(url).stat(url)

    def read(self, url: str, offset: int, size: int) -> bytes:
        return self._of(url).read(url, offset, size)

    def open(self, url: str) -> IO[bytes]:
        return self._of(url).open(url)

    def open_shard(self, url: str) -> IO[bytes]:
        return self._of(url).open_shard(url)

    def read_into(self, url: str, offset: int, out: memoryview) -> int:
        return self._of(url).read_into(url, offset, out)

    def read_ranges_into(self, url: str, ranges: Sequence[tuple[int, int]], out: memoryview, at: Sequence[int]) -> int:
        return self._of(url).read_ranges_into(url, ranges, out, at)

    def map(self, url: str) -> MappedFile | None:
        return self._of(url).map(url)

    def touch(self, url: str) -> None:
        self._of(url).touch(url)

    def prefetch(self, urls: Sequence[str], *, keep: int | None = None) -> None:
        for owner, mine in self._by_owner(urls).items():
            self.storages[owner].prefetch(mine, keep=keep)

    def expect_parts(self, parts: Mapping[str, tuple[int, int]]) -> None:
        mine: dict[int, dict[str, tuple[int, int]]] = {i: {} for i in range(len(self.storages))}
        for url, span in parts.items():
            mine[self.owners.get(url, 0)][url] = span
        for owner, spans in mine.items():
            self.storages[owner].expect_parts(spans)

    def stop_prefetch(self) -> None:
        for s in self.storages:
            s.stop_prefetch()

    def close(self) -> None:
        for s in self.storages:
            s.close()
