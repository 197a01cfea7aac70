"""``gpupipe bench --profile``: where each configuration's time went, per batch, in its last epoch
(the first is the start-up), and what the loader says limits it.

The stages are the loader's own clocks (``loader.stats()["times"]``, ``gpupipe.loader._verdict``):
the torch backend's workers time reading, decoding, the per-sample transforms and collating each
batch (seconds of one worker: with ``W`` workers a batch comes every ``sum / W`` at best); the
DALI backend's training thread times its waits for the reader threads and for DALI's graph; the
device stage's host time is the training thread's. ``wait`` is the time the bench loop waited in
``next()`` for each batch. The bench loop does nothing else, so the loader is always the limit
here: the verdict names which part of it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ..core._errors import ConfigError
from ..loader._verdict import CLOCKS

__all__ = ["profile_of", "profile_text", "profile_plot", "LABELS"]

LABELS = {"read": "read", "decode": "decode", "transform": "transforms", "collate": "collate",
          "wait_read": "wait: reader threads", "wait_graph": "wait: DALI graph", "h2d": "copy to GPU",
          "stage": "device stage", "mix": "MixUp/CutMix",
          "wait": "loop's wait in next()"}  # fmt: skip


def profile_of(loader: Any, waits: Sequence[float]) -> dict[str, Any]:
    """The last epoch's profile of ``loader`` (made with ``loader._times.keep`` on), whose batches
    the loop waited ``waits`` seconds for: ``{"epoch", "batches": [{"wait", <stage>: seconds, ...}],
    "times": loader.stats()["times"], "bound": loader.stats()["bound"]}``."""
    stats = loader.stats()
    history = loader._times.history
    batches = [{"wait": round(w, 6), **{k: round(v, 6) for k, v in h.items()}}
               for w, h in zip(waits, history, strict=False)]  # fmt: skip
    return {"epoch": stats["stall"]["epoch"], "workers": loader.num_workers, "batches": batches,
            "times": stats["times"], "bound": stats["bound"]}  # fmt: skip


def profile_text(profile: dict[str, Any]) -> str:
    """Three lines: the median ms per batch of each stage timed and of the loop's wait (the
    epoch's first batch, the start-up, left out), then the verdict and its remedy."""
    batches = profile["batches"][1:] or profile["batches"]
    cells = []
    for name in (*CLOCKS, "wait"):
        values = [b[name] for b in batches if name in b]
        if values:
            cells.append(f"{LABELS[name]} {statistics.median(values) * 1000:.1f}")
    read = [b["read_bytes"] for b in batches if "read_bytes" in b]
    if read:
        cells.append(f"MB read {statistics.median(read) / 1e6:.2f}")
    ready = [b["queue_ready"] for b in batches if "queue_ready" in b]  # the runner's queue, when asked
    if ready:
        depth = max(b["queue_depth"] for b in batches if "queue_depth" in b)
        cells.append(f"queue ready {statistics.median(ready):.1f} of {depth:.0f}")
    misses = [b["cache_misses"] for b in batches if "cache_misses" in b]  # remote shards: the node cache's
    if misses:
        hits = [b.get("cache_hits", 0.0) for b in batches if "cache_misses" in b]
        cells.append(f"reads waiting for a download {sum(misses):.0f} of {sum(misses) + sum(hits):.0f}")
    workers = profile.get("workers")
    each = f" (read..collate: one worker's, {workers} workers)" if any("decode" in b for b in batches) else ""
    bound = profile.get("bound") or {}
    lines = [f"profile, epoch {profile['epoch']}, median ms per batch{each}: " + (" | ".join(cells) or "nothing timed")]
    if bound.get("bound"):
        lines += [f"bound: {bound['bound']}: {bound['why']}", f"remedy: {bound['remedy']}"]
    return "\n".join(lines)


def profile_plot(runs: Sequence[Any], out: str, *, title: str, most: int = 6) -> None:
    """A PNG: for each configuration profiled (the first round's, at most ``most``), each stage's
    time per batch and the loop's wait over the last epoch, titled with the verdict."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("--profile PNG draws with matplotlib: pip install gpupipe[plot]") from e
    shown = [r for r in runs if r.profile is not None and r.round == 0][:most]
    if not shown:
        raise ConfigError("--profile PNG: no loader configuration was profiled (a baseline has no stage clocks)")
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 2.8 * len(shown)), constrained_layout=True, squeeze=False)
    for ax, run in zip(axes[:, 0], shown, strict=True):
        batches = run.profile["batches"]
        for i, name in enumerate((*CLOCKS, "wait")):
            points = [(b, batch[name] * 1000) for b, batch in enumerate(batches) if name in batch]
            if points:
                xs, ys = zip(*points, strict=True)
                style = {"color": "black", "linestyle": "--"} if name == "wait" else {"color": f"C{i}"}
                ax.plot(xs, ys, label=LABELS[name], linewidth=1.2, **style)
        bound = (run.profile.get("bound") or {}).get("bound")
        ax.set(title=f"{run.backend} {run.device}, batch {run.batch_size}, {run.workers} workers: "
               f"{run.images_per_s:.0f} images/s, bound: {bound}", xlabel="batch (last epoch)",
               ylabel="ms per batch")  # fmt: skip
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=9)
    fig.savefig(out, dpi=100)
    plt.close(fig)
