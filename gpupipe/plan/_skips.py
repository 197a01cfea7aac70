"""What a loader leaves out under ``on_error="skip"``: each sample once, with the first time it
was met, and the per-epoch count that ``max_skipped`` caps. Part of the loader's state."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from ..core._batch import SkippedSample
from ..core._config import LoaderConfig, OnError
from ..core._errors import SHARD_DAMAGE, ConfigError, Damage, DataError
from ..core._validate import is_int
from ..sources import Index

__all__ = ["Skips"]

log = logging.getLogger("gpupipe")


class Skips:
    """The samples a loader of ``rank`` left out, by ``(shard, key, numbered)``, in the order
    first met: a sample the index numbers and one it left out (a repeated key, a sample without
    its image) may share a shard and a key, and each is listed."""

    def __init__(self, config: LoaderConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.records: dict[tuple[str | None, str | None, bool], SkippedSample] = {}
        self.in_epoch = 0  # samples of the current epoch skipped so far (the cap's count)

    def record(self, error: DataError, epoch: int | None, *, numbered: bool = True) -> bool:
        """Lists ``error``'s sample unless it is listed already; ``True`` if new. ``numbered``:
        whether the index numbers the sample (not: damage the index itself left out)."""
        where = (error.shard, error.key, numbered)
        if where in self.records:
            return False
        kind = error.kind.value if error.kind is not None else None
        self.records[where] = SkippedSample(error.key, error.shard, str(error), epoch, kind)
        return True

    def known_before(self, index: Index) -> None:
        """Records what is left out of every epoch before it runs: damage the index found (under
        ``"skip"``; ``"raise"`` raised it already) and samples listed as bad by ``gpupipe check``
        (under either policy); logs a summary once and applies the cap to the dataset, under either
        policy. A lost shard (missing, unreadable, empty) counts as the samples of an intact
        shard on average, a truncated one as those it lacks of that average."""
        found, listed = index.problems, index.bad_errors()
        for error in found:
            self.record(error, None, numbered=False)
        for error in listed:
            self.record(error, None)
        if not (found or listed):
            return
        first = (found or listed)[0]
        policy = "on_error='skip'" if self.config.on_error is OnError.SKIP else "on_error='raise': the listed ones only"
        log.warning(
            "gpupipe: leaving out %d damaged shards or samples found when indexing and %d samples listed as bad "
            "by gpupipe check (%s); loader.skipped lists them. First: %s",
            len(found),
            len(listed),
            policy,
            first,
        )
        samples = sum(e.key is not None for e in found) + len(listed)
        lost, shards = lost_in_shards(index)
        limit = self.config.skip_limit(len(index) + samples - len(listed) + lost)
        if limit is not None and samples + lost > limit:
            what = f"{samples} damaged samples" + (f" and {shards} damaged shards (about {lost} samples)" if shards
                                                   else "")  # fmt: skip
            raise DataError(
                f"the dataset has {what} known before the first epoch, more than "
                f"max_skipped={self.config.max_skipped!r} allows ({limit}). First: {first}. "
                "`python -m gpupipe check` lists them all.",
                shard=first.shard,
                key=first.key,
            )

    def mark(
        self, skipped: tuple[tuple[int, DataError], ...], valid: np.ndarray, epoch: int, limit: int | None
    ) -> None:
        """Marks a batch's skipped samples invalid, records and logs each the first time, and
        raises once the epoch's count passes ``limit``."""
        for position, error in skipped:
            if valid[position]:  # padding repeats a sample: counted once
                self.in_epoch += 1
            valid[position] = False
            if self.record(error, epoch):
                log.warning("gpupipe: skipped a sample (on_error='skip'): %s", error)
        if limit is not None and self.in_epoch > limit:
            first = next(iter(self.records.values()))
            raise DataError(
                f"rank {self.rank} skipped {self.in_epoch} samples in epoch {epoch}, more than "
                f"max_skipped={self.config.max_skipped!r} allows ({limit}); the data is damaged beyond the limit set. "
                f"First skipped: {first}. See loader.skipped for all of them.",
                shard=first.shard,
                key=first.key,
            )

    def state(self) -> dict[str, Any]:
        return {"skipped": [dataclasses.asdict(s) for s in self.records.values()], "skipped_in_epoch": self.in_epoch}

    @staticmethod
    def parse(state: dict[str, Any]) -> tuple[list[SkippedSample], int]:
        """A saved state's records of its epochs and its count of this epoch's skips, checked
        (nothing is taken yet: :meth:`load`). Raises ``ConfigError`` for a damaged record."""
        try:
            listed = state.get("skipped", ())
            if not isinstance(listed, list | tuple):
                raise TypeError("skipped must be a list")
            records = [SkippedSample(**r) for r in listed if r.get("epoch") is not None]
            for r in records:
                names = all(v is None or isinstance(v, str) for v in (r.key, r.shard, r.kind))
                epoch = r.epoch is not None and is_int(r.epoch) and r.epoch >= 0
                if not (names and isinstance(r.reason, str) and epoch):
                    raise TypeError(f"a skipped sample of the wrong types: {r!r}"[:200])
            in_epoch = state.get("skipped_in_epoch", 0)
            if not (is_int(in_epoch) and in_epoch >= 0):
                raise ValueError(f"skipped_in_epoch={in_epoch!r} is not a count")
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"Loader.load_state_dict: a damaged loader state ({e})") from None
        return records, in_epoch

    def load(self, parsed: tuple[list[SkippedSample], int]) -> None:
        """Takes the records of a saved state's epochs (:meth:`parse`), keeping what this loader
        found when indexing (the state's own record of that is the same: its plan's digest says
        so)."""
        records, in_epoch = parsed
        before = {where: r for where, r in self.records.items() if r.epoch is None}
        self.records = {**before, **{(r.shard, r.key, True): r for r in records}}
        self.in_epoch = in_epoch


WHOLE = SHARD_DAMAGE - {Damage.TRUNCATED_SHARD}  # a shard lost whole: missing, unreadable, empty


def lost_in_shards(index: Index) -> tuple[int, int]:
    """``(samples, shards)``: about how many samples ``index``'s damaged shards lost (a lost shard,
    an intact shard's samples on average; a truncated one, what it lacks of that), and how many
    shards are damaged. ``(0, 0)`` where none is."""
    kinds = [{p.kind for p in s.problems if p.key is None} for s in index.shards]
    whole = sum(bool(k & WHOLE) for k in kinds)
    cut = [len(s) for s, k in zip(index.shards, kinds, strict=True) if Damage.TRUNCATED_SHARD in k]
    intact = [len(s) for s, k in zip(index.shards, kinds, strict=True) if not k]
    if not (whole or cut):
        return 0, 0
    mean = sum(intact) / len(intact) if intact else max(cut, default=0)
    return round(whole * mean + sum(max(0.0, mean - n) for n in cut)), whole + len(cut)
