"""The DALI runner's input path: each batch's encoded samples located, read and wrapped for
DALI ahead of it, in reader threads (see the runner's docstring).

- :class:`BatchReader` prepares batch ``b`` (:meth:`BatchReader.read`): the index locates its
  samples, each shard's samples become views of the shard mapped under a read lease
  (``_memory.Maps``, CPU pipelines), or are ``pread`` into a reused buffer (``_memory.Buffers``:
  pinned memory for a GPU pipeline, transparent huge pages otherwise), the batch's random factors
  are drawn, and its masks and boxes moved (``backends._torch._targets``).
- A :class:`FeedBatch` (the batch fed to DALI, not the loader's ``gp.Batch``) holds what its views
  point into until :meth:`FeedBatch.release`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from ...core._errors import DataError, SampleError, too_many_bytes, truncated, unreadable
from ...core._imageinfo import MAX_IMAGE_PIXELS
from ...core._random import step_factors
from ...plan._plan import RankPlan
from ...runtime._decode import require_header, transcoded
from ...sources import Index, Located, RawSample
from ...storage import MappedFile
from ...storage._counts import snapshot
from ...transforms import Transform
from .._base import donor, fill
from .._fields import batch_fields, empty_values, field_values
from .._torch._targets import has_targets, move_targets
from ._context import Lowered
from ._fallback import ppm_size
from ._headers import Headers, Sizes
from ._host import SOURCE, HostEnv, evaluate, failures
from ._memory import Buffers, Maps

__all__ = ["READ_THREADS", "FeedBatch", "BatchReader"]

READ_THREADS = 2  # more threads contend for the GIL between reads; two keep the disk and DALI busy


class FeedBatch(NamedTuple):
    """One batch, read and ready to feed to DALI: ``encoded`` are views of ``buffer`` and of ``maps``."""

    b: int
    samples: np.ndarray
    keys: list[str]
    shards: list[str]
    labels: np.ndarray | None
    encoded: list[Any]  # DALI TensorCPU views of buffer and maps
    buffer: np.ndarray | None  # the samples read with pread
    maps: tuple[MappedFile, ...]  # the mapped shards the other samples are views of, one use each
    feeds: dict[str, np.ndarray]  # the graph's other inputs, by name: random factors, host-computed arguments
    views: list[Any]  # the encoded samples as numpy views (what encoded wraps)
    sizes: np.ndarray  # int64 [B, 2]: each image's (height, width), from its header
    skipped: tuple[tuple[int, Any], ...]  # (position, DataError) of samples left out (skip), sorted
    token: object  # the batch's identity for use counting: a retried copy (decode failure, skip) shares it
    decoded: frozenset[int] = frozenset()  # positions fed gpupipe's decoding (a PPM) instead of the file
    fields: dict[str, Any] | None = None  # the source's other fields, batched (backends._fields), by name
    windows: dict[int, np.ndarray] | None = None  # box-chosen crop windows by step (HostEnv.window)
    nbytes: int = 0  # the encoded samples' bytes, summed here in the reader thread (RawBatch.times' read_bytes)
    reads: Mapping[str, float] | None = None  # the node cache's hits and misses here (storage._counts)
    drawn: np.ndarray | None = None  # the draw numbers fed, where a bad sample's took a donor's or a spare's

    @staticmethod
    def release(maps: Iterable[MappedFile], buffer: np.ndarray | None, buffers: Buffers, event: Any = None) -> None:
        """Ends the batch's uses of its maps and returns its buffer to the pool."""
        for mapped in maps:
            mapped.give()
        if buffer is not None:
            buffers.give(buffer, event)


