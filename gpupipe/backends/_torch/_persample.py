"""The per-sample CPU pieces the torch and ray backends share: a map-style dataset that reads,
decodes and transforms one sample with torchvision's kernels (:class:`Samples`), the collate that
stacks a batch (:class:`Collate`), a sample's error carried as data (:class:`Failure`), and the
sandbox probe that finds the sample that killed a process (:func:`culprits`). The torch backend
runs them in DataLoader workers, the ray backend in Ray tasks: a file gets the same verdict on
both."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ...core._errors import Damage, DataError, GpupipeError, SampleError
from ...core._fields import Field
from ...core._geometry import TooSmall
from ...core._random import factors
from ...plan._plan import RankPlan
from ...runtime._children import CRASHED
from ...runtime._decode import decode_rgb
from ...sources import Index
from ...storage._counts import snapshot
from ...transforms import ImageSpec, Transform
from .._base import READ_BYTES, STAGE_CLOCKS, RawBatch, donor, fill
from .._fields import batch_fields, empty_values, field_values
from .._slots import Arena, Slots
from .._stage import Stage
from ._kernels import apply_params, apply_pipeline, sample_factors
from ._targets import has_targets, move_targets

__all__ = ["Item", "Sample", "Failure", "Samples", "Collate", "BatchItems", "batch_items", "culprits"]

Item = tuple[int, int, int, int]  # (sample, the number its augmentation is drawn from, seed, epoch)


class BatchItems(list):
    """A batch's items (or, once fetched, its samples), with what the stage run where the batch
    is collated needs: the batch's number in its epoch, its seed, epoch and rank, which positions
    are padding (``valid``) and each position's draw number (``draws``)."""

    def __init__(self, items: Sequence[Any], *, number: int, seed: int, epoch: int, rank: int,
                 valid: Sequence[bool], draws: Sequence[int]) -> None:  # fmt: skip
        super().__init__(items)
        self.number, self.seed, self.epoch, self.rank = number, seed, epoch, rank
        self.valid, self.draws = list(valid), list(draws)
        self.times: dict[str, float] | None = None  # once fetched: seconds per stage (Samples' clocks)

    def like(self, items: Sequence[Any]) -> BatchItems:
        """``items`` with this batch's context."""
        return BatchItems(items, number=self.number, seed=self.seed, epoch=self.epoch, rank=self.rank,
                          valid=self.valid, draws=self.draws)  # fmt: skip

    def __reduce__(self) -> Any:
        return (_batch_items, (list(self), self.number, self.seed, self.epoch, self.rank, self.valid, self.draws))


def _batch_items(items: list[Any], number: int, seed: int, epoch: int, rank: int, valid: list[bool],
                 draws: list[int]) -> BatchItems:  # fmt: skip
    return BatchItems(items, number=number, seed=seed, epoch=epoch, rank=rank, valid=valid, draws=draws)


# (one image per view, label, key, the other fields' values by name or None)
Sample = tuple[tuple[torch.Tensor, ...], "int | None", str, "dict[str, Any] | None"]


@dataclasses.dataclass(frozen=True)
class Failure:
    """A sample's DataError carried out of a worker process as data, so that the main process
    raises it as it was, ``.shard`` and ``.key`` included (DataLoader's re-raise of a worker's
    exception keeps only a message), and the same with or without workers."""

    kind: type[DataError]
    message: str
    shard: str | None
    key: str | None
    damage: Damage | None = None

    def error(self) -> DataError:
        return self.kind(self.message, shard=self.shard, key=self.key, kind=self.damage)


def batch_items(plan: RankPlan, b: int, rank: int = 0) -> BatchItems:
    """What the workers get of batch ``b`` of ``plan`` (of ``rank``): each sample's number, draw
    number, seed and epoch, with the batch's context (:class:`BatchItems`)."""
    (samples, valid), draws = plan.batch(b), plan.drawn(b).tolist()
    items = [(s, d, plan.seed, plan.epoch) for s, d in zip(samples.tolist(), draws, strict=True)]
    return BatchItems(items, number=plan.batch_offset + b, seed=plan.seed, epoch=plan.epoch, rank=rank,
                      valid=valid.tolist(), draws=draws)  # fmt: skip


