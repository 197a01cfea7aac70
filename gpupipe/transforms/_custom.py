"""User transforms written once for every backend."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._base import ImageSpec, Transform

__all__ = ["Arithmetic", "ArrayFunction"]


@dataclasses.dataclass(frozen=True)
class Arithmetic(Transform):
    """Base class of a user transform that is pure arithmetic on pixel values.

    Subclass it as a frozen dataclass and implement :meth:`apply` with ``+ - * /``, comparisons
    and numeric constants only: the same method then runs on a ``torch.Tensor`` (torch backend)
    and on a DALI graph node (DALI backend, CPU and GPU), with no Python in the DALI graph.

    Input and output are float images (put ``ToDtype(torch.float32, scale=True)`` before it,
    checked at build time); shapes are unchanged.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True)
        ... class AddMult(Arithmetic):
        ...     add: float = 0.0
        ...     mult: float = 1.0
        ...
        ...     def apply(self, x):
        ...         return (x + self.add) * self.mult
    """

    keeps_size = True

    def apply(self, x: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement apply(x)")

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if not spec.dtype.is_floating_point:
            raise self._fail(f"needs a float image, got {spec}; add ToDtype(torch.float32, scale=True) before it")
        return spec


@dataclasses.dataclass(frozen=True)
class ArrayFunction(Transform):
    """Base class of a user transform written once as a function over one image's array — NumPy
    on the CPU backends, CuPy on the GPU — for what arithmetic cannot express (lookup tables,
    library calls, shape changes).

    Subclass it as a frozen dataclass and implement :meth:`apply`; where the transform changes
    the image's shape or dtype, declare it in :meth:`output_spec` (default: unchanged), which the
    pipeline check and the loader rely on.

    Backends: the torch backend calls ``apply`` in its worker processes with NumPy; the DALI
    backend calls it inside the graph through DALI's ``python_function`` operator — with NumPy on
    DALI's CPU operators, with CuPy on the GPU (``pip install cupy-cuda12x``, or ``-cuda13x``;
    CuPy's current stream is DALI's during the call, so CuPy kernels are ordered with the graph).

    An opt-in escape hatch, off the hot path: Python runs once per sample under the GIL, and in
    the DALI graph one call at a time for the whole pipeline; a DALI graph containing it cannot
    be serialized. Its cost is measured by ``bench/array_function.py`` (see docs/guide/transforms.md). Where the
    function is plain arithmetic, :class:`Arithmetic` runs compiled, with no Python.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass(frozen=True)
        ... class Posterize(ArrayFunction):
        ...     bits: int = 4
        ...
        ...     def apply(self, image, xp):
        ...         return image & xp.uint8((0xFF << (8 - self.bits)) & 0xFF)
    """

    def apply(self, image: Any, xp: Any) -> Any:
        """``image``: one ``[H, W, C]`` array (read-only: return a new array) of the dtype the
        step before produces; ``xp``: the array module, ``numpy`` or ``cupy``. Returns an
        ``[H', W', C']`` array matching :meth:`output_spec`."""
        raise NotImplementedError(f"{type(self).__name__} must implement apply(image, xp)")
