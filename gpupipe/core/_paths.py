"""Where gpupipe keeps what it learns between runs: ``$GPUPIPE_CACHE_DIR``, default
``~/.cache/gpupipe`` — the index cache (``wds-index/``), remote shards (``shards/``), ``gpupipe
tune``'s records (``tune.json``) and the loaders' last verdict (``verdict.json``). Point it at
storage every node sees for one index cache per job."""

from __future__ import annotations

import os

__all__ = ["cache_root"]


def cache_root() -> str:
    """``$GPUPIPE_CACHE_DIR``, else ``~/.cache/gpupipe`` (read at each call: tests and jobs set it)."""
    return os.environ.get("GPUPIPE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpupipe")
