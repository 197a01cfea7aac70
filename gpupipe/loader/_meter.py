"""The data-stall meter, always on: for each batch, the time the training loop waited inside the
loader's ``next()`` against the time it spent elsewhere (its step) since the batch before.

The stall is ``wait / (wait + step)``: 0 when every batch was ready when the loop asked for it (the
model sets the pace), near 1 when the loop did little but wait (the loader sets it). It is kept for
the current epoch, from its second batch on (the first batch's wait is the start-up,
``first_batch_s``), and over a moving window of the last :data:`WINDOW` batches, and read with
``loader.stats()["stall"]``. Two clock readings and a few additions per batch: nothing per sample.

On a GPU the loop's host thread runs ahead of the device and waits for it where it reads a value
back (``loss.item()``), so the wait the meter sees is the loader's share of the host's time: a
loader that keeps up shows a stall near 0 however busy the GPU is.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Meter", "WINDOW", "metrics"]

WINDOW = 50  # batches in the moving window


class Meter:
    """Times one iteration at a time: :meth:`begin` where the loop first asks for a batch,
    :meth:`ready` just before each batch is yielded, :meth:`resumed` where the loop asks for the
    next one."""

    def __init__(self, *, window: int = WINDOW, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._recent: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=window)
        self.epoch: int | None = None
        self.batch_size = 0
        self._asked = 0.0  # when the loop last asked for a batch
        self._handed: float | None = None  # when the last batch was handed over
        self._first: float | None = None
        self._batches = 0
        self._images = 0  # the images of the epoch's batches measured (padding and skipped samples left out)
        self._wait = 0.0
        self._step = 0.0
        self._total = [0, 0.0, 0.0]  # batches, wait, step since the meter was made, every batch
        self._last: float | None = None  # the last hand-over, across epochs

    def begin(self, epoch: int, batch_size: int) -> None:
        """The loop asks for an epoch's first batch: that epoch's counts start from zero (the
        window goes on across epochs)."""
        self.epoch, self.batch_size = epoch, batch_size
        self._asked, self._handed, self._first = self._clock(), None, None
        self._batches, self._images, self._wait, self._step = 0, 0, 0.0, 0.0

    def ready(self, images: int | None = None) -> None:
        """A batch of ``images`` valid images (default: the batch size) is about to be handed over."""
        now = self._clock()
        images = self.batch_size if images is None else images
        wait = now - self._asked
        if self._handed is None:
            self._first = wait
        else:
            step = self._asked - self._handed
            self._batches += 1
            self._images += images
            self._wait += wait
            self._step += step
            self._recent.append((wait, step, images))
        total = self._total
        total[0] += 1
        total[1] += wait
        total[2] += 0.0 if self._last is None else self._asked - self._last
        self._handed = self._last = now

    def resumed(self) -> None:
        """The loop asks for the next batch."""
        self._asked = self._clock()

    def totals(self) -> tuple[int, float, float]:
        """``(batches, wait_s, step_s)`` since the meter was made, over every batch across epochs:
        each epoch's first batch's wait (its start-up) included, and the loop's time between
        epochs counted as step. The difference of two readings is the meter over the batches
        between them (``bench/data_stall.py`` compares it with its own clock)."""
        batches, wait, step = self._total
        return int(batches), float(wait), float(step)

    def stats(self) -> dict[str, Any]:
        """``{"epoch", "first_batch_s", "batches", "wait_s", "step_s", "stall", "images_per_s",
        "window": {"batches", "stall", "images_per_s"}}``: the epoch's figures from its second
        batch on, and the last batches'; ``None`` where nothing was measured yet."""
        recent = list(self._recent)  # (stats() may be called from another thread than ready())
        recent_wait = sum(w for w, _, _ in recent)
        recent_step = sum(s for _, s, _ in recent)
        recent_images = sum(n for _, _, n in recent)
        return {
            "epoch": self.epoch,
            "first_batch_s": self._first,
            "batches": self._batches,
            "wait_s": self._wait,
            "step_s": self._step,
            **_rates(self._batches, self._wait, self._step, self._images),
            "window": {"batches": len(recent), **_rates(len(recent), recent_wait, recent_step, recent_images)},
        }  # fmt: skip


def _rates(batches: int, wait: float, step: float, images: int) -> dict[str, float | None]:
    total = wait + step
    if not batches or total <= 0:
        return {"stall": None, "images_per_s": None}
    return {"stall": wait / total, "images_per_s": images / total}


def metrics(stall: dict[str, Any], prefix: str = "gpupipe/") -> dict[str, float]:
    """:meth:`Meter.stats` as the flat numbers a logger takes: the window's ``stall`` and
    ``images_per_s``, and the epoch's as ``epoch_stall``, ``epoch_images_per_s`` and
    ``first_batch_s``, each under ``prefix``; those not measured yet left out."""
    window = stall["window"]
    found = {"stall": window["stall"], "images_per_s": window["images_per_s"], "epoch_stall": stall["stall"],
             "epoch_images_per_s": stall["images_per_s"], "first_batch_s": stall["first_batch_s"]}  # fmt: skip
    return {prefix + k: float(v) for k, v in found.items() if v is not None}
