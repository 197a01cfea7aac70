"""ImageFolder trees: the source and its reader (one file per sample, the label from its folder)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core._errors import ConfigError, Damage, DataError, Problem, SampleError, ShardError, too_many_bytes
from ..core._validate import valid_bool
from ..shards._indexcache import cache_dir
from ..shards._shard import RawSample, ShardIndex
from ..storage._base import LocalStorage, Storage
from ..storage._files import NotRegularFile
from ._index import Index, Source

__all__ = ["ImageFolder", "IMG_EXTENSIONS"]

log = logging.getLogger("gpupipe")

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclasses.dataclass(frozen=True)
class ImageFolder(Source):
    """A torchvision ImageFolder tree: ``root/<class>/<...>/<image>`` (a local directory).

    Classes are the sorted names of ``root``'s sub-folders, numbered from 0, exactly as
    ``torchvision.datasets.ImageFolder``; files are walked in sorted order, following links.

    Args:
        root: the tree's root folder.
        extensions: accepted file extensions (lower-case match). Default: torchvision's
            ``IMG_EXTENSIONS``.
        allow_empty: accept class folders without an image file, as classes with no samples
            (default ``False``: refused when indexing, as torchvision's ``ImageFolder`` does).

    Sample keys are paths relative to ``root`` (``"cat/001.jpg"``). Each class is one shard of
    the index.
    """

    root: str
    _: dataclasses.KW_ONLY
    extensions: tuple[str, ...] = IMG_EXTENSIONS
    allow_empty: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", os.fspath(self.root))
        if not os.path.isdir(self.root):
            raise ConfigError(f"ImageFolder: root {self.root!r} is not a directory")
        valid_bool("ImageFolder", self.allow_empty, "allow_empty")

    @property
    def classes(self) -> list[str]:
        try:
            with os.scandir(self.root) as entries:
                return sorted(e.name for e in entries if _is_dir(e))
        except OSError as e:
            raise ShardError(f"ImageFolder: cannot list the root {self.root!r}: {e.strerror}", shard=self.root,
                             kind=Damage.UNREADABLE_SHARD) from e  # fmt: skip

    def index(self, *, rank: int = 0, world_size: int = 1, on_error: Any = "raise") -> Index:
        """Lists the class folders' image files (an image file is read, and judged, when its
        sample is). A sub-folder that cannot be listed (no permission, an I/O error) is damage
        found when indexing: raised under ``on_error="raise"``, listed in ``Index.problems``
        (its files left out, counted) under ``"skip"``."""
        from ..core._config import OnError
        from ..core._validate import valid_enum

        policy = valid_enum("ImageFolder.index", on_error, "on_error", OnError)
        classes = self.classes
        if not classes:
            raise ShardError(f"ImageFolder: no class folders in {self.root!r}", shard=self.root)
        exts = tuple(e.lower() for e in self.extensions)
        shards, empty = [], []
        for label, cls in enumerate(classes):
            keys, unlisted = list[str](), list[OSError]()
            for dirpath, names in _walk(os.path.join(self.root, cls), unlisted):
                rel = os.path.relpath(dirpath, self.root)
                keys += [f"{rel}/{n}".replace(os.sep, "/") for n in sorted(names) if n.lower().endswith(exts)]
            problems = tuple(
                Problem(Damage.UNREADABLE_SHARD, os.path.relpath(e.filename, self.root).replace(os.sep, "/"),
                        f"is a folder that cannot be listed ({e.strerror}): its files are not in the index")
                for e in unlisted
            )  # fmt: skip
            if not keys and not problems:
                empty.append(cls)
            if keys or problems:
                records = functools.partial(_class_record, self.root, cls, keys)
                shards.append(ShardIndex(self.root, keys, {"label": np.full(len(keys), label, np.int64)},
                                         records=records, problems=problems))  # fmt: skip
        if empty and not self.allow_empty and len(empty) < len(classes):
            raise ShardError(f"ImageFolder: no image files ({', '.join(exts)}) in the class folder"
                             f"{'s' if len(empty) > 1 else ''} {', '.join(map(repr, empty[:10]))}"
                             f"{f' and {len(empty) - 10} more' if len(empty) > 10 else ''} of {self.root!r}: as "
                             "torchvision's ImageFolder, gpupipe refuses them (allow_empty=True keeps each as a class "
                             "without samples)", shard=self.root)  # fmt: skip
        index = Index(shards, reader=FileReader(LocalStorage()), sequential=False, labeled=True)
        if policy is OnError.RAISE and index.problems:
            from ._webdataset import raise_first

            raise_first(index.problems)
        if not len(index):
            raise ShardError(f"ImageFolder: no image files ({', '.join(exts)}) under {self.root!r}", shard=self.root)
        return index


def _is_dir(entry: os.DirEntry[str]) -> bool:
    """Whether a root entry is a class folder (links followed); a link that loops on itself or
    cannot be followed (``ELOOP``, ``EACCES``) is not one, with a warning."""
    try:
        return entry.is_dir()
    except OSError as e:
        log.warning("gpupipe: ImageFolder: %r cannot be followed (%s): not a class folder", entry.path, e.strerror)
        return False


def _walk(top: str, unlisted: list[OSError] | None = None) -> list[tuple[str, list[str]]]:
    """``os.walk(top, followlinks=True)``'s folders and file names, sorted by folder, as
    torchvision's ImageFolder lists them, but a link to a folder that holds it (a loop: ``a/up ->
    ..``) is not followed, with a warning: torchvision follows it until the path is too long,
    listing each file again at each level. (A file's entry here may still be a FIFO, a device or a
    dangling link: each gets its verdict when its sample is read.) A folder that cannot be listed
    is appended to ``unlisted`` (``os.walk`` would pass over it without a word)."""
    out, chains = [], {top: _identity(top)}
    for dirpath, dirnames, names in os.walk(
        top, followlinks=True, onerror=None if unlisted is None else unlisted.append
    ):
        chain = chains.pop(dirpath, frozenset())
        for d in list(dirnames):
            path = os.path.join(dirpath, d)
            ident = _identity(path)
            if ident & chain:
                dirnames.remove(d)
                log.warning(
                    "gpupipe: ImageFolder: %r leads back to a folder that holds it (a link loop): not followed", path
                )
            else:
                chains[path] = chain | ident
        out.append((dirpath, names))
    return sorted(out)


def _identity(path: str) -> frozenset[tuple[int, int]]:
    """The folder's ``(device, inode)``, links followed (none where it cannot be stat'ed)."""
    try:
        st = os.stat(path)
    except OSError:
        return frozenset()
    return frozenset({(st.st_dev, st.st_ino)})


def _class_record(root: str, cls: str, keys: list[str]) -> str | None:
    """Where what a loader learns of a class folder's files is recorded (their images' sizes,
    ``backends/_dali/_headers.Sizes``): in the node's index cache, under a digest of the folder
    and of each file's name, size and modification time, so that a file added, removed or
    rewritten makes a new record. Called once per loader, when the class is first read (a stat
    per file, in a reader thread); ``None`` where a file cannot be stat'ed."""
    digest = hashlib.sha256(os.fsencode(f"{os.path.realpath(root)}\0{cls}"))  # (a name need not be UTF-8)
    for key in keys:
        try:
            st = os.stat(os.path.join(root, key))
        except OSError:
            return None
        digest.update(os.fsencode(f"\0{key}\0{st.st_size}\0{st.st_mtime_ns}"))
    return os.path.join(cache_dir(), f"imagefolder-{digest.hexdigest()[:32]}.idx")


