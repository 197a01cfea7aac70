"""Backends: each lowers transform definitions through its own registry.

- ``torch``: torchvision's functional kernels in DataLoader worker processes (CPU).
- ``dali``: one NVIDIA DALI graph; nvJPEG and GPU operators with ``device="cuda"``, DALI's CPU
  operators with ``device="cpu"``.
"""

from __future__ import annotations

from typing import Any

from .._errors import ConfigError
from .._registry import Registry

__all__ = ["BACKENDS", "registry", "register_lowering", "resolve"]

BACKENDS = ("auto", "torch", "dali")


def names() -> tuple[str, ...]:
    """The backends' names."""
    return BACKENDS[1:]


def registry(backend: str) -> Registry:
    """The lowering registry of ``backend`` (imports that backend)."""
    if backend == "torch":
        from ._torch import LOWERINGS

        return LOWERINGS
    if backend == "dali":
        from ._dali import LOWERINGS

        return LOWERINGS
    raise ConfigError(f"backend must be one of {BACKENDS[1:]}, got {backend!r}")


def register_lowering(transform_type: type, *, backend: str) -> Any:
    """Decorator: registers ``fn`` as ``backend``'s lowering of ``transform_type``.

    The function's signature is the backend's: ``(transform, image [C, H, W] tensor, params)``
    for ``"torch"`` (``params`` from ``transform.make_params``, or None), ``(transform, node,
    ctx)`` for ``"dali"`` (a DALI graph node in HWC layout; ``ctx.fn``, ``ctx.device``,
    ``ctx.next_seed()``). For pure arithmetic, subclass ``transforms.Arithmetic`` instead: it
    needs no lowering at all.

    Example:
        >>> @gp.register_lowering(Posterize, backend="torch")  # doctest: +SKIP
        ... def _posterize(t, image, params):
        ...     return torchvision.transforms.v2.functional.posterize(image, t.bits)
    """
    from ..transforms import Transform

    if not (isinstance(transform_type, type) and issubclass(transform_type, Transform)):
        raise ConfigError(f"register_lowering: transform_type must be a gpupipe Transform subclass, got {transform_type!r}")
    return registry(backend).register(transform_type)


def resolve(backend: str, device: Any) -> tuple[str, str]:
    """Picks ``(backend, device)`` for the requested values; ``"auto"``/``None`` pick the best present."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        from .._errors import BackendUnavailableError

        raise BackendUnavailableError(f"Loader: device={device!r} but CUDA is not available")
    if dev.type == "cuda" and dev.index is None:  # "cuda": this process's GPU (LOCAL_RANK under torchrun)
        from .._dist import cuda_device

        dev = torch.device(cuda_device())
    if backend == "auto":  # DALI-GPU where CUDA and DALI are present, else DALI-CPU, else torch
        from ._dali_loader import dali_available

        backend = "dali" if dali_available() else "torch"
    return backend, str(dev)
