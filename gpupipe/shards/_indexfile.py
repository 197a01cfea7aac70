"""Index files beside the shards, ``<shard>.gpupipe.json``: what a loader needs of a shard before
it reads any — the sample count, the damage found in its tar structure, and where each sample's
members are — so that a new node starts on a remote dataset without downloading it, and a rank
that reads only part of a shard downloads only that part (a byte range).

Every rank needs every shard's sample count to draw the plan. Without these files a remote
shard is downloaded (into the node-local cache) and scanned the first time a node indexes it;
``python -m gpupipe index SHARDS --beside`` writes them once for a dataset, local or remote (where
the storage takes writes). A loader reads one per shard when its index cache has none (about
60 bytes per sample) and keeps it in that cache, in DALI's index format like a scanned shard's.
A file written for another version of the shard (another size), or for other extensions, is
ignored: the shard is then scanned as without one.

Format (JSON): ``{"format": "gpupipe-shard-summary", "version": 2, "size": <shard bytes>,
"samples": <n>, "image": "jpg;jpeg;png", "label": "cls" | null, "problems": [{"kind", "key",
"detail"}, ...], "keys": [<n keys>], "exts": [<n chosen image extensions>], "image_range":
[offset, size, offset, size, ...], "label_range": [...] | null, "labels": [<n integers>] | null}``
(ranges of member data, labels parsed, ``NO_LABEL`` where not an integer). Version 3 adds
``"sizes": {"rules": <tag>, "hw": [h, w, h, w, ...]} | null``: each image's height and width as
the DALI backend's header check passed them (0 0 where not checked), under the tag of the rules
and parser that passed them (``gpupipe index --beside --sizes``): a node that takes the file
into its index cache starts its first epoch without reading the headers again. A file of another
version is ignored (the shard is scanned); version 2 is read, without sizes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any, NamedTuple

import numpy as np

from ..core._errors import Damage, Problem, redact
from ..storage._base import Storage, beside

__all__ = ["IndexFile", "Samples", "index_file_url", "read_index_file", "write_index_file"]

log = logging.getLogger("gpupipe")
FORMAT, VERSION = "gpupipe-shard-summary", 3
_READ = (2, 3)  # the versions read (2: without sizes)
_RULES = re.compile(r"[0-9a-z]{1,32}")  # a sizes tag: part of a cache file's name
Sizes = tuple[str, np.ndarray]  # the rules' tag, int32 [N, 2] heights and widths (0 0: not checked)
MAX_BYTES = 256 << 20  # about 4 million samples


class Samples(NamedTuple):
    """A shard's samples as its index file lists them: keys, each one's chosen image extension,
    int64 ``[N, 2]`` image and label ranges (offset and size of the member data; the label's
    ``None`` for unlabeled data), int64 ``[N]`` parsed labels (``None`` for unlabeled data)."""

    keys: list[str]
    exts: list[str]
    image: np.ndarray
    label: np.ndarray | None
    labels: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class IndexFile:
    samples: int
    problems: tuple[Problem, ...]
    detail: Samples
    sizes: Sizes | None = None


def index_file_url(url: str) -> str:
    return beside(url, ".gpupipe.json")


def _exts(image_exts: tuple[str, ...], label_ext: str | None) -> tuple[str, str | None]:
    return ";".join(image_exts), label_ext


def _flat(ranges: np.ndarray | None) -> list[int] | None:
    return None if ranges is None else np.asarray(ranges, np.int64).reshape(-1).tolist()


def encode(
    size: int, detail: Samples, image_exts: tuple[str, ...], label_ext: str | None, problems: tuple[Problem, ...],
    sizes: Sizes | None = None, version: str | None = None,
) -> bytes:  # fmt: skip
    image, label = _exts(image_exts, label_ext)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "size": size,
        "shard_version": version,  # (its ETag, else its modification time: Stat.version)
        "samples": len(detail.keys),
        "image": image,
        "label": label,
        "problems": [{"kind": p.kind.value, "key": p.key, "detail": p.detail} for p in problems],
        "keys": detail.keys,
        "exts": detail.exts,
        "image_range": _flat(detail.image),
        "label_range": _flat(detail.label),
        "labels": None if detail.labels is None else np.asarray(detail.labels, np.int64).tolist(),
        "sizes": None if sizes is None else {"rules": sizes[0], "hw": _flat(sizes[1])},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _integers(doc: Any, name: str, count: int) -> np.ndarray:
    """``doc[name]``: a list of ``count`` integers within int64 (not floats, not booleans)."""
    values = doc[name]
    if not isinstance(values, list) or len(values) != count:
        raise ValueError(f"{name} must list {count} integers")
    if not all(type(v) is int and -(1 << 63) <= v < (1 << 63) for v in values):
        raise ValueError(f"{name} must hold int64 integers only")
    return np.array(values, dtype=np.int64)


def _ranges(doc: Any, name: str, n: int, size: int) -> np.ndarray:
    ranges = _integers(doc, name, 2 * n).reshape(n, 2)
    offset, length = ranges[:, 0], ranges[:, 1]
    if len(ranges) and not ((offset >= 0) & (length >= 0) & (offset <= size) & (length <= size - offset)).all():
        raise ValueError(f"{name} reaches outside the shard")
    return ranges


def _samples(doc: Any, size: int, image_exts: tuple[str, ...], labeled: bool) -> Samples:
    n = doc["samples"]
    if type(n) is not int or n < 0:
        raise ValueError("samples must be a count")
    keys, exts = doc["keys"], doc["exts"]
    if not (isinstance(keys, list) and isinstance(exts, list) and len(keys) == len(exts) == n):
        raise ValueError(f"keys and exts must list the {n} samples")
    if not all(isinstance(k, str) and k for k in keys):
        raise ValueError("keys must be strings")
    if not all(e in image_exts for e in exts):
        raise ValueError(f"exts must be image extensions asked for ({'/'.join(image_exts)})")
    label = _ranges(doc, "label_range", n, size) if labeled else None
    labels = _integers(doc, "labels", n) if labeled else None
    image = _ranges(doc, "image_range", n, size)
    _members(image if label is None else np.concatenate([image, label]))
    return Samples(keys, exts, image, label, labels)


def _members(ranges: np.ndarray) -> None:
    """Raises ``ValueError`` unless ``ranges`` ``[N, 2]`` (offset, length) can be the data of a
    tar's members: each starts on a 512-byte block after a header block, and each member's data
    ends, rounded up to a block, at least a header block before the next one's starts (no range
    overlaps another, or a header, or repeats)."""
    if not len(ranges):
        return
    offset, length = ranges[:, 0], ranges[:, 1]
    if ((offset % 512) != 0).any() or (offset < 512).any():
        raise ValueError("a byte range does not start where a tar member's data can")
    order = np.argsort(offset, kind="stable")
    start, end = offset[order], offset[order] + length[order]
    if len(start) > 1 and (start[1:] < (end[:-1] + 511) // 512 * 512 + 512).any():
        raise ValueError("byte ranges overlap, repeat, or leave no room for a tar header between them")


def _sizes(doc: Any, n: int) -> Sizes | None:
    found = doc.get("sizes")
    if found is None:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("rules"), str) or not _RULES.fullmatch(found["rules"]):
        raise ValueError("sizes must be {'rules': a short tag, 'hw': heights and widths}")
    hw = _integers(found, "hw", 2 * n).reshape(n, 2)
    if len(hw) and not ((hw >= 0) & (hw < (1 << 31))).all():
        raise ValueError("sizes must be heights and widths in int32")
    return found["rules"], hw.astype(np.int32)


def read_index_file(
    storage: Storage, url: str, *, size: int, image_exts: tuple[str, ...], label_ext: str | None,
    version: str | None = None,
) -> IndexFile | None:  # fmt: skip
    """The index file beside shard ``url`` if there is one for this version (``size``, and
    ``version`` where the file records the one it was written for) and these extensions, its
    byte ranges those of a tar's members; ``None`` otherwise (logged when one is there but does
    not apply)."""
    where = redact(index_file_url(url))  # for messages
    try:
        with storage.open(index_file_url(url)) as f:
            raw = f.read(MAX_BYTES)
    except Exception:  # none, unreadable, or a network library's own error: the shard is scanned
        return None
    try:
        doc: Any = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("format") != FORMAT or doc.get("version") not in _READ:
            raise ValueError(f"not a {FORMAT} file of version {' or '.join(map(str, _READ))}")
        if (doc["size"], doc["image"], doc["label"]) != (size, *_exts(image_exts, label_ext)):
            log.info("gpupipe: %s was written for another version of its shard or other extensions; ignored", where)
            return None
        written_for = doc.get("shard_version")
        if written_for is not None and version is not None and written_for != version:
            log.info("gpupipe: %s was written for another version of its shard (%s, now %s); ignored", where,
                     written_for, version)  # fmt: skip
            return None
        problems = tuple(_problem(p) for p in doc["problems"])
        detail = _samples(doc, size, image_exts, label_ext is not None)
        return IndexFile(int(doc["samples"]), problems, detail, _sizes(doc, len(detail.keys)))
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else e
        log.warning("gpupipe: cannot use the index file %s (%s); the shard is scanned instead", where, reason)
        return None


_SHARD_LEVEL = frozenset((Damage.MISSING_SHARD, Damage.UNREADABLE_SHARD))  # not what a readable file can say


def _problem(p: Any) -> Problem:
    """One damage an index file lists: a kind scanning finds, a key (a string, or none for the
    shard), a detail."""
    kind = Damage(p["kind"])
    if kind in _SHARD_LEVEL or not (p["key"] is None or isinstance(p["key"], str)):
        raise ValueError("problems must list damage found in the shard's samples")
    return Problem(kind, p["key"], str(p["detail"]))


def write_index_file(
    storage: Storage,
    url: str,
    *,
    size: int,
    detail: Samples,
    image_exts: tuple[str, ...],
    label_ext: str | None,
    problems: tuple[Problem, ...],
    sizes: Sizes | None = None,
    version: str | None = None,
) -> str:
    """Writes the index file of shard ``url`` (``size`` bytes, its samples ``detail``, with its
    images' ``sizes`` where given) beside it through ``storage`` (whole or not at all); returns
    its URL."""
    where = index_file_url(url)
    storage.put(where, encode(size, detail, image_exts, label_ext, problems, sizes, version))
    return where
