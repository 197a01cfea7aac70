"""A loader's runners, named: ``current`` runs its iterations; ``next``, built by
``Loader.set_pipeline``, takes over when the next iteration starts. With the index they read, they
are closed together: by ``Loader.close``, when the loader is collected, or at exit."""

from __future__ import annotations

import logging
from typing import Any

from ..backends import Runner
from ..sources import Index

__all__ = ["Runners", "end_run"]

log = logging.getLogger("gpupipe")


class Runners:
    """The running runner, the next one (or ``None``) and their index."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self.current: Runner | None = None
        self.next: Runner | None = None

    def set_next(self, runner: Runner | None) -> None:
        """``runner`` runs from the next iteration (``None``: the current one goes on); an earlier
        next one, never run, is closed."""
        if self.next is not None:
            self.next.close()
        self.next = runner

    def take_next(self) -> bool:
        """Between iterations: the next runner, if any, becomes the current one, and the old one
        is closed. Whether there was one."""
        if self.next is None:
            return False
        old, self.current, self.next = self.current, self.next, None
        if old is not None:
            old.close()
        return True

    def replace(self, index: Index, current: Runner, next: Runner | None) -> None:
        """Runners of another index (a growing source listed again): the old ones and the old
        index are closed."""
        old = (self.current, self.next)
        old_index, self.index, self.current, self.next = self.index, index, current, next
        for runner in old:
            if runner is not None:
                runner.close()
        old_index.close()

    def close(self) -> None:
        """Closes the runners, then the index. Idempotent."""
        runners, self.current, self.next = (self.current, self.next), None, None
        for runner in runners:
            if runner is not None:
                runner.close()
        self.index.close()


def end_run(generator: Any) -> None:
    """Ends a run's generator (its ``finally`` runs now); one being ended by ``close()`` in
    another thread is left to it. An error while ending it is logged: the error that ended the
    iteration, if any, is the one raised."""
    if generator is None or not hasattr(generator, "close"):
        return
    try:
        generator.close()
    except ValueError:  # executing in another thread: close() is ending it
        pass
    except Exception as e:
        log.warning("gpupipe loader: ending a run raised %s: %s", type(e).__name__, e)
