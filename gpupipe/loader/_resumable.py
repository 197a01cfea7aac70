"""A :class:`~gpupipe.Loader`'s checkpoint: :meth:`Resumable.state_dict` and
:meth:`Resumable.load_state_dict` (the position, the plan's settings, the skipped samples and a
growing source's shards), over ``gpupipe.plan._resume``; and the rule that goes on with the next
epoch rather than replay one (:meth:`Resumable._advance`)."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

from ..plan._resume import nested, restore, saved

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
    _warned_advance: bool

    @property
    def epoch(self) -> int:  # (the loader's)
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:  # (the loader's)
        raise NotImplementedError

    if TYPE_CHECKING:

        def _relist(self, listing: Any) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: the epoch and the batches of it yielded so far, with the settings
        the plan depends on. Call it between batches (after a step); see :meth:`load_state_dict`."""
        state = {**saved(self._at.position(self.seed), self.plan_spec, self.rank), **self._skips.state()}
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
        listing = state.get("listing") if isinstance(state, dict) else None
        if listing is not None and self._listing is not None:  # the shards the saved epoch read
            self._relist(nested(listing, tuple))
            self._at.listed = state.get("epoch", self._at.epoch)
        position = restore(state, spec=self.plan_spec, seed=self.seed, seed_given=self.config.seed is not None)
        self.seed = position.seed
        self._at.restore(position)
        self._skips.load(state)

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
