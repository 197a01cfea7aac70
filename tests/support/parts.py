"""``pytest --part K/N``: the K-th of N contiguous, near-equal slices of the selected tests, so
that a long run (the ``gpu`` tests on a lent GPU machine, whose commands may run 10 minutes each)
goes in several calls. Contiguous, in collection order: a module's fixtures are built in one
part, or at most two."""

from __future__ import annotations

import re

__all__ = ["parse_part", "part_slice"]


def parse_part(text: str) -> tuple[int, int]:
    """``"K/N"`` as ``(K, N)``, with ``1 <= K <= N``; ``ValueError`` naming the form otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise ValueError(f"--part {text!r}: expected K/N with 1 <= K <= N, as in --part 2/3")
    return int(match[1]), int(match[2])


def part_slice(count: int, part: tuple[int, int]) -> slice:
    """The slice of ``count`` tests that part ``(K, N)`` runs: sizes differ by one at most, and
    parts 1..N together run each test once."""
    k, n = part
    return slice((k - 1) * count // n, k * count // n)
