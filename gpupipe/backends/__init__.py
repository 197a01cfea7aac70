"""Backends: each lowers transform definitions through its own registry.

- ``torch``: torchvision's functional kernels in DataLoader worker processes (CPU).
"""

from __future__ import annotations

from typing import Any

from .._errors import ConfigError
from .._registry import Registry

__all__ = ["BACKENDS", "registry", "resolve"]

BACKENDS = ("auto", "torch")


def registry(backend: str) -> Registry:
    """The lowering registry of ``backend`` (imports that backend)."""
    if backend == "torch":
        from ._torch import LOWERINGS

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
    return ("torch" if backend == "auto" else backend), str(dev)
