"""What every backend provides: a :class:`Backend` (availability, lowerings, a runner factory) and
its :class:`Runner` (runs epoch plans, then is closed)."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Container, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from ..core._config import DEFAULT_PREFETCH, LoaderConfig, OnError
from ..core._errors import DataError, UnsupportedTransformError
from ..plan._plan import RankPlan
from ..sources import Index
from ..transforms import ImageSpec, Transform
from ._registry import Registry

log = logging.getLogger("gpupipe")

__all__ = [
    "Backend",
    "Runner",
    "RunSpec",
    "RawBatch",
    "Runs",
    "to_device",
    "donor",
    "fill",
    "STAGE_CLOCKS",
    "WAIT_CLOCKS",
    "READ_BYTES",
]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. For a GPU, copied from pinned memory without blocking the
    host (from pageable memory CUDA copies synchronously, through a staging buffer); torch's
    caching host allocator keeps the pinned block until the copy has run."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


_COLLECTING = threading.local()


@contextlib.contextmanager
def collecting() -> Iterator[None]:
    """Runners closed in this block are closed by the garbage collector (a loader dropped without
    ``close()``). The collector runs in whatever thread allocates, even inside ``threading``'s own
    locks (a thread being started holds ``_shutdown_locks_lock`` on Python 3.11, and joining a
    thread takes it again): a runner closed here must not wait for its threads to end. They are
    told to end, and do, on their own."""
    before = getattr(_COLLECTING, "on", False)
    _COLLECTING.on = True
    try:
        yield
    finally:
        _COLLECTING.on = before


def in_collection() -> bool:
    """Whether this thread is closing runners for the garbage collector (:func:`collecting`)."""
    return bool(getattr(_COLLECTING, "on", False))


class RawBatch(NamedTuple):
    """What a runner yields per batch; the loader adds the validity mask. ``images`` holds one
    tensor per view of the pipeline (one for a single transform list).

    With ``on_error="skip"``, ``skipped`` lists the batch positions of the samples that could not
    be used, with their errors; each such position holds a copy of another sample (its image,
    label and key), which the loader marks invalid.

    A runner given the stage (``RunSpec.stage``) yields its batches after it: tails run, and
    ``labels`` soft targets ``[B, num_classes]`` where the pipeline has a batch transform.
    """

    images: tuple[torch.Tensor, ...]  # one [B, C, H, W] per view, on the loader's device (channels-last if asked)
    labels: torch.Tensor | None  # [B] int64 on the loader's device; None for unlabeled sources
    keys: list[str]
    skipped: tuple[tuple[int, DataError], ...] = ()
    fields: Mapping[str, Any] | None = None  # the source's other fields by name (Batch.fields); None: none
    slot: Any = None  # the torch backend's claim on the worker buffer the batch is in (``_slots.Ticket``)
    times: Mapping[str, float] | None = None  # seconds the batch took per stage where it was made (STAGE_CLOCKS)
    # the draw numbers the rows were made with, where the runner gave a left-out sample's row
    # another's (DALI's spare, for a batch with no good sample); None: the plan's
    draws: Any = None


# The stages a runner may time per batch (RawBatch.times), in the order a sample goes through them:
# reading its bytes (storage), decoding its image, its per-sample transforms, stacking the batch
# (seconds of the worker that made it: the torch backend's); or the training thread's waits for
# the reader threads' batch and for DALI's graph (the DALI backend's).
STAGE_CLOCKS = ("read", "decode", "transform", "collate")
WAIT_CLOCKS = ("wait_read", "wait_graph")
READ_BYTES = "read_bytes"  # RawBatch.times' other entry: the bytes of the batch's samples read from storage
# how full the runner's queue of batches made ahead ran: the batches ready in it when the loop asked
# for this one, and how many it holds at most (the torch workers' prefetch; DALI's reader threads')
QUEUE_READY, QUEUE_DEPTH = "queue_ready", "queue_depth"


def donor(size: int, bad: Container[int]) -> int | None:
    """Under ``on_error="skip"``, the position in a batch of ``size`` whose sample takes the
    places of the ``bad`` ones (its image, label and key, copied): the first good one; ``None``
    when every sample is bad (each backend then has its fallback). One rule for every backend."""
    return next((i for i in range(size) if i not in bad), None)


def fill(positions: Iterable[int], columns: Sequence[Any], values: Sequence[Any]) -> None:
    """``column[i] = value`` for each position ``i`` and each column (a list, NumPy array or
    tensor, changed in place; ``None`` columns are left out) with its value: the places of bad
    samples given the donor's. A tensor value that is a row of its own column must be cloned by
    the caller."""
    positions = list(positions)
    for column, value in zip(columns, values, strict=True):
        if column is not None:
            for i in positions:
                column[i] = value


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a runner is built from: the data, the transform lists (one per view), the
    loader's options, and what the loader resolved from them (device, workers, rank, seed)."""

    index: Index
    views: tuple[tuple[Transform, ...], ...]  # one transform list per output; one for most pipelines
    config: LoaderConfig  # batch_size, prefetch, memory_format, dali, ...
    device: torch.device
    workers: int  # worker processes (torch) or CPU threads (DALI)
    rank: int
    seed: int  # the loader's seed when built; each plan carries the seed it was drawn for
    outputs: tuple[ImageSpec, ...] | None = None  # each view's output image (fixed size); None: no pipeline
    per_source: bool = False  # views are a gp.Mix's per-source lists: one output, each sample its source's
    # the loader's stage (tails, MixUp/CutMix) where the backend runs it as it makes each batch
    # (Backend.batches_stage); None: the loader runs it on the delivered batch, if it has one
    stage: Any = None  # a backends._stage.Stage (a floor above: not imported here)

    @property
    def prefetch(self) -> int:
        """Batches prepared ahead (the loader resolved the option, ``gpupipe tune``'s value or 2)."""
        return self.config.prefetch or DEFAULT_PREFETCH

    @property
    def skip(self) -> bool:
        """Whether bad samples are skipped (``on_error="skip"``) rather than raised."""
        return self.config.on_error == OnError.SKIP


