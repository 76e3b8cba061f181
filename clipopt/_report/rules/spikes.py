"""The spike rules: gradient-norm outliers against a rolling window, and loss spikes."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..read import GradLog
from ..text import fmt_num as _num
from .common import (
    HANDLED_ROWS,
    LOSS_SPIKE_RATIO,
    LOSS_SPIKE_Z,
    LOSS_WINDOW,
    MAX_LISTED_STEPS,
    SPIKE_MIN_HISTORY,
    SPIKE_MIN_RATIO,
    SPIKE_TOP,
    SPIKE_WINDOW,
    SPIKE_Z,
    as_tensor,
    median_of,
    steps_text,
)


def rolling(x: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, population std and count of the previous up to ``window`` values, for every index."""
    n = x.numel()
    shift = float(x.mean()) if n else 0.0
    y = x - shift
    c1 = torch.cat([torch.zeros(1, dtype=x.dtype), y.cumsum(0)])
    c2 = torch.cat([torch.zeros(1, dtype=x.dtype), (y * y).cumsum(0)])
    j = torch.arange(n)
    lo = (j - window).clamp(min=0)
    count = (j - lo).to(x.dtype)
    safe = count.clamp(min=1)
    s1 = (c1[j] - c1[lo]) / safe
    s2 = (c2[j] - c2[lo]) / safe
    var = (s2 - s1 * s1).clamp(min=0)
    return s1 + shift, var.sqrt(), count


def norm_spikes(
    log: GradLog, norm: Tensor, loss: Tensor, end: int, skipped: frozenset[int] = frozenset()
) -> tuple[dict[str, Any] | None, list[int]]:
    """Norm spikes before row ``end`` and the steps of the spikes clipping handled; a spike at one of
    the ``skipped`` rows (spike skips the loss stayed calm after, :func:`skips_handled`) is neither."""
    spikes: list[dict[str, Any]] = []
    handled: list[int] = []
    for row, x, mean, z in log_norm_outliers(norm[:end]):
        if row in skipped:
            continue
        if log.clipped[row] and loss_calm_after(loss, row):
            handled.append(log.steps[row])
            continue
        spikes.append({"row": row, "step": log.steps[row], "norm": x, "mean": mean, "z": z})
    return (_norm_spikes_finding(log, spikes) if spikes else None), handled


def skips_handled(loss: Tensor, rows: list[int]) -> list[int]:
    """The spike-skip ``rows`` (reason ``spike``: a SpikeGuard's, or a policy's ``skip_spikes``) that
    the skip handled: the median loss of the next HANDLED_ROWS applied rows after each (the other
    skips left out: a bad shard is skipped window after window) stays below LOSS_SPIKE_RATIO x the
    median of the applied losses before it.  Without a loss in the log every skip is handled: a
    skipped update never reached the parameters."""
    if not rows or bool(torch.isnan(loss).all()):
        return list(rows)
    applied = loss.clone()
    applied[torch.tensor(rows, dtype=torch.int64)] = math.nan
    given = (~torch.isnan(applied)).nonzero().flatten()  # sorted: a search per skip, not a scan
    at = torch.searchsorted(given, torch.tensor(rows, dtype=given.dtype)).tolist()
    out = []
    for row, p in zip(rows, at, strict=True):
        before = applied[given[max(0, p - LOSS_WINDOW) : p]]
        before = before[torch.isfinite(before)]
        after = applied[given[p : p + HANDLED_ROWS]]  # the skip's own row is not in given
        if before.numel() == 0 or after.numel() == 0:
            out.append(row)
            continue
        ref = median_of(before)
        if bool(torch.isfinite(after).all()) and (ref <= 0 or median_of(after) <= LOSS_SPIKE_RATIO * ref):
            out.append(row)
    return out


def log_norm_outliers(head: Tensor) -> list[tuple[int, float, float, float]]:
    """The rows of ``head`` whose log-norm is a spike over the rolling window: ``(row, norm, mean, z)``.

    A spike has at least SPIKE_MIN_HISTORY finite norms before it, a z-score of
    its logarithm above SPIKE_Z, and a norm of at least SPIKE_MIN_RATIO x the
    window's mean (``mean``)."""
    idx = (torch.isfinite(head) & (head > 0)).nonzero().flatten()
    x = head[idx]
    if x.numel() <= SPIKE_MIN_HISTORY:
        return []
    logs = x.log()
    mean_log, std_log, count = rolling(logs, SPIKE_WINDOW)
    scale = float(x.max())
    mean_raw = rolling(x / scale, SPIKE_WINDOW)[0] * scale
    excess = logs - mean_log
    z = torch.where(std_log > 0, excess / std_log.clamp(min=1e-300), torch.where(excess > 0, math.inf, 0.0))
    hit = (count >= SPIKE_MIN_HISTORY) & (z > SPIKE_Z) & (x >= SPIKE_MIN_RATIO * mean_raw)
    pos = hit.nonzero().flatten().tolist()
    return [(int(idx[p]), float(x[p]), float(mean_raw[p]), float(z[p])) for p in pos]


