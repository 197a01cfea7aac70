"""What a :class:`~gpupipe.Loader` says of itself while it runs: :meth:`Observed.stats` (samples
per source, the data-stall meter, the time per stage, what limits the loader and the labels'
mixing), :meth:`Observed.stall_metrics` for loggers, and the check of the labels' mixing that warns
once. The loader keeps the meter (``_meter``), the stage times (``_times``) and the mixing
(``_mixing``); this reads them."""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import warnings
from typing import TYPE_CHECKING, Any

from ..core._paths import cache_root
from ..runtime._dist import local_rank
from ..storage._base import write_atomic
from ._meter import Meter
from ._meter import metrics as stall_metrics
from ._trainers import Trained
from ._verdict import MIXED_ENOUGH, StageTimes, label_mixing, verdict

if TYPE_CHECKING:
    from ..core._config import LoaderConfig
    from ..plan._indexed import Indexed
    from ..plan._plan import RankPlan
    from ..plan._resume import Cursor
    from ..plan._skips import Skips

__all__ = ["Observed", "verdict_file", "last_verdict"]

log = logging.getLogger("gpupipe")


def verdict_file() -> str:
    """Where loaders leave their last verdict for ``gpupipe doctor``: ``$GPUPIPE_CACHE_DIR/verdict.json``."""
    return os.path.join(cache_root(), "verdict.json")


def last_verdict() -> dict[str, Any] | None:
    """The verdict a loader on this machine (its node's first rank) left last, or ``None``."""
    try:
        with open(verdict_file(), encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("bound"), str) else None


