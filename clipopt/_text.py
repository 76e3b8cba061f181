"""Small helpers shared by the command-line outputs: numbers as text, JSON without nan."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["fmt_num", "json_safe"]


def fmt_num(value: float | None) -> str:
    """4 significant digits; 'nan', 'inf', '-inf' spelled out; '-' for None."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as the strings 'nan', 'inf', '-inf' (valid JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else fmt_num(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
