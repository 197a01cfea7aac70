"""Byte access to shards, the layer under every source: one small interface, chosen by URL scheme.

- :class:`Storage` answers ``stat`` (size and version), ``read`` (a byte range) and ``open`` (a
  seekable stream); :class:`LocalStorage` serves paths and ``file://`` (memory-mapped shards
  that never raise SIGBUS: ``_mapped``).
- ``_schemes``: which storage serves a URL (:func:`register_storage` adds a scheme); any fsspec
  protocol (``https``, ``s3``, ``gs``, ...) is read through ``_remote``'s node-local shard cache
  (``_cache``), downloaded by ``_transfer`` and ahead, by URL, by ``_prefetch`` (which URLs: the
  plan's, ``gpupipe.plan._prefetch``).

Nothing here knows samples, labels or formats: that is :mod:`gpupipe.sources`.
"""

from ._base import LocalStorage, Stat, Storage
from ._mapped import MappedFile
from ._schemes import expand_urls, register_storage, scheme_of, storage_for

__all__ = [
    "Storage",
    "LocalStorage",
    "Stat",
    "MappedFile",
    "register_storage",
    "storage_for",
    "expand_urls",
    "scheme_of",
]
