"""Augmentation randomness, drawn in one place for every backend.

A random transform consumes ``t.draws`` uniforms in ``[0, 1)`` per sample and turns them into its
random *factors* (:meth:`~gpupipe.transforms.Transform.sample`, vectorized), which a backend
combines with the image's size into the transform's parameters. The uniforms of one sample are a
pure function of ``(seed, epoch, sample, step)`` — ``step`` being the transform's position in
the pipeline — or of ``(seed, epoch, sample, view, step)`` in a pipeline of several views (view 0
drawing as a pipeline of that one transform list does) — computed by a counter-based generator
(the SplitMix64 finalizer over 64-bit counters), vectorized over a batch. So:

- every backend draws the same parameters for the same sample: the torch backend computes them
  in its workers, one sample at a time; the DALI backend on the host for a whole batch, and feeds
  them to the graph;
- a resumed epoch draws exactly what the uninterrupted one drew, and the worker count, the rank
  and the sample's position in its batch change nothing;
- a padding duplicate of a sample (see the epoch plan) is augmented as the sample itself;
- the views of one sample (two global crops, several local ones) draw independently, even where
  their transform lists are the same.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

__all__ = ["uniforms", "step_factors", "factors", "batch_generator"]

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=1024)
def _key(seed: int, epoch: int, step: int, view: int) -> np.uint64:
    """The stream of ``(seed, epoch, step, view)`` (remembered: a batch asks for it once per step,
    and a few small NumPy operations cost more than the batch's own draws)."""
    key = np.zeros(1, np.uint64)
    for part in (seed, epoch, step) if view == 0 else (seed, epoch, step, view):
        key = _mix(key ^ np.array([part & _MASK], np.uint64))
    return key[0]


def uniforms(
    seed: int, epoch: int, samples: np.ndarray | Sequence[int], step: int, count: int, view: int = 0
) -> np.ndarray:
    """float64 ``[len(samples), count]`` uniforms in ``[0, 1)``: row ``i`` depends only on
    ``(seed, epoch, samples[i], view, step)``."""
    s = np.asarray(samples, dtype=np.int64).astype(np.uint64)[:, None]
    j = np.arange(count, dtype=np.uint64)[None, :]
    z = _mix(_mix(s ^ _key(seed, epoch, step, view)) + (j + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def step_factors(
    t: object, seed: int, epoch: int, samples: np.ndarray | Sequence[int], step: int, view: int = 0
) -> np.ndarray | None:
    """The random factors ``[len(samples), F]`` (float64) of ``t``, step ``step`` of view
    ``view``; ``None`` for a deterministic step."""
    draws = getattr(t, "draws", 0)
    return t.sample(uniforms(seed, epoch, samples, step, draws, view)) if draws else None  # type: ignore[attr-defined]


def factors(
    transforms: Sequence[object], seed: int, epoch: int, samples: np.ndarray | Sequence[int], view: int = 0
) -> list:
    """For each step of ``transforms`` (view ``view``'s list): :func:`step_factors`."""
    return [step_factors(t, seed, epoch, samples, step, view) for step, t in enumerate(transforms)]


def batch_generator(seed: int, epoch: int, rank: int, batch: int) -> np.random.Generator:
    """The generator of one batch's batch-level draws (MixUp's λ, CutMix's box, the choice between
    them): a pure function of ``(seed, epoch, rank, batch)``, ``batch`` the batch's position in the
    rank's epoch, so a resumed epoch draws what the interrupted one did. (Beta variates take a
    varying number of uniforms: a seeded NumPy generator, not the counter-based uniforms.)"""
    entropy = [seed & _MASK, epoch, rank, batch, 0x6D6978]  # the last: this stream's own tag
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
