"""Backends, in one table: each lowers transform definitions through its own registry and runs
them with its own runner.

- ``dali``: one NVIDIA DALI graph; nvJPEG and GPU operators with ``device="cuda"``, DALI's CPU
  operators with ``device="cpu"``.
- ``torch``: torchvision's functional kernels in DataLoader worker processes.
- ``ray``: the torch backend's kernels in Ray tasks, on a Ray cluster's CPUs (scale-out).

A backend is a module (or package) defining a :class:`Backend` instance named ``BACKEND``; adding
one is that module plus an entry in :data:`TABLE`. Modules are imported on first use, so
``import gpupipe`` imports no backend library.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core._errors import BackendUnavailableError, ConfigError, UnsupportedTransformError
from ._base import Backend, RawBatch, Runner, RunSpec, to_device

__all__ = [
    "TABLE",
    "Backend",
    "Runner",
    "RunSpec",
    "RawBatch",
    "names",
    "get",
    "resolve",
    "why",
    "auto_choice",
    "register_lowering",
    "to_device",
    "DaliContext",
]

# name -> module defining BACKEND. backend="auto" picks the first available one, in this order,
# that delivers to the requested device.
TABLE: dict[str, str] = {
    "dali": "gpupipe.backends._dali",
    "torch": "gpupipe.backends._torch",
    "ray": "gpupipe.backends._ray",  # only when named: backend="ray"
}

_loaded: dict[str, Backend] = {}


def __getattr__(name: str) -> Any:
    """``DaliContext``, the DALI lowering context (for ``register_lowering(..., backend="dali")``
    functions' annotations), imported on first use so that ``import gpupipe`` loads no backend."""
    if name == "DaliContext":
        from ._dali._context import Ctx

        return Ctx
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def names() -> tuple[str, ...]:
    """The backends' names, in ``"auto"``'s order of preference."""
    return tuple(TABLE)


def get(name: str) -> Backend:
    """The backend called ``name`` (imports its module, not its libraries)."""
    if name not in TABLE:
        raise ConfigError(f"Loader: backend must be one of {('auto', *TABLE)}, got {name!r}")
    if name not in _loaded:
        backend = importlib.import_module(TABLE[name]).BACKEND
        if not isinstance(backend, Backend) or backend.name != name:
            raise TypeError(f"{TABLE[name]}.BACKEND must be a gpupipe Backend named {name!r}, got {backend!r}")
        _loaded[name] = backend
    return _loaded[name]


def register_lowering(transform_type: type, *, backend: str, replace: bool = False) -> Any:
    """Decorator: registers ``fn`` as ``backend``'s lowering of ``transform_type``.

    The function's signature is the backend's: ``(transform, image [C, H, W] tensor, params)``
    for ``"torch"`` (``params`` from ``transform.make_params``, or None), ``(transform, node,
    ctx)`` for ``"dali"`` (a DALI graph node in HWC layout; ``ctx.fn``, ``ctx.device``). For pure
    arithmetic, subclass ``transforms.Arithmetic`` instead: it needs no lowering at all.

    A type that already has a lowering on that backend (a built-in transform, or one registered
    before) is refused unless ``replace=True``; a subclass of a built-in may register its own.

    Example:
        >>> @gp.register_lowering(Posterize, backend="torch")  # doctest: +SKIP
        ... def _posterize(t, image, params):
        ...     return torchvision.transforms.v2.functional.posterize(image, t.bits)
    """
    from ..transforms import Transform

    if not (isinstance(transform_type, type) and issubclass(transform_type, Transform)):
        raise ConfigError(
            f"register_lowering: transform_type must be a gpupipe Transform subclass, got {transform_type!r}"
        )
    return get(backend).lowerings.register(transform_type, replace=replace)


def resolve(
    name: str, device: str | torch.device | None, views: Any = (), *, fields: Sequence[str] = (), images: bool = True,
    targets: Sequence[str] = (), pipeline: Any = None, stage: bool | None = None,
) -> tuple[Backend, torch.device]:  # fmt: skip
    """The backend and device for the requested ones: ``"auto"`` picks the first available backend
    of the table that delivers to the device and runs every step of ``views`` (the pipeline's
    transform lists; a step the DALI backend cannot run, such as ``RandomRotation(expand=True)``,
    makes it the torch backend); ``None`` picks ``cuda`` when present, else ``cpu``; ``"cuda"``
    means this process's GPU (``LOCAL_RANK`` under torchrun). ``fields``: the source's fields
    beyond image and label (``Pipeline.fields``), which only some backends read; ``targets``: those
    of them that follow the image's geometry (masks, boxes: ``Pipeline.targets``), which only some
    backends transform. ``pipeline`` (a ``gp.Pipeline``) and ``stage`` (``LoaderConfig.stage``):
    ``"auto"`` also passes by a backend that runs a step in the stage only
    (``Backend.stage_only``, DALI's policies) where the stage would not take it.

    Raises:
        BackendUnavailableError: the backend's libraries or the device are not present.
        UnsupportedTransformError: with ``"auto"``, no available backend runs every step (the
            first one's reason).
    """
    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError(f"Loader: device={str(device)!r} but CUDA is not available")
    if dev.type == "cuda" and dev.index is None:
        from ..runtime._dist import cuda_device

        dev = torch.device(cuda_device())
    if name == "auto":
        return auto_choice(dev.type, views, fields=fields, images=images, targets=targets, pipeline=pipeline,
                           stage=stage)[0], dev  # fmt: skip
    backend = get(name)
    if not backend.available():
        raise BackendUnavailableError(f"Loader: backend={name!r} needs {backend.requirement}")
    if dev.type not in backend.devices:
        raise BackendUnavailableError(f"Loader: backend={name!r} cannot deliver to {str(dev)!r}")
    return backend, dev


def auto_choice(
    device_type: str,
    views: Any = (),
    *,
    available: Callable[[Backend], bool] | None = None,
    fields: Sequence[str] = (),
    images: bool = True,
    targets: Sequence[str] = (),
    pipeline: Any = None,
    stage: bool | None = None,
) -> tuple[Backend, str]:
    """``backend="auto"``'s choice on ``device_type`` and why, in a few words: the first available
    backend of the table that delivers there, runs every step of ``views`` and is not measured
    slower there for one of them (``Backend.slower``); else the first that runs them all.
    ``available`` (default: each backend's own ``available()``) lets ``gpupipe doctor`` ask about
    an environment it describes.

    Raises:
        UnsupportedTransformError: no available backend runs every step (the first one's reason).
        BackendUnavailableError: no backend available for the device.
    """
    is_available = available or (lambda b: b.available())
    refused: UnsupportedTransformError | None = None
    fallback: Backend | None = None
    reasons: list[str] = []
    missing: list[str] = []
    for candidate in TABLE:
        backend = get(candidate)
        if not backend.auto:
            continue
        if device_type not in backend.devices or not is_available(backend):
            missing.append(backend.name)
            continue
        cannot = _cannot_run(backend, views, fields, images, targets)
        if cannot is None and pipeline is not None and backend.stage_only:
            from ._stage import staged_refusal  # (a floor above the table)

            cannot = staged_refusal(pipeline, torch.device(device_type), backend, stage)
        slower = None if cannot is not None else backend.slower_step(device_type, views)
        if cannot is None and slower is None:
            return backend, _because(missing, reasons)
        if cannot is not None:
            refused = refused or cannot
            unread = backend.unread(fields, images=images, targets=targets)
            reasons.append(f"{backend.name} {unread}" if unread is not None else
                           f"{backend.name} cannot run {_step_of(cannot)}")  # fmt: skip
        elif fallback is None:
            fallback = backend
            reasons.append(str(slower))
    if fallback is not None:
        return fallback, _because([], [])
    if refused is not None:
        raise refused
    raise BackendUnavailableError(f"Loader: no backend available for device {device_type!r}")


def _because(missing: list[str], reasons: list[str]) -> str:
    found = ([f"{', '.join(missing)} not available"] if missing else []) + reasons
    return "; ".join(found) if found else "the first available of " + ", ".join(n for n in TABLE if get(n).auto)


def why(
    name: str, device: str | torch.device | None, backend: Backend, dev: torch.device, views: Any = (),
    *, fields: Sequence[str] = (), images: bool = True, targets: Sequence[str] = (), pipeline: Any = None,
    stage: bool | None = None,
) -> str | None:  # fmt: skip
    """Why :func:`resolve` chose ``backend`` and ``dev`` where it chose (``backend="auto"``,
    ``device=None``), in a few words for the loader's repr and log; ``None`` where both were given."""
    parts = []
    if device is None:
        parts.append(f"device {dev.type}: {'CUDA is available' if dev.type == 'cuda' else 'no CUDA'}")
    if name == "auto":
        choice = auto_choice(dev.type, views, fields=fields, images=images, targets=targets, pipeline=pipeline,
                             stage=stage)  # fmt: skip
        parts.append(f"backend {backend.name}: {choice[1]}")
    return "; ".join(parts) or None


def _cannot_run(
    backend: Backend, views: Any, fields: Sequence[str] = (), images: bool = True, targets: Sequence[str] = ()
) -> UnsupportedTransformError | None:
    """Why ``backend`` cannot run a step of ``views`` or read the source (its ``fields``, samples
    without ``images``), or ``None``."""
    try:
        backend.require_fields(fields, images=images, targets=targets)
        for steps in views:
            backend.require_supported(steps)
    except UnsupportedTransformError as e:
        return e
    return None


def _step_of(error: UnsupportedTransformError | None) -> str:
    """The step an error names and why, in a few words: ``step 1, RandomRotation: expand=True …``."""
    text = str(error)
    found = re.match(r"the \w+ backend cannot run (\w+)\(.*\) \(pipeline step (\d+)\): (.*)", text, re.DOTALL)
    return f"step {found[2]}, {found[1]}: {found[3]}" if found else text
