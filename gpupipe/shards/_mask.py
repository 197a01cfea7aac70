"""Bad-sample lists beside the shards, written by ``gpupipe check`` and read by every loader.

``gpupipe check`` decodes every sample; for a shard with bad samples it writes
``<shard>.bad.json`` beside the shard (and removes a stale one from a shard found sound), so that
every rank and node sees the same list. A loader leaves the listed samples out of its plan, under
either ``on_error`` policy, without renumbering the others: sample numbers are the index's, so
plans and saved loader states keep their meaning. A list applies only to the shard it was written
for: the shard's size, its sample count and the image and label extensions must match, else the
list is ignored with a warning (run ``gpupipe check`` again). A list written for a source with
``fields=`` names them (``"fields"``: each field's name, extensions and missing policy, as the
index numbers samples by them and a bad field is a bad sample there only); it applies to loaders
of those fields alone, and a list without ``"fields"`` to loaders without fields.

Format (JSON)::

    {"format": "gpupipe-bad-samples", "version": 1, "shard": "train-000001.tar", "size": 1234567,
     "samples": 1000, "image": "jpg;jpeg;png", "label": "cls",
     "bad": [{"sample": 12, "key": "n01440764_10026", "kind": "undecodable", "detail": "..."}]}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

from ..core._errors import Damage, Problem, redact
from ..core._validate import is_int
from ..storage._base import Storage, beside, write_atomic
from ._shard import FieldMembers, fields_id

__all__ = ["mask_url", "read_mask", "write_mask", "FORMAT", "SUFFIX"]

log = logging.getLogger("gpupipe")
FORMAT, VERSION, SUFFIX = "gpupipe-bad-samples", 1, ".bad.json"


def mask_url(url: str) -> str:
    """Where the bad-sample list of shard ``url`` is: beside it."""
    return beside(url, SUFFIX)


def _exts(image_exts: tuple[str, ...], label_ext: str | None) -> tuple[str, str | None]:
    return ";".join(image_exts), label_ext


def read_mask(
    storage: Storage,
    url: str,
    *,
    size: int,
    samples: int,
    image_exts: tuple[str, ...],
    label_ext: str | None,
    fields: tuple[FieldMembers, ...] = (),
) -> tuple[tuple[int, Problem], ...]:
    """The bad samples listed for shard ``url`` (``(sample number, problem)``, sorted), or ``()``
    where there is no list, or it was written for another version of the shard (a warning)."""
    where = redact(mask_url(url))  # for messages
    try:
        with storage.open(mask_url(url)) as f:
            raw = f.read(16 << 20)
    except FileNotFoundError:
        return ()
    except Exception as e:  # OSError, or a network library's own error while reading
        log.warning("gpupipe: cannot read the bad-sample list %s (%s); it is ignored", where, redact(str(e)))
        return ()
    try:
        doc: Any = json.loads(raw)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} file of version {VERSION}")
        image, label = _exts(image_exts, label_ext)
        if (doc["size"], doc["samples"], doc["image"], doc["label"]) != (size, samples, image, label):
            log.warning(
                "gpupipe: the bad-sample list %s was written for another version of its shard or other "
                "extensions (size %s, %s samples, image=%r, label=%r; now %s, %s, %r, %r); it is ignored: "
                "run `python -m gpupipe check` again",
                where, doc["size"], doc["samples"], doc["image"], doc["label"], size, samples, image, label,
            )  # fmt: skip
            return ()
        if doc.get("fields", "") != fields_id(fields):  # (no warning: other fields, another list's reader)
            return ()
        listed = f"is listed as bad in {where} (by gpupipe check): "
        bad = sorted(
            (_count(r["sample"]), Problem(Damage(r["kind"]), str(r["key"]), listed + str(r["detail"])))
            for r in doc["bad"]
        )
        if any(not 0 <= n < samples for n, _ in bad) or len({n for n, _ in bad}) != len(bad):
            raise ValueError("sample numbers out of range or repeated")
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else e
        log.warning("gpupipe: the bad-sample list %s is damaged (%s); it is ignored", where, reason)
        return ()
    return tuple(bad)


def write_mask(
    path: str,
    shard: str,
    *,
    size: int,
    samples: int,
    image_exts: tuple[str, ...],
    label_ext: str | None,
    bad: list[tuple[int, Problem]],
    fields: tuple[FieldMembers, ...] = (),
) -> str | None:
    """Writes (atomically) or, for a shard without bad samples, removes the local bad-sample list
    of the shard at ``path``; returns the file written, or ``None``."""
    target = mask_url(path)
    if not bad:
        with contextlib.suppress(FileNotFoundError):
            os.remove(target)
        return None
    image, label = _exts(image_exts, label_ext)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "shard": os.path.basename(shard),
        "size": size,
        "samples": samples,
        "image": image,
        "label": label,
        **({"fields": fields_id(fields)} if fields else {}),
        "bad": [{"sample": n, "key": p.key, "kind": p.kind.value, "detail": p.detail} for n, p in sorted(bad)],
    }
    write_atomic(target, json.dumps(doc, indent=1).encode())
    return target


def _count(value: Any) -> int:
    """A sample number as the list wrote it: an integer (not a float, a boolean or a string)."""
    if not is_int(value):
        raise ValueError(f"a sample number is {type(value).__name__}, not an integer")
    return value