class Samples(Dataset["Sample | Failure"]):
    def __init__(
        self,
        index: Index,
        views: Sequence[Sequence[Transform]],
        *,
        max_pixels: int | None,
        exif: bool,
        per_source: bool = False,
    ) -> None:
        self.index, self.views, self.per_source = index, tuple(tuple(v) for v in views), per_source
        self.max_pixels, self.exif = max_pixels, exif
        self.poisoned: dict[int, Failure] = {}  # samples that killed a worker: refused from then on
        self.clocks = _clocks()  # seconds per stage (and bytes read), of the samples since reset

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item: Item) -> Sample | Failure:
        sample, draw, seed, epoch = item
        drawn = [sample_factors(steps, seed, epoch, draw, view) for view, steps in enumerate(self.views)]
        return self._guarded(sample, drawn)

    def __getitems__(self, items: list[Item]) -> list[Sample | Failure]:
        """A batch's samples (DataLoader's batched fetch): the random factors of the whole batch
        drawn at once, vectorized (``gpupipe.core._random``), then each sample decoded and transformed."""
        started = time.perf_counter()
        self.clocks = _clocks()
        reads = snapshot()  # this thread's reads of remote shards so far
        draws = np.array([item[1] for item in items], dtype=np.int64)
        seed, epoch = items[0][2], items[0][3]
        drawn = [factors(steps, seed, epoch, draws, view) for view, steps in enumerate(self.views)]
        self.clocks["transform"] += time.perf_counter() - started  # the draws: the transforms' parameters
        out = [
            self._guarded(item[0], [[None if f is None else f[i] for f in view] for view in drawn])
            for i, item in enumerate(items)
        ]
        if not isinstance(items, BatchItems):
            return out
        batch = items.like(out)
        batch.times = {**self.clocks, **snapshot().since(reads)}  # (the node cache's hits and misses)
        return batch

    def probe(self, item: Item) -> bool:
        """Whether ``item`` comes out (a sample) or is refused (in a sandbox child: whether it kills
        its process is what matters)."""
        return not isinstance(self[item], Failure)

    def _guarded(self, sample: int, drawn: list[list[np.ndarray | None]]) -> Sample | Failure:
        poisoned = self.poisoned.get(sample)
        if poisoned is not None:
            return poisoned
        try:
            return self._sample(sample, drawn)
        except DataError as e:
            return Failure(type(e), str(e), e.shard, e.key, e.kind)
        except Exception as e:
            if _sendable(type(e)):
                raise
            # a type the queue cannot pickle (a class made in a function, say): dropped on the way,
            # the loop would wait worker_timeout and call the workers stuck
            raise GpupipeError(f"{type(e).__qualname__}: {e} (raised in a torch-backend worker; its type cannot be "
                               "sent to the training process)") from None  # fmt: skip

    def _sample(self, sample: int, drawn: list[list[np.ndarray | None]]) -> Sample:
        """``drawn[view][step]``: this sample's factors of each step of each view."""
        clocks, started = self.clocks, time.perf_counter()
        raw = self.index.read(sample)
        read = time.perf_counter()
        clocks["read"] += read - started
        clocks[READ_BYTES] += 0 if raw.data is None else len(raw.data)
        values = field_values(self.index.fields, raw.fields, shard=raw.shard, key=raw.key)
        if not self.index.images:  # a source of fields alone
            return (), raw.label, raw.key, values
        try:
            image = decode_rgb(
                raw.data, shard=raw.shard, key=raw.key, max_pixels=self.max_pixels, apply_exif_orientation=self.exif
            )
        finally:
            decoded = time.perf_counter()
            clocks["decode"] += decoded - read
        try:
            return self._transformed(sample, image, raw, values, drawn)
        finally:
            clocks["transform"] += time.perf_counter() - decoded

    def _transformed(self, sample: int, image: torch.Tensor, raw: Any, values: dict[str, Any] | None,
                     drawn: list[list[np.ndarray | None]]) -> Sample:  # fmt: skip
        """The decoded ``image`` of sample number ``sample`` (read as ``raw``) through each view's
        steps."""
        try:  # each view from the same decoded image, with its own draws
            if has_targets(self.index.fields):  # one view (the pipeline checked): they follow the image
                assert values is not None
                size = (int(image.shape[-2]), int(image.shape[-1]))
                params = move_targets(self.index.fields, values, self.views[0], drawn[0], size, shard=raw.shard,
                                      key=raw.key)  # fmt: skip
                steps = self.views[0]  # (with the targets' parameters: a step's may depend on the boxes)
                out = apply_pipeline(steps, image, drawn[0]) if params is None else apply_params(steps, image, params)
                outputs: tuple[torch.Tensor, ...] = (out,)
            elif self.per_source:  # one output: the sample's source's list (a gp.Mix's per_source)
                source = int(self.index.source_of(np.array([sample]))[0])  # type: ignore[attr-defined]
                outputs = (apply_pipeline(self.views[source], image, drawn[source]),)
            else:
                outputs = tuple(apply_pipeline(steps, image, drawn[view]) for view, steps in enumerate(self.views))
        except TooSmall as e:  # RandomCrop larger than this image; a Resize to nothing
            size = (int(image.shape[-2]), int(image.shape[-1]))
            raise SampleError.at(str(e), shard=raw.shard, key=raw.key, size=size) from e
        return outputs, raw.label, raw.key, values


