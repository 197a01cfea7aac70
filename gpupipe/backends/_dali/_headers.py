"""The header stage of the DALI runner's input path: each sample's image size, and the files its
decoders are not given (``_fallback``), for a whole batch in a reader thread.

A sample's header is read once in a runner's life: the first time its batch is read, its header
is checked by gpupipe's rules (``gpupipe.runtime._decode.read_header``: formats, the pixel limit) and by
nvImageCodec's parser (``_fallback.parsed``), and the size of a file that passes both is
remembered (:class:`Sizes`). From then on the batch's sizes are gathered from memory with a few
array operations per shard: no Python per sample, and no page of the file touched by a thread that
holds the GIL (DALI's decoders read it anyway). The files that do not pass are checked again each
time they are read: their verdict is the loader's to count every epoch.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

from ...core._errors import Damage, DataError, SampleError
from ...runtime._decode import read_header, transcoded
from ...sources import Index, Located
from ._fallback import native, parsed, ppm_size

__all__ = ["Sizes", "Headers"]


class Sizes:
    """The ``(height, width)`` of every sample whose header passed (int32, zeros where not known),
    for one index, shared by the reader threads: one array for an index of up to :attr:`LIMIT`
    samples (a batch's sizes are then one gather), else by shard, the shards used least recently
    forgotten beyond :attr:`LIMIT` samples."""

    LIMIT = 8 << 20  # samples remembered at most: 64 MB

    def __init__(self, index: Index) -> None:
        self.index = index
        self._all: np.ndarray | None = None  # [len(index), 2], where it is small enough
        self._shards: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._count = 0
        self._lock = threading.Lock()

    def known(self, where: Located, samples: np.ndarray) -> np.ndarray:
        """The remembered sizes of a batch (int64 ``[B, 2]``, zeros where not known)."""
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

    def remember(self, where: Located, samples: np.ndarray, sizes: np.ndarray, positions: np.ndarray) -> None:
        """Remembers ``sizes[positions]`` (samples whose header passed)."""
        if not len(positions):
            return
        if len(self.index) <= self.LIMIT:
            with self._lock:
                if self._all is None:
                    self._all = np.zeros((len(self.index), 2), np.int32)
            self._all[np.asarray(samples, np.int64)[positions]] = sizes[positions]
            return
        shard = where.shard[positions]
        local = np.asarray(samples, np.int64)[positions] - self.index.offsets[shard]
        with self._lock:
            for s in np.unique(shard).tolist():
                rows = self._shards.get(s)
                if rows is None:
                    n = int(self.index.shard_sizes[s])
                    rows = self._shards[s] = np.zeros((n, 2), np.int32)
                    self._count += n
                mine = shard == s
                rows[local[mine]] = sizes[positions[mine]]
            while self._count > self.LIMIT and len(self._shards) > 1:
                self._count -= len(self._shards.popitem(last=False)[1])


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
        """The size DALI's decoders will read, or ``None``: not given to them (see ``_fallback``)."""
        header = read_header(memoryview(view), self.max_pixels, shard=shard, key=key)
        dali = parsed(view) if native(header) else None
        if dali is None or (header.size is not None and dali != header.size):
            return None
        if self.host_geometry and not all(dali):
            raise SampleError.at("the image's header declares no size (not an image, or a corrupt header)",
                                 shard=shard, key=key, kind=Damage.UNDECODABLE)  # fmt: skip
        return dali

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
