"""Which storage serves a URL: the scheme table (local paths and ``file://`` built in, more through
:func:`register_storage`), any fsspec protocol through the node-local shard cache
(``storage._remote``), and the expansion of shard patterns. Above both kinds of storage, so that
neither imports the other."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..core._errors import ConfigError, redact
from ._base import LocalStorage, Storage, compressed
from ._transfer import MAX_INFLATION

__all__ = ["register_storage", "scheme_of", "storage_for", "expand_urls", "list_urls"]


_SCHEMES: dict[str, Callable[[], Storage]] = {"": LocalStorage, "file": LocalStorage}


def register_storage(scheme: str, factory: Callable[[], Storage], *, replace: bool = False) -> None:
    """Serves URLs ``scheme://...`` with storages made by ``factory``."""
    if scheme in _SCHEMES and not replace:
        raise ConfigError(f"register_storage: scheme {scheme!r} is already served; pass replace=True to replace it")
    _SCHEMES[scheme] = factory


def scheme_of(url: str) -> str:
    """``"s3"`` for ``"s3://bucket/a.tar"``, ``""`` for a local path."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep and head.isidentifier() else ""


def storage_for(
    urls: Sequence[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | None = None,
    cache_size: int | None = None,
    max_inflation: float | None = MAX_INFLATION,
) -> Storage:
    """A new storage for ``urls``, which must share one scheme: a registered one (local paths,
    ``file://``), else any fsspec protocol (``https``, ``s3``, ``gs``, ``memory``, ...) read
    through the node-local shard cache (``storage._remote``) with fsspec's ``storage_options``;
    gzip shards inflate there to at most ``max_inflation`` times their size."""
    schemes = sorted({scheme_of(u) for u in urls})
    if len(schemes) > 1:
        raise ConfigError(f"one source cannot mix URL schemes, got {schemes}")
    scheme = schemes[0] if schemes else ""
    if scheme in ("", "file") and any(compressed(u) for u in urls):
        from ._remote import RemoteStorage

        # compressed local shards: decompressed once into the shard cache, read from there
        return RemoteStorage("file", cache_dir=cache_dir, cache_size=cache_size, max_inflation=max_inflation)
    if scheme in _SCHEMES:
        if storage_options:
            raise ConfigError(f"storage_options apply to remote URLs only, not to {scheme or 'local'} paths")
        return _SCHEMES[scheme]()
    from ._fsspec import fsspec_protocol
    from ._remote import RemoteStorage

    if not fsspec_protocol(scheme):
        raise ConfigError(_unserved(scheme))
    return RemoteStorage(scheme, storage_options=storage_options, cache_dir=cache_dir, cache_size=cache_size,
                         max_inflation=max_inflation)  # fmt: skip


def _served(scheme: str) -> bool:
    """Whether a storage serves ``scheme``; a ConfigError naming the package to install where
    fsspec knows the protocol but its driver is missing (``s3fs`` for ``s3://``)."""
    from ._fsspec import fsspec_protocol, require_driver

    if scheme in _SCHEMES:
        return True
    if not fsspec_protocol(scheme):
        return False
    require_driver(scheme)
    return True


def _unserved(scheme: str) -> str:
    served = ", ".join(f"{s}://" for s in _SCHEMES if s)
    return (
        f"no storage serves {scheme}:// URLs (served: local paths, {served}, and the protocols fsspec knows: "
        "https://, s3:// with s3fs, gs:// with gcsfs, ...)"
    )


def expand_urls(urls: str | os.PathLike[str] | Sequence[str], *, owner: str = "WebDataset") -> list[str]:
    """Brace-expands a pattern (several braces allowed) or each entry of a list of patterns, checks
    that a storage serves the URLs' scheme, and turns ``file://`` URLs into paths."""
    import braceexpand

    if isinstance(urls, (str, os.PathLike)):
        urls = [urls]  # type: ignore[list-item]
    out: list[str] = []
    for u in urls:
        u = os.fspath(u)
        if u.startswith("pipe:"):
            raise ConfigError(
                f"{owner}: 'pipe:' URLs are not supported: gpupipe never runs a shell command from a URL "
                f"({redact(repr(u))})"
            )
        if not _served(scheme_of(u)):
            raise ConfigError(f"{owner}: {_unserved(scheme_of(u))}: {redact(repr(u))}")
        out.extend(p.removeprefix("file://") for p in braceexpand.braceexpand(u))
    if not out:
        raise ConfigError(f"{owner}: no shard given")
    return out


def list_urls(patterns: Sequence[str], *, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The URLs that exist now of ``patterns`` (brace-expanded, then each a glob with ``*``,
    ``?``, ``[...]``, or a URL kept if it exists): each pattern's matches sorted, in the patterns'
    order, each URL once. Local paths through :mod:`glob`; remote URLs through the fsspec
    filesystem of their protocol (``glob``, ``exists``), with ``storage_options``."""
    import glob

    found: dict[str, None] = {}
    for url in expand_urls(list(patterns)):
        scheme = scheme_of(url)
        if scheme in ("", "file"):
            matches = sorted(glob.glob(url)) if glob.has_magic(url) else [url] if os.path.exists(url) else []
        else:
            from ._fsspec import filesystem_for

            fs = filesystem_for(scheme, storage_options or {})
            fs.invalidate_cache()  # (fsspec keeps listings: a shard written since must be seen)
            if glob.has_magic(url.partition("://")[2]):
                matches = sorted(m if "://" in m else f"{scheme}://{m}" for m in fs.glob(url))
            else:
                matches = [url] if fs.exists(url) else []
        found.update(dict.fromkeys(matches))
    return list(found)
