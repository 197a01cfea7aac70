"""The processes gpupipe starts — the torch backend's DataLoader workers, ``gpupipe check``'s
pool — never outlive the process that started them, and one that dies is named.

A worker normally ends when its parent tells it to (``close()``, the end of ``with``, interpreter
exit, Ctrl-C). When the parent is killed (``kill -9``, the out-of-memory killer, a scheduler's
timeout) nothing tells it. PyTorch's own DataLoader worker notices only between two samples, every
5 s, and a worker stuck in native code (a hung read, a deadlocked library) never does.
:func:`exit_with_parent`, run first in every such child, starts a daemon thread that ends the child
(``os._exit``) within :data:`POLL_S` of its parent's death, whatever the child's main thread is
doing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import faulthandler
import mmap
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool

from ..core._errors import WorkerError

__all__ = [
    "POLL_S",
    "CRASHED",
    "exit_with_parent",
    "exit_status",
    "death_cause",
    "process_pool",
    "Stacks",
    "Births",
    "fork_can_freeze",
    "frozen_fork_cause",
]

POLL_S = 0.25  # how often a child checks that its parent is alive


def fork_can_freeze(version: tuple[int, ...]) -> tuple[int, int, int] | None:
    """The CPython release that fixed gh-112275 for ``version`` (``sys.version_info[:3]``), if
    ``version`` predates it; else ``None``. Before 3.10.15 and 3.11.10 (3.12 has the fix) a child
    forked while another thread holds the interpreter's thread-state lock can freeze for good inside
    ``fork``, before it runs any of its own code (seen here on 3.11.7 under load)."""
    fixed = {(3, 10): (3, 10, 15), (3, 11): (3, 11, 10)}.get((version[0], version[1]))
    return fixed if fixed is not None and tuple(version[:3]) < fixed else None


def frozen_fork_cause(version: tuple[int, ...] | None = None) -> str:
    """For the message about a forked child that never started: whether this Python
    (``sys.version_info``, or ``version``) can freeze one inside ``fork`` (``fork_can_freeze``)."""
    version = tuple(sys.version_info[:3]) if version is None else version
    here, fixed = ".".join(map(str, version)), fork_can_freeze(version)
    if fixed is None:
        return f"Python {here} has the fix of CPython gh-112275 (a child frozen inside fork): not that"
    return f"Python {here} can freeze a forked child for good (CPython gh-112275, fixed in {'.'.join(map(str, fixed))})"


def exit_with_parent(*_: object) -> None:
    """Called first in a child process (a ``worker_init_fn`` or a pool ``initializer``; arguments
    ignored): ends this process soon after its parent dies.

    The parent is the process that started this one (``os.getppid()`` now; under the
    ``forkserver`` start method that is the fork server, which itself ends with the main process).
    A child whose parent is already gone ends at once.
    """
    parent = os.getppid()
    if parent == 1:
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="gpupipe-parent-watch", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)  # the parent is gone: nobody will read what this process makes


# Exit codes of a process that crashed in native code (a decoder on a damaged file, most often).
CRASHED = frozenset(-s for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT))


def death_cause(code: int | None) -> str:
    """What a child's exit code most likely means, and what to do, in one sentence."""
    if code in CRASHED:
        return ("It crashed in native code: most often a decoder on a damaged file. `python -m gpupipe check` "
                "finds such files (each decoded in its own process) and lists them so that loaders leave them "
                "out; with num_workers=0 the traceback shows where.")  # fmt: skip
    if code == -signal.SIGKILL:
        return ("A process killed with SIGKILL is most often the kernel's out-of-memory killer (see `dmesg`); "
                "fewer workers or a smaller prefetch use less memory.")  # fmt: skip
    return "A crash in native code shows its traceback when run in this process (num_workers=0)."


def exit_status(code: int | None) -> str:
    """``multiprocessing``'s ``exitcode`` in words: ``"exit code 3"``,
    ``"exit code -9 (killed by SIGKILL)"``."""
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"exit code {code} (killed by {name})"
    return f"exit code {code}"


