"""Data sources: WebDataset tar shards and ImageFolder trees, and their sample indexes.

A source is a description (cheap, picklable); :meth:`index` reads the metadata — tar headers, or
the directory tree — and returns an :class:`Index`, from which any process can read samples by
their global number.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import tarfile
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from . import _wdsindex
from ._errors import ConfigError, SampleError, ShardError

__all__ = ["WebDataset", "ImageFolder", "Source", "Index", "RawSample", "parse_label", "split_key"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class RawSample(NamedTuple):
    """One sample as stored: encoded image bytes and the label (``None`` for unlabeled data)."""

    key: str
    shard: str
    data: bytes
    label: int | None


def split_key(member: str) -> tuple[str, str]:
    """``"img/00/000123.seg.png"`` → ``("img/00/000123", "seg.png")``: WebDataset's (and DALI's)
    rule, the key ends at the first dot of the file name; the extension is lower-cased."""
    member = member[2:] if member.startswith("./") else member
    head, _, name = member.rpartition("/")
    stem, dot, ext = name.partition(".")
    return (f"{head}/{stem}" if head else stem), ext.lower() if dot else ""


ShardDetail = tuple[list[str], np.ndarray, np.ndarray]  # keys, image [N, 2], label [N, 2]


class ShardIndex:
    """The samples of one shard: ``size``, and (loaded on first use) their keys and the
    ``[offset, size]`` of the chosen members (-1: none).

    A shard whose details come from a cached index file loads them lazily, so that a loader over
    thousands of shards starts from the shard sizes alone and each rank only parses the index
    files of the shards it reads.
    """

    def __init__(self, path: str, keys: list[str] | None = None, image: np.ndarray | None = None,
                 label: np.ndarray | None = None, labels: np.ndarray | None = None, dali_index: str | None = None,
                 *, size: int | None = None, loader: Callable[[], ShardDetail] | None = None) -> None:
        if keys is None and (loader is None or size is None):
            raise ValueError("ShardIndex needs keys, or a size and a loader")
        self.path = path
        self.labels = labels  # [N] int64, for sources whose labels are not stored in members
        self.dali_index = dali_index  # the cached index file of this shard (DALI's format)
        self.size = len(keys) if keys is not None else int(size)
        self._loader = loader
        self._detail = None if keys is None else (keys, image, label)

    def __len__(self) -> int:
        return self.size

    @property
    def loaded(self) -> bool:
        return self._detail is not None

    def release(self) -> None:
        """Forgets lazily loaded details (they are loaded again when needed)."""
        if self._loader is not None:
            self._detail = None

    def _load(self) -> ShardDetail:
        if self._detail is None:
            detail = self._loader()
            if len(detail[0]) != self.size:
                raise ShardError(f"the index of shard {self.path!r} changed while in use ({len(detail[0])} samples, "
                                 f"{self.size} expected)", shard=self.path)
            self._detail = detail
        return self._detail

    @property
    def keys(self) -> list[str]:
        return self._load()[0]

    @property
    def image(self) -> np.ndarray:  # [N, 2] int64
        return self._load()[1]

    @property
    def label(self) -> np.ndarray:  # [N, 2] int64; all -1 when the source is unlabeled
        return self._load()[2]


class Index:
    """All samples of a source, numbered 0..N-1 in shard order, then member order.

    Attributes:
        shards: one :class:`ShardIndex` per shard, in order.
        sequential: ``True`` where shards are best read front to back (tar files); ``False`` where
            every sample is its own file (ImageFolder).
        labeled: whether samples carry labels.

    Reading is thread-safe: each thread keeps its own open files and reads with ``pread``.
    """

    MAX_OPEN = 128  # open shard files per thread (at least the loader's interleave)
    MAX_LOADED = 1024  # lazily loaded shard details kept per process

    def __init__(self, shards: list[ShardIndex], *, sequential: bool, labeled: bool) -> None:
        self.shards = shards
        self.sequential = sequential
        self.labeled = labeled
        self.shard_sizes = np.array([len(s) for s in shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self._init_process_state()

    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all_files: list[dict[str, int]] = []
        self._loaded: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def close(self) -> None:
        """Closes the shard files this process opened (they reopen on the next read)."""
        if self._pid != os.getpid():
            return
        with self._lock:
            for files in self._all_files:
                for fd in files.values():
                    os.close(fd)
                files.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_local", "_lock", "_all_files", "_loaded")}
        state["_pid"] = -1
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    def locate(self, sample: int) -> tuple[int, int]:
        """Global sample number → (shard number, sample number in the shard)."""
        shard = int(np.searchsorted(self.offsets, sample, side="right")) - 1
        return shard, sample - int(self.offsets[shard])

    def shard(self, s: int) -> ShardIndex:
        """Shard ``s`` with its details loaded; keeps at most ``MAX_LOADED`` lazily loaded."""
        shard = self.shards[s]
        if shard._loader is not None:
            with self._lock:
                self._loaded[s] = None
                self._loaded.move_to_end(s)
                while len(self._loaded) > self.MAX_LOADED:
                    self.shards[self._loaded.popitem(last=False)[0]].release()
        shard._load()
        return shard

    def key(self, sample: int) -> str:
        s, i = self.locate(sample)
        return self.shard(s).keys[i]

    def _fd(self, path: str, key: str) -> int:
        if self._pid != os.getpid():  # a forked child: never share the parent's descriptors
            self._init_process_state()
        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = {}
            with self._lock:
                self._all_files.append(files)
        fd = files.get(path)
        if fd is None:
            if len(files) >= self.MAX_OPEN:
                with self._lock:
                    for old in files.values():
                        os.close(old)
                    files.clear()
            try:
                fd = files[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise ShardError(f"cannot open shard {path!r}: {e}", shard=path, key=key) from e
        return fd

    def _read(self, path: str, offset: int, size: int, key: str) -> bytes:
        data = os.pread(self._fd(path, key), size, offset)
        if len(data) != size:
            raise ShardError(f"shard {path!r} is truncated at sample {key!r}", shard=path, key=key)
        return data

    def read(self, sample: int) -> RawSample:
        """Reads sample number ``sample``: its key, shard, encoded image and parsed label."""
        s, i = self.locate(sample)
        shard = self.shard(s)
        key = shard.keys[i]
        if shard.labels is not None:  # ImageFolder: one file per sample, label from the folder
            path = os.path.join(shard.path, key)
            try:
                with open(path, "rb") as f:
                    return RawSample(key, shard.path, f.read(), int(shard.labels[i]))
            except OSError as e:
                raise SampleError(f"cannot read sample {key!r} in {shard.path!r}: {e}", shard=shard.path,
                                  key=key) from e
        data = self._read(shard.path, *map(int, shard.image[i]), key)
        label = None
        if self.labeled:
            label = parse_label(self._read(shard.path, *map(int, shard.label[i]), key), shard=shard.path, key=key)
        return RawSample(key, shard.path, data, label)


def parse_label(raw: bytes, *, shard: str, key: str) -> int:
    """A ``.cls`` member's ASCII integer; SampleError naming shard and key otherwise."""
    try:
        return int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise SampleError(f"label of sample {key!r} in shard {shard!r} is not an ASCII integer: {raw[:40]!r}",
                          shard=shard, key=key) from None


