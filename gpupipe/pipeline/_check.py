"""``gpupipe check``: every sample of a WebDataset validated before training, and the bad ones
listed beside their shards so that every loader leaves them out.

For each shard (in parallel, one process per shard at a time): the tar structure (as the index
reads it: missing, empty, unreadable or truncated shards, samples without image or label, repeated
keys), then every sample: its label (an ASCII int64), its image header against the file-acceptance
rules and the pixel limit, and a full decode with the decoder the torch backend uses (and the DALI
backend uses to name a sample DALI refused), in a child process: a decoder that crashes on a file
makes it a finding instead of ending the check. Numbered samples found bad are written to ``<shard>.bad.json``
(``shards/_mask.py``); what the index itself refuses is not numbered and stays in the index's
record (the loaders raise it, or skip it under ``on_error="skip"``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from ..core._errors import ConfigError, Damage, DataError, Problem, counted, redact
from ..core._fields import field_values
from ..core._imageinfo import MAX_IMAGE_BYTES
from ..core._validate import valid_optional_int
from ..runtime._children import process_pool
from ..runtime._decode import MAX_IMAGE_PIXELS, verdicts
from ..runtime._dist import cpu_cores
from ..shards._mask import mask_url, write_mask
from ..shards._shard import NO_LABEL
from ..sources import WebDataset
from ..sources._index import Source
from ._labels import LabelOrder, label_order, summary

__all__ = ["check", "CheckReport", "Finding"]

log = logging.getLogger("gpupipe")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem: the shard, the sample's key and number in its shard (``None`` for a whole
    shard's damage or a sample the index does not number), the kind and the message."""

    shard: str
    key: str | None
    sample: int | None
    kind: Damage
    message: str


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """What :func:`check` found.

    Attributes:
        shards: shards checked. ``samples``: samples the index numbers (each decoded).
        labels: how the labels are ordered within the shards (``None``: no labels):
            ``classes``, ``same`` (the fraction of neighbouring samples that share a label),
            ``expected`` (the same in a shuffled order), ``longest`` (run of one label) and
            ``sorted`` (the shards that look sorted by label). Sorted shards are not a defect
            (``ok`` ignores them) but train worse: see the summary.
        findings: every problem, shard by shard in the order given.
        written: the bad-sample lists written (``<shard>.bad.json``); ``removed``: stale lists
            removed from shards now found sound.
    """

    shards: int
    samples: int
    findings: tuple[Finding, ...]
    written: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    labels: dict[str, Any] | None = None  # the label order (``_labels.summary``); None: unlabeled

    @property
    def ok(self) -> bool:
        """Nothing is wrong."""
        return not self.findings

    def counts(self) -> dict[str, int]:
        """Findings per kind of damage (:class:`~gpupipe.Damage` values), most frequent first."""
        return dict(collections.Counter(f.kind.value for f in self.findings).most_common())

    def summary(self, first: int = 3) -> str:
        """A few lines for people: totals, then per kind the count, the first keys and the shards."""
        bad = sum(f.sample is not None for f in self.findings)
        left = len(self.findings) - bad
        lines = [f"checked {self.samples} samples in {self.shards} shards: " + ("all good" if self.ok else
                 f"{counted(len(self.findings), 'problem')}: {bad} of them numbered samples, which a bad-sample list "
                 "beside their shard leaves out of every loader")]  # fmt: skip
        if left:
            lines.append(f"  {left} not listable (damaged shards; samples without image or label, or with a repeated "
                         "key, which the index does not number): loaders with on_error='raise' refuse the dataset "
                         "until they are mended; on_error='skip' leaves them out")  # fmt: skip
        for kind, n in self.counts().items():
            found = [f for f in self.findings if f.kind.value == kind]
            shards = sorted({f.shard for f in found})
            keys = [f.key for f in found if f.key is not None][:first]
            lines.append(
                f"  {kind}: {n}"
                + (f"; first keys {', '.join(repr(k) for k in keys)}" if keys else "")
                + f"; in {counted(len(shards), 'shard')}: {', '.join(shards[:first])}"
                + (" ..." if len(shards) > first else "")
            )
        if self.findings:
            lines.append(f"  first: {self.findings[0].message}")
        order = self.labels
        if order is not None and order["sorted"]:
            lines.append(
                f"labels: {counted(len(order['sorted']), 'shard')} of {self.shards} look sorted by label "
                f"({', '.join(order['sorted'][:first])}{' ...' if len(order['sorted']) > first else ''}): neighbouring "
                f"samples share a label {order['same']:.0%} of the time against {order['expected']:.0%} shuffled, in "
                f"runs of up to {order['longest']:,}. A loader shuffles within the few shards it reads at a time, so "
                "its batches hold few classes, which trains worse: write the shards again in a shuffled order "
                "(gpupipe make-shards shuffles by default)"
            )
        lines += [f"wrote {w}" for w in self.written] + [f"removed {r} (its shard is now sound)" for r in self.removed]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: totals, counts per kind, every finding, the files written and removed."""
        return {
            "ok": self.ok,
            "shards": self.shards,
            "samples": self.samples,
            "counts": self.counts(),
            "findings": [{**dataclasses.asdict(f), "kind": f.kind.value} for f in self.findings],
            "written": list(self.written),
            "removed": list(self.removed),
            "labels": self.labels,
        }


_Job = tuple[str, tuple[str, ...], "str | None", "int | None", "int | None", "WebDataset"]


def _check_shard(job: _Job) -> tuple[int, int | None, list[Finding], LabelOrder | None]:
    """Checks one shard; returns its sample count, its size in bytes (``None`` if it has none),
    its findings and its labels' order (``None``: unlabeled)."""
    from ..shards._indexing import cached_scan
    from ..sources import storage_for
    from ..sources._webdataset import TarReader

    url, image_exts, label_ext, max_pixels, max_bytes, source = job
    extra, members = source.extra_fields(), source.field_members()
    findings = []
    where = redact(url)  # what reports show: no credentials or signatures
    with storage_for([url], storage_options=source.storage_options, cache_dir=source.cache_dir,
                     max_inflation=source.max_inflation) as storage:  # fmt: skip
        shard = cached_scan(storage, url, image_exts, label_ext, fields=members)
        for error in shard.errors():
            findings.append(Finding(where, error.key, None, error.kind or Damage.UNREADABLE_SHARD, str(error)))
        if not len(shard):
            return 0, None, findings, None
        size = storage.stat(url).size
        parsed = shard.detail()[1].get("label") if label_ext is not None else None
        order = None if parsed is None else label_order(parsed[parsed != NO_LABEL])
        reader = TarReader(storage, labeled=label_ext is not None, fields=extra, max_image_bytes=max_bytes)
        for chunk in _chunks(shard):  # read a chunk, then decode it in a child process
            numbers, suspects = [], []
            for i in chunk:
                try:
                    raw = reader.read(shard, i)
                    field_values(extra, raw.fields, shard=url, key=raw.key)  # a bad field: as the loaders decode it
                except DataError as e:
                    findings.append(Finding(where, shard.keys[i], i, e.kind or Damage.UNDECODABLE, str(e)))
                    continue
                if image_exts:  # (a source of fields alone has no image to decode)
                    numbers.append(i)
                    suspects.append((raw.data, url, raw.key))
            for i, refused in zip(numbers, verdicts(suspects, max_pixels=max_pixels), strict=True):
                if refused is not None:
                    findings.append(Finding(where, shard.keys[i], i, refused.kind or Damage.UNDECODABLE, str(refused)))
    return len(shard), size, findings, order


