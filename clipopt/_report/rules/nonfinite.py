"""The non-finite rule: the first window with nan/inf gradients, and the layer where they began."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ..read import GradLog
from ..text import fmt_num as _num


def nonfinite_finding(log: GradLog, bad_rows: Tensor) -> dict[str, Any]:
    """The ``nonfinite`` finding: the first non-finite update, how many were applied, and its layer."""
    first = int(bad_rows[0])
    step = log.steps[first]
    skipped = sum(log.skipped[int(i)] for i in bad_rows[:1_000_000].tolist())
    applied = int(bad_rows.numel()) - skipped
    layer, how, bad_layers, layer_step = _nonfinite_layer(log, first)
    tail = ""
    if applied and first + 1 < len(log) and all(not math.isfinite(v) for v in log.total_norm[first + 1 :]):
        tail = "; it was applied and every later update is non-finite too (the parameters went non-finite)"
    evidence = (
        f"total norm {_num(log.total_norm[first])} at step {step}, the first of {bad_rows.numel()} non-finite "  # noqa: E501
        f"update(s) ({skipped} skipped, {applied} applied); {how}{tail}"
    )
    return {
        "kind": "nonfinite",
        "verdict": "nonfinite",
        "step": step,
        "layer": layer,
        "evidence": evidence,
        "values": {
            "row": first,
            "total_norm": log.total_norm[first],
            "count": int(bad_rows.numel()),
            "applied": applied,
            "layer_step": layer_step,
            "nonfinite_layers": bad_layers,
        },
    }


def _nonfinite_layer(log: GradLog, first: int) -> tuple[str | None, str, dict[str, int], int | None]:
    """The layer of the first non-finite row ``first``: ``(layer, how it was found, bad layers, step)``.

    Taken from the first per-layer row at or after it; ``bad layers`` maps each
    non-finite parameter to its count of non-finite elements (-1: not counted)."""
    pos = next((p for p, r in enumerate(log.layer_rows) if r >= first), None)
    if pos is None:
        return None, "no per-layer statistics were recorded at or after it", {}, None
    layer_step = log.steps[log.layer_rows[pos]]
    bad_layers = _nonfinite_layers_at(log, pos)
    own = layer_step == log.steps[first]
    where = "in its own per-layer row" if own else f"in the next per-layer row (step {layer_step}), a guess"
    if not bad_layers:
        return None, f"no parameter recorded non-finite elements {where}", bad_layers, layer_step
    layer = next(iter(bad_layers))
    how = (
        f"first parameter with a non-finite gradient {where}: {layer} "
        f"({len(bad_layers)} of {len(log.layers)} non-finite)"
    )
    return layer, how, bad_layers, layer_step


def _nonfinite_layers_at(log: GradLog, pos: int) -> dict[str, int]:
    """The parameters non-finite in per-layer row ``pos``, in parameter order, with their counts."""
    bad_layers = {}
    for name, cols in log.layers.items():
        count, g = cols["nonfinite"][pos], cols["grad_norm"][pos]
        # a non-finite norm is a non-finite gradient where the log counts no non-finite elements
        # (Lightning); where it counts them (clipopt), the count decides: a nan norm without one is a
        # parameter without a gradient, an inf norm without one a finite gradient whose float32 norm
        # overflowed (elements of 1e25), not the parameter that went non-finite
        counted = name in log.counted
        if (math.isfinite(count) and count > 0) or (not counted and not math.isfinite(g)):
            bad_layers[name] = int(count) if math.isfinite(count) else -1
    return bad_layers
