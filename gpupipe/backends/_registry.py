"""Lowering registries: transform type → the function that lowers it on one backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..core._errors import ConfigError, UnsupportedTransformError

__all__ = ["Registry", "Lowering", "inner_unsupported"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Lowering:
    """A backend's lowering of one transform type. ``unsupported(transform)`` returns why an
    instance's options cannot run on the backend (``None`` where they can)."""

    fn: Callable[..., Any]
    unsupported: Callable[[Any], str | None] | None = None


class Registry:
    """Maps transform types to a backend's lowerings.

    Lookup is by exact type first, then along the MRO, so a user's subclass of a built-in
    transform lowers like its parent unless it registers its own lowering. Registering a second
    lowering for the same type is an error unless ``replace=True``.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._table: dict[type, Lowering] = {}

    def register(
        self, *types: type, unsupported: Callable[[Any], str | None] | None = None, replace: bool = False
    ) -> Callable[[F], F]:
        """Decorator: registers the function as the lowering of ``types``."""
        for t in types:
            if t in self._table and not replace:
                old = self._table[t].fn
                raise ConfigError(
                    f"the {self.backend} backend already has a lowering for {t.__name__} "
                    f"({old.__module__}.{old.__qualname__}); pass replace=True to replace it"
                )

        def decorator(fn: F) -> F:
            for t in types:
                self._table[t] = Lowering(fn, unsupported)
            return fn

        return decorator

    def __contains__(self, t: type) -> bool:
        return any(c in self._table for c in t.__mro__)

    def _entry(self, transform: Any, position: int | None) -> Lowering:
        for cls in type(transform).__mro__:
            if cls in self._table:
                return self._table[cls]
        where = "" if position is None else f" (pipeline step {position})"
        name = type(transform).__name__
        raise UnsupportedTransformError(
            f"the {self.backend} backend cannot run {name}{where}: it has no lowering for it. Choose another backend "
            f"or register one with gpupipe.register_lowering({name}, backend={self.backend!r})"
        )

    def lookup(self, transform: Any, position: int | None = None) -> Callable[..., Any]:
        """The lowering function of ``transform``; UnsupportedTransformError if there is none."""
        return self._entry(transform, position).fn

    def require_supported(self, transforms: Sequence[Any], *, skip: Callable[[Any], bool] | None = None) -> None:
        """Raises UnsupportedTransformError, naming the transform and its step, if one has no
        lowering or has options the backend cannot run (``skip``: the steps not asked about)."""
        for i, t in enumerate(transforms):
            if skip is not None and skip(t):
                continue
            entry = self._entry(t, i)
            reason = entry.unsupported(t) if entry.unsupported else None
            if reason:
                raise UnsupportedTransformError(
                    f"the {self.backend} backend cannot run {t!r} (pipeline step {i}): {reason}"
                )


def inner_unsupported(registry: Registry, transforms: Sequence[Any]) -> str | None:
    """Why ``registry``'s backend cannot run one of a composite transform's inner ``transforms``
    (``None`` where it can run them all): the ``unsupported`` of a lowering such as RandomApply's."""
    for i, t in enumerate(transforms):
        try:
            entry = registry._entry(t, None)
        except UnsupportedTransformError as e:
            return f"transforms[{i}]: {e}"
        reason = entry.unsupported(t) if entry.unsupported else None
        if reason:
            return f"transforms[{i}] {t!r}: {reason}"
    return None
