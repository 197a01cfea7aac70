"""The torch backend: torchvision's functional kernels in DataLoader worker processes (CPU), the
batches moved to the loader's device."""

from __future__ import annotations

from .._base import Backend, Runner, RunSpec
from . import _policies  # noqa: F401 - register the policies
from ._kernels import LOWERINGS

__all__ = ["BACKEND", "TorchBackend"]


class TorchBackend(Backend):
    name = "torch"
    requirement = "torch and torchvision"
    lowerings = LOWERINGS
    reads_fields = True
    imageless = True
    reads_targets = True
    batches_stage = ("cpu",)  # in the workers, where each batch is collated

    def runner(self, spec: RunSpec) -> Runner:
        from ._runner import TorchRunner

        return TorchRunner(spec)


BACKEND = TorchBackend()