class FileReader:
    """Reads a whole file per sample: ``<shard path>/<key>``; the label is the shard's column. A
    file over ``max_image_bytes`` is refused after reading one byte more than the limit."""

    def __init__(self, storage: Storage, max_image_bytes: int | None = None) -> None:
        self.storage, self.max_image_bytes = storage, max_image_bytes

    def read(self, shard: ShardIndex, i: int) -> RawSample:
        key, limit = shard.keys[i], self.max_image_bytes
        try:
            with self.storage.open(f"{shard.path}/{key}") as f:
                data = f.read() if limit is None else f.read(limit + 1)
            if limit is not None and len(data) > limit:
                raise too_many_bytes(shard.path, key, self.storage.stat(f"{shard.path}/{key}").size, limit)
        except OSError as e:
            raise _unreadable(shard.path, key, e) from e
        return RawSample(key, shard.path, data, int(shard.column("label")[i]))

    def read_files_into(self, items: Sequence[tuple[ShardIndex, int]],
                        take: Callable[[int], np.ndarray]) -> WholeFiles:  # fmt: skip
        """Samples ``items`` (``(shard, i)`` pairs) read whole into one buffer of
        ``take(total)``: a ``stat`` per file first (one over ``max_image_bytes`` is refused from
        its size, unread), then each file read straight into its place (``Storage.read_files_into``:
        no bytes object per file, no second copy). A file that changed size between the two, or
        whose read failed, is read again by :meth:`read`. The errors are :meth:`read`'s."""
        urls = [f"{shard.path}/{shard.keys[i]}" for shard, i in items]
        limit = self.max_image_bytes
        errors: dict[int, DataError] = {}
        lengths = []
        for j, size in enumerate(self.storage.sizes(urls)):
            shard, i = items[j]
            if isinstance(size, OSError):
                errors[j] = _unreadable(shard.path, shard.keys[i], size)
            elif limit is not None and size > limit:
                errors[j] = too_many_bytes(shard.path, shard.keys[i], size, limit)
            else:
                lengths.append((j, size))
        slots = [size + 1 for _, size in lengths]  # a byte more each: a file that grew reads it
        buffer = take(sum(slots))
        at = np.cumsum([0, *slots]).tolist()
        views: list[np.ndarray | None] = [None] * len(items)
        got = self.storage.read_files_into([urls[j] for j, _ in lengths], memoryview(buffer), at[:-1],  # type: ignore[arg-type]
                                           slots)  # fmt: skip
        for (j, size), start, n in zip(lengths, at[:-1], got, strict=True):
            shard, i = items[j]
            if n == size:
                views[j] = buffer[start : start + size]
            else:  # it changed since its stat, or its read failed: read it again, alone (read()'s error)
                try:
                    views[j] = np.frombuffer(self.read(shard, i).data, np.uint8)
                except DataError as e:
                    errors[j] = e
        return WholeFiles(buffer, views, errors)

    def close(self) -> None:
        self.storage.close()


class WholeFiles(NamedTuple):
    """A batch of whole files read into one buffer (:meth:`FileReader.read_files_into`)."""

    buffer: np.ndarray  # from the caller's ``take``: the caller gives it back
    views: list[np.ndarray | None]  # each sample's bytes (in ``buffer``, or its own); None where it failed
    errors: dict[int, DataError]  # by position: the samples that could not be read


def _unreadable(shard: str, key: str, e: OSError) -> SampleError:
    """A file that is missing (a dangling link) or not a regular file (a FIFO, a device) has no
    image; another I/O error is the folder's."""
    kind = Damage.NO_IMAGE if isinstance(e, FileNotFoundError | NotRegularFile) else Damage.UNREADABLE_SHARD
    return SampleError(f"cannot read sample {key!r} in {shard!r}: {e}", shard=shard, key=key, kind=kind)
