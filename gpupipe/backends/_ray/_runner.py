"""The Ray backend's runner: each batch of the rank's epoch plan is one Ray task, which decodes,
transforms and collates its samples with the torch backend's code (``_Samples``, ``_Collate``) and
returns the batch as NumPy arrays in Ray's object store; the rank maps them as tensors (no copy on
the CPU; one copy to a GPU).

Tasks, not actors: a task whose worker or node dies is run again elsewhere by Ray itself
(``max_retries``), with nothing to restart or re-place, and Ray spreads tasks over whatever CPUs the
cluster has. What an actor would keep — the index, the transforms — is put in the object store once
per runner and kept by each worker process the first time one of its tasks needs it (a few cached
jobs per process), so a task carries only its batch's sample numbers.
"""

from __future__ import annotations

import collections
import logging
import uuid
import warnings
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import torch

from ..._errors import ClosedError, WorkerError
from ..._plan import RankPlan
from ...sources import Index
from ...transforms import ImageSpec, Transform
from .._base import RawBatch, Runs, RunSpec
from .._torch._runner import _Collate, _Failure, _Samples, batch_items
from . import _cluster

__all__ = ["RayRunner", "Job", "run_batch"]

log = logging.getLogger("gpupipe")

CACHED_JOBS = 4  # jobs (indexes and transforms) a worker process keeps
TASK_PINS = 2  # remote shards a worker process keeps pinned in the node's cache


class Job:
    """What every task of one runner needs: the index, the transforms and how to collate."""

    def __init__(self, spec: RunSpec) -> None:
        self.index: Index = spec.index
        self.views: tuple[tuple[Transform, ...], ...] = spec.views
        self.max_pixels, self.exif = spec.config.max_image_pixels, spec.config.apply_exif_orientation
        self.per_source, self.skip = spec.per_source, spec.skip
        self.outputs: tuple[ImageSpec, ...] | None = spec.outputs
        self.channels_last = spec.config.channels_last

    def make(self) -> tuple[_Samples, _Collate]:
        """The torch backend's pieces, in a worker process. A remote storage there pins only the
        shards of the batch at hand (``TASK_PINS``): a node's many worker processes would
        otherwise keep the whole node cache pinned, beyond its bound."""
        storage = getattr(self.index.reader, "storage", None)
        if storage is not None and storage.remote:
            storage.keep = TASK_PINS
        samples = _Samples(self.index, self.views, max_pixels=self.max_pixels, exif=self.exif,
                           per_source=self.per_source)  # fmt: skip
        return samples, _Collate(self.skip, self.outputs, self.index.labeled, self.channels_last)


_jobs: collections.OrderedDict[str, tuple[_Samples, _Collate]] = collections.OrderedDict()


def run_batch(token: str, job: list[Any], items: list[tuple[int, int, int, int]]) -> Any:
    """One batch, in a Ray worker: ``(images, labels, keys, failed)`` — images as NumPy arrays
    (``[B, C, H, W]``, or ``[B, H, W, C]`` for channels_last), labels int64 ``[B]`` or None — or
    the ``_Failure`` of a sample that cannot be used (``on_error="raise"``). ``job`` holds the
    runner's :class:`Job` reference, in a list so that Ray does not fetch it for every task."""
    made = _jobs.get(token)
    if made is None:
        import ray

        made = _jobs[token] = ray.get(job[0]).make()
        while len(_jobs) > CACHED_JOBS:
            _jobs.popitem(last=False)
    _jobs.move_to_end(token)
    samples, collate = made
    batch = collate(samples.__getitems__(items))
    if isinstance(batch, _Failure):
        return batch
    images = tuple(
        (view.permute(0, 2, 3, 1) if collate.channels_last and view.dim() == 4 else view).numpy() for view in batch[0]
    )
    labels = None if batch.labels is None else batch.labels.numpy()
    return images, labels, batch.keys, batch.skipped


