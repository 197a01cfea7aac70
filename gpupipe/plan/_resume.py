"""Where a loader is in its epochs, as saved by ``Loader.state_dict`` and restored by
``Loader.load_state_dict``: on the same ranks (exact, mid-epoch), or elastically on another world
size or batch size (what is left of the epoch split over the new ranks, ``_elastic.remaining``)."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from ..core._errors import ConfigError
from ..core._validate import is_int
from ._elastic import Layout, remaining
from ._plan import PlanSpec, ceil_div

__all__ = ["STATE_VERSION", "ELASTIC", "Position", "Cursor", "restore", "saved", "layout_batches", "nested"]

STATE_VERSION = 2
ELASTIC = frozenset({"world_size", "batch_size"})  # what may change between saving and resuming


@dataclasses.dataclass(frozen=True)
class Position:
    """The epoch, the batches of it yielded so far (of what ``layout`` leaves of it, where set),
    and the seed the plan was drawn with."""

    epoch: int
    batches: int
    seed: int
    layout: Layout | None = None


@dataclasses.dataclass
class Cursor:
    """A loader's live position, in one place:

    - ``epoch``: the epoch the next iteration yields;
    - ``yielded``: its batches yielded so far (after an elastic resume, counted on from those the
      saving run yielded);
    - ``start``: the batch the next iteration of ``epoch`` starts from, set by a restore
      (``None``: its first);
    - ``layout``: what an elastic resume leaves of ``epoch`` (``None``: the whole epoch);
    - ``finished``: ``epoch`` ran to its end, with no ``set_epoch`` since;
    - ``listed``: the epoch whose listing of a growing source the index is of.
    """

    epoch: int = 0
    yielded: int = 0
    start: int | None = None
    layout: Layout | None = None
    finished: bool = False
    listed: int = 0

    def layout_of(self, epoch: int) -> Layout | None:
        """What is left of ``epoch`` (an elastic resume's, of its own epoch only), else ``None``."""
        return self.layout if epoch == self.epoch else None

    def go_to(self, epoch: int) -> None:
        """``set_epoch``: another epoch drops the position in this one (its resume point and
        layout); the same epoch keeps it. Either way the epoch is to be iterated."""
        if epoch != self.epoch:
            self.yielded, self.start, self.layout = 0, None, None
        self.epoch, self.finished = epoch, False

    def restore(self, position: Position) -> None:
        """Goes to a saved ``position``: its next iteration starts after the batches yielded."""
        self.epoch, self.yielded, self.start = position.epoch, position.batches, position.batches
        self.layout, self.finished = position.layout, False

    def begin(self) -> int:
        """An iteration of ``epoch`` starts: the batch it starts from (the restored one, once;
        else the first of what ``layout`` leaves of the epoch: its batches count on from
        ``layout.offset``)."""
        first = self.layout.offset if self.layout is not None else 0
        start, self.start = first if self.start is None else self.start, None
        self.yielded = start
        return start

    def position(self, seed: int) -> Position:
        """The position to save (with the ``seed`` the plan is drawn with)."""
        return Position(self.epoch, self.yielded, seed, self.layout)


def layout_batches(spec: PlanSpec, layout: Layout) -> int:
    """Batches every rank of ``spec`` yields for what ``layout`` leaves of an epoch."""
    return ceil_div(ceil_div(layout.num_samples, spec.world_size), spec.batch_size)


def restore(state: Any, *, spec: PlanSpec, seed: int, seed_given: bool) -> Position:
    """The position ``state`` says, for a loader of ``spec`` (on any rank), from any rank's state:
    ranks yield the same number of batches, so the states of one step differ only in ``rank`` and
    the skipped-sample list (a trainer that checkpoints rank 0's alone, as Lightning does, resumes
    every rank). The same plan settings: exact, this rank's own plan from that batch on. Another
    ``world_size`` or ``batch_size`` (elastic): what the saving ranks had not yet yielded is left
    for the new ones (:func:`gpupipe.plan._elastic.remaining`).

    Raises:
        ConfigError: not a state; a state whose other plan settings (samples, ``drop_last``,
            shuffling, the bad-sample list) or explicitly given seed differ; a bad position.
    """
    where = "Loader.load_state_dict"
    if not (isinstance(state, dict) and state.get("version") == STATE_VERSION and isinstance(state.get("plan"), dict)):
        raise ConfigError(f"{where}: not a gpupipe loader state (version {STATE_VERSION})")
    try:
        saved = PlanSpec.checked(state["plan"])
        layout = Layout.from_dict(state["layout"]) if state.get("layout") is not None else None
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{where}: a damaged loader state ({e})") from None
    changed = spec.changed(state["plan"])
    diff = spec.differences(state["plan"])
    elastic = bool(changed) and changed <= ELASTIC
    if elastic:
        diff = []
    if not is_int(state.get("seed")):
        raise ConfigError(f"{where}: a damaged loader state (seed={state.get('seed')!r} is not an integer)")
    if seed_given and state.get("seed") != seed:
        diff.append(f"seed={state.get('seed')!r} (this loader: {seed})")
    if diff:
        raise ConfigError(f"{where}: the state does not match this loader: " + "; ".join(diff))
    if layout is not None and layout.first.changed(saved.as_dict()) - ELASTIC:
        raise ConfigError(f"{where}: a damaged loader state (its layout is of another epoch plan)")
    epoch, done = state.get("epoch"), state.get("batches_yielded")
    low = layout.offset if layout is not None else 0
    high = low + layout_batches(saved, layout) if layout is not None else saved.num_batches
    if not (is_int(epoch) and is_int(done) and cast(int, epoch) >= 0 and low <= cast(int, done) <= high):
        raise ConfigError(f"{where}: bad position epoch={epoch!r}, batches_yielded={done!r}")
    epoch, done = cast(int, epoch), cast(int, done)
    if elastic:  # what is left, its batches counted on from those yielded
        return Position(epoch, done, state["seed"], remaining(saved, done, layout))
    return Position(epoch, done, state["seed"], layout)


def saved(position: Position, spec: PlanSpec, rank: int) -> dict[str, Any]:
    """The state of ``position`` (see :func:`restore`)."""
    return {
        "version": STATE_VERSION,
        "epoch": position.epoch,
        "batches_yielded": position.batches,
        "seed": position.seed,
        "rank": rank,
        "plan": spec.as_dict(),
        "layout": position.layout.as_dict() if position.layout is not None else None,
    }


def nested(value: Any, kind: type) -> Any:
    """``value`` with its tuples or lists (nested) made ``kind``: a listing saved in a state as
    lists (JSON), compared as tuples."""
    return kind(nested(v, kind) for v in value) if isinstance(value, (list, tuple)) else value
