"""A :class:`~gpupipe.Loader`'s checkpoint: :meth:`Resumable.state_dict` and
:meth:`Resumable.load_state_dict` (the position, the plan's settings, the skipped samples and a
growing source's shards), over ``gpupipe.plan._resume``; and the rule that goes on with the next
epoch rather than replay one (:meth:`Resumable._advance`)."""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

from ..core._errors import ConfigError
from ..plan._resume import STATE_VERSION, nested, restore, saved
from ..storage._fsspec import canonical_url

if TYPE_CHECKING:
    from ..core._config import LoaderConfig
    from ..pipeline._pipeline import Pipeline
    from ..plan._plan import PlanSpec
    from ..plan._resume import Cursor
    from ..plan._skips import Skips

__all__ = ["Resumable"]

log = logging.getLogger("gpupipe")


class Resumable:
    """Saving and restoring a loader's position (a :class:`~gpupipe.Loader` supplies the state)."""

    config: LoaderConfig
    seed: int
    rank: int
    plan_spec: PlanSpec
    _at: Cursor
    _skips: Skips
    _listing: Any
    pipeline: Pipeline
    index: Any
    _warned_advance: bool
    _data_of: tuple[Any, str] | None = None

    @property
    def epoch(self) -> int:  # (the loader's)
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:  # (the loader's)
        raise NotImplementedError

    if TYPE_CHECKING:

        def _relist(self, listing: Any) -> None: ...

        def __len__(self) -> int: ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: the epoch and the batches of it yielded so far, with the settings
        the plan depends on. Call it between batches (after a step); see :meth:`load_state_dict`."""
        state = {**saved(self._at.position(self.seed), self.plan_spec, self.rank), **self._skips.state(),
                 "data": self._data()}  # fmt: skip
        if self._listing is not None:  # a growing source's shards this epoch, to resume on exactly those
            state["listing"] = nested(self._listing, list)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a position saved by :meth:`state_dict`; the next iteration of that epoch
        yields what the interrupted run would have yielded next, on every backend:

        Any rank's state will do: ranks yield the same number of batches, so one says where all
        were (a trainer that checkpoints rank 0's alone, as Lightning does, resumes every rank).

        - **Same world size and batch size**: the same keys in the same order with the same
          augmentation, mid-epoch: this rank's own plan from that batch on.
        - **Another world size or batch size** (elastic: a job back on fewer or more GPUs):
          every sample of the epoch not yet yielded by the saving ranks is yielded exactly once
          over the new ranks, with the augmentation it would have had, in equal batch counts
          (under ``drop_last`` the last is padded, marked in ``batch.valid``, rather than dropping
          samples). Those batches are numbered on from the ones yielded before the stop:
          ``len(loader)`` counts both, as a trainer restarting its batch counter from its
          checkpoint does. The next epochs are whole again. Each new rank
          takes the skipped-sample list of the state it loaded. Worked example in
          docs/guide/distributed.md.

        Raises:
            ConfigError: a state whose plan differs otherwise (sample count, ``drop_last``,
                shuffle settings, the bad-sample list, or an explicitly different seed).
        """
        if not isinstance(state, dict):
            raise ConfigError(f"Loader.load_state_dict: not a gpupipe loader state (version {STATE_VERSION})")
        skipped = self._skips.parse(state)  # checked first: a state refused changes nothing
        listing, previous = state.get("listing"), self._listing
        relisted = listing is not None and previous is not None
        if relisted:  # the shards the saved epoch read
            if not _urls(listing):
                raise ConfigError("Loader.load_state_dict: a damaged loader state (its listing is not of shard URLs)")
            self._relist(nested(listing, tuple))
        try:
            data = state.get("data")
            if data is not None and data != self._data():
                raise ConfigError(
                    "Loader.load_state_dict: the state was saved over other data: other shards, or these in "
                    "another order (shard names and sample counts differ), so its positions are not this "
                    "loader's samples"
                )
            position = restore(state, spec=self.plan_spec, seed=self.seed, seed_given=self.config.seed is not None)
        except BaseException:
            if relisted:
                self._relist(previous)  # the loader as it was
            raise
        if relisted:
            self._at.listed = position.epoch
        self.seed = position.seed
        self._at.restore(position)
        if 0 < position.batches == len(self):  # saved at the epoch's end: the next iteration goes on with
            self._at.finished = True  # the next epoch, as the saving loader's would (set_epoch: exact)
        self._skips.load(skipped)

    def _data(self) -> str:
        """A digest of the data the plan numbers: each shard's name (not its folder: data moved
        elsewhere resumes) and sample count, in order. Made once per index."""
        cached = self._data_of
        if cached is None or cached[0] is not self.index:
            digest = hashlib.sha256()
            for shard in self.index.shards:  # (a URL's name without its signature: re-signed, the same shard)
                name = os.path.basename(canonical_url(str(shard.path)).rstrip("/" + os.sep))
                digest.update(f"{name}\0{len(shard)}\n".encode())
            cached = self._data_of = (self.index, digest.hexdigest()[:16])
        return cached[1]

    def _advance(self) -> None:
        """The rule that never replays an epoch silently: a loader iterated again after an epoch ran
        to its end, with no ``set_epoch`` (nor ``load_state_dict``) in between, goes on with the
        next epoch — its own order and augmentation draws — and warns once. ``set_epoch(e)`` is
        always exact, and a state saved after an advance resumes it (the epoch is in it). A loader
        whose epochs are all alike (no shuffle, no random transform: a validation loader) goes on
        silently: nothing differs."""
        varies = self.config.shuffle or any(t.random for view in self.pipeline.views for t in view)
        if varies and not self._warned_advance:
            self._warned_advance = True
            warnings.warn(
                f"gp.Loader iterated again after epoch {self.epoch} without set_epoch(): it goes on with epoch "
                f"{self.epoch + 1} (a new order and new augmentation) rather than repeating epoch {self.epoch}. Call "
                "loader.set_epoch(epoch) before each epoch to say which (trainers do, through loader.sampler); this "
                "warning is shown once per loader",
                UserWarning,
                stacklevel=3,
            )
        log.info("gpupipe loader: rank %d goes on with epoch %d (no set_epoch)", self.rank, self.epoch + 1)
        self.set_epoch(self.epoch + 1)


def _urls(listing: Any, depth: int = 0) -> bool:
    """Whether a saved listing is shard URLs: strings in (nested, for a ``gp.Mix``) lists; a
    ``gp.Mix``'s source that does not grow lists ``None``."""
    if isinstance(listing, str) or listing is None:
        return depth > 0
    return isinstance(listing, list | tuple) and depth < 3 and all(_urls(v, depth + 1) for v in listing)