class Source:
    """Base class of data sources."""

    def index(self, *, rank: int = 0, world_size: int = 1) -> Index:  # pragma: no cover - abstract
        raise NotImplementedError


def _split_exts(value: str | Sequence[str] | None, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    parts = value.split(";") if isinstance(value, str) else list(value)
    exts = tuple(p.strip().lower().lstrip(".") for p in parts if p.strip())
    if not exts or not all(isinstance(e, str) for e in exts):
        raise ConfigError(f"WebDataset: {name} must be extensions separated by ';' (e.g. 'jpg;png'), got {value!r}")
    return exts


def expand_urls(urls: str | Sequence[str]) -> list[str]:
    """Brace-expands a pattern (several braces allowed) or each entry of a list of patterns."""
    import braceexpand

    if isinstance(urls, (str, os.PathLike)):
        urls = [urls]
    out: list[str] = []
    for u in urls:
        u = os.fspath(u)
        if u.startswith("pipe:"):
            raise ConfigError(f"WebDataset: 'pipe:' URLs are not supported: gpupipe never runs a shell command "
                              f"from a URL ({u!r})")
        if "://" in u and not u.startswith("file://"):
            raise ConfigError(f"WebDataset: only local paths (or file://) are supported for now, got {u!r}")
        out.extend(p.removeprefix("file://") for p in braceexpand.braceexpand(u))
    if not out:
        raise ConfigError("WebDataset: no shard given")
    return out


@dataclasses.dataclass(frozen=True)
class WebDataset(Source):
    """WebDataset tar shards.

    Args:
        urls: a path pattern with brace ranges (``"data/train-{000000..000127}.tar"``; several
            braces allowed) or a list of paths/patterns.
        image: accepted image extensions, in order of preference, separated by ``;``.
            Default ``"jpg;jpeg;png"``.
        label: the extension of the label member, an ASCII integer (``"cls"``), or ``None`` for
            unlabeled data (the loader then yields images only).

    A sample is a run of consecutive members sharing a key: the member path up to the first dot of
    its file name (``img/00/000123.jpg`` → ``img/00/000123``). Members of other extensions are
    ignored. A sample without an accepted image, or without its label, is an error that names the
    shard and the key.
    """

    urls: str | Sequence[str]
    _: dataclasses.KW_ONLY
    image: str = "jpg;jpeg;png"
    label: str | None = "cls"

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", tuple(expand_urls(self.urls)))
        _split_exts(self.image, "image")
        if self.label is not None:
            _split_exts(self.label, "label")

    def extensions(self) -> tuple[tuple[str, ...], str | None]:
        """The image extensions, in order of preference, and the label extension (``None``)."""
        return _split_exts(self.image, "image"), (self.label.lstrip(".").lower() if self.label else None)

    def index(self, *, rank: int = 0, world_size: int = 1) -> Index:
        """Indexes the shards. Cached shards cost one header line each (their details load when
        first read); the others are scanned and cached. Rank ``r`` of ``world_size`` starts
        scanning at shard ``r * n // world_size``, so that ranks sharing a cache directory scan a
        new dataset's shards in parallel rather than all in the same order."""
        image_exts, label_ext = self.extensions()
        n = len(self.urls)
        first = rank * n // max(1, world_size)
        shards: list[ShardIndex | None] = [None] * n
        for i in range(n):
            s = (first + i) % n
            shards[s] = _cached_scan(self.urls[s], image_exts, label_ext)
        return Index(shards, sequential=True, labeled=label_ext is not None)


def _cached_scan(path: str, image_exts: tuple[str, ...], label_ext: str | None) -> ShardIndex:
    try:
        idx_path = _wdsindex.index_path(path, image_exts, label_ext)
    except OSError as e:
        raise ShardError(f"cannot read shard {path!r}: {e}", shard=path) from e
    labeled = label_ext is not None
    size = _wdsindex.count(idx_path)
    if size is not None:
        def load() -> ShardDetail:
            cached = _wdsindex.load(idx_path, labeled=labeled)
            if cached is None:  # the cache file went away or was damaged: scan the shard again
                shard, _ = scan_tar(path, image_exts, label_ext)
                return shard.keys, shard.image, shard.label
            return cached

        return ShardIndex(path, dali_index=idx_path, size=size, loader=load)
    shard, exts = scan_tar(path, image_exts, label_ext)
    if _wdsindex.save(idx_path, shard.keys, exts, shard.image, shard.label if labeled else None):
        shard.dali_index = idx_path
    return shard


def scan_tar(path: str, image_exts: tuple[str, ...], label_ext: str | None) -> tuple[ShardIndex, list[str]]:
    """Reads the headers of one tar shard (not the data) and groups members into samples."""
    groups: list[tuple[str, dict[str, tuple[int, int]]]] = []
    try:
        with tarfile.open(path, mode="r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, ext = split_key(m.name)
                if not groups or groups[-1][0] != key:
                    groups.append((key, {}))
                groups[-1][1][ext] = (m.offset_data, m.size)
    except (OSError, tarfile.TarError) as e:
        raise ShardError(f"cannot read shard {path!r}: {e}", shard=path) from e
    keys, exts, image, label = [], [], np.full((len(groups), 2), -1, np.int64), np.full((len(groups), 2), -1, np.int64)
    for i, (key, members) in enumerate(groups):
        ext = next((e for e in image_exts if e in members), None)
        if ext is None:
            raise SampleError(f"sample {key!r} in shard {path!r} has no image ({'/'.join(image_exts)}); it has "
                              f"{sorted(members) or 'no members'}", shard=path, key=key)
        image[i] = members[ext]
        exts.append(ext)
        if label_ext is not None:
            if label_ext not in members:
                raise SampleError(f"sample {key!r} in shard {path!r} has no .{label_ext} label; pass label=None "
                                  f"for unlabeled data", shard=path, key=key)
            label[i] = members[label_ext]
        keys.append(key)
    return ShardIndex(path, keys, image, label), exts


@dataclasses.dataclass(frozen=True)
class ImageFolder(Source):
    """A torchvision ImageFolder tree: ``root/<class>/<...>/<image>``.

    Classes are the sorted names of ``root``'s sub-folders, numbered from 0, exactly as
    ``torchvision.datasets.ImageFolder``; files are walked in sorted order, following links.

    Args:
        root: the tree's root folder.
        extensions: accepted file extensions (lower-case match). Default: torchvision's
            ``IMG_EXTENSIONS``.

    Sample keys are paths relative to ``root`` (``"cat/001.jpg"``).
    """

    root: str
    _: dataclasses.KW_ONLY
    extensions: tuple[str, ...] = IMG_EXTENSIONS

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", os.fspath(self.root))
        if not os.path.isdir(self.root):
            raise ConfigError(f"ImageFolder: root {self.root!r} is not a directory")

    @property
    def classes(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.root) if e.is_dir())

    def index(self, *, rank: int = 0, world_size: int = 1) -> Index:
        classes = self.classes
        if not classes:
            raise ShardError(f"ImageFolder: no class folders in {self.root!r}", shard=self.root)
        exts = tuple(e.lower() for e in self.extensions)
        shards = []
        for label, cls in enumerate(classes):
            keys = []
            for dirpath, _, names in sorted(os.walk(os.path.join(self.root, cls), followlinks=True)):
                rel = os.path.relpath(dirpath, self.root)
                keys += [f"{rel}/{n}".replace(os.sep, "/") for n in sorted(names) if n.lower().endswith(exts)]
            if keys:
                empty = np.zeros((0, 2), np.int64)
                shards.append(ShardIndex(self.root, keys, empty, empty, np.full(len(keys), label, np.int64)))
        if not shards:
            raise ShardError(f"ImageFolder: no image files ({', '.join(exts)}) under {self.root!r}", shard=self.root)
        return Index(shards, sequential=False, labeled=True)
