"""Index files beside the shards, ``<shard>.gpupipe.json``: what a loader needs of a shard before
it reads any (the sample count, and the damage found in its tar structure), so that a new node
starts on a remote dataset without downloading it.

Every rank needs every shard's sample count to draw the plan. Without these files a remote
shard is downloaded (into the node-local cache) and scanned the first time a node indexes it;
``python -m gpupipe index SHARDS --beside`` writes them once for a dataset, local or remote (where
the storage takes writes). A loader reads one (a few hundred bytes) per shard when its index cache
has none, and scans the shard itself only when it first reads it — after downloading it for the
plan anyway. A file written for another version of the shard (another size), or for other
extensions, is ignored: the shard is then scanned as without one.

Format (JSON): ``{"format": "gpupipe-shard-summary", "version": 1, "size": <shard bytes>,
"samples": <n>, "image": "jpg;jpeg;png", "label": "cls" | null, "problems": [{"kind", "key",
"detail"}, ...]}``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from .._errors import Damage, redact
from ._index import Problem
from ._storage import Storage, beside

__all__ = ["Summary", "summary_url", "read_summary", "write_summary"]

log = logging.getLogger("gpupipe")
FORMAT, VERSION = "gpupipe-shard-summary", 1
MAX_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Summary:
    samples: int
    problems: tuple[Problem, ...]


def summary_url(url: str) -> str:
    return beside(url, ".gpupipe.json")


def _exts(image_exts: tuple[str, ...], label_ext: str | None) -> tuple[str, str | None]:
    return ";".join(image_exts), label_ext


def encode(
    size: int, samples: int, image_exts: tuple[str, ...], label_ext: str | None, problems: tuple[Problem, ...]
) -> bytes:
    image, label = _exts(image_exts, label_ext)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "size": size,
        "samples": samples,
        "image": image,
        "label": label,
        "problems": [{"kind": p.kind.value, "key": p.key, "detail": p.detail} for p in problems],
    }
    return json.dumps(doc, indent=1).encode()


def read_summary(
    storage: Storage, url: str, *, size: int, image_exts: tuple[str, ...], label_ext: str | None
) -> Summary | None:
    """The summary beside shard ``url`` if there is one for this version (``size``) and these
    extensions; ``None`` otherwise (logged when one is there but does not apply)."""
    where = redact(summary_url(url))  # for messages
    try:
        with storage.open(summary_url(url)) as f:
            raw = f.read(MAX_BYTES)
    except Exception:  # none, unreadable, or a network library's own error: the shard is scanned
        return None
    try:
        doc: Any = json.loads(raw)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} file of version {VERSION}")
        if (doc["size"], doc["image"], doc["label"]) != (size, *_exts(image_exts, label_ext)):
            log.info("gpupipe: %s was written for another version of its shard or other extensions; ignored", where)
            return None
        problems = tuple(Problem(Damage(p["kind"]), p["key"], str(p["detail"])) for p in doc["problems"])
        return Summary(int(doc["samples"]), problems)
    except (ValueError, KeyError, TypeError) as e:
        log.warning("gpupipe: cannot use the index file %s (%s); the shard is scanned instead", where, e)
        return None


def write_summary(
    storage: Storage,
    url: str,
    *,
    size: int,
    samples: int,
    image_exts: tuple[str, ...],
    label_ext: str | None,
    problems: tuple[Problem, ...],
) -> str:
    """Writes the summary beside shard ``url`` through ``storage`` (whole or not at all); returns
    its URL."""
    where = summary_url(url)
    storage.put(where, encode(size, samples, image_exts, label_ext, problems))
    return where