def _norm_spikes_finding(log: GradLog, spikes: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``spikes`` finding for the (not handled) norm spikes: the largest, its layer, every step."""
    top = sorted(spikes, key=lambda s: -s["z"])[:SPIKE_TOP]
    big = top[0]
    layer = _most_unusual_layer(log, big["row"])
    steps = [s["step"] for s in spikes]
    at_layer = f"; at that step {layer} had the largest gradient norm against its median" if layer else ""
    evidence = (
        f"{len(spikes)} spike(s) (log-norm z > {SPIKE_Z:g} over the previous up to {SPIKE_WINDOW} "
        f"updates and >= {SPIKE_MIN_RATIO:g}x their mean) at step(s) {steps_text(steps)}; "
        f"largest at step {big['step']}: norm {_num(big['norm'])}, {_num(big['norm'] / big['mean'])}x the "
        f"rolling mean {_num(big['mean'])}, z = {_num(big['z'])}{at_layer}"
    )
    return spike_finding("spikes", spikes, top, layer, evidence)


def spike_finding(
    kind: str, spikes: list[dict[str, Any]], top: list[dict[str, Any]], layer: str | None, evidence: str
) -> dict[str, Any]:
    """A spike finding of ``kind`` (verdict ``spikes``): its first step, every step (the first
    MAX_LISTED_STEPS) and row, the ``top`` spikes, the layer named and the evidence."""
    steps = [s["step"] for s in spikes]
    return {
        "kind": kind,
        "verdict": "spikes",
        "step": steps[0],
        "layer": layer,
        "evidence": evidence,
        "values": {
            "count": len(spikes),
            "steps": steps[:MAX_LISTED_STEPS],
            "rows": [s["row"] for s in spikes],
            "steps_truncated": len(steps) > MAX_LISTED_STEPS,
            "top": top,
        },
    }


def loss_calm_after(loss: Tensor, row: int) -> bool:
    """The loss of the next rows stays below LOSS_SPIKE_RATIO x the median before (False without a loss)."""
    if bool(torch.isnan(loss).all()):
        return False
    before = loss[max(0, row - LOSS_WINDOW) : row]
    before = before[torch.isfinite(before)]
    after = loss[row + 1 : row + 1 + HANDLED_ROWS]
    after = after[~torch.isnan(after)]
    if before.numel() == 0 or after.numel() == 0:
        return True
    if not bool(torch.isfinite(after).all()):
        return False
    ref = median_of(before)
    return median_of(after) <= LOSS_SPIKE_RATIO * ref if ref > 0 else True


def loss_spikes(
    log: GradLog, loss: Tensor, end: int, skipped: frozenset[int] = frozenset()
) -> dict[str, Any] | None:
    """The ``loss_spikes`` finding: losses before row ``end`` far above the rolling mean before them
    (but at the ``skipped`` rows: spike skips that handled them)."""
    head = loss[:end]
    idx = torch.isfinite(head).nonzero().flatten()
    x = head[idx]
    if x.numel() <= SPIKE_MIN_HISTORY:
        return None
    mean, std, count = rolling(x, LOSS_WINDOW)
    hit = (count >= SPIKE_MIN_HISTORY) & (x - mean > LOSS_SPIKE_Z * std) & (x > LOSS_SPIKE_RATIO * mean)
    hit &= mean > 0
    pos = [p for p in hit.nonzero().flatten().tolist() if int(idx[p]) not in skipped]
    if not pos:
        return None
    rows = [int(idx[p]) for p in pos]
    steps = [log.steps[r] for r in rows]
    big = max(pos, key=lambda p: float((x[p] - mean[p]) / std[p].clamp(min=1e-300)))
    evidence = (
        f"{len(pos)} loss spike(s) (> {LOSS_SPIKE_Z:g} std and > {LOSS_SPIKE_RATIO:g}x the mean of the previous "  # noqa: E501
        f"up to {LOSS_WINDOW} losses) at step(s) {steps_text(steps)}; largest at step {log.steps[int(idx[big])]}: "  # noqa: E501
        f"loss {_num(float(x[big]))} against a rolling mean {_num(float(mean[big]))}"
    )
    return {
        "kind": "loss_spikes",
        "verdict": "spikes",
        "step": steps[0],
        "layer": None,
        "evidence": evidence,
        "values": {"count": len(pos), "steps": steps[:MAX_LISTED_STEPS], "rows": rows[:MAX_LISTED_STEPS]},
    }


def _most_unusual_layer(log: GradLog, row: int) -> str | None:
    """The layer with the largest gradient norm against its median at row ``row`` (None: no per-layer row)."""
    pos = next((p for p, r in enumerate(log.layer_rows) if r == row), None)
    if pos is None:
        return None
    best: tuple[str | None, float] = (None, -math.inf)
    for name, cols in log.layers.items():
        g = as_tensor(cols["grad_norm"])
        x = float(g[pos])
        history = g[torch.isfinite(g)]
        if not math.isfinite(x) or history.numel() == 0:
            continue
        med = median_of(history)
        ratio = x / med if med > 0 else math.inf
        if ratio > best[1]:
            best = (name, ratio)
    return best[0]
