"""User transforms written once for every backend."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._base import ImageSpec, Transform

__all__ = ["Arithmetic"]


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

    def apply(self, x: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement apply(x)")

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        if not spec.dtype.is_floating_point:
            raise self._fail(f"needs a float image, got {spec}; add ToDtype(torch.float32, scale=True) before it")
        return spec
