"""The DALI runner's input path: each batch's encoded samples located, read and wrapped for
DALI ahead of it, in reader threads (see the runner's docstring).

- :class:`Reader` prepares batch ``b`` (:meth:`Reader.read`): the index locates its samples, each
  shard's samples become views of the shard mapped under a read lease (:class:`Maps`, CPU
  pipelines), or are ``pread`` into a reused buffer (:class:`Buffers`: pinned memory for a GPU
  pipeline, transparent huge pages otherwise), and the batch's random factors are drawn.
- A :class:`Batch` holds what its views point into until :meth:`Batch.release`.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import torch

from ..._plan import RankPlan
from ..._random import step_factors
from ...sources import Index, RawSample
from ...sources._index import NO_LABEL, Located
from ...sources._mapped import MappedFile
from ...sources._webdataset import truncated, unreadable
from ...transforms import Transform

__all__ = ["READ_THREADS", "Batch", "Buffers", "Maps", "Reader"]

READ_THREADS = 2  # more threads contend for the GIL between reads; two keep the disk and DALI busy


class Buffers:
    """Reused byte buffers, one per batch in flight (pinned host memory for a GPU pipeline, so
    that the decoder's copies to the device are asynchronous). A buffer given back with a CUDA
    event is reused only once the event completed (the consumer stream passed the batch's
    outputs, hence DALI's copies of it)."""

    KEEP = 16  # free buffers kept at most

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._free: list[tuple[np.ndarray, Any]] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        with self._lock:
            ready = [i for i, (_, event) in enumerate(self._free) if event is None or event.query()]
            fits = [i for i in ready if len(self._free[i][0]) >= size]
            if fits:
                return self._free.pop(min(fits, key=lambda i: len(self._free[i][0])))[0]
            if ready and len(self._free) >= self.KEEP:  # none fits: let the smallest go
                self._free.pop(min(ready, key=lambda i: len(self._free[i][0])))
        size = max(size + size // 4, 1 << 16)
        if self.pinned:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
        return _huge_page_buffer(size)

    def give(self, buf: np.ndarray, event: Any = None) -> None:
        with self._lock:
            self._free.append((buf, event))
            if len(self._free) > self.KEEP:
                self._free.pop(0)


_HUGE_PAGE = 2 << 20


def _huge_page_buffer(size: int) -> np.ndarray:
    """``size`` bytes of anonymous memory backed by transparent huge pages where the kernel allows
    it: ``pread`` copies into it about 2.7x faster than into malloc'd pages (5.3 against 1.9 GB/s
    measured on the 2-core machine, page cache warm). Unmapped when the array is collected."""
    length = -(-size // _HUGE_PAGE) * _HUGE_PAGE
    region = mmap.mmap(-1, length)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE on this platform
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, np.uint8)


class Batch(NamedTuple):
    """One batch, read and ready to feed: ``encoded`` are views of ``buffer`` and of ``maps``."""

    b: int
    samples: np.ndarray
    keys: list[str]
    shards: list[str]
    labels: np.ndarray | None
    encoded: list[Any]  # DALI TensorCPU views of buffer and maps
    buffer: np.ndarray | None  # the samples read with pread
    maps: tuple[MappedFile, ...]  # the mapped shards the other samples are views of, one use each
    factors: dict[str, np.ndarray | None]  # by input name; None only for a step that is not random

    @staticmethod
    def release(maps: Iterable[MappedFile], buffer: np.ndarray | None, buffers: Buffers, event: Any = None) -> None:
        """Ends the batch's uses of its maps and returns its buffer to the pool."""
        for mapped in maps:
            mapped.give()
        if buffer is not None:
            buffers.give(buffer, event)


class Maps:
    """The shards of one epoch mapped under read leases (``Storage.map``), opened on first use.

    Used for CPU pipelines: a batch's samples are then views of the page cache, with no copy at
    all. A shard that cannot be leased (not the owner, NFS, ...), or whose lease is breaking (a
    writer waits), is read with ``pread`` instead. At most :attr:`MAX_OPEN` shards stay mapped
    (the plan reads ``interleave`` at a time): the least recently used is retired beyond that, and
    :meth:`close` retires every map at the end of the epoch. A retired map's lease (and its file
    descriptor) goes once the last batch that uses it is done.
    """

    MAX_OPEN = 64

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self._maps: collections.OrderedDict[str, MappedFile | None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def use(self, shard: str) -> MappedFile | None:
        """The mapped shard with one use counted, or ``None``: read it."""
        with self._lock:
            if shard in self._maps:
                self._maps.move_to_end(shard)
            else:
                try:
                    self._maps[shard] = self.storage.map(shard)
                except OSError:
                    self._maps[shard] = None  # pread says what is wrong, naming the sample
                while len(self._maps) > self.MAX_OPEN:
                    old = self._maps.popitem(last=False)[1]
                    if old is not None:
                        old.retire()
            mapped = self._maps[shard]
        return mapped if mapped is not None and mapped.acquire() else None

    def close(self) -> None:
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
        for mapped in maps:
            if mapped is not None:
                mapped.retire()


class Reader:
    """Reads the plan's batches ahead of DALI in :data:`READ_THREADS` threads."""

    def __init__(self, index: Index, plan: RankPlan, inputs: dict[str, int], transforms: tuple[Transform, ...],
                 buffers: Buffers, maps: Maps | None, pool: ThreadPoolExecutor, ahead: int) -> None:  # fmt: skip
        self.index, self.plan, self.inputs, self.transforms = index, plan, inputs, transforms
        self.buffers, self.maps, self.pool, self.ahead = buffers, maps, pool, ahead
        self._pending: dict[int, Future[Batch]] = {}
        self._next = 0

    def get(self, b: int) -> Batch:
        self._next = max(self._next, b)
        while self._next < min(b + 1 + self.ahead, self.plan.num_batches):
            self._pending[self._next] = self.pool.submit(self.read, self._next)
            self._next += 1
        future = self._pending.pop(b, None)
        return future.result() if future is not None else self.read(b)

    def read(self, b: int) -> Batch:
        index, samples = self.index, self.plan.batch(b)[0]
        where = index.locate_batch(samples)
        shards = [index.shards[s].path for s in where.shard.tolist()]
        if where.labels is not None and (where.labels == NO_LABEL).any():
            index.read(int(samples[int(np.argmax(where.labels == NO_LABEL))]))  # raises, naming the sample
        labels, buffer = where.labels, None
        maps: list[MappedFile] = []
        views: list[Any] = [None] * len(samples)
        try:
            if where.ranges is None or (index.labeled and labels is None):  # whole files (ImageFolder), ...
                raws = [index.read(int(s)) for s in samples]  # ... or a source without parsed labels
                buffer = self._copy(raws, views)
                if index.labeled:
                    labels = np.array([r.label for r in raws], np.int64)
            else:
                rest = self._map_ranges(where, shards, views, maps)
                if rest:
                    buffer = self._read_ranges(where, rest, shards, views)
        except BaseException:
            Batch.release(maps, buffer, self.buffers)
            raise
        from nvidia.dali.tensors import TensorCPU  # wrapped here, off the training thread; no copy

        encoded = [TensorCPU(view) for view in views]
        seed, epoch = self.plan.seed, self.plan.epoch
        fed = {
            name: step_factors(self.transforms[step], seed, epoch, samples, step) for name, step in self.inputs.items()
        }
        return Batch(b, samples, where.keys, shards, labels, encoded, buffer, tuple(maps), fed)

    def _copy(self, raws: list[RawSample], views: list[Any]) -> np.ndarray:
        """Copies whole samples' bytes into one buffer (sources without byte ranges)."""
        sizes = [len(r.data) for r in raws]
        buffer = self.buffers.take(sum(sizes))
        end = 0
        for i, (raw, size) in enumerate(zip(raws, sizes, strict=True)):
            views[i] = buffer[end : end + size]
            views[i][:] = np.frombuffer(raw.data, np.uint8)
            end += size
        return buffer

    def _map_ranges(self, where: Located, shards: list[str], views: list[Any],
                    maps: list[MappedFile]) -> list[np.ndarray]:  # fmt: skip
        """Views into the mapped shards (see :class:`Maps`); returns the groups left to read."""
        assert where.ranges is not None
        rest = []
        for group in where.groups:
            shard = shards[int(group[0])]
            mapped = self.maps.use(shard) if self.maps is not None else None
            if mapped is None:
                rest.append(group)
                continue
            maps.append(mapped)
            rows = where.ranges[group]
            ends = rows[:, 0] + rows[:, 1]
            if int(ends.max()) > mapped.size:  # the shard is shorter than when it was indexed
                raise truncated(shard, where.keys[int(group[int(np.argmax(ends > mapped.size))])])
            array = mapped.array
            for i, offset, end in zip(group.tolist(), rows[:, 0].tolist(), ends.tolist(), strict=True):
                views[i] = array[offset:end]
        return rest

    def _read_ranges(self, where: Located, groups: list[np.ndarray], shards: list[str], views: list[Any]) -> np.ndarray:
        """Reads the byte ranges of ``groups`` into one buffer: one storage call per shard."""
        assert where.ranges is not None
        positions = np.concatenate(groups)
        sizes = where.ranges[positions, 1]
        buffer = self.buffers.take(int(sizes.sum()))
        ends = np.cumsum(sizes)
        starts = ends - sizes
        for i, start, end in zip(positions.tolist(), starts.tolist(), ends.tolist(), strict=True):
            views[i] = buffer[start:end]
        storage = self.index.reader.storage  # type: ignore[attr-defined]
        out = memoryview(buffer)  # type: ignore[arg-type]
        first = 0
        try:
            for group in groups:
                shard, rows = shards[int(group[0])], where.ranges[group].tolist()
                at = starts[first : first + len(group)].tolist()
                first += len(group)
                try:
                    done = storage.read_ranges_into(shard, rows, out, at)
                except OSError as e:
                    raise unreadable(shard, where.keys[int(group[0])], e) from e
                if done != len(rows):
                    raise truncated(shard, where.keys[int(group[done])])
        except BaseException:
            self.buffers.give(buffer)
            raise
        return buffer

    def close(self) -> None:
        for future in self._pending.values():
            if not future.cancel():
                with contextlib.suppress(BaseException):
                    batch = future.result()
                    Batch.release(batch.maps, batch.buffer, self.buffers)
        self._pending.clear()