def _clocks() -> dict[str, float]:
    return {**dict.fromkeys(STAGE_CLOCKS, 0.0), READ_BYTES: 0.0}


def culprits(samples: Samples, items: list[Item], timeout: float | None) -> list[str]:
    """Each of ``items`` run again, alone, in a sandbox child (``gpupipe.runtime._sandbox``), after a
    process running them died: those that crash it (or hang past ``timeout``, at most 60 s) are
    refused from now on (``samples.poisoned``), as undecodable, naming the signal. Returns their
    keys. The torch backend's workers and the ray backend's tasks share it, so a file gets the
    same verdict on both."""
    from ...runtime._decode import imported_for_fork
    from ...runtime._sandbox import guarded_map

    imported_for_fork()  # before the fork: a plugin import another thread is inside would never end in the child
    found = []
    limit = min(timeout or 60.0, 60.0)  # a sample that takes longer alone is hung
    for (sample, *_), outcome in zip(items, guarded_map(samples.probe, items, timeout=limit), strict=True):
        if outcome.ok or (outcome.crashed is not None and outcome.crashed not in CRASHED):
            continue
        raw = samples.index.read(sample)  # readable: the reading happened before the crash
        message = f"the image of sample {raw.key!r} in shard {raw.shard!r} cannot be decoded: {outcome.reason()}"
        samples.poisoned[sample] = Failure(SampleError, message, raw.shard, raw.key, Damage.UNDECODABLE)
        found.append(raw.key)
    return found