@contextlib.contextmanager
def process_pool(workers: int | None, what: str, *, spawn: bool = False) -> Iterator[concurrent.futures.Executor]:
    """A ``ProcessPoolExecutor`` whose processes never outlive this one.

    - Each process runs :func:`exit_with_parent` first.
    - An exception in the ``with`` body (Ctrl-C included) cancels what has not started and
      terminates the processes at once, instead of waiting for their current tasks.
    - A process that died (killed, crashed) is raised as :class:`~gpupipe.WorkerError` naming
      ``what`` the pool was doing and the process's exit code, not as ``BrokenProcessPool``.

    Args:
        workers: processes (``None``: every core).
        what: what the pool does, for messages (``"gpupipe check"``).
        spawn: start processes with ``spawn`` (no inherited threads, DALI or CUDA state) rather
            than the platform's default.
    """
    context = multiprocessing.get_context("spawn") if spawn else None
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=exit_with_parent)
    # CPython's map of the pool's processes, filled in place as they start (empty elsewhere):
    # kept to name a dead one and to terminate them.
    found = getattr(pool, "_processes", None)
    processes: dict[int, multiprocessing.process.BaseProcess] = {} if found is None else found
    try:
        yield pool
    except BrokenProcessPool as e:
        pool.shutdown(wait=True)  # the pool's own thread has ended and reaped every process
        dead = [p for p in processes.values() if p.exitcode not in (None, 0, -signal.SIGTERM)]
        pid, code = (dead[0].pid, dead[0].exitcode) if dead else (None, None)
        which = "" if pid is None else f" (pid {pid})"
        raise WorkerError(
            f"{what}: a worker process{which} died with {exit_status(code)}. {death_cause(code)}",
            pid=pid,
            exitcode=code,
        ) from e
    except BaseException:
        _terminate(pool, list(processes.values()))
        raise
    pool.shutdown(wait=True)


def _terminate(pool: concurrent.futures.Executor, processes: list[multiprocessing.process.BaseProcess]) -> None:
    """Cancels what has not started and kills the processes; the pool's own thread then reaps
    them (only it waits for them: two threads waiting for one child race, and one loses its exit
    status)."""
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(OSError, ValueError):
            process.terminate()
    pool.shutdown(wait=True)


class Stacks:
    """Python stacks of stuck child processes, on request: a child started while :meth:`armed`
    (or that calls :meth:`arm` itself) dumps every thread's stack into one shared file when
    :meth:`dump` sends it ``SIGUSR2`` (``faulthandler``: C-level, so it works while the child is
    frozen — even inside ``fork``'s own handlers, which is why the parent is armed too while it
    forks, and disarmed right after)."""

    SIGNAL = signal.SIGUSR2

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile(mode="w+", prefix="gpupipe-stacks-")  # noqa: SIM115 - held open: children write to it

    def arm(self) -> None:
        faulthandler.register(self.SIGNAL, file=self.file, all_threads=True, chain=False)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Around the ``fork`` of children: they inherit the handler from the first instruction."""
        self.arm()
        try:
            yield
        finally:
            faulthandler.unregister(self.SIGNAL)

    def dump(self, pids: list[int], wait: float = 1.0) -> str:
        """Each of ``pids``' stacks (those that answer within ``wait`` seconds each), as text: one
        process at a time, so that their dumps do not interleave in the shared file."""
        found = []
        for pid in pids:
            start = self.file.seek(0, os.SEEK_END)
            with contextlib.suppress(OSError):
                os.kill(pid, self.SIGNAL)
            deadline, size = time.monotonic() + wait, start
            while time.monotonic() < deadline:  # until its dump stops growing
                time.sleep(0.05)
                now = os.fstat(self.file.fileno()).st_size
                if now == size and now > start:
                    break
                size = now
            self.file.seek(start)
            text = self.file.read().strip()
            if text:
                found.append(f"process {pid}:\n{text}")
        return "\n\n".join(found)

    def close(self) -> None:
        self.file.close()


class Births:
    """Which worker processes have started: a ``worker_init_fn`` (it runs :func:`exit_with_parent`
    first) that marks its worker born in memory shared with the parent. A worker frozen inside
    ``fork`` (:func:`fork_can_freeze`) never runs it, so the parent can tell it from a slow first
    batch within seconds, instead of after ``worker_timeout``."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._flags = mmap.mmap(-1, max(1, workers))  # anonymous and shared: the forked workers write to it

    def __call__(self, worker_id: int) -> None:
        exit_with_parent()
        self._flags[worker_id] = 1

    def reset(self) -> None:
        """Before new workers fork: none born yet."""
        self._flags[:] = bytes(len(self._flags))

    def unborn(self) -> list[int]:
        """The ids of the workers that have not started."""
        return [i for i in range(self._workers) if not self._flags[i]]

    def close(self) -> None:
        self._flags.close()