class Observed(Trained):
    """The loader's reports on itself (a :class:`~gpupipe.Loader` supplies the state)."""

    config: LoaderConfig
    index: Any
    num_workers: int
    _at: Cursor
    _indexed: Indexed
    _skips: Skips
    _meter: Meter
    _times: StageTimes
    _mixing: dict[str, float] | None
    backend: str
    device: str
    rank: int
    world_size: int
    _recorded: tuple[int | None, int] | None = None  # (epoch, batches) of the verdict last written

    def stats(self) -> dict[str, Any]:
        """What this rank's current epoch holds and has yielded, per source (a :class:`~gpupipe.Mix`'s
        sources, or the one source):

        ``{"epoch": 3, "batches_yielded": 12, "skipped": 0, "sources": [{"source": "WebDataset(...)",
        "per_epoch": 8000, "planned": 2000, "yielded": 768}, ...], "stall": {...}}``: ``per_epoch``, the source's
        samples in an epoch over all ranks (a mix's count; else the good samples); ``planned``,
        those in this rank's plan of the epoch (padding left out; of an epoch resumed on another
        world size: of what was left of it); ``yielded``, those of them yielded so far;
        ``skipped``, samples left out of this epoch so far (``on_error="skip"``). Computed from
        the plan when called (``O(N / world_size)``), nothing counted per batch.

        ``stall``: the data-stall meter of the last iteration (``gpupipe.loader._meter``): the
        seconds the training loop waited in ``next()`` (``wait_s``) and spent between batches
        (``step_s``) from the epoch's second batch on, ``stall`` = ``wait_s / (wait_s + step_s)``
        (0: the model sets the pace; near 1: the loader does), ``images_per_s`` as the loop got
        them, ``first_batch_s`` (from asking for the first batch to getting it), and the same over
        the last 50 batches (``window``). Example: a loop that steps 90 ms and waits 10 ms per
        batch of 256 shows ``stall`` 0.1 and ``images_per_s`` 2560.

        ``times``: the epoch's seconds per batch in each stage where the backend times them (the
        torch backend's workers: ``read_s``, ``decode_s``, ``transform_s``, ``collate_s``; the
        device stage's host time: ``stage_s``; ``None`` where not timed). ``bound``: what limits
        the loader now and the change that would help, ``{"bound", "stall", "why", "remedy"}``,
        ``bound`` one of ``model`` (no stall), ``storage``, ``decode``, ``transforms``,
        ``collate``, ``graph`` (DALI's graph), ``stage``, ``main`` (the training thread's share) and
        ``loader`` (a backend without per-stage times) (``gpupipe.loader._verdict``). ``labels``: with ``shuffle=True``,
        the first epoch's first batches' distinct labels on average against a full shuffle's
        (``distinct``, ``expected``, ``ratio``; under 0.5 a warning: shards sorted by label), or
        ``None``.
        """
        layout = self._at.layout
        done = (self._at.yielded - (layout.offset if layout is not None else 0)) * self.config.batch_size
        sources = self._indexed.planner.per_source(self.pipeline.source, self.plan(), done)
        stall, times = self._meter.stats(), self._times.stats()
        return {"epoch": self.epoch, "batches_yielded": self._at.yielded, "skipped": self._skips.in_epoch,
                "sources": sources, "stall": stall, "times": times, "labels": self._mixing or None,
                "bound": verdict(stall, times, workers=self._makers())}  # fmt: skip

    def _makers(self) -> int:
        """The processes or threads making batches for the verdict, ``0`` where the training thread
        makes them itself (Ray's tasks run on the cluster whatever ``num_workers`` says)."""
        return max(self.num_workers, 1) if self.backend == "ray" else self.num_workers

    def stall_metrics(self, prefix: str = "gpupipe/") -> dict[str, float]:
        """The data-stall meter (``stats()["stall"]``) as a logger's numbers, under ``prefix``:
        ``stall`` and ``images_per_s`` over the last 50 batches, ``epoch_stall``,
        ``epoch_images_per_s`` and ``first_batch_s`` of the epoch; those not measured yet left
        out. With Accelerate: ``accelerator.log(loader.stall_metrics(), step=step)``; with
        Lightning, ``gpupipe.lightning.StallLogger`` logs them."""
        return stall_metrics(self._meter.stats(), prefix)

    def _record_verdict(self) -> None:
        """Leaves the verdict on the epoch so far in :func:`verdict_file` for ``gpupipe doctor``
        (at an epoch's end and at ``close()``; a training loader, ``shuffle=True``, so that the
        validation loaders run between its epochs do not replace its verdict; by the node's first
        rank, ``LOCAL_RANK`` 0 or none): one small file written whole, never an error (a
        diagnosis never stops a run)."""
        if not self.config.shuffle or local_rank() not in (None, 0):
            return
        try:
            stall = self._meter.stats()
            if self._recorded == (stall["epoch"], stall["batches"]):
                return
            said = verdict(stall, self._times.stats(), workers=self._makers())
            if said["bound"] is None:
                return
            self._recorded = (stall["epoch"], stall["batches"])
            views = self.pipeline.views
            record = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                      "host": socket.gethostname(), "pid": os.getpid(), "rank": self.rank,
                      "world_size": self.world_size, "backend": self.backend, "device": self.device,
                      "batch_size": self.config.batch_size, "num_workers": self.num_workers,
                      "source": repr(self.pipeline.source)[:200],
                      "transforms": [type(t).__name__ for t in views[0]] if views else [],
                      "epoch": stall["epoch"], "batches": stall["batches"], "images_per_s": stall["images_per_s"],
                      **said}  # fmt: skip
            os.makedirs(cache_root(), exist_ok=True)
            write_atomic(verdict_file(), json.dumps(record, indent=1).encode())
        except Exception as e:  # a read-only cache directory, a full disk: the run goes on
            log.info("gpupipe loader: the verdict was not recorded for gpupipe doctor: %s", e)

    def _judge_mixing(self, plan: RankPlan) -> None:
        """The epoch's first batches' labels against a full shuffle's: a warning, once, where
        they hold fewer than half its distinct labels (shards sorted by label)."""
        try:
            self._mixing = label_mixing(self.index, plan) or {}
        except Exception as e:  # a diagnosis: never what stops a run (the batches name a bad shard)
            log.info("gpupipe loader: the labels' mixing was not measured: %s", e)
            self._mixing = {}
            return
        ratio = self._mixing.get("ratio")
        if ratio is not None and ratio < MIXED_ENOUGH:
            warnings.warn(
                f"gp.Loader: the first {self._mixing['batches']:.0f} batches of epoch {plan.epoch} hold "
                f"{self._mixing['distinct']:.1f} labels each on average, against {self._mixing['expected']:.1f} in "
                "batches of a full shuffle: the samples look sorted by label within their shards, and batches of "
                "few classes train worse. Write the shards in a shuffled order (gpupipe make-shards shuffles by "
                "default); gpupipe check reports the label runs. loader.stats()['labels'] has the figures",
                UserWarning,
                stacklevel=3,
            )
