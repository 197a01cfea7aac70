"""The training thread's intra-op threads while gpupipe does its own torch work there.

gpupipe's DALI and Ray backends apply a batch transform (MixUp, CutMix) in the training
process after batching. On the CPU that is a few passes over a batch that memory bandwidth
bounds. torch would run each pass on its intra-op team (one OpenMP thread per core). After each
parallel region, OpenMP's default wait policy keeps that team's threads spinning for a while.
Those spinning threads take the cores from the loader's own threads: DALI's thread pool, or the
worker processes. On the 2-core development VM, with the V2 recipe on DALI's CPU operators, they
used 11-18 ms of CPU per batch, about 7% of the process's. Images/s changed by less than the noise
between runs (``bench/results/2026-11-26-training-thread-omp.md``).

:func:`one_intraop_thread` runs such work on the calling thread alone. It sets the calling
thread's OpenMP team size (``omp_set_num_threads``, which OpenMP keeps per thread) to one, and
restores it afterwards. This is not ``torch.set_num_threads``, which would change the default of
every thread started later and clear oneDNN's cache. Other threads, and the user's own work on
this thread before and after, keep their settings.

Where torch does not use OpenMP for its intra-op work, or its runtime's functions cannot be
found, this is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["one_intraop_thread", "openmp"]

log = logging.getLogger(__name__)


@functools.cache
def openmp() -> tuple[Any, Any] | None:
    """``(omp_get_max_threads, omp_set_num_threads)`` of the OpenMP runtime that torch's ATen
    uses, or ``None`` (another parallel backend, or no runtime found in the process)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        process = ctypes.CDLL(None)
        get, set_ = process.omp_get_max_threads, process.omp_set_num_threads
    except (OSError, AttributeError, TypeError):  # no global symbol table (Windows), or no runtime
        return None
    get.restype, get.argtypes = ctypes.c_int, []
    set_.restype, set_.argtypes = None, [ctypes.c_int]
    # The runtime found must be torch's: torch's count follows a change made through it.
    before = torch.get_num_threads()  # (also ATen's first setup of this thread's count)
    if before != get():
        return None
    if before > 1:
        set_(1)
        seen = torch.get_num_threads()
        set_(before)
        if seen != 1:
            log.debug("gpupipe: the OpenMP runtime found is not torch's; training-thread work keeps its threads")
            return None
    return get, set_


@contextlib.contextmanager
def one_intraop_thread() -> Iterator[None]:
    """Runs the block's torch CPU operators on the calling thread alone (see the module's
    docstring); the thread's intra-op thread count is restored on leaving, also on an error."""
    omp = openmp()
    before = torch.get_num_threads() if omp is not None else 1
    if omp is None or before == 1:
        yield
        return
    _, set_ = omp
    set_(1)
    try:
        yield
    finally:
        set_(before)
