"""Small helpers shared by the command-line tools: numbers as text, JSON without nan, whole-number options."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["fmt_num", "fmt_scale", "json_safe", "whole_number"]


def fmt_num(value: float | None) -> str:
    """4 significant digits; 'nan', 'inf', '-inf' spelled out; '-' for None."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def fmt_scale(value: float | None) -> str:
    """A GradScaler's loss scale: a whole number (a power of two, as GradScaler keeps it) in full,
    e.g. 65536 rather than :func:`fmt_num`'s 6.554e+04; anything else as :func:`fmt_num` does."""
    if value is not None and math.isfinite(value) and float(value).is_integer() and abs(value) < 2.0**53:
        return str(int(value))
    return fmt_num(value)


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as the strings 'nan', 'inf', '-inf' (valid JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else fmt_num(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def whole_number(text: str, minimum: int | None = None) -> int:
    """An option's ``text`` as an int of at least ``minimum`` (an argparse ``type``: argparse
    prefixes the message with the option's name, e.g. "argument --steps: must be ...")."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise argparse.ArgumentTypeError(f"must be a whole number{bound}, got {text!r}")
    return value