class Runner(Protocol):
    """Runs one backend's compiled pipeline over epoch plans."""

    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        """Yields batches ``start .. plan.num_batches - 1`` of ``plan``, exactly its samples in its
        order; augmentation is seeded from ``plan.seed`` and ``plan.epoch``. An iteration left
        unfinished is abandoned when its iterator is closed or dropped."""
        ...

    def close(self) -> None:
        """Ends every process, thread and pipeline the runner started; idempotent."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the runner chose, by name (worker processes or threads, a decode strategy, the
        graph's size, ...): shown in the loader's repr and log."""
        ...


class Runs:
    """A runner's unfinished ``run`` iterations, so that ``close()`` can stop them (each ends its
    epoch's threads in its ``finally``). Holds them weakly: a dropped iteration is closed by
    Python."""

    def __init__(self) -> None:
        self._runs: weakref.WeakSet[Generator[RawBatch, None, None]] = weakref.WeakSet()

    def track(self, run: Generator[RawBatch, None, None]) -> Generator[RawBatch, None, None]:
        self._runs.add(run)
        return run

    def close(self) -> bool:
        """Closes every run not executing right now; returns whether all are stopped. A run
        executing in another thread cannot be closed from here: the runner's loop checks its
        closed flag between batches and ends it there."""
        stopped = True
        for run in list(self._runs):
            try:
                run.close()
            except ValueError:  # executing, in another thread (or this one): it ends at its next batch
                stopped = False
            except Exception as e:  # a run's own cleanup failed: the runner still closes the rest
                log.warning("gpupipe: closing a run failed: %s: %s", type(e).__name__, e)
        return stopped


def _walk(steps: Any) -> Iterator[Any]:
    """The steps and, depth first, the members of composite ones (``RandomApply``, ``RandomChoice``)."""
    for step in steps:
        yield step
        members = getattr(step, "transforms", None)
        if isinstance(members, tuple):
            yield from _walk(members)


