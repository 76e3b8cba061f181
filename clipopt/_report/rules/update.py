"""The update-norm rules, for logs that record the update (``update_clip=`` or ``update_stats=True``):
update spikes that no gradient spike explains, and the suggested ``UpdateClip`` bounds.

Both are documented in :mod:`clipopt._report.rules` (the module docstring, 'Update norm').
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..read import GradLog
from ..text import fmt_num as _num
from .common import (
    SPIKE_MIN_RATIO,
    SPIKE_TOP,
    SPIKE_WINDOW,
    SPIKE_Z,
    UPDATE_ECHO_ROWS,
    UPDATE_Z_MIN,
    UPDATE_Z_WINDOW,
    as_tensor,
    median_of,
    steps_text,
)
from .spikes import log_norm_outliers, loss_calm_after, rolling, spike_finding
from .threshold import healthy_stretch

#: What the update-spike finding advises (its evidence ends with it).
UPDATE_ADVICE = (
    "the inner optimizer's state amplified an ordinary gradient (e.g. Adam's second moment, still "
    "small after a quiet stretch of a parameter); bound the update: "
    "update_clip=UpdateClip(max_norm=...) or UpdateClip(z=...) (suggested below)"
)


@dataclass
class UpdateRules:
    """What the update rules found (:func:`update_rules`): the update norms (a float64 view of the
    log's), the ``update_spikes`` finding (None: none), the steps of the update spikes ``UpdateClip``
    handled, and the rows left out of the healthy stretch (update and gradient spikes, and the
    UPDATE_ECHO_ROWS after each, where momentum carries them)."""

    update: Tensor
    finding: dict[str, Any] | None
    handled: list[int]
    left_out: set[int]


def update_rules(log: GradLog, norm: Tensor, loss: Tensor, end: int) -> UpdateRules | None:
    """The update-spike rule over the rows before ``end`` (None: the log has no update norm)."""
    if not log.has_update_norm:
        return None
    update = as_tensor(log.update_norm)
    grad_rows = {row for row, *_ in log_norm_outliers(norm[:end])}
    finding, handled, rows = update_spikes(log, update, grad_rows, loss, end)
    echoes = {r + k for r in grad_rows | set(rows) for k in range(UPDATE_ECHO_ROWS + 1)}
    return UpdateRules(update, finding, handled, {r for r in echoes if r < len(log)})


def per_lr(log: GradLog, update: Tensor) -> Tensor:
    """The update norms per unit of learning rate (group 0's) in the rows that record a positive finite
    one (``nan`` in the others); the update norms themselves when no row records one."""
    lr = as_tensor(log.lr)
    usable = torch.isfinite(lr) & (lr > 0)
    if not bool(usable.any()):
        return update
    return torch.where(usable, update / lr.where(usable, torch.ones_like(lr)), math.nan)


def update_outliers(log: GradLog, update: Tensor, end: int) -> list[tuple[int, float, float, float]]:
    """The update-norm spikes before row ``end`` (per unit of learning rate, rows of applied updates):
    ``(row, update norm, ratio to the rolling mean, z)``, by the gradient-norm spike rule."""
    scaled = per_lr(log, update).where(~_skipped(log), math.nan)[:end]
    return [(row, float(update[row]), x / mean, z) for row, x, mean, z in log_norm_outliers(scaled)]


def update_spikes(
    log: GradLog, update: Tensor, grad_rows: set[int], loss: Tensor, end: int
) -> tuple[dict[str, Any] | None, list[int], list[int]]:
    """The ``update_spikes`` finding (the update spikes no gradient spike explains, not handled by
    ``UpdateClip``), the steps of those ``UpdateClip`` handled, and every update spike's row."""
    outliers = update_outliers(log, update, end)
    spikes, handled = [], []
    for row, x, ratio, z in outliers:
        if any(r in grad_rows for r in range(row - UPDATE_ECHO_ROWS, row + 1)):
            continue  # a gradient spike at that step or just before (momentum carries it)
        if log.update_coef[row] < 1.0 and loss_calm_after(loss, row):
            handled.append(log.steps[row])
            continue
        spikes.append({"row": row, "step": log.steps[row], "update_norm": x, "ratio": ratio, "z": z})
    finding = _finding(log, spikes) if spikes else None
    return finding, handled, [row for row, *_ in outliers]


def _finding(log: GradLog, spikes: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``update_spikes`` finding: every step, the largest spike and the gradient norm at its step."""
    top = sorted(spikes, key=lambda s: -s["z"])[:SPIKE_TOP]
    big = top[0]
    steps = [s["step"] for s in spikes]
    grad = as_tensor(log.total_norm)
    evidence = (
        f"{len(spikes)} update-norm spike(s) without a gradient-norm spike (log of the update norm per "
        f"unit of learning rate: z > {SPIKE_Z:g} over the previous up to {SPIKE_WINDOW} updates and >= "
        f"{SPIKE_MIN_RATIO:g}x their mean; no gradient-norm spike at that step or in the "
        f"{UPDATE_ECHO_ROWS} before it) at step(s) {steps_text(steps)}; largest at step {big['step']}: "
        f"update norm {_num(big['update_norm'])}, {_num(big['ratio'])}x the rolling mean, "
        f"z = {_num(big['z'])}, while the gradient norm was {_num(float(grad[big['row']]))}, "
        f"{_num(_grad_ratio(grad, big['row']))}x its rolling mean: {UPDATE_ADVICE}"
    )
    return spike_finding("update_spikes", spikes, top, None, evidence)


def _grad_ratio(grad: Tensor, row: int) -> float:
    """The gradient norm at ``row`` over the mean of the previous up to SPIKE_WINDOW finite ones."""
    head = grad[: row + 1]
    finite = head[torch.isfinite(head)]
    before = finite[-SPIKE_WINDOW - 1 : -1]
    mean = float(before.mean()) if before.numel() else math.nan
    return float(grad[row]) / mean if mean > 0 else math.nan


def update_summary(log: GradLog, rules: UpdateRules | None, end: int) -> dict[str, Any] | None:
    """The ``update`` key of the report: the column read, the recorded update norms, how often
    ``UpdateClip`` bounded them, and the suggested bounds (:func:`suggest_update_clip`) from the
    healthy stretch before row ``end``; None when the log has no update norm."""
    if rules is None:
        return None
    update = rules.update
    applied = _applied(log, update)
    x = update[applied]
    coef = as_tensor(log.update_coef)
    bounded = int((applied & (coef < 1.0)).sum())
    return {
        "column": log.update_column,
        "recorded": int(x.numel()),
        "median": median_of(x) if x.numel() else None,
        "max": float(x.max()) if x.numel() else None,
        "bounded": bounded,
        "suggested": suggest_update_clip(log, update, end, rules.left_out, rules.finding),
    }


def _skipped(log: GradLog) -> Tensor:
    """The ``skipped`` column as booleans."""
    if not log.skipped:
        return torch.zeros(0, dtype=torch.bool)
    return torch.frombuffer(log.skipped, dtype=torch.uint8).bool()


def _applied(log: GradLog, update: Tensor) -> Tensor:
    """Rows of applied updates with a finite update norm: what ``UpdateClip``'s history takes."""
    return torch.isfinite(update) & ~_skipped(log)


def suggest_update_clip(
    log: GradLog, update: Tensor, end: int, left_out: set[int], spikes: dict[str, Any] | None
) -> dict[str, Any] | None:
    """``UpdateClip(max_norm=...)``: the largest update norm of the healthy stretch (the rows before
    ``end``, the rows ``left_out`` -- update and gradient spikes -- left out); ``UpdateClip(z=...)``:
    the smallest z (in half steps, at least UPDATE_Z_MIN) under which UpdateClip's rolling bound
    bounds no update of that stretch (None: the history never held UPDATE_Z_WINDOW // 2 updates).
    With the count of the update spikes found (``spikes``) that each would have bounded."""
    stretch = healthy_stretch(update, end, left_out)
    if stretch.numel() == 0:
        return None
    max_norm = float(stretch.max())
    mean, std, zs = _z_limits(log, update, end, left_out)
    z = None if zs is None else max(UPDATE_Z_MIN, math.ceil(2 * zs) / 2)
    rows = spikes["values"]["rows"] if spikes is not None else []
    by_z = sum(1 for r in rows if z is not None and float(update[r]) > float(mean[r] + z * std[r]))
    return {
        "max_norm": max_norm,
        "z": z,
        "window": UPDATE_Z_WINDOW,
        "healthy_updates": int(stretch.numel()),
        "spikes": len(rows),
        "spikes_bounded": {"max_norm": sum(1 for r in rows if float(update[r]) > max_norm), "z": by_z},
    }


def _z_limits(
    log: GradLog, update: Tensor, end: int, left_out: set[int]
) -> tuple[Tensor, Tensor, float | None]:
    """UpdateClip's history at every row: the mean and ``max(std, 1e-6)`` of the previous up to
    UPDATE_Z_WINDOW applied update norms (``nan`` while it holds fewer than ``window // 2``), and the
    largest ``(norm - mean) / std`` over the healthy stretch's rows (None: no row had a bound)."""
    applied = _applied(log, update)
    rows = applied.nonzero().flatten()
    mean = torch.full_like(update, math.nan)
    std = torch.full_like(update, math.nan)
    m, s, count = rolling(update[rows], UPDATE_Z_WINDOW)
    ready = count >= max(2, UPDATE_Z_WINDOW // 2)
    mean[rows[ready]], std[rows[ready]] = m[ready], s[ready].clamp(min=1e-6)
    healthy = applied & ~torch.isnan(mean)
    healthy[end:] = False
    for r in left_out:
        healthy[r] = False
    z = (update - mean) / std
    return mean, std, float(z[healthy].max()) if bool(healthy.any()) else None
