"""Argument validation: every message names the argument, the value and the fix."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

__all__ = [
    "check_choice",
    "check_flag",
    "check_float_between",
    "check_int_at_least",
    "check_names",
    "check_norm_type",
    "check_optional_positive_float",
    "check_optional_positive_int",
    "check_path",
    "check_positive_finite",
    "check_positive_float",
    "check_positive_int",
]


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_positive_finite(name: str, value: Any, fix: str, *, or_none: bool = False) -> float:
    """A finite float > 0 (bool refused; the caller handles None); the messages end with ``fix``
    and, with ``or_none``, say that None is taken too."""
    what, none = ("a float or None", " or None") if or_none else ("a positive float", "")
    if not _is_real(value):
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__}); {fix}")
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a positive finite number{none}, got {value!r}; {fix}")
    return v


def check_optional_positive_float(name: str, value: Any, example: str) -> float | None:
    """None, or a finite float > 0."""
    if value is None:
        return None
    fix = f"pass e.g. {name}={example}, or {name}=None to turn it off"
    return check_positive_finite(name, value, fix, or_none=True)


def _fix(name: str, example: str, hint: str) -> str:
    """The fix a message ends with: a value to pass, and why when ``hint`` says it."""
    return f"pass e.g. {name}={example}" + (f" ({hint})" if hint else "")


def check_positive_float(name: str, value: Any, example: str, hint: str = "") -> float:
    """A finite float > 0 (None refused); ``hint``: what the argument is, after the example."""
    fix = _fix(name, example, hint)
    if value is None:
        raise TypeError(f"{name} must be a positive float, got None; {fix}")
    return check_positive_finite(name, value, fix)


def check_float_between(
    name: str, value: Any, low: float, high: float, example: str, hint: str = "", *, open_high: bool = False
) -> float:
    """A float in ``[low, high]`` (``open_high``: ``[low, high)``; bool refused); ``hint``: what the
    argument is, after the example."""
    interval = f"[{low:g}, {high:g}{')' if open_high else ']'}"
    if not _is_real(value):
        raise TypeError(
            f"{name} must be a float in {interval}, got {value!r} ({type(value).__name__}); "
            f"{_fix(name, example, hint)}"
        )
    v = float(value)
    if not (low <= v < high if open_high else low <= v <= high):
        raise ValueError(f"{name} must be in {interval}, got {value!r}; {_fix(name, example, hint)}")
    return v


def check_norm_type(value: Any) -> float:
    """A float p > 0 or float('inf')."""
    if not _is_real(value):
        raise TypeError(
            f"norm_type must be a float, got {value!r} ({type(value).__name__}); "
            "pass e.g. norm_type=2.0 or norm_type=float('inf')"
        )
    p = float(value)
    if not (p > 0) or math.isnan(p):
        raise ValueError(
            f"norm_type must be > 0 or float('inf'), got {value!r}; "
            "pass e.g. norm_type=2.0 or norm_type=float('inf')"
        )
    return p


def check_int_at_least(name: str, value: Any, minimum: int, example: int) -> int:
    """An int >= ``minimum`` (bool rejected)."""
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise TypeError(
            f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__}); "
            f"pass e.g. {name}={example}"
        )
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}; pass e.g. {name}={example}")
    return int(value)


def check_positive_int(name: str, value: Any, example: int = 4) -> int:
    """An int >= 1 (bool rejected)."""
    return check_int_at_least(name, value, 1, example)


def check_path(name: str, value: Any, example: str) -> str | os.PathLike[str]:
    """A str or os.PathLike."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be a str or os.PathLike, got {type(value).__name__}; pass e.g. {example!r}"
        )
    return value


def check_optional_positive_int(name: str, value: Any) -> int | None:
    """None, or an int >= 1."""
    if value is None:
        return None
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise TypeError(
            f"{name} must be an int >= 1 or None, got {value!r} ({type(value).__name__}); "
            f"pass e.g. {name}=8, or {name}=None to turn it off"
        )
    if value < 1:
        raise ValueError(
            f"{name} must be an int >= 1 or None, got {value!r}; "
            f"pass e.g. {name}=8, or {name}=None to turn it off"
        )
    return int(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of a few strings."""
    if value not in choices:
        options = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be {options}, got {value!r}; pass e.g. {name}={choices[0]!r}")
    return str(value)


def check_flag(name: str, value: Any) -> bool:
    """A real bool."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False, got {value!r} ({type(value).__name__}); "
            f"pass {name}=True or {name}=False"
        )
    return value


def check_names(name: str, value: Any, allowed: tuple[str, ...], example: str = "") -> tuple[str, ...]:
    """A tuple (or list) of names from ``allowed``, each at most once and at least one, in the order
    given; ``example``: a value to pass (default: ``allowed`` itself)."""
    fix = f"pass e.g. {name}={example or repr(allowed)}"
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a tuple of names from {allowed!r}, got {value!r}; {fix}")
    out = tuple(value)
    unknown = [v for v in out if v not in allowed]
    if not out or unknown or len(set(out)) != len(out):
        raise ValueError(
            f"{name} must name each of {allowed!r} at most once, and at least one, got {value!r}; {fix}"
        )
    return out
