"""The header stage of the DALI runner's input path: each sample's image size, and the files its
decoders are not given (``_fallback``), for a whole batch in a reader thread.

A sample's header is read once in a runner's life: the first time its batch is read, its header
is checked by gpupipe's rules (``gpupipe.runtime._decode.read_header``: formats, the pixel limit) and by
nvImageCodec's parser (``_fallback.parsed``), and the size of a file that passes both is
remembered (:class:`Sizes`), and recorded beside the shard's index cache file, so that a run's
first epoch, and every rank of a restarted job, finds it there. From then on the batch's sizes
are gathered from memory with a few array operations per shard: no Python per sample, and no page
of the file touched by a thread that holds the GIL (DALI's decoders read it anyway). The files
that do not pass are checked again each time they are read: their verdict is the loader's to count
every epoch.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Any

import numpy as np

from ...core._errors import Damage, DataError, SampleError
from ...core._imageinfo import MAX_IMAGE_BYTES
from ...runtime._decode import read_header, transcoded
from ...shards import _indexcache
from ...shards._shard import ShardIndex
from ...sources import Index, Located
from ...storage._base import Storage
from ._fallback import native, parsed, ppm_size

__all__ = ["Sizes", "Headers", "rules", "check_header", "record_shard"]


def check_header(view: Any, shard: str, key: str, *, max_pixels: int | None,
                 host_geometry: bool = True) -> tuple[int, int] | None:  # fmt: skip
    """The size DALI's decoders will read, or ``None``: not given to them (see ``_fallback``). A
    header that fails gpupipe's rules raises its ``DataError``."""
    header = read_header(memoryview(view), max_pixels, shard=shard, key=key)
    dali = parsed(view) if native(header) else None
    if dali is None or (header.size is not None and dali != header.size):
        return None
    if host_geometry and not all(dali):
        raise SampleError.at("the image's header declares no size (not an image, or a corrupt header)",
                             shard=shard, key=key, kind=Damage.UNDECODABLE)  # fmt: skip
    return dali


def record_shard(storage: Storage, shard: ShardIndex, *, max_bytes: int | None = MAX_IMAGE_BYTES) -> int:
    """Checks the header of every image of ``shard`` (indexed into the node's index cache) as the
    reader threads do, without a pixel limit (a loader applies its own to a record), and records
    the sizes that pass beside its index cache file (``gpupipe index --sizes``): a loader's first
    epoch then reads no header. Each image is read once; those over ``max_bytes`` are not. Returns
    the sizes recorded (0 where the shard has no cache file)."""
    if not shard.dali_index or not len(shard):
        return 0
    ranges, keys = shard.column("image_range"), shard.keys
    sizes = np.zeros((len(keys), 2), np.int32)
    for i, (offset, size) in enumerate(ranges.tolist()):
        if size <= 0 or (max_bytes is not None and size > max_bytes):
            continue
        try:
            found = check_header(storage.read(shard.path, offset, size), shard.path, keys[i], max_pixels=None)
        except DataError:
            continue
        if found is not None:
            sizes[i] = found
    _indexcache.save_sizes(shard.dali_index, rules(), sizes)
    return int(np.count_nonzero(sizes[:, 0]))


def rules() -> str:
    """What a recorded size has passed: gpupipe's header rules (:data:`RULES`) and the version of
    nvImageCodec's parser (the parser gate), as a short tag of the cache file's name."""
    global _rules
    if _rules is None:
        try:
            from nvidia import nvimgcodec

            parser = str(getattr(nvimgcodec, "__version__", "?"))
        except ImportError:
            parser = "none"
        _rules = hashlib.sha1(f"{RULES}|{parser}".encode()).hexdigest()[:10]
    return _rules


RULES = 6  # bumped when read_header or the parser gate changes what passes (2: stray marker; 3: BMP headers;
# 4: PNM maxval; 5: a PNM's maxval whatever its pixels or comments; 6: TIFF never to DALI's decoders)
_rules: str | None = None


