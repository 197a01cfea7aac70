"""Running code that may crash the process — a decoder on a damaged file — in a child process, so
that a crash becomes a verdict on one item instead of the end of a training run.

:func:`guarded_map` runs ``fn`` on each item in a forked child (the items and ``fn`` are inherited,
not pickled; only results travel back), one item after another; the child says which item it
starts. A child that dies (SIGSEGV in a decoder, an abort) marks the item it was on as crashed,
with its exit status, and a new child goes on with the next item; one that takes longer than
``timeout`` on an item is killed and the item marked as hung. A child that dies or freezes before
it starts its first item (killed at birth, or frozen inside ``fork`` by CPython's gh-112275 before
3.11.10) blames no item: another is started, up to :data:`STARTS` times in a row, then
:class:`~gpupipe.WorkerError` is raised. Used where gpupipe decodes suspects
(the DALI backend naming the sample DALI failed on, ``gpupipe check``) and to find the sample that
killed a torch-backend worker.

Forked, as DataLoader's workers are: the child inherits the parent's state (``backends/_dali``
pins DALI's pipelines in it, ``exit_with_parent`` ends it with its parent), starts in milliseconds
and never touches CUDA. The sandbox's forks are one at a time in the process (``_FORKING``): the
DALI backend's reader threads may each be judging a suspect at once, and a fork while another
thread is inside one is refused by libraries that guard it (filelock 4's audit hook on CPython
3.12, with ``RuntimeError``); a fork refused anyway (by another library's fork in another thread)
is tried again, as a child that failed to start.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

from ..core._errors import WorkerError
from ._children import exit_status, exit_with_parent, frozen_fork_cause

__all__ = ["Outcome", "guarded_map"]

log = logging.getLogger("gpupipe")

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_TIMEOUT = 120.0  # seconds per item: a decode that takes longer is hung, not slow
START_TIMEOUT = 30.0  # seconds for a child to start its first item (milliseconds when all is well)
STARTS = 3  # children in a row that may fail to start before guarded_map gives up
_FORKING = threading.Lock()  # one sandbox fork at a time in this process


@dataclasses.dataclass(frozen=True)
class Outcome(Generic[R]):
    """One item's outcome: ``value`` (what ``fn`` returned), or ``crashed`` (the child's exit
    code: a signal is negative) or ``hung`` (the seconds it was given)."""

    value: R | None = None
    crashed: int | None = None
    hung: float | None = None

    @property
    def ok(self) -> bool:
        return self.crashed is None and self.hung is None

    def reason(self) -> str:
        """Why the item has no value, in words."""
        if self.crashed is not None:
            return f"it killed the process decoding it ({exit_status(self.crashed)})"
        if self.hung is not None:
            return f"decoding it did not finish in {self.hung:g} s"
        return "ok"


def _child(conn: Connection, fn: Callable[[Any], Any], items: Sequence[Any], start: int) -> None:
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    faulthandler.disable()  # a crash here is expected and reported by the parent: no traceback dump
    for i in range(start, len(items)):
        conn.send(("start", i))
        conn.send(("done", i, fn(items[i])))
    conn.send(("end", None))
    conn.close()


def guarded_map(fn: Callable[[T], R], items: Sequence[T], *, timeout: float = DEFAULT_TIMEOUT) -> list[Outcome[R]]:
    """``fn(item)`` for each of ``items`` in forked children (see the module docstring); one
    :class:`Outcome` per item, in order. ``fn`` must return something picklable and raise
    nothing (return errors as data)."""
    context = multiprocessing.get_context("fork")
    outcomes: dict[int, Outcome[R]] = {}
    start, failed_starts = 0, 0
    while start < len(items):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_child, args=(send, fn, items, start), daemon=True, name="gpupipe-sandbox")
        try:
            with _FORKING:
                child.start()
        except RuntimeError as e:  # the fork refused (an audit hook's guard): no child, no verdict
            receive.close()
            send.close()
            failed_starts = _failed_start(child, f"could not be forked ({e})", failed_starts)
            time.sleep(0.05 * failed_starts)
            continue
        send.close()
        current, since, started = start, time.monotonic(), False
        try:
            while True:
                limit = timeout if started else min(timeout, START_TIMEOUT)
                if not receive.poll(max(0.0, limit - (time.monotonic() - since))):
                    child.kill()
                    child.join()
                    if started:
                        outcomes[current] = Outcome(hung=timeout)
                        start = current + 1
                    else:
                        failed_starts = _failed_start(child, f"gave no sign within {limit:g} s", failed_starts)
                    break
                try:
                    message = receive.recv()
                except EOFError:  # the child died: on the item it last started
                    child.join()
                    if started:
                        outcomes[current] = Outcome(crashed=child.exitcode)
                        start = current + 1
                    else:
                        failed_starts = _failed_start(child, f"ended ({exit_status(child.exitcode)})", failed_starts)
                    break
                if message[0] == "start":
                    current, since, started, failed_starts = message[1], time.monotonic(), True, 0
                elif message[0] == "done":
                    outcomes[message[1]] = Outcome(value=message[2])
                else:  # "end"
                    child.join()
                    start = len(items)
                    break
        finally:
            receive.close()
            if child.is_alive():
                child.kill()
                child.join()
    return [outcomes[i] for i in range(len(items))]


def _failed_start(child: multiprocessing.process.BaseProcess, what: str, failed: int) -> int:
    """A child that never started an item: no verdict on any. Logs it, or raises after
    :data:`STARTS` in a row; returns the new count."""
    failed += 1
    pid = "" if child.pid is None else f" (pid {child.pid})"
    message = (f"a gpupipe sandbox process{pid} {what} before it started its first item ({failed} of "
               f"{STARTS} in a row); {frozen_fork_cause()}")  # fmt: skip
    if failed >= STARTS:
        raise WorkerError(message + ": giving up", pid=child.pid, exitcode=child.exitcode)
    log.warning("%s: starting another", message)
    return failed
