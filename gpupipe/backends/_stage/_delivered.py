"""The stage on a delivered batch: the per-batch work after the backend's, in one owner. The
loader decides, per pipeline, which views hand a tail of steps to the stage (:func:`stage_for`);
the backend then runs each view only up to that tail (``RunSpec.views`` cut there, its outputs
uint8 of a fixed size). :meth:`Stage.finish` runs the tails on each batch, on the batch's device
(:meth:`Stage.run`), then the pipeline's batch transform (MixUp, CutMix: ``Stage.mix``).

It runs in one of two places, chosen once when the runner is built (``Backend.batches_stage``):
where the runner makes each batch (the torch backend's worker processes, on the CPU), or in the
loader on each batch the runner delivers (:meth:`Stage.batches`: on a GPU one batch ahead, on a
stream of its own).

The draws are every backend's: a tail step's factors are those of its place in the full view
(``gpupipe.core._random.step_factors`` of ``(seed, epoch, sample, view, step)``), drawn for the
batch's draw numbers (``RankPlan.drawn``), so a staged batch is the batch the backend would have
made sample by sample, and a resumed or elastic run draws the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ...core._errors import UnsupportedTransformError
from ...core._random import step_factors
from ...runtime._threads import one_intraop_thread
from ...sources._mix import SourceOf
from ...transforms import BatchTransform, ImageSpec, Transform
from .._base import _walk, donor
from ._ahead import SideStream, ahead
from ._kernels import upload
from ._mix import apply_batch
from ._steps import STAGE, run_stage, stage_start, tail_start, takes

__all__ = ["Stage", "stage_for", "require_staged", "staged_refusal"]


@dataclasses.dataclass(frozen=True)
class Stage:
    """Where each view's tail starts (``None``: the view has none), how the batch is laid out
    after it, and the pipeline's batch transform (``mix``, applied after the tails). With
    ``sources`` the views are a ``gp.Mix``'s ``per_source`` lists, one output: each sample's
    tail is its source's list's."""

    views: tuple[tuple[Transform, ...], ...]
    starts: tuple[int | None, ...]
    channels_last: bool = False
    mix: BatchTransform | None = None
    sources: SourceOf | None = None

    @property
    def tails(self) -> bool:
        """Whether a view hands the stage a tail of steps (else it holds the batch transform alone)."""
        return any(s is not None for s in self.starts)

    def first_staged(self, kind: type) -> str | None:
        """Where the first step of type ``kind`` (a composite's member included) that a tail
        holds is, in words ("pipeline step 2 (RandomApply)"); ``None``: no tail holds one."""
        for view, (steps, start) in enumerate(zip(self.views, self.starts, strict=True)):
            for i, t in enumerate(steps[start:] if start is not None else (), start or 0):
                if any(isinstance(step, kind) for step in _walk((t,))):
                    where = f" of view {view}" if len(self.views) > 1 else ""
                    return f"pipeline step {i}{where} ({type(t).__name__})"
        return None

    def cut(self) -> tuple[tuple[Transform, ...], ...]:
        """The views as the backend runs them: each up to its tail."""
        return tuple(v if s is None else v[:s] for v, s in zip(self.views, self.starts, strict=True))

    def cut_specs(self, view_specs: tuple[tuple[ImageSpec, ...], ...]) -> tuple[ImageSpec, ...]:
        """Each view's output spec as the backend delivers it (``view_specs``: the pipeline's;
        ``per_source`` lists: their one output, the same for each)."""
        cut = tuple(specs[-1 if s is None else s] for specs, s in zip(view_specs, self.starts, strict=True))
        return cut[:1] if self.sources is not None else cut

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
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        if self.sources is not None:
            return (self._per_source(images[0], seed, epoch, draws).contiguous(memory_format=fmt),)
        out = list(images)
        for group in self._stacked(images):
            tail = self.views[group[0]][self.starts[group[0]] :]
            drawn = [self._factors(view, seed, epoch, draws) for view in group]
            factors = [None if rows[0] is None else np.concatenate(rows) for rows in zip(*drawn, strict=True)]
            stacked = images[group[0]] if len(group) == 1 else torch.cat([images[view] for view in group])
            result = run_stage(tail, stacked, factors)
            for view, img in zip(group, result.split(len(draws)) if len(group) > 1 else (result,), strict=True):
                # dense (a copy only where a step handed on an expanded tensor: a grayscale of every row)
                out[view] = img.contiguous(memory_format=fmt)
        return tuple(out)

    def _per_source(self, images: torch.Tensor, seed: int, epoch: int, draws: np.ndarray) -> torch.Tensor:
        """A ``gp.Mix``'s ``per_source`` batch: the rows of each source through its list's tail
        (its draws those of its list, as the backends draw a sample's list), into one batch."""
        assert self.sources is not None
        sources = self.sources(draws)
        out: torch.Tensor | None = None
        for source in np.unique(sources).tolist():
            rows = np.flatnonzero(sources == source)
            whole = len(rows) == len(draws)
            index = upload(rows, images.device)  # (pinned: a pageable copy would wait for the training step)
            start = self.starts[source]
            assert start is not None
            part = run_stage(self.views[source][start:], images if whole else images.index_select(0, index),
                             self._factors(source, seed, epoch, draws[rows]))  # fmt: skip
            if whole:
                return part
            if out is None:
                out = part.new_empty((len(draws), *part.shape[1:]))
            out.index_copy_(0, index, part)
        assert out is not None
        return out

    def _factors(self, view: int, seed: int, epoch: int, draws: np.ndarray) -> list[np.ndarray | None]:
        """The factors of ``view``'s tail steps for the samples of draw numbers ``draws``."""
        steps, start = self.views[view], self.starts[view]
        assert start is not None
        return [step_factors(steps[step], seed, epoch, draws, step, view) for step in range(start, len(steps))]

    def _stacked(self, images: tuple[torch.Tensor, ...]) -> list[list[int]]:
        """The views with a tail, in groups that run it as one batch: those with the same tail on
        images of the same shape, dtype and device (DINO's 8 local views: one run of the stage,
        its launches once on a GPU, not 8 times)."""
        groups: list[list[int]] = []
        for view, start in enumerate(self.starts):
            if start is None:
                continue
            for group in groups:
                first, img = group[0], images[view]
                if (self.views[first][self.starts[first] :] == self.views[view][start:]
                        and (images[first].shape, images[first].dtype, images[first].device)
                        == (img.shape, img.dtype, img.device)):  # fmt: skip
                    group.append(view)
                    break
            else:
                groups.append([view])
        return groups

    def finish(self, images: tuple[torch.Tensor, ...], labels: torch.Tensor | None, valid: np.ndarray, *, seed: int,
               epoch: int, rank: int, batch: int, draws: np.ndarray,
               skipped: Sequence[int] = ()) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:  # fmt: skip
        """The batch after the stage: each view's tail (:meth:`run`), then the batch transform on
        the first view's ``[B, C, H, W]`` images and the class ``labels`` ``[B]`` (float32 soft
        targets ``[B, num_classes]`` after it). ``valid`` ``[B]`` (bool, host memory): the rows
        that are not padding (the ``skipped`` ones are left out here); the rows that mix are those
        valid and not skipped. ``batch``: the batch's number in its epoch (``RankPlan.batch_offset``
        counted in), whose generator draws the mix. On the CPU it runs on the calling thread
        alone (``one_intraop_thread``): torch's second OpenMP thread spins after each operator and
        takes a core from DALI's threads (DALI-CPU's V2 with the stage: 1.18x with one thread,
        0.89x with two, 2 cores, 2026-11-29)."""
        if self.tails:
            with one_intraop_thread() if images[0].device.type == "cpu" else contextlib.nullcontext():
                images = self.run(images, seed=seed, epoch=epoch, draws=draws, skipped=skipped)
        if self.mix is None or labels is None:
            return images, labels
        mixing = np.array(valid, dtype=bool)
        mixing[list(skipped)] = False
        mixed, labels = apply_batch(self.mix, images[0], labels, torch.from_numpy(mixing), seed=seed, epoch=epoch,
                                    rank=rank, batch=batch)  # fmt: skip
        return (mixed, *images[1:]), labels

    def batches(self, batches: Iterator[tuple[int, Any]], plan: Any, device: torch.device, *, rank: int,
                spent: list[float] | None = None) -> Iterator[tuple[Any, ...]]:  # fmt: skip
        """``(b, raw, images, labels)`` for each ``(b, raw)`` a runner yields for ``plan``
        (``RawBatch``es) of ``rank``: the batch after :meth:`finish`. On a GPU each batch's stage is
        launched on a stream of its own one batch ahead (``_ahead``): it runs while the training
        loop's step of the batch before does. ``spent[0]``: the host's seconds in the stage,
        added to."""

        def tail(b: int, raw: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
            started = time.perf_counter()
            try:
                draws = raw.draws if raw.draws is not None else plan.drawn(b)  # (a spare's, in a batch of none good)
                return self.finish(raw.images, raw.labels, plan.batch(b)[1], seed=plan.seed, epoch=plan.epoch,
                                   rank=rank, batch=plan.batch_offset + b, draws=draws,
                                   skipped=[i for i, _ in raw.skipped])  # fmt: skip
            finally:
                if spent is not None:
                    spent[0] += time.perf_counter() - started

        if device.type != "cuda":
            return ((b, raw, *tail(b, raw)) for b, raw in batches)
        side: SideStream[Any] = SideStream(device)
        return ahead(batches, lambda item: (item, side.launch(lambda: tail(*item), (item[1].images, item[1].labels))),
                     lambda launched: (*launched[0], *side.finish(launched[1])), depth=1)  # fmt: skip


def stage_for(pipeline: Any, device: torch.device, choice: bool | None, *, channels_last: bool = False,
              pays: bool = False, sources: SourceOf | None = None) -> Stage | None:  # fmt: skip
    """The stage of ``pipeline`` delivered to ``device``: its views' tails and its batch
    transform; ``None`` where it has neither.

    A view's tail goes to the stage where it holds a per-sample draw and its input has a fixed
    size (the batch stacks); every backend stops a view where it is cut. No view has one with
    ``choice`` (``LoaderConfig.stage``) ``False``, or ``None`` on the CPU, where the torch
    workers run a tail about as fast sample by sample (0.94-1.14x batched: 2 cores,
    ``bench/results/2026-11-29-stage-cpu.md``), unless the backend measured the stage faster for
    the pipeline there (``pays``: ``Backend.stage_default``, DALI's policies 1.14-1.47x); nor with
    no image. A ``gp.Mix``'s ``per_source`` lists (``sources``: the index's, ``MixIndex.sources``) are staged
    together where each has a tail the stage runs and every one of them starts on the same image
    (shape, dtype): a list without a random step hands over its ``ToDtype`` and ``Normalize``
    then (:func:`_per_source_starts`). Masks and boxes that follow the image stay
    with the backend, which moves them through the view up to its tail: nothing in a tail moves
    them (its steps are photometric; the policies, whose operations are partly geometric, refuse
    masks and boxes, as torchvision's do)."""
    on = choice if choice is not None else device.type == "cuda" or pays
    starts: list[int | None] = [None] * len(pipeline.views)
    if on and pipeline.per_source and sources is not None:
        starts = _per_source_starts(pipeline)
    elif on and pipeline.has_image and not pipeline.per_source:
        for view, (steps, specs) in enumerate(zip(pipeline.views, pipeline.view_specs, strict=True)):
            start = stage_start(steps, specs)
            starts[view] = start if start is not None and specs[start].fixed_size else None
    if all(s is None for s in starts) and pipeline.batch_transform is None:
        return None
    staged = pipeline.per_source and any(s is not None for s in starts)
    return Stage(tuple(pipeline.views), tuple(starts), channels_last, pipeline.batch_transform,
                 sources if staged else None)  # fmt: skip


def candidate_tails(pipeline: Any) -> list[tuple[Transform, ...]]:
    """Each view's tail that the stage would take with it on (:func:`stage_start`; empty where
    none): what ``Backend.stage_default`` is asked about, not the whole view (a ``ColorJitter``
    before the crop, which the backend's graph runs, says nothing of the stage's speed)."""
    tails: list[tuple[Transform, ...]] = []
    for steps, specs in zip(pipeline.views, pipeline.view_specs, strict=True):
        start = stage_start(steps, specs)
        tails.append(() if start is None else tuple(steps[start:]))
    return tails


def _per_source_starts(pipeline: Any) -> list[int | None]:
    """The tails of a ``gp.Mix``'s ``per_source`` lists, staged together: each list's from
    :func:`stage_start`, or where it has no random step its longest the stage runs
    (:func:`tail_start`), if every list's starts on images of one fixed shape and dtype (the
    backend batches them); else none."""
    none: list[int | None] = [None] * len(pipeline.views)
    pairs = list(zip(pipeline.views, pipeline.view_specs, strict=True))
    random = [stage_start(steps, specs) for steps, specs in pairs]
    if all(s is None for s in random):
        return none
    starts = [s if s is not None else tail_start(steps, specs) for s, (steps, specs) in zip(random, pairs, strict=True)]
    given = [specs[s] for s, (_, specs) in zip(starts, pairs, strict=True)]
    if not all(spec.fixed_size for spec in given) or len({str(spec) for spec in given}) > 1:
        return none
    return list(starts)


def require_staged(pipeline: Any, stage: Stage | None, backend: Any, choice: bool | None) -> None:
    """Raises UnsupportedTransformError where ``backend`` runs a type in the stage only
    (``Backend.stage_only``: DALI's policies) and ``pipeline`` has a step of it (a composite's
    member included) that the stage does not take (``stage``: the loader's, ``choice``:
    ``LoaderConfig.stage``), saying why and what to change: before anything is built or read."""
    if not backend.stage_only:
        return
    cut = stage.cut() if stage is not None and stage.tails else pipeline.views
    for view, (steps, specs) in enumerate(zip(cut, pipeline.view_specs, strict=True)):
        for i, t in enumerate(steps):
            if not any(isinstance(step, backend.stage_only) for step in _walk((t,))):
                continue
            kind = "per_source list" if pipeline.per_source else "view"
            where = f"pipeline step {i}" + (f" of {kind} {view}" if len(cut) > 1 else "")
            full = pipeline.views[view]
            after = [j for j in range(i + 1, len(full)) if not takes(full[j], specs[j])]
            if choice is False:
                why = "stage=False keeps it out: leave stage at None (the default) or True"
            elif pipeline.per_source and (stage is None or not stage.tails):
                why = ("a gp.Mix's per_source lists are staged together only where each has a tail the stage "
                       "runs, all starting on images of one shape and dtype")  # fmt: skip
            elif not takes(t, specs[i]):
                why = f"the stage does not run it so: {_refused(t, specs[i])}"
            elif after:
                why = (f"step {after[-1]} after it ({type(full[after[-1]]).__name__}) is not one the stage runs, and "
                       "the stage runs a view's last steps: put it after that step")  # fmt: skip
            else:  # (a tail keeps its input's size: one that varies has a step fixing it after it)
                why = "no tail of this view holds it"
            raise UnsupportedTransformError(
                f"the {backend.name} backend runs {type(t).__name__} ({where}) in the stage only, as a view's "
                f"last steps on images of one size, and here the stage does not take it: {why}. backend='torch' "
                "runs it sample by sample anywhere"
            )


def _refused(t: Transform, spec: ImageSpec) -> str:
    """What of ``t`` the stage does not run on ``spec``, in a few words: the first member of a
    composite it refuses (by type), or its options."""
    for member in getattr(t, "transforms", ()):
        if not takes(member, spec):
            inner = _refused(member, spec)
            return f"{type(member).__name__} inside {type(t).__name__}" + (
                f" ({inner})" if getattr(member, "transforms", None) else " is not one the stage runs"
            )
    try:
        entry = STAGE._entry(t, None)
    except UnsupportedTransformError:
        return f"{type(t).__name__} is not one it runs"
    reason = entry.unsupported(t) if entry.unsupported else None
    return reason or f"{type(t).__name__} on {spec}"


def staged_refusal(pipeline: Any, device: torch.device, backend: Any,
                   choice: bool | None) -> UnsupportedTransformError | None:  # fmt: skip
    """:func:`require_staged`'s refusal of ``pipeline`` on ``backend``, before the loader has an
    index (``backend="auto"``'s choice, which then passes the backend by); ``None``: none."""
    if not backend.stage_only:
        return None
    pays = backend.stage_default(device.type, candidate_tails(pipeline)) is not None
    sources = SourceOf(np.zeros(1, np.int64), np.zeros(0, np.int64)) if pipeline.per_source else None  # (starts only)
    try:
        require_staged(pipeline, stage_for(pipeline, device, choice, pays=pays, sources=sources), backend, choice)
    except UnsupportedTransformError as e:
        return e
    return None