class BatchReader:
    """Reads the plan's batches ahead of DALI in :data:`READ_THREADS` threads (not a
    ``gpupipe.sources.Reader``: it reads through the source's index).

    Each image's size is read from its header (once in the runner's life: ``_headers``), and every
    input the graph takes besides the encoded images is computed here for the whole batch
    (``Lowered.feeds``: random factors, crop windows, resize sizes). A sample that cannot be used
    (its shard unreadable or truncated there, its label not an integer or not a class, its image's header
    declaring more than ``max_pixels`` or no size at all, a file gpupipe's decoder refuses where
    DALI's are not given it, a host check of the graph failing: too small for a crop) raises its
    ``DataError`` when its batch is due, or with ``skip`` is left out: its place holds a copy of
    a good sample of the batch (:meth:`substitute`) and the batch lists it.
    """

    def __init__(self, index: Index, plan: RankPlan, lowered: Lowered,
                 views: tuple[tuple[Transform, ...], ...],
                 buffers: Buffers, maps: Maps | None, pool: ThreadPoolExecutor, ahead: int,
                 skip: bool = False, max_pixels: int | None = MAX_IMAGE_PIXELS,
                 exif: bool = False, sizes: Sizes | None = None,
                 blank: tuple[int, int] | None = None) -> None:  # fmt: skip
        self.index, self.plan, self.lowered, self.views = index, plan, lowered, views
        self.blank = blank  # the output images' (height, width): a mask's, where no sample of a batch is good
        self.exif = exif
        self.headers = Headers(sizes if sizes is not None else Sizes(index), host_geometry=lowered.host_geometry,
                               max_pixels=max_pixels, exif=exif)  # fmt: skip
        self.by_source = any(feed.value is SOURCE for feed in lowered.feeds.values())  # a per_source graph
        self.max_pixels = max_pixels
        self.targets = has_targets(index.fields)  # masks or boxes: moved here, with the image's size
        self.buffers, self.maps, self.pool, self.ahead, self.skip = buffers, maps, pool, ahead, skip
        self._pending: dict[int, Future[FeedBatch]] = {}
        self._next = 0
        self._spare: tuple[np.ndarray, int, str, str, int, tuple[int, int]] | None = None  # for all-bad batches

    def ready(self) -> int:
        """The batches read ahead and ready, waiting to be fed (of at most :attr:`ahead`)."""
        return sum(future.done() for future in self._pending.values())

    def get(self, b: int) -> FeedBatch:
        self._next = max(self._next, b)
        while self._next < min(b + 1 + self.ahead, self.plan.num_batches):
            self._pending[self._next] = self.pool.submit(self.read, self._next)
            self._next += 1
        future = self._pending.pop(b, None)
        return future.result() if future is not None else self.read(b)

    def _bad(self, bad: dict[int, DataError], position: int, error: DataError) -> None:
        """Records ``error`` for ``position`` (the first one counts): left out with ``skip``,
        raised by :meth:`read` otherwise."""
        bad.setdefault(position, error)

    def _first_error(
        self, bad: dict[int, DataError], views: list[Any], keys: list[str], shards: list[str]
    ) -> DataError:
        """Without ``skip``: the error of the batch's first bad sample in plan order, as the torch
        backend raises it — a sample before the first one found bad here may be one only a
        decoder refuses (DALI finds it later), so those are decoded first (an error path)."""
        from ...runtime._decode import verdicts

        first = min(bad)
        earlier = verdicts([(bytes(views[i]), shards[i], keys[i]) for i in range(first)], max_pixels=self.max_pixels)
        return next((e for e in earlier if e is not None), bad[first])

    def checked(self, batch: FeedBatch) -> FeedBatch:
        """``batch``, right before it is fed: if a lease of its maps broke since it was read (a
        writer waits, or the kernel gave up waiting for us), the batch read again with ``pread``
        — mapped bytes are never handed to DALI without a standing lease."""
        if all(mapped.valid() for mapped in batch.maps):
            return batch
        fresh = self.read(batch.b, mapped=False)
        FeedBatch.release(batch.maps, batch.buffer, self.buffers)
        return fresh

    def read(self, b: int, *, mapped: bool = True) -> FeedBatch:
        reads = snapshot()  # this reader thread's reads of remote shards so far
        index, samples = self.index, self.plan.batch(b)[0]
        if self.maps is not None:
            self.maps.sweep()
        where = index.locate_batch(samples)
        shards = [index.shards[s].path for s in where.shard.tolist()]
        bad: dict[int, DataError] = {}
        where = self._over_limit(where, shards, bad)
        refused = None if where.labels is None else index.refused_labels(where.labels)
        if refused is not None and refused.any():
            for i in np.flatnonzero(refused).tolist():
                try:
                    index.read(int(samples[i]))  # raises, naming the sample
                except DataError as e:
                    self._bad(bad, i, e)
        labels, buffer = where.labels, None
        maps: list[MappedFile] = []
        views: list[Any] = [None] * len(samples)
        try:
            whole = None
            if where.ranges is None and (labels is not None or not index.labeled):  # whole files (ImageFolder)
                whole = index.read_files_into(samples, self.buffers.take)  # None: the reader reads one by one
            if whole is not None:
                buffer = whole.buffer
                for i, error in whole.errors.items():
                    self._bad(bad, i, error)
                    whole.views[i] = buffer[:0]  # (substituted)
                views[:] = whole.views
            elif where.ranges is None or (index.labeled and labels is None):  # whole files, ...
                raws: list[RawSample | None] = []
                for i, s in enumerate(samples.tolist()):  # ... or a source without parsed labels
                    try:
                        raws.append(index.read(s))
                    except DataError as e:
                        self._bad(bad, i, e)
                        raws.append(None)
                buffer = self._copy(raws, views)
                if index.labeled:
                    labels = np.array([r.label if r is not None else 0 for r in raws], np.int64)
            else:
                rest = self._map_ranges(where, shards, views, maps, bad) if mapped else where.groups
                if rest:
                    buffer = self._read_ranges(where, rest, shards, views, bad)
            keys, drawn = list(where.keys), self.plan.drawn(b)
            values = self._fields(samples, keys, shards, bad) if index.fields else None
            sizes, decoded = self.headers.sizes(where, samples, views, shards, bad)
            windows = self._windows(len(samples))
            env = self.env(drawn, sizes, windows)
            if self.lowered.host_checks:
                for i, message in failures(self.lowered.host_checks, env, len(samples)).items():
                    if i not in bad:
                        size = (int(sizes[i, 0]), int(sizes[i, 1]))
                        self._bad(bad, i, SampleError.at(message, shard=shards[i], key=keys[i], size=size))
            if values is not None and self.targets:
                self._move_targets(values, env, sizes, keys, shards, bad, windows)
            if bad and not self.skip:
                raise self._first_error(bad, views, keys, shards)
            if bad:
                labels, drawn = self.substitute(bad, drawn, views, labels, keys, shards, sizes)
                good = donor(len(views), bad)
                for rows in windows.values():  # the donor's box-chosen windows (none for a spare)
                    fill(bad, (rows,), (rows[good] if good is not None else -1,))
                env = self.env(drawn, sizes, windows)
                if values is not None:  # the donor's fields, as its image and label
                    stand_in = values[good] if good is not None else empty_values(index.fields, self.blank)
                    fill(bad, (values,), (stand_in,))
            from nvidia.dali.tensors import TensorCPU  # wrapped here, off the training thread; no copy

            encoded = [TensorCPU(view) for view in views]
            fed = evaluate(self.lowered.feeds, env, len(samples))
        except BaseException:
            FeedBatch.release(maps, buffer, self.buffers)
            raise
        skipped = tuple(sorted(bad.items()))
        fields = batch_fields(index.fields, values) if values is not None else None
        return FeedBatch(b, samples, keys, shards, labels, encoded, buffer, tuple(maps), fed, views, sizes, skipped,
                         object(), decoded, fields, windows, sum(view.nbytes for view in views),
                         snapshot().since(reads), drawn if skipped else None)  # fmt: skip

    def _over_limit(self, where: Located, shards: list[str], bad: dict[int, DataError]) -> Located:
        """``where`` with the images over ``Index.max_image_bytes`` recorded in ``bad`` and their
        ranges emptied: never mapped into a view DALI copies, nor read into the batch's buffer."""
        limit = self.index.max_image_bytes
        if where.ranges is None or limit is None or not (over := where.ranges[:, 1] > limit).any():
            return where
        ranges = where.ranges.copy()
        for i in np.flatnonzero(over).tolist():
            self._bad(bad, i, too_many_bytes(shards[i], where.keys[i], int(ranges[i, 1]), limit))
        ranges[over, 1] = 0
        return where._replace(ranges=ranges)

    def _fields(self, samples: np.ndarray, keys: list[str], shards: list[str],
                bad: dict[int, DataError]) -> list[dict[str, Any] | None]:  # fmt: skip
        """Each sample's field values, read and decoded here (a reader thread: not the training
        thread); a sample whose field is bad is recorded in ``bad``, its values ``None``."""
        out: list[dict[str, Any] | None] = []
        for i, s in enumerate(samples.tolist()):
            try:
                stored = self.index.read_fields(s)
                out.append(field_values(self.index.fields, stored, shard=shards[i], key=keys[i]))
            except DataError as e:
                self._bad(bad, i, e)
                out.append(None)
        return out

    def _windows(self, batch: int) -> dict[int, np.ndarray]:
        """Each step whose window the boxes choose (``RandomIoUCrop``): int64 ``[B, 4]``, -1 until
        :meth:`_move_targets` fills them."""
        steps = self.views[0] if self.views else ()
        return {s: np.full((batch, 4), -1, np.int64) for s, t in enumerate(steps) if t.uses_boxes}

    def _move_targets(self, values: list[dict[str, Any] | None], env: HostEnv, sizes: np.ndarray,
                      keys: list[str], shards: list[str], bad: dict[int, DataError],
                      windows: dict[int, np.ndarray]) -> None:  # fmt: skip
        """Moves each good sample's masks and boxes with its image here, on the host, from the
        image's size and the sample's factors (``backends._torch._targets``: what the torch backend does in
        its workers, so they come out the same), and writes the crop ``windows`` the boxes chose
        (``(top, left, height, width)``); a sample they fail for is recorded in ``bad``. The
        factors are the batch's ``env``'s, drawn once for these and the graph's feeds alike."""
        steps = self.views[0]
        drawn_factors = [env.factors(0, s) if getattr(t, "draws", 0) else None for s, t in enumerate(steps)]
        for i, sample_values in enumerate(values):
            if sample_values is None or i in bad:
                continue
            row = [None if f is None else f[i] for f in drawn_factors]
            size = (int(sizes[i, 0]), int(sizes[i, 1]))
            try:
                params = move_targets(self.index.fields, sample_values, steps, row, size, shard=shards[i], key=keys[i])
            except DataError as e:
                self._bad(bad, i, e)
                continue
            for step, rows in windows.items():
                p = params[step] if params is not None else None
                if p is not None:
                    rows[i] = (p.top, p.left, p.height, p.width)

    def substitute(self, bad: dict[int, Any], draws: np.ndarray, views: list[Any], labels: np.ndarray | None,
                   keys: list[str], shards: list[str],
                   sizes: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:  # fmt: skip
        """Puts a copy of the batch's first good sample (its bytes, label, key, shard and size) in
        each ``bad`` position — or of a spare good sample of the epoch if none is good. Returns
        the labels (a new array) and the numbers to draw the augmentation from (``draws``, the
        batch's): the donor's in the bad positions, so that they come out as copies of it (as the
        torch backend's do)."""
        good = donor(len(views), bad)
        label: int | None
        if good is None:
            view, label, key, shard, number, size = self.spare()
        else:
            view, key, shard, number = views[good], keys[good], shards[good], int(draws[good])
            label, size = None if labels is None else int(labels[good]), (int(sizes[good, 0]), int(sizes[good, 1]))
        labels = None if labels is None else labels.copy()
        drawn = draws.copy()
        fill(bad, (views, keys, shards, drawn, labels, sizes), (view, key, shard, number, label, size))
        return labels, drawn

    def env(self, samples: np.ndarray, sizes: np.ndarray, windows: dict[int, np.ndarray] | None = None) -> HostEnv:
        """What the graph's host values see of a batch of ``samples``: their sizes and their
        random factors (drawn on first use, once per step)."""
        seed, epoch, drawn = self.plan.seed, self.plan.epoch, dict[tuple[int, int], np.ndarray]()

        def factors(view: int, step: int) -> np.ndarray:
            if (view, step) not in drawn:  # a random step: its factors are an array
                got = step_factors(self.views[view][step], seed, epoch, samples, step, view)
                drawn[view, step] = np.zeros((len(samples), 0)) if got is None else got
            return drawn[view, step]

        sources = None
        if self.by_source:  # (a draw number is a sample number, plus len(index) per copy)
            sources = self.index.source_of(samples)  # type: ignore[attr-defined]
        return HostEnv(sizes, factors, sources=sources, windows=windows or {})

    def feeds(self, samples: np.ndarray, sizes: np.ndarray,
              windows: dict[int, np.ndarray] | None = None) -> dict[str, np.ndarray]:  # fmt: skip
        """Every input the graph takes besides the encoded images, for a batch of ``samples``
        (``windows``: the box-chosen crop windows, :meth:`_windows`)."""
        return evaluate(self.lowered.feeds, self.env(samples, sizes, windows), len(samples))

    def spare(self) -> tuple[np.ndarray, int, str, str, int, tuple[int, int]]:
        """A good sample of the epoch (its pixels as a PPM, label, key, shard, draw number, size),
        for a batch whose every sample is bad: the first of the plan that reads and decodes."""
        if self._spare is None:
            draws = self.plan.samples if self.plan.draws is None else self.plan.draws
            for s, d in zip(self.plan.samples.tolist(), draws.tolist(), strict=True):
                try:
                    raw = self.index.read(s)
                    require_header(raw.data, self.max_pixels, shard=raw.shard, key=raw.key)
                except DataError:
                    continue
                out = transcoded([(raw.data, raw.shard, raw.key)], max_pixels=self.max_pixels,
                                 apply_exif_orientation=self.exif)[0]  # fmt: skip
                if isinstance(out, DataError):
                    continue
                label = raw.label if raw.label is not None else 0
                self._spare = (np.frombuffer(out, np.uint8), label, raw.key, raw.shard, d, ppm_size(out))
                break
            else:
                raise DataError("on_error='skip': no sample of this rank's epoch can be read")
        return self._spare

    def _copy(self, raws: list[RawSample | None], views: list[Any]) -> np.ndarray:
        """Copies whole samples' bytes into one buffer (sources without byte ranges)."""
        sizes = [len(r.data) if r is not None else 0 for r in raws]
        buffer = self.buffers.take(sum(sizes))
        end = 0
        for i, (raw, size) in enumerate(zip(raws, sizes, strict=True)):
            views[i] = buffer[end : end + size]
            if raw is not None:
                views[i][:] = np.frombuffer(raw.data, np.uint8)
            end += size
        return buffer

    def _map_ranges(self, where: Located, shards: list[str], views: list[Any], maps: list[MappedFile],
                    bad: dict[int, DataError]) -> list[np.ndarray]:  # fmt: skip
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
            for i in group[ends > mapped.size].tolist():  # the shard is shorter than when it was indexed
                self._bad(bad, i, truncated(shard, where.keys[i]))
            array = mapped.array
            for i, offset, end in zip(group.tolist(), rows[:, 0].tolist(), ends.tolist(), strict=True):
                views[i] = array[offset:end]  # past the end: a short view (never read; substituted)
        return rest

    def _read_ranges(self, where: Located, groups: list[np.ndarray], shards: list[str], views: list[Any],
                     bad: dict[int, DataError]) -> np.ndarray:  # fmt: skip
        """Reads the byte ranges of ``groups`` into one buffer: one storage call per shard (more
        only past a sample that cannot be read, with ``skip``)."""
        assert where.ranges is not None
        positions = np.concatenate(groups)
        sizes = where.ranges[positions, 1]
        buffer = self.buffers.take(int(sizes.sum()))
        ends = np.cumsum(sizes)
        starts = ends - sizes
        for i, start, end in zip(positions.tolist(), starts.tolist(), ends.tolist(), strict=True):
            views[i] = buffer[start:end]
        storage = self.index.reader.storage
        out = memoryview(buffer)  # type: ignore[arg-type]
        first = 0
        try:
            for group in groups:
                shard, rows = shards[int(group[0])], where.ranges[group].tolist()
                at = starts[first : first + len(group)].tolist()
                first += len(group)
                done = 0
                while done < len(rows):
                    try:
                        done += storage.read_ranges_into(shard, rows[done:], out, at[done:])
                    except OSError:  # at which sample? one at a time, from the first not read
                        self._read_singly(storage, shard, rows[done:], out, at[done:], group[done:], where.keys, bad)
                        break
                    if done < len(rows):  # came back short: the shard shrank
                        i = int(group[done])
                        self._bad(bad, i, truncated(shard, where.keys[i]))
                        done += 1
        except BaseException:
            self.buffers.give(buffer)
            raise
        return buffer

    def _read_singly(self, storage: Any, shard: str, rows: list[Any], out: memoryview, at: list[int],
                     group: np.ndarray, keys: list[str], bad: dict[int, DataError]) -> None:  # fmt: skip
        """Reads ``rows`` one by one, so that an error names its own sample (``keys[group[j]]``)."""
        for row, start, i in zip(rows, at, group.tolist(), strict=True):
            key = keys[i]
            try:
                if storage.read_ranges_into(shard, [row], out, [start]) != 1:
                    self._bad(bad, i, truncated(shard, key))
            except OSError as e:
                self._bad(bad, i, unreadable(shard, key, e))

    def close(self) -> None:
        for future in self._pending.values():
            if not future.cancel():
                with contextlib.suppress(BaseException):
                    batch = future.result()
                    FeedBatch.release(batch.maps, batch.buffer, self.buffers)
        self._pending.clear()