_CHUNK = 256  # samples read into memory at once, then decoded in one child process ...
_CHUNK_BYTES = 64 << 20  # ... or fewer, as many as these bytes of images hold (at least one)


def _chunks(shard: Any) -> list[range]:
    """The shard's sample numbers in chunks of at most ``_CHUNK`` samples and ``_CHUNK_BYTES`` of
    image members (one sample over that alone), so that a chunk's memory is bounded by the largest
    member accepted, not by the shard's."""
    sizes = shard.column("image_range")[:, 1].clip(0).tolist()
    chunks, first, held = [], 0, 0
    for i, size in enumerate(sizes):
        if i > first and (i - first == _CHUNK or held + size > _CHUNK_BYTES):
            chunks.append(range(first, i))
            first, held = i, 0
        held += size
    if first < len(sizes):
        chunks.append(range(first, len(sizes)))
    return chunks


def check(
    source: WebDataset | str | Sequence[str],
    *,
    workers: int | None = None,
    write: bool = True,
    progress: bool = False,
    max_image_pixels: int | None = MAX_IMAGE_PIXELS,
    max_image_bytes: int | None = MAX_IMAGE_BYTES,
) -> CheckReport:
    """Validates every sample of a WebDataset: tar structure, label, image header and a full
    decode, in ``workers`` processes (default: one per CPU this process may use), one shard each
    at a time.

    Args:
        source: a :class:`~gpupipe.WebDataset` (its image and label extensions are used) or shard
            URLs / a brace pattern (default extensions).
        workers: processes; ``0`` checks in this process.
        write: write each damaged shard's bad-sample list beside it (``<shard>.bad.json``; local
            shards only), and remove a stale list of a shard now sound. Every loader then leaves
            those samples out of its plan, under either ``on_error`` policy.
        progress: show a progress bar (tqdm) on stderr.
        max_image_pixels: the pixel limit, as the loaders' option of that name.
        max_image_bytes: the byte limit of an image member, as the loaders' option of that name
            (an image over it is a ``too-large`` finding, not read).

    Returns:
        A :class:`CheckReport`; ``report.ok`` is ``True`` when nothing is wrong.
    """
    if isinstance(source, Source) and not isinstance(source, WebDataset):
        raise ConfigError(
            f"gpupipe check reads WebDataset shards (got {type(source).__name__}): an ImageFolder's files are "
            "judged as they are read (loader.skipped, loader.stats()); to check them here, write them into shards "
            "(gpupipe make-shards --from-imagefolder)"
        )
    workers = valid_optional_int("check", workers, "workers", minimum=0)
    max_image_pixels = valid_optional_int("check", max_image_pixels, "max_image_pixels", minimum=1)
    max_image_bytes = valid_optional_int("check", max_image_bytes, "max_image_bytes", minimum=1)
    if not isinstance(source, WebDataset):
        source = WebDataset(source)
    source = source.with_listing(source.listing())  # (relist=True: the shards present now)
    image_exts, label_ext = source.extensions()
    jobs: list[_Job] = [(u, image_exts, label_ext, max_image_pixels, max_image_bytes, source) for u in source.urls]
    if write and any("://" in u and not u.startswith("file://") for u in source.urls):
        raise ConfigError("gpupipe check: bad-sample lists are written beside local shards only; pass write=False")
    workers = cpu_cores() if workers is None else workers
    results: dict[str, tuple[int, int | None, list[Finding], LabelOrder | None]] = {}
    from tqdm import tqdm

    with tqdm(total=len(jobs), unit="shard", desc="gpupipe check", disable=not progress) as bar:
        if workers == 0 or len(jobs) == 1:
            for job in jobs:
                results[job[0]] = _check_shard(job)
                bar.update()
        else:
            # spawned: no inherited threads, DALI or CUDA state
            with process_pool(min(workers, len(jobs)), "gpupipe check", spawn=True) as pool:
                futures = {pool.submit(_check_shard, job): job[0] for job in jobs}
                for future in concurrent.futures.as_completed(futures):
                    results[futures[future]] = future.result()
                    bar.set_postfix(problems=sum(len(r[2]) for r in results.values()), refresh=False)
                    bar.update()
    findings = [f for u in source.urls for f in results[u][2]]
    written, removed = [], []
    if write:
        for url in source.urls:
            samples, size, found, _ = results[url]
            path = url.removeprefix("file://")
            listed = [(f.sample, Problem(f.kind, f.key, f.message)) for f in found if f.sample is not None]
            if size is None:
                continue
            stale = os.path.exists(mask_url(path))
            target = write_mask(path, url, size=size, samples=samples, image_exts=image_exts, label_ext=label_ext,
                                bad=listed, fields=source.field_members())  # fmt: skip
            if target is not None:
                written.append(target)
            elif stale:
                removed.append(mask_url(path))
    return CheckReport(
        shards=len(jobs),
        samples=sum(r[0] for r in results.values()),
        findings=tuple(findings),
        written=tuple(written),
        removed=tuple(removed),
        labels=summary({redact(u): r[3] for u in source.urls if (r := results[u])[3] is not None}),
    )
