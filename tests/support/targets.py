"""What the contract suite runs against: each backend of the table on each device it delivers to
(conftest's ``backend`` fixture), and the launchers' rank variables that a test clears."""

from __future__ import annotations

import dataclasses

import pytest

import gpupipe as gp
from gpupipe import backends

DIST_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_CPUS_PER_TASK",
)


@dataclasses.dataclass(frozen=True)
class Target:
    """One backend on one device: what a contract test runs against."""

    backend: str
    device: str

    def loader(self, pipeline, batch_size, **options) -> gp.Loader:
        return gp.Loader(pipeline, batch_size, backend=self.backend, device=self.device, **options)

    def __str__(self) -> str:
        return f"{self.backend}-{self.device}"


def targets():
    """Every backend of the table on every device it delivers to; CUDA ones are marked ``gpu``."""
    for name in backends.names():
        for device in backends.get(name).devices:
            marks = [pytest.mark.gpu] if device == "cuda" else []
            yield pytest.param(Target(name, device), id=f"{name}-{device}", marks=marks)
