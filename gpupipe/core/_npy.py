"""numpy's ``.npy`` headers, parsed one thread at a time.

numpy parses a ``.npy`` header with ``ast.literal_eval``. CPython before 3.11.8 / 3.12.1 can
raise a spurious ``SystemError: AST constructor recursion depth mismatch`` when two threads build
ASTs at once (CPython gh-106905). gpupipe parses headers in several threads: the DALI runner's
reader threads decode ``.npy`` fields, and shard indexes load their cached labels. Seen in the full
test suite on Python 3.11.7 (a ``.npy`` field read by the DALI runner's two reader threads) and
in a 2-rank DALI run on a busy 2-core machine (cached labels).

:data:`HEADER` serializes gpupipe's own parsing. A parse that fails anyway, because some other
thread of the process was parsing Python meanwhile, is tried once more. Parsing a header takes
microseconds, so the lock costs nothing measurable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import IO, Any, TypeVar

import numpy as np

__all__ = ["HEADER", "read_header", "load"]

HEADER = threading.Lock()
_T = TypeVar("_T")


def _retried(parse: Callable[[], _T]) -> _T:
    """``parse()`` under :data:`HEADER`, once more after gh-106905's ``SystemError`` (another
    thread of the process parsed Python meanwhile)."""
    with HEADER:
        try:
            return parse()
        except SystemError:
            return parse()


def read_header(stream: IO[bytes]) -> tuple[tuple[int, int], tuple[int, ...], bool, np.dtype]:
    """``(version, shape, fortran_order, dtype)`` of the ``.npy`` data at ``stream``'s position,
    which is left after the header. Raises numpy's errors (``ValueError``, ``EOFError``, ...),
    and ``ValueError`` for a version other than 1.0, 2.0 and 3.0."""
    from numpy.lib import format as npy

    start = stream.tell()

    def parse() -> tuple[tuple[int, int], tuple[int, ...], bool, np.dtype]:
        stream.seek(start)  # (a retry starts the header again)
        version = npy.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = npy.read_array_header_1_0(stream)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = npy.read_array_header_2_0(stream)
        else:
            raise ValueError(f"NPY version {version[0]}.{version[1]}")
        return version, shape, fortran, dtype

    return _retried(parse)


def load(path: str) -> Any:
    """``np.load(path, allow_pickle=False)``, its header parsed as :func:`read_header` does."""
    return _retried(lambda: np.load(path, allow_pickle=False))
