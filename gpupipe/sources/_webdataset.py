"""WebDataset tar shards: the source and its sample reader (a shard's index: ``_indexing``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from ..core._config import OnError
from ..core._errors import ConfigError, Damage, DataError, ShardError, counted, too_many_bytes, truncated, unreadable
from ..core._fields import Field, Image, Label, Missing, parse_fields
from ..core._validate import is_number, valid_bytes, valid_enum
from ..shards._indexing import cached_scan, scan_ahead
from ..shards._shard import NO_LABEL, FieldMembers, RawSample, ShardIndex, field_column
from ..shards._tar import missing_field, parse_label, require_label_size
from ..storage._base import Storage
from ..storage._schemes import expand_urls, list_urls, storage_for
from ..storage._transfer import MAX_INFLATION
from ._index import Index, Source

__all__ = ["WebDataset", "TarReader", "raise_first"]


def _split_exts(value: str | Sequence[str] | None, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    parts = value.split(";") if isinstance(value, str) else list(value)
    exts = tuple(p.strip().lower().lstrip(".") for p in parts if isinstance(p, str) and p.strip())
    if not exts or not all(isinstance(p, str) for p in parts):
        raise ConfigError(f"WebDataset: {name} must be extensions separated by ';' (e.g. 'jpg;png'), got {value!r}")
    return exts


@dataclasses.dataclass(frozen=True)
class WebDataset(Source):
    """WebDataset tar shards.

    Args:
        urls: a path or URL pattern with brace ranges (``"data/train-{000000..000127}.tar"``,
            ``"https://host/data/train-{000000..000127}.tar"``, ``"s3://bucket/train-{0..9}.tar"``;
            several braces allowed) or a list of them. Remote URLs: any protocol fsspec knows,
            read through the node-local shard cache.
        image: accepted image extensions, in order of preference, separated by ``;``.
            Default ``"jpg;jpeg;png"``.
        label: the extension of the label member, an ASCII integer (``"cls"``), or ``None`` for
            unlabeled data (the loader then yields images only).
        storage_options: remote URLs only: keyword arguments of the fsspec filesystem
            (``{"endpoint_url": ...}`` for s3fs, headers for https); default: the driver's own
            configuration and environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
        cache_dir: remote URLs only: where whole shards are cached on this node (default
            ``$GPUPIPE_CACHE_DIR/shards``, ``~/.cache/gpupipe/shards``).
        cache_size: remote URLs only: the cache's bound, in bytes or as ``"500GB"``, ``"1.5TB"``,
            ``"800MiB"``; least recently used shards no
            process of the node reads are deleted to stay within it. Default: 80% of what the
            cache could use when first asked (its shards plus the free space of its disk).
        max_inflation: gzip shards (``.tar.gz``, ``.tgz``, local or remote; decompressed once into
            the shard cache): the most one may inflate to, times its compressed size (plus 1 MiB).
            Past it the decompression stops and the shard is ``"unreadable-shard"`` (skipped under
            ``on_error="skip"``, reported by ``check``): a 1.9 MB ``.tgz`` of zeros does not
            become 1.9 GB of cache. Default 100 (tars of JPEGs inflate about 1x, of text 5-20x);
            ``None``: no bound.
        relist: a dataset that grows between epochs: ``urls`` are patterns of what may exist
            (globs ``"data/train-*.tar"``, ``"s3://bucket/shards/*.tar"``, or brace ranges
            over shards not all written yet), listed again by the loader at each new epoch, so
            that the epoch reads the shards present then (``Source.listing``). Default ``False``:
            the shards are fixed when the source is made. Write each shard under another name and
            rename it when complete (a half-written shard matching the pattern is read as
            damaged). See docs/guide/growing.md.
        fields: the sample's members by name, as WebDataset's ``to_tuple``/``rename`` read them:
            ``{"image": "jpg;png", "label": "cls", "text": "txt", "meta": "json", "emb": "npy"}``.
            A value is extensions (their kind says how they are decoded: images, ``cls``,
            ``txt``, ``json``, ``npy``) or a field of ``gpupipe.fields`` (``Text``, ``Json``,
            ``Label``, ``Array``, ``Image``, ``Mask``, ``Boxes``) for its options: ``missing``
            (``"error"``, ``"skip"``, ``"empty"``), ``max_bytes``, an array's ``dtype``, ``shape``
            and ``pad``, a text's ``tokenizer``. The one
            ``Image`` field replaces ``image=``; without one, samples have no image (a pipeline of
            fields alone, ``.npy`` arrays say: ``images`` is ``None``). A ``Label`` field named
            ``"label"`` replaces ``label=`` (without one the source is unlabeled). The others come
            with each batch by name: ``batch["text"]`` a list of str, ``batch["meta"]`` a list of
            dicts, an array field of one shape a ``[B, ...]`` tensor (else a list, or
            ``Padded``), a ``Label`` int64 ``[B]``. They are decoded in the torch and Ray
            backends' workers or the DALI backend's reader threads (the same values), never by
            unpickling. Default ``None``: image and label only.

    A sample is a run of consecutive members sharing a key: the member path up to the first dot of
    its file name (``img/00/000123.jpg`` → ``img/00/000123``). Members of other extensions are
    ignored. A sample without an accepted image, or without its label, is an error that names the
    shard and the key.
    """

    urls: str | Sequence[str]
    _: dataclasses.KW_ONLY
    image: str = "jpg;jpeg;png"
    label: str | None = "cls"
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    cache_dir: str | None = None
    cache_size: int | str | None = None
    max_inflation: float | None = MAX_INFLATION
    relist: bool = False
    fields: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.fields is not None:
            self._take_fields()
        object.__setattr__(self, "cache_size", valid_bytes("WebDataset", self.cache_size, "cache_size"))
        if self.max_inflation is not None and not (is_number(self.max_inflation) and self.max_inflation >= 1):
            raise ConfigError(f"WebDataset: max_inflation must be a number >= 1 or None, got {self.max_inflation!r}")
        if not isinstance(self.relist, bool):
            raise ConfigError(f"WebDataset: relist must be True or False, got {self.relist!r}")
        if self.relist:  # patterns, listed when asked (checked now: schemes served, no pipe:)
            expand_urls(self.urls)
            patterns = [self.urls] if isinstance(self.urls, (str, os.PathLike)) else list(self.urls)
            object.__setattr__(self, "urls", tuple(os.fspath(u) for u in patterns))
        else:
            object.__setattr__(self, "urls", tuple(expand_urls(self.urls)))
        if self.has_image:
            _split_exts(self.image, "image")
        if self.label is not None:
            _split_exts(self.label, "label")

    def _take_fields(self) -> None:
        """``fields=``: parsed; the image field becomes ``image``, a ``Label`` named ``"label"``
        becomes ``label``, the rest are :meth:`extra_fields`."""
        fields = parse_fields(self.fields)  # type: ignore[arg-type]
        images = [name for name, f in fields.items() if isinstance(f, Image)]
        if len(images) > 1:
            raise ConfigError(
                f"WebDataset: fields= takes one image field (jpg, png, ... or gp.fields.Image), got {images}"
            )
        if self.image != "jpg;jpeg;png" or (self.label != "cls" and self.label is not None):
            raise ConfigError("WebDataset: give the image and the label in fields=, not also as image= and label=")
        label = fields.get("label")
        if label is not None and not isinstance(label, Label):
            raise ConfigError(f"WebDataset: fields['label'] is the class label: an integer member (cls), got {label}")
        if label is not None and (len(label.exts) != 1 or label.missing is not Missing.ERROR):
            raise ConfigError("WebDataset: fields['label'] (the class label) is one extension, and every sample has it")
        object.__setattr__(self, "image", ";".join(fields[images[0]].exts) if images else "")
        object.__setattr__(self, "label", label.exts[0] if label is not None else None)
        object.__setattr__(self, "fields", fields)

    def extra_fields(self) -> dict[str, Field]:
        """The fields beyond the image and the class label, by name (empty without ``fields=``)."""
        if not self.fields:
            return {}
        return {n: f for n, f in self.fields.items() if not isinstance(f, Image) and not (n == "label" and self.label)}

    def field_members(self) -> tuple[FieldMembers, ...]:
        """The :meth:`extra_fields` as a shard's index knows them (name, extensions, missing)."""
        return tuple(FieldMembers(n, tuple(f.exts), Missing(f.missing).value) for n, f in self.extra_fields().items())

    def listing(self) -> tuple[str, ...] | None:
        """With ``relist=True``: the shards that match ``urls`` now (``None`` otherwise)."""
        if not self.relist:
            return None
        return tuple(list_urls(self.urls, storage_options=self.storage_options))

    def with_listing(self, listing: Any) -> WebDataset:
        if not self.relist:
            return self
        if not listing:
            raise ConfigError(f"WebDataset: no shard matches {list(self.urls)} yet")
        return dataclasses.replace(self, urls=tuple(listing), relist=False)

    def storage(self) -> Storage:
        """A new storage for the shards (the caller closes it)."""
        return storage_for(
            self.urls,
            storage_options=self.storage_options,
            cache_dir=self.cache_dir,
            cache_size=self.cache_size,  # type: ignore[arg-type]  # an int after __post_init__
            max_inflation=self.max_inflation,
        )

    @property
    def has_image(self) -> bool:
        """Whether samples have an image: not for ``fields=`` without an image field (arrays, text)."""
        return self.fields is None or bool(self.image)

    def extensions(self) -> tuple[tuple[str, ...], str | None]:
        """The image extensions, in order of preference (none for a source without images), and
        the label extension (``None``)."""
        image = _split_exts(self.image, "image") if self.has_image else ()
        return image, (self.label.lstrip(".").lower() if self.label else None)

    def index(self, *, rank: int = 0, world_size: int = 1, on_error: OnError | str = OnError.RAISE) -> Index:
        """Indexes the shards. Cached shards cost one header line each (their details load when
        first read); the others are scanned and cached. Rank ``r`` of ``world_size`` starts
        scanning at shard ``r * n // world_size``, so that ranks sharing a cache directory scan a
        new dataset's shards in parallel rather than all in the same order.

        Damage (a missing, unreadable, empty or truncated shard; a sample without image or label,
        or with a repeated key) is recorded in the cache with the index. ``on_error="raise"``
        raises the first (after indexing every shard); ``"skip"`` returns the index without those
        samples and shards, listed in ``Index.problems``. With ``relist=True``: of the shards
        present now."""
        if self.relist:
            return self.with_listing(self.listing()).index(rank=rank, world_size=world_size, on_error=on_error)
        image_exts, label_ext = self.extensions()
        extra, members = self.extra_fields(), self.field_members()
        storage = self.storage()
        n = len(self.urls)
        first = rank * n // max(1, world_size)
        order = [(first + i) % n for i in range(n)]
        scan_ahead(storage, [self.urls[s] for s in order], image_exts, label_ext, members)  # a new dataset, local
        shards: list[ShardIndex | None] = [None] * n
        for s in order:
            shards[s] = cached_scan(storage, self.urls[s], image_exts, label_ext, fields=members)
        labeled = label_ext is not None
        reader = TarReader(storage, labeled=labeled, fields=extra)
        index = Index(shards, reader=reader, sequential=True, labeled=labeled, fields=extra,  # type: ignore[arg-type]
                      images=bool(image_exts))  # fmt: skip
        try:
            policy = valid_enum("WebDataset.index", on_error, "on_error", OnError)
            _none_missing_all(self.urls, index.problems)  # whatever the policy: skipping all leaves nothing
            if policy is OnError.RAISE:  # (a field with missing="skip" leaves its samples out under both)
                skipped = {missing_field(m) for m in members if m.missing == Missing.SKIP.value}
                raise_first([e for e in index.problems if not _detail_in(e, skipped)])
        except BaseException:
            index.close()
            raise
        return index


