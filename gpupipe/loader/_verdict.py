"""What limits a loader, and what to change: :func:`verdict` reads the data-stall meter
(``_meter``) and the time each batch took per stage (:class:`StageTimes`) and names the part that
sets the pace, with the remedy, for ``loader.stats()["bound"]``.

The stages: where a runner times them (the torch backend's workers and Ray's tasks,
``RawBatch.times``), reading
the samples' bytes (``read``: the storage), decoding (``decode``), the per-sample transforms with
their draws (``transform``) and stacking the batch (``collate``), in seconds of a worker per
batch; and, in the training thread, the device stage (``stage``: its host time per batch, on a
GPU its launches), or ``mix`` where the stage holds the batch transform alone (MixUp/CutMix). The
rule:

1. The loop waited at most :data:`STALL_OK` of its time (the epoch's stall, from its second batch
   on): ``model``, the model sets the pace, no loader change would speed the run up.
2. The device stage's host time is at least half of the loop's wait per batch: ``stage``; the
   batch transform's alone (``mix``): ``main``, the training thread's share.
3. With the workers' stages timed: the one of ``read``, ``decode``, ``transform`` and ``collate``
   that takes the most of a batch's worker time (``storage`` for ``read``, ``decode``,
   ``transforms``, ``collate``); but where the workers could make batches at least twice as fast
   as the loop got them, the training thread's own share (hand-over, MixUp/CutMix, prefetch):
   ``main``. Without workers (``num_workers=0``) the training thread makes each batch during the
   loop's wait: the slowest stage, unless the stages take under half of that wait (``main``).
4. The DALI backend: the training thread's waits for the reader threads' batches
   (``wait_read``) and for DALI's graph (``wait_graph``): ``storage`` or ``graph`` by the larger,
   ``main`` where the two are under half the loop's wait.
5. Without per-stage times (a backend that does not time them): ``loader``, with the tuning
   advice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..backends._base import QUEUE_DEPTH, QUEUE_READY, READ_BYTES, STAGE_CLOCKS, WAIT_CLOCKS
from ..backends._copies import H2D
from ..pipeline._labels import batch_mixing
from ..shards._shard import NO_LABEL
from ..storage._counts import CACHE_HITS, CACHE_MISSES, WAIT_DOWNLOAD

__all__ = ["StageTimes", "verdict", "STALL_OK", "BOUNDS", "CLOCKS", "label_mixing", "MIXED_ENOUGH"]

MIXED_ENOUGH = 0.5  # batches with fewer than half a full shuffle's distinct labels: sorted shards
_MIXING_BATCHES = 20  # the first batches of an epoch whose labels are compared

STALL_OK = 0.05  # the loop waiting up to 5% of its time: the model sets the pace
BOUNDS = ("model", "storage", "decode", "transforms", "collate", "graph", "stage", "main", "loader")
_NAMES = {"read": "storage", "decode": "decode", "transform": "transforms", "collate": "collate"}
CLOCKS = (*STAGE_CLOCKS, *WAIT_CLOCKS, H2D, "stage", "mix")  # the stages timed, in order
_CACHE = (CACHE_HITS, CACHE_MISSES, WAIT_DOWNLOAD)
_COUNTED = (READ_BYTES, CACHE_HITS, CACHE_MISSES, WAIT_DOWNLOAD, QUEUE_READY, QUEUE_DEPTH)  # what else they count


class StageTimes:
    """An epoch's seconds per stage, summed over its batches (from the second on, as the meter's):
    the runner's (``RawBatch.times``) and the device stage's host time."""

    def __init__(self, *, keep: bool = False) -> None:
        self.keep = keep  # each batch's times in `history` too (gpupipe bench --profile)
        self.begin()

    def begin(self) -> None:
        self.batches = 0  # batches with the runner's times
        self.seconds = dict.fromkeys((*CLOCKS, *_COUNTED), 0.0)  # (and the bytes read, the node cache's reads)
        self.counts = dict.fromkeys((*CLOCKS, *_COUNTED), 0)  # batches that timed each
        self.history: list[dict[str, float]] = []  # the epoch's batches, the first included (with keep)
        self._first = True

    def add(self, times: Mapping[str, float] | None, stage_s: float | None, *, clock: str = "stage") -> None:
        """One batch's times (``None``: not timed), and the stage's host time in the training
        thread, as ``clock`` (``"mix"``: a stage of the batch transform alone)."""
        found = {**(times or {}), **({} if stage_s is None else {clock: stage_s})}
        if self.keep:
            self.history.append({k: float(v) for k, v in found.items() if k in self.seconds})
        if self._first:  # the start-up's batch: apart, as the meter keeps it
            self._first = False
            return
        self.batches += times is not None
        for name, value in found.items():
            if name in self.seconds:
                self.seconds[name] += float(value)
                self.counts[name] += 1

    def stats(self) -> dict[str, Any]:
        """``{"batches", "read_s", "decode_s", "transform_s", "collate_s", "wait_read_s",
        "wait_graph_s", "h2d_s", "stage_s", "mix_s", "read_bytes", "cache_hits", "cache_misses",
        "wait_download_s", "queue_ready", "queue_depth"}``: seconds per batch (``h2d_s``: the
        GPU time of a batch's host-to-device copies, the torch and Ray backends' on a GPU); the bytes of
        a batch's samples read from storage; for remote shards, a batch's reads the node cache
        served at once (``cache_hits``) and those that waited for their shard's download
        (``cache_misses``), and the seconds they waited; the batches made ahead that were ready
        when the loop asked (``queue_ready``), of at most ``queue_depth`` (the torch workers'
        prefetch, DALI's reader threads', Ray's tasks in flight): all of them, the loop is the slower; none, the
        runner is (``None`` where not timed, or not counted)."""
        out: dict[str, Any] = {"batches": self.batches}
        for name in (*CLOCKS, *_COUNTED):
            key = f"{name}_s" if name in CLOCKS or name == WAIT_DOWNLOAD else name
            # the node cache's reads over every batch timed (DALI's mapped reads count a shard once)
            per = self.batches if name in _CACHE and self.counts[name] else self.counts[name]
            out[key] = self.seconds[name] / per if per else None
        return out


def verdict(stall: Mapping[str, Any], times: Mapping[str, Any], *, workers: int) -> dict[str, Any]:
    """``{"bound", "stall", "why", "remedy"}`` for a loader whose meter reads ``stall``
    (``Meter.stats()``) and whose stages took ``times`` (``StageTimes.stats()``), with
    ``workers`` processes or threads making batches (``0``: the training thread itself)."""
    share = stall.get("stall")
    if share is None or not stall.get("batches"):
        return {"bound": None, "stall": None, "why": "no batch measured yet (the epoch's second batch on)",
                "remedy": None}  # fmt: skip
    if share <= STALL_OK:
        return _said("model", share, f"the loop waited {share:.0%} of its time for batches (at most {STALL_OK:.0%})",
                     "none: the model sets the pace; a faster loader would not train faster")  # fmt: skip
    batches = stall["batches"]
    wait = stall["wait_s"] / batches
    period = (stall["wait_s"] + stall["step_s"]) / batches
    stage = times.get("stage_s")
    if stage is not None and stage >= wait / 2:
        return _said("stage", share, f"the device stage's host time, {_ms(stage)} per batch in the training thread, "
                     f"is most of the loop's {_ms(wait)} wait", "Loader(stage=False): the backend runs the tail in "
                     "its workers or graph (compare both: bench/gpu.py, gpupipe bench; DALI runs the augmentation "
                     "policies in the stage only, the torch backend sample by sample)")  # fmt: skip
    mix = times.get("mix_s")
    if mix is not None and mix >= wait / 2:
        return _said("main", share, f"MixUp/CutMix take {_ms(mix)} per batch in the training thread, most of the "
                     f"loop's {_ms(wait)} wait", "on the CPU the torch backend mixes in its workers "
                     "(backend='torch'); on a GPU the batch is mixed on the device, ahead of the step")  # fmt: skip
    read, graph = times.get("wait_read_s"), times.get("wait_graph_s")
    if read is not None and graph is not None:  # the DALI backend: the training thread's waits
        return _dali_bound(share, wait, read, graph, times.get(READ_BYTES), _downloads(times), _queue(times))
    if not times.get("batches") or times.get("read_s") is None:
        return _said("loader", share, f"the loop waited {share:.0%} of its time; this backend does not time its "
                     "stages", "gpupipe tune (threads, prefetch, the hardware decoder's share); see docs: Is my "
                     "loader the bottleneck?")  # fmt: skip
    spent = {name: times[f"{name}_s"] or 0.0 for name in STAGE_CLOCKS}
    total = sum(spent.values())
    slowest = max(spent, key=lambda k: spent[k])
    if workers == 0:  # the training thread makes each batch, in its wait: the stages are the wait's share
        if total < wait / 2:
            return _said("main", share, f"the training thread makes a batch in {_ms(total)} (num_workers=0) of the "
                         f"loop's {_ms(wait)} wait per batch", "the training thread's share: keep MixUp/CutMix and "
                         "the hand-over on the device")  # fmt: skip
        made = (
            f"the {_ms(total)} per batch the training thread spends making it (num_workers=0: during the loop's wait)"
        )
    else:
        capacity = workers / total if total > 0 else float("inf")  # batches/s the workers can make
        if capacity >= 2.0 / period:
            return _said("main", share, f"the workers make a batch in {_ms(total)} ({workers} of them: "
                         f"{capacity:.0f} batches/s) but the loop got {1 / period:.0f}/s{_queue(times)}",
                         "the training thread's share: raise prefetch (gpupipe tune), keep MixUp/CutMix and the "
                         "hand-over on the device")  # fmt: skip
        made = f"the workers' {_ms(total)} per batch ({spent[slowest] / total:.0%})"
    why = (f"{_NAMES[slowest] if slowest != 'read' else 'reading the samples'} takes {_ms(spent[slowest])} of "
           f"{made}{_rate(times, spent['read'], slowest)}; the loop waited {share:.0%} of its time")  # fmt: skip
    return _said(_NAMES[slowest], share, why, _REMEDY[_NAMES[slowest]])


_REMEDY = {
    "storage": "faster storage for the shards: local disk, or for remote shards the node cache and shards_ahead "
    "(docs: Remote data and the cache); more workers hide latency (num_workers, gpupipe tune)",
    "decode": "decode on the GPU (backend='dali', device='cuda': nvJPEG, the hardware decoder on A100/H100), or "
    "more workers (num_workers, gpupipe tune); max_image_pixels refuses oversized images",
    "transforms": "run the per-sample augmentation on the GPU (the device stage: device='cuda'), crop before "
    "heavy steps, or more workers (num_workers, gpupipe tune)",
    "collate": "smaller outputs per batch, or more workers (num_workers, gpupipe tune)",
    "graph": "more DALI threads (num_workers) or gpupipe tune; on a GPU, decode there (device='cuda') with the "
    "hardware decoder's share (DaliOptions.hw_decoder_load; 1.0 by default on Hopper); the device stage for "
    "the augmentation policies",
}


def _dali_bound(share: float, wait: float, read: float, graph: float, nbytes: float | None = None,
                downloads: str = "", queue: str = "") -> dict[str, Any]:  # fmt: skip
    """The DALI backend: the loop's wait per batch against the runner's for the reader threads'
    batches (``read``) and for DALI's graph (``graph``)."""
    if read + graph < wait / 2:
        return _said("main", share, f"the loop waited {_ms(wait)} per batch, the runner {_ms(read + graph)} of it"
                     f"{queue}",
                     "the training thread's share: raise prefetch (gpupipe tune), keep MixUp/CutMix and the "
                     "hand-over on the device")  # fmt: skip
    if read >= graph:
        size = f" ({nbytes / 1e6:.1f} MB)" if nbytes else ""
        return _said("storage", share, f"the reader threads' batches{size} kept the loop waiting {_ms(read)} per "
                     f"batch, DALI's graph {_ms(graph)}{downloads}", _REMEDY["storage"])  # fmt: skip
    return _said("graph", share, f"DALI's graph (decoding and transforms) kept the loop waiting {_ms(graph)} per "
                 f"batch, the reader threads {_ms(read)}", _REMEDY["graph"])  # fmt: skip


def _rate(times: Mapping[str, Any], seconds: float, slowest: str) -> str:
    """The storage's rate, where reading is the slowest stage and the bytes were counted; and
    the reads that waited for a download."""
    read = times.get(READ_BYTES)
    if slowest != "read" or not read or seconds <= 0:
        return ""
    return f", {read / 1e6:.1f} MB per batch at {read / seconds / 1e6:.0f} MB/s per worker{_downloads(times)}"


def _queue(times: Mapping[str, Any]) -> str:
    """How full the runner's queue ran, where it was measured."""
    ready, depth = times.get(QUEUE_READY), times.get(QUEUE_DEPTH)
    if ready is None or not depth:
        return ""
    return f" (its queue held {ready:.1f} of {depth:.0f} batches ready when the loop asked)"


def _downloads(times: Mapping[str, Any]) -> str:
    """For remote shards: how many of a batch's reads waited for their shard's download, and
    for how long (the node cache's misses); empty where none did."""
    misses, hits = times.get(CACHE_MISSES), times.get(CACHE_HITS) or 0.0
    if not misses:
        return ""
    waited = times.get(f"{WAIT_DOWNLOAD}_s") or 0.0
    return (
        f"; {misses:.1f} of the {misses + hits:.1f} reads of remote shards per batch waited for a shard's "
        f"download ({_ms(waited)}): the node cache missed, raise shards_ahead"
    )


def _said(bound: str, share: float, why: str, remedy: str) -> dict[str, Any]:
    return {"bound": bound, "stall": share, "why": why, "remedy": remedy}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def label_mixing(index: Any, plan: Any) -> dict[str, float] | None:
    """How mixed the labels of ``plan``'s first batches are against a full shuffle's
    (``_labels.batch_mixing``), read from ``index`` (no image is read); ``None`` for unlabeled
    data, or too few batches or labels to judge (4 batches, 3 labels expected per batch)."""
    if not getattr(index, "labeled", False) or plan.num_batches < 4:
        return None
    labels = []
    for b in range(min(_MIXING_BATCHES, plan.num_batches)):
        samples, valid = plan.batch(b)
        found = index.locate_batch(samples[valid]).labels
        if found is None:
            return None
        labels.append(found[found != NO_LABEL])  # (a label member that is not an integer: not a class)
    mixing = batch_mixing(labels)
    return mixing if mixing is not None and mixing["expected"] >= 3 else None
