"""Data sources: the dataset formats, over the storage layer (:mod:`gpupipe.storage`, whose
names are re-exported here) and a shard's index (:mod:`gpupipe.shards`: tar scanning, the index
cache, the files beside the shards).

- :class:`Index` — a source's samples numbered ``0..N-1``, shard by shard (:class:`ShardIndex`),
  with no I/O of its own: a :class:`Reader` given by the source reads samples through a storage.
- Sources — cheap, picklable descriptions whose ``index()`` builds an :class:`Index`:
  :class:`WebDataset` (tar shards; tar headers scanned once and cached in DALI's index format)
  and :class:`ImageFolder`, and :class:`FakeData` (generated JPEGs, for runs without a dataset);
  :class:`Mix` reads several of them as one, each with its share of every epoch.
  A new source subclasses :class:`Source`.
"""

from ..shards._shard import NO_LABEL, RawSample, Reader, ShardIndex
from ..shards._tar import parse_label, split_key
from ..storage import LocalStorage, Stat, Storage, expand_urls, register_storage, storage_for
from ._fake import FakeData
from ._imagefolder import IMG_EXTENSIONS, ImageFolder
from ._index import Index, Located, Source
from ._mix import Mix
from ._webdataset import WebDataset

__all__ = [
    "Source",
    "WebDataset",
    "ImageFolder",
    "FakeData",
    "Mix",
    "Index",
    "ShardIndex",
    "RawSample",
    "Reader",
    "Located",
    "NO_LABEL",
    "Storage",
    "LocalStorage",
    "Stat",
    "register_storage",
    "storage_for",
    "expand_urls",
    "split_key",
    "parse_label",
    "IMG_EXTENSIONS",
]