class Backend(abc.ABC):
    """One way of running pipelines. A backend module defines a subclass and an instance named
    ``BACKEND``; one entry in the table of :mod:`gpupipe.backends` makes it selectable.

    Attributes:
        name: what users pass as ``Loader(backend=...)``.
        devices: the device types it delivers batches to.
        requirement: what to install when it is not available.
        auto: whether ``backend="auto"`` may choose it (``False``: only when named).
        lowerings: transform type → lowering function, for this backend.
        slower: ``(device type, transform types, evidence)`` entries: where the backend runs
            those transforms (``None``: any pipeline) measurably slower than the next backend of
            the table, so that ``backend="auto"`` passes it over there for that backend (when it
            runs the pipeline).
        batches_stage: the device types where its runner runs the loader's stage (``RunSpec.stage``:
            the views' tails, the batch transform) where it makes each batch, off the training
            thread; elsewhere the loader runs it on each delivered batch.
    """

    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    auto: ClassVar[bool] = True  # whether backend="auto" may pick it
    requirement: ClassVar[str] = ""
    lowerings: ClassVar[Registry]
    slower: ClassVar[tuple[tuple[str, tuple[type, ...] | None, str], ...]] = ()
    reads_fields: ClassVar[bool] = False  # whether it reads a source's fields= (Batch.fields)
    imageless: ClassVar[bool] = False  # whether it runs a source of fields alone (no image per sample)
    reads_targets: ClassVar[bool] = False  # whether it moves Mask fields with the image (gp.fields.Mask)
    # the device types where its runner runs the stage as it makes each batch (RunSpec.stage)
    batches_stage: ClassVar[tuple[str, ...]] = ()
    # (device type, transform types, evidence): where the stage is on by default (LoaderConfig.stage
    # None) on a device that otherwise leaves it off, for a pipeline with one of the types
    stage_pays: ClassVar[tuple[tuple[str, tuple[type, ...], str], ...]] = ()
    # transform types it runs in the stage only (a view's tail the loader hands the stage): it has
    # no lowering of its own for them, and a pipeline where one is not staged is refused
    # (backends._stage.require_staged)
    stage_only: ClassVar[tuple[type, ...]] = ()

    def slower_step(self, device_type: str, views: Any) -> str | None:
        """Why the next backend suits ``views`` on ``device_type`` better (a step of an entry of
        :attr:`slower`, composite transforms' members included), in a few words; ``None``."""
        for dev, types, evidence in self.slower:
            if dev != device_type:
                continue
            if types is None:
                return f"{self.name} runs slower on the {dev} ({evidence})"
            for steps in views:
                for step in _walk(steps):
                    if isinstance(step, types):
                        return f"{self.name} runs {type(step).__name__} slower on the {dev} ({evidence})"
        return None

    def stage_default(self, device_type: str, views: Any) -> str | None:
        """Why the stage is on by default for ``views`` on ``device_type`` (an entry of
        :attr:`stage_pays`, composite transforms' members included); ``None``: the device's
        default."""
        for dev, types, evidence in self.stage_pays:
            if dev == device_type:
                for steps in views:
                    for step in _walk(steps):
                        if isinstance(step, types):
                            return f"{type(step).__name__} runs faster in the stage on the {dev} ({evidence})"
        return None

    def available(self) -> bool:
        """Whether the backend's libraries are installed (cheap; imports them at most once)."""
        return True

    def require_supported(self, transforms: Sequence[Transform]) -> None:
        """Raises UnsupportedTransformError, naming the step, if a transform (or one of its options)
        cannot run on this backend: before any data is read. A type it runs in the stage only
        (:attr:`stage_only`), or a composite holding one, passes here; the loader checks that
        the stage takes it."""
        only = self.stage_only
        self.lowerings.require_supported(transforms, skip=lambda t: any(isinstance(s, only) for s in _walk((t,))))

    def unread(self, fields: Sequence[str], *, images: bool = True, targets: Sequence[str] = ()) -> str | None:
        """What of a source this backend does not read, in a few words (``None``: it reads it
        all): ``fields`` beyond image and label, samples without ``images``, or ``targets`` (fields
        that follow the image's geometry)."""
        if not images and not self.imageless:
            return "does not read a source without images (fields= without an image field) yet"
        if fields and not self.reads_fields:
            return f"does not read a source's fields= yet ({', '.join(map(repr, fields))})"
        if targets and not self.reads_targets:
            return f"does not move masks and boxes with the image yet ({', '.join(map(repr, targets))})"
        return None

    def require_fields(self, fields: Sequence[str], *, images: bool = True, targets: Sequence[str] = ()) -> None:
        """Raises UnsupportedTransformError if the pipeline's source has ``fields`` (beyond image
        and label) and this backend does not read them, or has no images (``images`` false) and
        this backend needs one per sample (:meth:`unread`)."""
        unread = self.unread(fields, images=images, targets=targets)
        if unread is not None:
            raise UnsupportedTransformError(
                f"the {self.name} backend {unread}: backend='torch' does (backend='auto' picks it)"
            )

    @abc.abstractmethod
    def runner(self, spec: RunSpec) -> Runner:
        """A runner for ``spec`` (its transforms already checked)."""

    def __repr__(self) -> str:
        return f"<gpupipe backend {self.name!r}>"
