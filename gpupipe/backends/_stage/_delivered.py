"""The stage on a delivered batch: the loader decides, per pipeline, which views hand a tail of
steps to the stage (:func:`stage_for`); the backend then runs each view only up to that tail
(``RunSpec.views`` cut there, its outputs uint8 of a fixed size) and the loader runs the tail on
each batch it receives, on the batch's device (:meth:`Stage.run`), before the batch transform.

The draws are every backend's: a tail step's factors are those of its place in the full view
(``gpupipe.core._random.step_factors`` of ``(seed, epoch, sample, view, step)``), drawn for the
batch's draw numbers (``RankPlan.drawn``), so a staged batch is the batch the backend would have
made sample by sample, and a resumed or elastic run draws the same.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ...core._random import step_factors
from ...transforms import ImageSpec, Transform
from .._base import donor
from ._ahead import SideStream, ahead
from ._steps import run_stage, stage_start

__all__ = ["Stage", "stage_for"]


@dataclasses.dataclass(frozen=True)
class Stage:
    """Where each view's tail starts (``None``: the view has none) and how the batch is laid out
    after it."""

    views: tuple[tuple[Transform, ...], ...]
    starts: tuple[int | None, ...]
    channels_last: bool = False

    def cut(self) -> tuple[tuple[Transform, ...], ...]:
        """The views as the backend runs them: each up to its tail."""
        return tuple(v if s is None else v[:s] for v, s in zip(self.views, self.starts, strict=True))

    def cut_specs(self, view_specs: tuple[tuple[ImageSpec, ...], ...]) -> tuple[ImageSpec, ...]:
        """Each view's output spec as the backend delivers it (``view_specs``: the pipeline's)."""
        return tuple(specs[-1 if s is None else s] for specs, s in zip(view_specs, self.starts, strict=True))

    def run(self, images: tuple[torch.Tensor, ...], *, seed: int, epoch: int, draws: np.ndarray,
            skipped: Sequence[int] = ()) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """Each view's tail on its delivered ``[B, C, H, W]`` images, sample ``i`` with the factors
        of draw number ``draws[i]``; in the loader's memory format. ``skipped``: the positions of
        samples left out, which hold a copy of the batch's donor (``backends._base.donor``): they
        take its draws too, so that they stay its copies after the tail, as without the stage."""
        good = donor(len(draws), set(skipped)) if skipped else None
        if good is not None:
            draws = np.array(draws, copy=True)
            draws[list(skipped)] = draws[good]
        out = []
        for view, (steps, start, img) in enumerate(zip(self.views, self.starts, images, strict=True)):
            if start is not None:
                drawn = [step_factors(steps[step], seed, epoch, draws, step, view) for step in range(start, len(steps))]
                img = run_stage(steps[start:], img, drawn)
                if self.channels_last:
                    img = img.contiguous(memory_format=torch.channels_last)
            out.append(img)
        return tuple(out)

    def batches(self, batches: Iterator[tuple[int, Any]], plan: Any, device: torch.device, *,
                spent: list[float] | None = None) -> Iterator[tuple[int, Any, tuple[torch.Tensor, ...]]]:  # fmt: skip
        """``(b, raw, images)`` for each ``(b, raw)`` a runner yields for ``plan`` (``RawBatch``es),
        ``images`` the views after their tails. On a GPU each batch's tail is launched on a stream
        of its own one batch ahead (``_ahead``): it runs while the training loop's step of the
        batch before does. ``spent[0]``: the host's seconds in the tails, added to."""

        def tail(b: int, raw: Any) -> tuple[torch.Tensor, ...]:
            started = time.perf_counter()
            try:
                return self.run(raw.images, seed=plan.seed, epoch=plan.epoch, draws=plan.drawn(b),
                                skipped=[i for i, _ in raw.skipped])  # fmt: skip
            finally:
                if spent is not None:
                    spent[0] += time.perf_counter() - started

        if device.type != "cuda":
            return ((b, raw, tail(b, raw)) for b, raw in batches)
        side: SideStream[Any] = SideStream(device)
        return ahead(batches, lambda item: (item, side.launch(lambda: tail(*item))),
                     lambda launched: (*launched[0], side.finish(launched[1])), depth=1)  # fmt: skip


def stage_for(pipeline: Any, device: torch.device, choice: bool | None, *, channels_last: bool = False) -> Stage | None:
    """The stage of ``pipeline`` delivered to ``device``, or ``None`` where no view hands it a
    tail: ``choice`` (``LoaderConfig.stage``) ``False``, or ``None`` on the CPU, where the
    backends run a tail faster themselves, in their workers or threads, than the training thread
    runs the stage (the torch backend 0.57-0.72x with it, DALI 0.77-0.95x but AugMix 1.30x: 2
    cores, ``bench/results/2026-11-28-stage-cpu.md``); a ``gp.Mix``'s ``per_source`` lists, masks or boxes
    that follow the image, or no image. A view's tail goes to the stage where it holds a
    per-sample draw and its input has a fixed size (the batch stacks); every backend stops a view
    where it is cut."""
    on = choice if choice is not None else device.type == "cuda"
    if not on or pipeline.per_source or pipeline.targets or not pipeline.has_image:
        return None
    starts = []
    for steps, specs in zip(pipeline.views, pipeline.view_specs, strict=True):
        start = stage_start(steps, specs)
        starts.append(start if start is not None and specs[start].fixed_size else None)
    if all(s is None for s in starts):
        return None
    return Stage(tuple(pipeline.views), tuple(starts), channels_last)