def _none_missing_all(urls: Sequence[str], problems: list[DataError]) -> None:
    """Raises when not one of ``urls`` exists: a wrong path or pattern, not damage to skip."""
    missing = [e for e in problems if e.kind is Damage.MISSING_SHARD]
    if not urls or len(missing) < len(urls):
        return
    first = urls[0]
    where = "" if "://" in first or os.path.isabs(first) else f", relative to the working directory {os.getcwd()}"
    shards = f"none of the {len(urls)} shards exists" if len(urls) > 1 else "the shard does not exist"
    hint = ""
    if any(c in (urlsplit(u).path if "://" in u else u) for u in urls for c in "*?["):  # (not a URL's query)
        hint = (
            "; globs are listed with WebDataset(..., relist=True), or give a brace range "
            "('train-{000000..000099}.tar') or a list of paths"
        )
    raise ShardError(f"WebDataset: {shards}: {first!r}{where}{hint}", shard=first, kind=Damage.MISSING_SHARD)


def _detail_in(error: DataError, details: set[str]) -> bool:
    """Whether ``error`` is a missing field's whose detail is one of ``details``."""
    return error.kind is Damage.MISSING_FIELD and any(str(error).endswith(d) for d in details)


def raise_first(problems: list[DataError]) -> None:
    """Raises the first of ``problems`` (if any), saying how many more there are."""
    if not problems:
        return
    first = problems[0]
    more = (
        f" ({counted(len(problems) - 1, 'more problem')} in this dataset: `python -m gpupipe check` lists them all; "
        "Loader(on_error='skip') leaves them out)"
        if len(problems) > 1
        else ""
    )
    raise type(first)(f"{first}{more}", shard=first.shard, key=first.key, kind=first.kind)


