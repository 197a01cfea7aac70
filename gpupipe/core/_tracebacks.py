"""An exception in one line, with where the user's code raised it: what ``gp.load_pipeline``
and the command line say of a pipeline file that fails, and whether a failure is gpupipe's own
bug (its traceback is then worth printing)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["raised", "raised_in_gpupipe"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # gpupipe's own files


def _frames(e: BaseException) -> list[Any]:
    """``e``'s traceback, outermost first, without generated code (``<string>``, ``<frozen ...>``)."""
    import traceback

    return [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]


def raised(e: BaseException, file: str | None = None) -> str:
    """``e`` in one line, with where the user's code raised it: the innermost frame in ``file``
    (the pipeline file), else the innermost outside gpupipe and Python's import machinery."""
    frames = [f for f in _frames(e) if not f.filename.startswith(_PACKAGE) and "importlib" not in f.filename]
    mine = [f for f in frames if file is not None and os.path.abspath(f.filename) == os.path.abspath(file)]
    frames = mine or frames
    if isinstance(e, SyntaxError) and e.filename:
        where = f" ({e.filename}:{e.lineno})"
    else:
        where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = e.msg if isinstance(e, SyntaxError) else str(e)
    return f"{type(e).__name__}: {message}{where}"


def raised_in_gpupipe(e: BaseException) -> bool:
    """Whether ``e`` was raised by gpupipe's own code (a bug of gpupipe's, not of its caller)."""
    frames = _frames(e)
    return bool(frames) and frames[-1].filename.startswith(_PACKAGE)
