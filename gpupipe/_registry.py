"""Lowering registries: transform type → the function that lowers it on one backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ._errors import UnsupportedTransformError

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """Maps transform types to a backend's lowering functions.

    Lookup is by exact type first, then along the MRO, so a user's subclass of a built-in
    transform lowers like its parent unless it registers its own lowering.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._table: dict[type, Callable[..., Any]] = {}

    def register(self, *types: type) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            for t in types:
                self._table[t] = fn
            return fn
        return decorator

    def __contains__(self, t: type) -> bool:
        return any(c in self._table for c in t.__mro__)

    def lookup(self, transform: Any, position: int | None = None) -> Callable[..., Any]:
        for cls in type(transform).__mro__:
            if cls in self._table:
                return self._table[cls]
        where = "" if position is None else f" (pipeline step {position})"
        raise UnsupportedTransformError(
            f"the {self.backend} backend cannot run {type(transform).__name__}{where}: "
            f"it has no lowering for it. Choose another backend or register one with "
            f"gpupipe.register_lowering({type(transform).__name__}, backend={self.backend!r})"
        )