class TarReader:
    """Reads a sample's image and label members, and the ``fields`` named (their bytes,
    undecoded), by the byte ranges in its shard's index; each refused before it is read where its
    size is over its limit (``max_image_bytes``, ``LABEL_LIMIT``, a field's ``max_bytes``)."""

    def __init__(self, storage: Storage, *, labeled: bool, fields: Mapping[str, Field] | None = None,
                 max_image_bytes: int | None = None) -> None:  # fmt: skip
        self.storage, self.labeled, self.fields = storage, labeled, dict(fields or {})
        self.max_image_bytes = max_image_bytes

    def _read(self, shard: ShardIndex, offset: int, size: int, key: str) -> bytes:
        try:
            data = self.storage.read(shard.path, offset, size)
        except OSError as e:
            raise unreadable(shard.path, key, e) from e
        if len(data) != size:
            raise truncated(shard.path, key)
        return data

    def read(self, shard: ShardIndex, i: int) -> RawSample:
        key = shard.keys[i]
        offset, size = shard.column("image_range")[i]
        if self.max_image_bytes is not None and size > self.max_image_bytes:
            raise too_many_bytes(shard.path, key, int(size), self.max_image_bytes)
        data = self._read(shard, int(offset), int(size), key) if size >= 0 else b""  # (-1: a source without images)
        label = None
        if self.labeled:
            parsed = shard.detail()[1].get("label")  # parsed when indexed
            label = NO_LABEL if parsed is None else int(parsed[i])
            if label == NO_LABEL:  # not parsed, or not an integer: read it (again, for the error's detail)
                offset, size = shard.column("label_range")[i]
                require_label_size(int(size), shard=shard.path, key=key)
                label = parse_label(self._read(shard, int(offset), int(size), key), shard=shard.path, key=key)
        return RawSample(key, shard.path, data, label, self.read_fields(shard, i) if self.fields else None)

    def read_fields(self, shard: ShardIndex, i: int) -> dict[str, bytes | None]:
        """The bytes of sample ``i``'s fields by name (``None``: no member); a member over its
        field's ``max_bytes`` is refused before it is read."""
        key, fields = shard.keys[i], dict[str, bytes | None]()
        for name, field in self.fields.items():
            offset, size = shard.column(field_column(name))[i]
            if size >= 0:
                field.require_fits(int(size), shard=shard.path, key=key)
            fields[name] = None if size < 0 else self._read(shard, int(offset), int(size), key)
        return fields

    def close(self) -> None:
        self.storage.close()
