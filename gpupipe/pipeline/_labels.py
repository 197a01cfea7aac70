"""Whether a dataset's samples are mixed by label: shards written in class order (an ImageFolder
tarred class by class) train worse, because a loader's shuffle reads a few shards at a time and
mixes within them (a CIFAR-10 subset in 8 sorted shards: 2.6 points lower, one class at 0-1%
with TrivialAugmentWide and MixUp/CutMix). ``gpupipe check`` reports each shard's label runs
(:func:`label_order`, :func:`summary`); the loader compares its first batches' labels with a full
shuffle's (:func:`batch_mixing`) and warns when they look sorted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["LabelOrder", "label_order", "summary", "looks_sorted", "batch_mixing"]


@dataclasses.dataclass(frozen=True)
class LabelOrder:
    """One shard's labels in their order: samples, pairs of neighbours with the same label, the
    longest run of one label, and the samples per label."""

    samples: int
    same: int
    longest: int
    counts: dict[int, int]


def label_order(labels: np.ndarray) -> LabelOrder:
    """``labels`` ``[N]`` (int) of a shard, in order."""
    labels = np.asarray(labels, dtype=np.int64)
    if not len(labels):
        return LabelOrder(0, 0, 0, {})
    edges = np.flatnonzero(labels[1:] != labels[:-1])
    starts = np.concatenate([[0], edges + 1])
    runs = np.diff(np.concatenate([starts, [len(labels)]]))
    values, counts = np.unique(labels, return_counts=True)
    return LabelOrder(len(labels), len(labels) - len(runs), int(runs.max()),
                      dict(zip(values.tolist(), counts.tolist(), strict=True)))  # fmt: skip


def looks_sorted(same: float, expected: float) -> bool:
    """Whether neighbours share a label (``same``, a fraction of pairs) far more often than in a
    shuffled order (``expected``: the sum of the labels' squared frequencies)."""
    return same > 2 * expected and same > expected + 0.25


def summary(shards: Mapping[str, LabelOrder]) -> dict[str, Any] | None:
    """The dataset's label order from each shard's (``None``: no labels): ``classes``,
    ``same`` (the fraction of neighbouring pairs sharing a label, over every shard), ``expected``
    (the same in a shuffled order), ``longest`` (run), and ``sorted`` (the shards whose own
    neighbours share a label far more often than shuffled: :func:`looks_sorted`)."""
    counts: dict[int, int] = {}
    for order in shards.values():
        for label, n in order.counts.items():
            counts[label] = counts.get(label, 0) + n
    total = sum(counts.values())
    if not total:
        return None
    p = np.array(list(counts.values()), dtype=np.float64) / total
    expected = float((p**2).sum())
    pairs = sum(max(o.samples - 1, 0) for o in shards.values())
    same = sum(o.same for o in shards.values()) / pairs if pairs else 0.0
    sorted_shards = [url for url, o in shards.items() if o.samples > 1 and looks_sorted(o.same / (o.samples - 1),
                                                                                       expected)]  # fmt: skip
    return {"classes": len(counts), "same": same, "expected": expected,
            "longest": max(o.longest for o in shards.values()), "sorted": sorted_shards}  # fmt: skip


def batch_mixing(labels: Sequence[np.ndarray]) -> dict[str, float] | None:
    """How mixed batches of ``labels`` are against a full shuffle's: ``distinct``, the labels per
    batch on average; ``expected``, the same for batches drawn from the whole (the labels seen
    here standing for the dataset's frequencies); ``ratio`` of the two. ``None`` without labels."""
    batches = [np.asarray(b) for b in labels if len(b)]
    if not batches:
        return None
    _, counts = np.unique(np.concatenate(batches), return_counts=True)
    p = counts / counts.sum()
    size = np.mean([len(b) for b in batches])
    expected = float((1.0 - (1.0 - p) ** size).sum())
    distinct = float(np.mean([len(np.unique(b)) for b in batches]))
    return {"batches": float(len(batches)), "distinct": distinct, "expected": expected,
            "ratio": distinct / expected if expected else 1.0}  # fmt: skip