class Collate:
    """Stacks a batch's samples, view by view, then runs the loader's ``stage`` on it, if it is
    given one (``RunSpec.stage``). A sample that failed raises (its ``Failure`` is the batch), or,
    with ``skip``, is replaced by a copy of the first good sample of the batch (zeros of the
    outputs' shapes, label 0, if none is good) and listed by position."""

    def __init__(self, skip: bool, outputs: tuple[ImageSpec, ...] | None, labeled: bool,
                 channels_last: bool = False, stage: Stage | None = None,
                 fields: Mapping[str, Field] | None = None, slots: Slots | None = None) -> None:  # fmt: skip
        self.skip, self.outputs, self.labeled, self.channels_last = skip, outputs, labeled, channels_last
        self.fields = dict(fields or {})  # the source's fields beyond image and label (Index.fields)
        self.stage = stage  # run here, on each batch of BatchItems collated
        self.slots = slots  # the workers' reusable batch buffers (``_slots``); None: fresh memory

    def __call__(self, items: list[Sample | Failure]) -> RawBatch | Failure:
        started = time.perf_counter()
        made, staged = self._collate(items)
        fetched = getattr(items, "times", None)
        if isinstance(made, Failure) or fetched is None:
            return made
        # the stage's seconds are the batch's transforms' (run batched), the rest stacking it
        stacked = time.perf_counter() - started - staged
        return made._replace(times={**fetched, "transform": fetched["transform"] + staged, "collate": stacked})

    def _collate(self, items: list[Sample | Failure]) -> tuple[RawBatch | Failure, float]:
        """The batch, and the seconds its stage took (0 without one)."""
        failed = [(i, item) for i, item in enumerate(items) if isinstance(item, Failure)]
        if failed and not self.skip:
            return failed[0][1], 0.0
        samples: list = list(items)
        if failed:
            good = donor(len(items), dict(failed))
            fill(dict(failed), (samples,), (self._blank(failed[0][1]) if good is None else items[good],))
        worker = get_worker_info()
        arena = None if worker is None else self.slots.arena(worker.id) if self.slots is not None else Arena.fresh()
        images = tuple(self._stack(view, arena) for view in zip(*(s[0] for s in samples), strict=True))
        labels = None if samples[0][1] is None else torch.tensor([s[1] for s in samples], dtype=torch.int64)
        keys = [s[2] for s in samples]
        alloc = arena.empty if arena is not None else None
        fields = batch_fields(self.fields, [s[3] for s in samples], alloc=alloc) if self.fields else None
        slot = arena.ticket() if arena is not None else None
        staged = 0.0
        if self.stage is not None:
            if not isinstance(items, BatchItems):  # the runner's batch sampler makes each batch one
                raise TypeError(f"Collate: the stage needs a batch's BatchItems, got {type(items).__name__}")
            started = time.perf_counter()
            images, labels = self.stage.finish(images, labels, np.array(items.valid, dtype=bool), seed=items.seed,
                                               epoch=items.epoch, rank=items.rank, batch=items.number,
                                               draws=np.array(items.draws, dtype=np.int64),
                                               skipped=[i for i, _ in failed])  # fmt: skip
            staged = time.perf_counter() - started
        return RawBatch(images, labels, keys, tuple(failed), fields=fields, slot=slot), staged  # type: ignore[arg-type]

    def _stack(self, view: Sequence[torch.Tensor], arena: Arena | None) -> torch.Tensor:
        """The view's images as one ``[B, C, H, W]`` tensor, in the memory format asked for. In a
        worker process (``arena``) it is written straight into shared memory, as DataLoader's own
        collate does, reused from batch to batch (``_slots``): the batch then crosses to the
        training process without another copy."""
        first = view[0]
        shape = (len(view), *first.shape)
        channels_last = self.channels_last and first.dim() == 3
        if arena is not None:
            out = arena.empty(shape, first.dtype, channels_last=channels_last)
        else:
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            out = torch.empty(shape, dtype=first.dtype, memory_format=fmt)
        for i, image in enumerate(view):
            out[i].copy_(image)
        return out

    def _blank(self, failure: Failure) -> Sample:
        if self.outputs is None or not all(spec.fixed_size for spec in self.outputs):
            raise failure.error()
        images = tuple(
            torch.zeros(spec.channels, spec.height, spec.width, dtype=spec.dtype)  # type: ignore[arg-type]
            for spec in self.outputs
        )
        size = (self.outputs[0].height, self.outputs[0].width)  # a mask follows the one view (Pipeline)
        values = empty_values(self.fields, size) if self.fields else None  # type: ignore[arg-type]
        return images, 0 if self.labeled else None, failure.key or "", values


def _sendable(kind: type) -> bool:
    """Whether an exception type can be pickled (by reference) to the training process."""
    import pickle

    try:
        pickle.dumps(kind)
    except Exception:
        return False
    return True
