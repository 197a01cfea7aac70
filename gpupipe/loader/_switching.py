"""What replaces a :class:`~gpupipe.Loader`'s runners between epochs: :meth:`Switching.set_pipeline`
(another pipeline over the same source from the next iteration: progressive resizing) and a
growing source's listing indexed again (:meth:`Switching._relist`, from ``set_epoch``). The loader
supplies its index, runners and the run spec each runner is built from."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .. import backends
from ..core._errors import ClosedError, ConfigError
from ..pipeline._pipeline import Pipeline, require_runnable
from ..plan._indexed import index_source

if TYPE_CHECKING:
    from ..core._config import LoaderConfig
    from ..plan._indexed import Indexed
    from ..plan._skips import Skips
    from ..runtime._dist import Topology
    from ._runners import Runners

__all__ = ["Switching"]

log = logging.getLogger("gpupipe")


class Switching:
    """Replacing the runners between iterations (a :class:`~gpupipe.Loader` supplies the state)."""

    config: LoaderConfig
    pipeline: Pipeline
    backend: str
    rank: int
    seed: int
    index: Any
    _indexed: Indexed
    _listing: Any
    _runners: Runners
    _next_pipeline: Pipeline | None
    _topo: Topology
    _device: Any
    _skips: Skips

    if TYPE_CHECKING:

        @property
        def epoch(self) -> int: ...

        @property
        def closed(self) -> bool: ...

        def _use(self, indexed: Indexed) -> None: ...

        def _run_spec(self, pipeline: Pipeline) -> backends.RunSpec: ...

    def _relist(self, listing: Any) -> None:
        """A growing source's ``listing`` differs from the indexed one: indexes it, and replaces
        the runners (theirs is the old index) and the index, closing the old ones."""
        if listing == self._listing:
            return
        indexed = index_source(self.pipeline.source, listing, self.config, self._topo, seed=self.seed,
                               device=self._device, skips=self._skips)  # fmt: skip
        old = self._indexed
        self._use(indexed)
        backend = backends.get(self.backend)
        current: backends.Runner | None = None
        try:
            current = backend.runner(self._run_spec(self.pipeline))
            pending = self._next_pipeline if self._runners.next is not None else None  # built, not yet run
            upcoming = backend.runner(self._run_spec(pending)) if pending is not None else None
        except BaseException:
            if current is not None:
                current.close()
            indexed.index.close()
            self._use(old)
            raise
        self._runners.replace(indexed.index, current, upcoming)
        log.info("gpupipe loader: rank %d, epoch %d: %d samples in %d shards (the source's shards listed again)",
                 self.rank, self.epoch, len(self.index), len(self.index.shards))  # fmt: skip

    def set_pipeline(self, pipeline: Pipeline) -> None:
        """Runs ``pipeline`` from the next iteration (the next epoch) on, over the same source: a
        new output size per epoch (progressive resizing, ``pipelines/lowres.py``), another
        augmentation strength. The loader keeps its index, plan, position, ``state_dict`` and
        skipped list; only the backend's runner is replaced.

        The new runner is built now, so that a pipeline the backend cannot run fails here (a DALI
        graph is built, ~0.1-1 s, and held beside the running one until the next iteration
        starts; the torch backend's new worker processes start with that iteration), and takes
        over when the next iteration starts, the old one being closed then. A pipeline with the
        same transform lists as the running one builds nothing. Until then, another
        ``set_pipeline`` replaces this one.

        To resume mid-epoch, set the pipeline of that epoch before iterating, as the schedule does:
        ``loader.set_pipeline(make(epoch)); loader.load_state_dict(state); loader.set_epoch(epoch)``.

        Raises:
            ConfigError: ``pipeline`` reads another source (build a new loader for that).
            PipelineError: an output's size varies.
            UnsupportedTransformError: a transform the loader's backend cannot run.
        """
        if not isinstance(pipeline, Pipeline):
            raise ConfigError(f"Loader.set_pipeline: pipeline must be a gp.Pipeline, got {type(pipeline).__name__}")
        if pipeline.source != self.pipeline.source:
            raise ConfigError(
                f"Loader.set_pipeline: the pipeline reads {pipeline.source!r}, not this loader's source "
                f"{self.pipeline.source!r}; a loader's index and plan belong to its source: build a new gp.Loader"
            )
        backend = backends.get(self.backend)
        require_runnable(pipeline, backend)
        if self.closed:
            raise ClosedError("this gp.Loader is closed")
        same = (pipeline.views, pipeline.has_views, pipeline.per_source, pipeline.batch_transform) == (
            self.pipeline.views, self.pipeline.has_views, self.pipeline.per_source,
            self.pipeline.batch_transform)  # (a runner may hold the stage: the torch workers')  # fmt: skip
        runner = None if same else backend.runner(self._run_spec(pipeline))  # fails here, if it fails
        self._runners.set_next(runner)  # (an earlier set_pipeline's, never run, is closed)
        self._next_pipeline = pipeline

    def _switch_pipeline(self) -> None:
        """Hands over to the runner :meth:`set_pipeline` built (between iterations: the previous
        one has ended) and closes the old one."""
        pipeline, self._next_pipeline = self._next_pipeline, None
        if pipeline is None:
            return
        if self._runners.take_next():
            log.info("gpupipe loader: rank %d runs a new pipeline from epoch %d: %s", self.rank, self.epoch, pipeline)
        self.pipeline = pipeline
        self.index.num_classes = pipeline.num_classes
