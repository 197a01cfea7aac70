"""The Ray backend: the torch backend's kernels (decode, transforms, collate) run as Ray tasks on a
Ray cluster's CPUs — other machines' too — and each batch comes back through Ray's object store.

Chosen only when named (``backend="ray"``); ``gp.RayOptions`` says which cluster and how many
batches are in flight. See docs/guide/scaling-out.md.
"""

from __future__ import annotations

import importlib.util

from .._base import Backend, Runner, RunSpec
from .._torch._kernels import LOWERINGS

__all__ = ["BACKEND", "RayBackend"]


class RayBackend(Backend):
    name = "ray"
    requirement = "ray (pip install 'gpupipe[ray]')"
    lowerings = LOWERINGS  # the torch backend's kernels
    auto = False
    reads_fields = True  # the torch backend's decoders and batching, in the tasks
    imageless = True
    reads_targets = True

    def available(self) -> bool:
        return importlib.util.find_spec("ray") is not None

    def runner(self, spec: RunSpec) -> Runner:
        from ._runner import RayRunner

        return RayRunner(spec)


BACKEND = RayBackend()