class Sizes:
    """The ``(height, width)`` of every sample whose header passed (int32, zeros where not known),
    for one index, shared by the reader threads: one array for an index of up to :attr:`LIMIT`
    samples (a batch's sizes are then one gather), else by shard, the shards used least recently
    forgotten beyond :attr:`LIMIT` samples.

    Where a shard has an index cache file, its sizes are kept beside it (``_indexcache.save_sizes``,
    by :meth:`save` after each epoch) and read back in each epoch the first time the shard has a
    sample whose size is not known (:meth:`begin`): a run's first epoch, another rank's shards and
    a restarted job read no header the node has checked before. A recorded size over ``max_pixels``
    is not taken (its header is checked, and refused, again). ``record=False``: memory alone."""

    LIMIT = 8 << 20  # samples remembered at most: 64 MB

    def __init__(self, index: Index, *, max_pixels: int | None = None, record: bool = True) -> None:
        self.index, self.max_pixels, self.record = index, max_pixels, record
        self._all: np.ndarray | None = None  # [len(index), 2], where it is small enough
        self._shards: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._count = 0
        self._lock = threading.Lock()
        self._recalling = threading.Lock()
        n = len(index.shards)
        self._complete = np.zeros(n, bool)  # every size of the shard known
        self._looked = np.zeros(n, bool)  # its record read this epoch
        self._learned: set[int] = set()  # shards with sizes learned since the last save

    def begin(self) -> None:
        """A new epoch: the records of shards not complete are read again when first used."""
        self._looked[:] = self._complete

    def known(self, where: Located, samples: np.ndarray) -> np.ndarray:
        """The remembered sizes of a batch (int64 ``[B, 2]``, zeros where not known)."""
        if self.record and not self._looked[where.shard].all():
            self._recall(where)
        if self._all is not None:
            return self._all[samples].astype(np.int64)
        out = np.zeros((len(samples), 2), np.int64)
        local = np.asarray(samples, np.int64) - self.index.offsets[where.shard]
        with self._lock:
            for group in where.groups:
                sizes = self._shards.get(int(where.shard[group[0]]))
                if sizes is not None:
                    out[group] = sizes[local[group]]
                    self._shards.move_to_end(int(where.shard[group[0]]))
        return out

    def _recall(self, where: Located) -> None:
        """Reads the records of the batch's shards not looked at this epoch (one thread at a
        time: another thread's batch of the same shard waits for them)."""
        with self._recalling:
            for s in np.unique(where.shard[~self._looked[where.shard]]).tolist():
                path = self.index.shards[s].record()
                recorded = _indexcache.load_sizes(path, rules(), int(self.index.shard_sizes[s])) if path else None
                if recorded is not None:
                    if self.max_pixels is not None:
                        recorded[recorded[:, 0].astype(np.int64) * recorded[:, 1] > self.max_pixels] = 0
                    with self._lock:
                        rows = self._rows(s)
                        unknown = rows[:, 0] == 0
                        rows[unknown] = recorded[unknown]
                        self._complete[s] = bool(rows[:, 0].all())
                self._looked[s] = True

    def _held(self, s: int) -> np.ndarray | None:
        """Shard ``s``'s rows where they are held (a view into the whole array, or its own), else
        ``None``; under the lock."""
        if self._all is not None:
            return self._all[self.index.offsets[s] : self.index.offsets[s + 1]]
        return self._shards.get(s)

    def _rows(self, s: int) -> np.ndarray:
        """Shard ``s``'s rows, made where missing (the shards used least recently forgotten
        beyond :attr:`LIMIT`); under the lock."""
        rows = self._held(s)
        if rows is None and len(self.index) <= self.LIMIT:
            self._all = np.zeros((len(self.index), 2), np.int32)
            return self._all[self.index.offsets[s] : self.index.offsets[s + 1]]
        if rows is None:
            n = int(self.index.shard_sizes[s])
            rows = self._shards[s] = np.zeros((n, 2), np.int32)
            self._count += n
            while self._count > self.LIMIT and len(self._shards) > 1:
                gone, dropped = self._shards.popitem(last=False)
                self._count -= len(dropped)
                self._complete[gone] = self._looked[gone] = False
        if self._all is None:
            self._shards.move_to_end(s)
        return rows

    def remember(self, where: Located, samples: np.ndarray, sizes: np.ndarray, positions: np.ndarray) -> None:
        """Remembers ``sizes[positions]`` (samples whose header passed)."""
        if not len(positions):
            return
        shard = where.shard[positions]
        local = np.asarray(samples, np.int64)[positions] - self.index.offsets[shard]
        with self._lock:
            for s in np.unique(shard).tolist():
                mine = shard == s
                rows = self._rows(s)
                rows[local[mine]] = sizes[positions[mine]]
                self._learned.add(s)

    def save(self) -> None:
        """Records the sizes learned since the last save beside their shards' index cache files
        (merged with what other ranks recorded there). A failure is logged: the sizes are then
        checked again in another run."""
        if not self.record:
            return
        with self._lock:
            learned, self._learned = self._learned, set()
            todo = []
            for s in sorted(learned):
                path = self.index.shards[s].record()
                rows = self._held(s)
                if path and rows is not None:
                    todo.append((path, rows.copy()))
        for path, rows in todo:
            _indexcache.save_sizes(path, rules(), rows)