class RayRunner:
    """Runs ``spec``'s batches as Ray tasks, at most ``in_flight`` at a time per rank."""

    def __init__(self, spec: RunSpec) -> None:
        import ray

        self.options = spec.config.ray
        self.device, self.channels_last = spec.device, spec.config.channels_last
        _cluster.attach(self.options)
        self._attached = True
        try:
            self.in_flight = self.options.in_flight or max(2, 2 * spec.workers)
            self._job = [ray.put(Job(spec))]
            self._token = uuid.uuid4().hex
            self._task = ray.remote(run_batch).options(
                num_cpus=self.options.num_cpus, max_retries=self.options.max_retries, retry_exceptions=False
            )
        except BaseException:
            self.close()
            raise
        self._runs = Runs()
        self._closed = False

    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        if self._closed:
            raise ClosedError("the ray runner is closed")
        return self._runs.track(self._run(plan, start))

    def _run(self, plan: RankPlan, start: int) -> Generator[RawBatch, None, None]:
        pending: collections.deque[tuple[int, Any]] = collections.deque()
        submitted = start
        try:
            for b in range(start, plan.num_batches):
                while submitted < plan.num_batches and len(pending) < self.in_flight:
                    pending.append((submitted, self._task.remote(self._token, self._job, batch_items(plan, submitted))))
                    submitted += 1
                _, ref = pending.popleft()
                result = self._get(ref, plan, b)
                if self._closed:  # closed from another thread while this epoch runs
                    raise ClosedError("the ray runner was closed during an epoch")
                if isinstance(result, _Failure):
                    raise result.error()
                images, labels, keys, failed = result
                views = tuple(self._tensor(a) for a in images)
                label_tensor = None if labels is None else self._tensor(labels)
                yield RawBatch(views, label_tensor, list(keys), tuple((i, f.error()) for i, f in failed))
        finally:
            import ray

            if pending and ray.is_initialized():  # (at exit Ray may be shut down first: a call would start one)
                for _, ref in pending:
                    ray.cancel(ref)

    def _get(self, ref: Any, plan: RankPlan, batch: int) -> Any:
        import ray
        from ray import exceptions as rex

        try:
            return ray.get(ref, timeout=self.options.timeout)
        except rex.GetTimeoutError:
            raise WorkerError(
                f"ray backend: no batch in {self.options.timeout} s (epoch {plan.epoch}, batch {batch}): the cluster "
                f"has no free CPUs for its tasks (each reserves num_cpus={self.options.num_cpus}; cluster: "
                f"{ray.cluster_resources().get('CPU', 0)} CPUs), or lost the node that ran them"
            ) from None
        except rex.RayTaskError as e:  # the task raised: its own error
            cause = e.as_instanceof_cause() if hasattr(e, "as_instanceof_cause") else e
            raise cause from None
        except (rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError, rex.RayError) as e:
            keys = [str(s) for s in plan.batch(batch)[0].tolist()]
            raise WorkerError(
                f"ray backend: the task of epoch {plan.epoch}, batch {batch} failed {self.options.max_retries + 1} "
                f"times ({type(e).__name__}): its worker or node died each time; samples {', '.join(keys[:8])}"
                f"{' ...' if len(keys) > 8 else ''}"
            ) from e

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A tensor over ``array`` (read-only memory of the object store: no copy on the CPU; one
        copy to a GPU). channels_last images come as ``[B, H, W, C]`` and are viewed as NCHW."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            out = torch.from_numpy(array)
        if out.dim() == 4 and self.channels_last:
            out = out.permute(0, 3, 1, 2)
        return out if self.device.type == "cpu" else out.to(self.device)

    def describe(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight, "task_cpus": self.options.num_cpus}

    def close(self) -> None:
        """Stops a running epoch (its tasks in flight are cancelled), drops the job from the object
        store and detaches from Ray (a local Ray gpupipe started ends with its last loader)."""
        self._closed = True
        runs = getattr(self, "_runs", None)
        if runs is not None:
            runs.close()
        self._job = []
        if getattr(self, "_attached", False):
            self._attached = False
            _cluster.detach()
