"""Argument checks shared by transforms, the loader's config, rank discovery and the shard writer.

Every check takes the ``owner`` (the class or function the argument belongs to) and the argument's
``name``, so that each message reads ``"Owner: name must be <what>, got <value>"`` wherever it is
raised. Each raises :class:`~gpupipe.ConfigError` (a ``ValueError``) and returns the normalised
value.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any, TypeVar

from ._errors import ConfigError

__all__ = [
    "is_int",
    "is_number",
    "invalid",
    "valid_int",
    "valid_optional_int",
    "valid_bool",
    "valid_size",
    "valid_range",
    "valid_probability",
    "valid_choice_weights",
    "valid_enum",
]

E = TypeVar("E", bound=enum.Enum)


def invalid(owner: str, name: str, expected: str, got: Any) -> ConfigError:
    """The error for argument ``name`` of ``owner`` that is not ``expected``."""
    return ConfigError(f"{owner}: {name} must be {expected}, got {got!r}")


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def valid_int(owner: str, value: Any, name: str, *, minimum: int | None = None) -> int:
    """An int (not a bool), at least ``minimum`` when given."""
    if not is_int(value) or (minimum is not None and value < minimum):
        expected = "an int" if minimum is None else "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise invalid(owner, name, expected, value)
    return int(value)


def valid_optional_int(owner: str, value: Any, name: str, *, minimum: int | None = None) -> int | None:
    """``None``, or an int as :func:`valid_int`."""
    if value is None:
        return None
    if not is_int(value) or (minimum is not None and value < minimum):
        expected = "an int or None" if minimum is None else f"None or an int >= {minimum}"
        raise invalid(owner, name, expected, value)
    return int(value)


def valid_bool(owner: str, value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(owner, name, "True or False", value)
    return value


def valid_size(owner: str, value: Any, name: str = "size") -> tuple[int, int]:
    """``int`` or a sequence of one or two positive ints → ``(h, w)``."""
    expected = "a positive int or a sequence of one or two positive ints (h, w)"
    if is_int(value):
        value = (value, value)
    elif isinstance(value, Sequence) and not isinstance(value, str) and len(value) in (1, 2):
        value = (value[0], value[0]) if len(value) == 1 else tuple(value)
    else:
        raise invalid(owner, name, expected, value)
    if not all(is_int(v) and v > 0 for v in value):
        raise invalid(owner, name, expected, value)
    return (int(value[0]), int(value[1]))


def valid_range(
    owner: str,
    value: Any,
    name: str,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    allow_equal: bool = True,
) -> tuple[float, float]:
    """A sequence ``(min, max)`` of numbers with ``low <= min <= max <= high``."""
    expected = f"a sequence (min, max) of numbers in [{low}, {high}] with min <= max"
    if not (
        isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2 and all(map(is_number, value))
    ):
        raise invalid(owner, name, expected, value)
    lo, hi = float(value[0]), float(value[1])
    if not (low <= lo <= hi <= high) or (not allow_equal and lo == hi):
        raise invalid(owner, name, expected, value)
    return (lo, hi)


def valid_probability(owner: str, value: Any, name: str = "p") -> float:
    if not (is_number(value) and 0.0 <= value <= 1.0):
        raise invalid(owner, name, "a number in [0, 1]", value)
    return float(value)


def valid_choice_weights(owner: str, value: Any, count: int, name: str = "p") -> tuple[float, ...]:
    """``count`` finite numbers ``>= 0``, not all 0, normalized to sum to 1 (as torchvision's
    ``RandomChoice`` takes ``p``)."""
    try:
        p = [float(x) for x in value] if isinstance(value, Sequence) and not isinstance(value, str) else []
    except (TypeError, ValueError):
        p = []
    if len(p) != count or not all(0 <= x < math.inf for x in p) or sum(p) <= 0:
        raise ConfigError(f"{owner}: {name} must be {count} non-negative numbers, not all 0, got {value!r}")
    total = sum(p)
    return tuple(x / total for x in p)


def valid_enum(owner: str, value: Any, name: str, kind: type[E]) -> E:
    """A member of ``kind``, or the value of one (so that another library's enum with the same
    string values, such as torchvision's ``InterpolationMode``, is accepted)."""
    raw = getattr(value, "value", value)
    try:
        return kind(raw)
    except ValueError:
        names = ", ".join(m.name for m in kind)
        raise invalid(owner, name, f"a {kind.__name__} ({names}) or its value", value) from None


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def valid_bytes(owner: str, value: Any, name: str) -> int | None:
    """A size in bytes: an int, or a string with a unit (``"500GB"``, ``"1.5 TB"``, ``"800MiB"``;
    decimal units as disks are sold, binary ones with ``i``); ``None`` passes."""
    if value is None:
        return None
    if isinstance(value, str):
        import re

        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"{owner}: {name} must be bytes as an int or a string like '500GB', '1.5TB' or '800MiB', got {value!r}"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    return valid_int(owner, value, name, minimum=1)
