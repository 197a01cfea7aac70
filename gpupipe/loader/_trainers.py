"""What trainers read on a data loader besides iterating it, for a :class:`~gpupipe.Loader`.

Lightning and Accelerate were written for ``torch.utils.data.DataLoader``: they advance the epoch
through ``loader.sampler.set_epoch(epoch)`` (Lightning calls it on ``sampler`` and on
``batch_sampler.sampler`` before each training and validation epoch), size things by
``len(loader.dataset)`` and ``len(loader.sampler)``, and read ``batch_size``, ``num_workers`` and
``drop_last``. A gpupipe loader plans each epoch itself, so its ``sampler`` is not iterated: it is
the handle through which a trainer sets the epoch, and says how many samples this rank yields.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from ..core._config import DEFAULT_PREFETCH

if TYPE_CHECKING:
    from ..core._config import LoaderConfig
    from ..pipeline._pipeline import Pipeline
    from ..plan._plan import PlanSpec, RankPlan

__all__ = ["Trained", "LoaderAttributes", "EpochSampler", "DatasetView", "accelerate_gradient_state"]


def accelerate_gradient_state() -> Any:
    """Accelerate's ``GradientState`` where an ``Accelerator`` was made in this process, else ``None``
    (accelerate is not imported here). Its gradient accumulation steps the optimizer at the last
    batch of a loader's epoch (``sync_with_dataloader``), which it learns from the loader being
    iterated: a gp.Loader registers each iteration with it as accelerate's own DataLoaders do
    (``end_of_dataloader`` true on the epoch's last batch; ``remainder`` -1: ``gather_for_metrics``
    drops nothing, padding is ``batch.valid``'s)."""
    state = sys.modules.get("accelerate.state")
    gradient_state = getattr(state, "GradientState", None)
    if gradient_state is None or not getattr(gradient_state, "_shared_state", None):
        return None
    try:
        found = gradient_state()
    except Exception:  # another accelerate than the one written for: no registration, as before
        return None
    return found if hasattr(found, "_add_dataloader") and hasattr(found, "_remove_dataloader") else None


class Trained(Protocol):
    """What the sampler and dataset views read on their loader (a :class:`~gpupipe.Loader`)."""

    pipeline: Pipeline

    @property
    def epoch(self) -> int: ...

    @property
    def num_samples(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def plan(self, epoch: int | None = None) -> RankPlan: ...


class _Bound:
    def __init__(self, loader: Trained) -> None:
        self._loader = weakref.ref(loader)  # no cycle: a dropped loader is collected (and closed) at once

    @property
    def loader(self) -> Trained:
        loader = self._loader()
        if loader is None:
            raise ReferenceError("the gp.Loader of this object was collected")
        return loader


class EpochSampler(_Bound):
    """``loader.sampler``: :meth:`set_epoch` sets the loader's epoch (what Lightning and
    Accelerate call each epoch, as on a ``DistributedSampler``); ``len()`` is the samples this
    rank yields per epoch, padding included (``DistributedSampler``'s length). Not iterable: the
    loader plans its epochs itself."""

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        loader = self.loader
        return len(loader.plan(loader.epoch).samples)

    def __iter__(self) -> Any:
        raise TypeError("a gp.Loader's sampler is not iterated: the loader plans each epoch itself (set_epoch)")

    def __repr__(self) -> str:
        return f"<gpupipe sampler of {self.loader!r}>"


class DatasetView(_Bound):
    """``loader.dataset``: ``len()`` is the samples of an epoch over all ranks (the source's, less
    those known to be bad), as ``len(DataLoader.dataset)``; ``source`` and ``pipeline`` are the
    loader's. Samples are not indexed: a gpupipe source is read by the loader's backend."""

    def __len__(self) -> int:
        return self.loader.num_samples

    @property
    def source(self) -> Any:
        return self.loader.pipeline.source

    @property
    def pipeline(self) -> Any:
        return self.loader.pipeline

    def __repr__(self) -> str:
        return f"<gpupipe dataset of {len(self)} samples: {self.source!r}>"


class LoaderAttributes(Trained):
    """The attributes a :class:`~gpupipe.Loader` shows with a DataLoader's names and more, read-only
    (the loader's :class:`~gpupipe.LoaderConfig` is the one source): what trainers read. The
    loader supplies the rest of :class:`Trained` (``epoch``, ``pipeline``, ``set_epoch``, ``plan``)."""

    config: LoaderConfig
    plan_spec: PlanSpec
    _run_config: LoaderConfig
    end_of_dataloader: bool = False  # what accelerate's GradientState reads (accelerate_gradient_state)
    remainder: int = -1

    @property
    def num_samples(self) -> int:
        """Samples per epoch over all ranks: the index's, less those known to be bad."""
        return self.plan_spec.num_samples

    @property
    def sampler(self) -> EpochSampler:
        """What trainers call ``set_epoch`` on each epoch (Lightning, Accelerate), and whose
        ``len()`` is this rank's samples per epoch, padding included (``gpupipe.loader._trainers``)."""
        return EpochSampler(self)

    @property
    def batch_sampler(self) -> None:
        """``None``, as a DataLoader given a ``sampler``: trainers then look at :attr:`sampler`."""
        return None

    @property
    def dataset(self) -> DatasetView:
        """``len(loader.dataset)``: the samples of an epoch over all ranks, as a DataLoader's."""
        return DatasetView(self)

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def shuffle(self) -> bool:
        return self.config.shuffle

    @property
    def drop_last(self) -> bool:
        return self.config.drop_last

    @property
    def prefetch(self) -> int:
        """Batches prepared ahead: the option, else ``gpupipe tune``'s value, else 2."""
        return self._run_config.prefetch or DEFAULT_PREFETCH

    @property
    def shuffle_buffer(self) -> int:
        return self.config.shuffle_buffer

    @property
    def interleave(self) -> int:
        return self.config.interleave

    @property
    def channels_last(self) -> bool:
        return self.config.channels_last