class Headers:
    """The header stage of one epoch's batches (``BatchReader``'s), with the runner's :class:`Sizes`.

    Args:
        sizes: what the runner remembers of its index.
        host_geometry: the graph's geometry is computed from the sizes: a header without a size
            is refused.
        max_pixels: the pixel limit.
        exif: images are turned upright (gpupipe's decoding of a file DALI is not given too).
    """

    def __init__(self, sizes: Sizes, *, host_geometry: bool, max_pixels: int | None, exif: bool) -> None:
        self.memo, self.host_geometry, self.max_pixels, self.exif = sizes, host_geometry, max_pixels, exif

    def sizes(self, where: Located, samples: np.ndarray, views: list[Any], shards: list[str],
              bad: dict[int, DataError]) -> tuple[np.ndarray, frozenset[int]]:  # fmt: skip
        """Each image's ``(height, width)`` (int64 ``[B, 2]``; zeros for samples bad), and the
        positions whose view now holds gpupipe's decoding of the file (a PPM): the files DALI's
        decoders are not given. A sample whose header fails a rule is put in ``bad``."""
        keys = where.keys
        sizes = self.memo.known(where, samples)
        todo = [i for i in np.flatnonzero(sizes[:, 0] == 0).tolist() if i not in bad]
        if not todo:
            return sizes, frozenset()
        foreign, passed = [], []
        for i in todo:
            try:
                size = self._check(views[i], shards[i], keys[i])
            except DataError as e:
                bad.setdefault(i, e)
                continue
            if size is None:
                foreign.append(i)
            else:
                sizes[i] = size
                passed.append(i)
        self.memo.remember(where, samples, sizes, np.array(passed, np.int64))
        return sizes, self.decode_foreign(foreign, views, keys, shards, sizes, bad)

    def _check(self, view: Any, shard: str, key: str) -> tuple[int, int] | None:
        return check_header(view, shard, key, max_pixels=self.max_pixels, host_geometry=self.host_geometry)

    def decode_foreign(self, positions: list[int], views: list[Any], keys: list[str], shards: list[str],
                       sizes: np.ndarray, bad: dict[int, DataError]) -> frozenset[int]:  # fmt: skip
        """Decodes the images at ``positions`` with gpupipe's decoder, in a child process
        (``_fallback``): a refused one is bad (its verdict as on the torch backend), a read one's
        view becomes its pixels as a PPM, and its size the decoded one. Returns the positions read."""
        if not positions:
            return frozenset()
        suspects = [(bytes(views[i]), shards[i], keys[i]) for i in positions]
        decoded = set()
        found = transcoded(suspects, max_pixels=self.max_pixels, apply_exif_orientation=self.exif)
        for i, out in zip(positions, found, strict=True):
            if isinstance(out, DataError):
                bad.setdefault(i, out)
                continue
            views[i] = np.frombuffer(out, np.uint8)
            sizes[i] = ppm_size(out)
            decoded.add(i)
        return frozenset(decoded)
