"""Backends: each lowers transform definitions through its own registry.

- ``torch``: torchvision's functional kernels in DataLoader worker processes (CPU).
- ``dali``: one NVIDIA DALI graph; nvJPEG and GPU operators with ``device="cuda"``, DALI's CPU
  operators with ``device="cpu"``.
"""

from __future__ import annotations

from typing import Any

from .._errors import ConfigError
from .._registry import Registry

__all__ = ["BACKENDS", "registry", "resolve"]

BACKENDS = ("auto", "torch", "dali")


def registry(backend: str) -> Registry:
    """The lowering registry of ``backend`` (imports that backend)."""
    if backend == "torch":
        from ._torch import LOWERINGS

        return LOWERINGS
    if backend == "dali":
        from ._dali import LOWERINGS

        return LOWERINGS
    raise ConfigError(f"backend must be one of {BACKENDS[1:]}, got {backend!r}")


def resolve(backend: str, device: Any) -> tuple[str, str]:
    """Picks ``(backend, device)`` for the requested values; ``"auto"``/``None`` pick the best present."""
    import torch

    if backend not in BACKENDS:
        raise ConfigError(f"Loader: backend must be one of {BACKENDS}, got {backend!r}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"Loader: device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        from .._errors import BackendUnavailableError

        raise BackendUnavailableError(f"Loader: device={device!r} but CUDA is not available")
    if backend == "auto":  # DALI-GPU where CUDA and DALI are present, else DALI-CPU, else torch
        from ._dali_loader import dali_available

        backend = "dali" if dali_available() else "torch"
    return backend, str(dev)
