"""The exploding rule: norms that grow for good, or a loss that blows up and stays up."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..read import GradLog
from ..text import fmt_num as _num
from .common import (
    BLOCK_MIN,
    GROWTH_MIN_UPDATES,
    GROWTH_ONSET_RATIO,
    GROWTH_RATIO,
    LOSS_BLOWUP,
    LOSS_SPIKE_RATIO,
    LOSS_SPIKE_Z,
    LOSS_STAY,
    LOSS_WINDOW,
    MAX_CANDIDATES,
    MAX_LEVEL_CHECKS,
    OVERFLOW_NAME,
    SPIKE_MIN_HISTORY,
    START_ROWS,
    as_tensor,
    block,
    median_of,
    start_level,
)


def _sustained_onset(x: Tensor, threshold: float, k: int, back: float | None) -> int | None:
    """The first index j with ``x[j] > threshold`` and the median of ``x[j:j+k]`` above it (nan/inf:
    above), after the last whole block of ``k`` values whose median came ``back`` to at most that
    level (the start).  A run that went up and came back (a turbulent start that settled, then a
    blow-up later) has its onset where it went up to stay, not at its first excursion; a run that
    went up and hovers between ``back`` and the threshold never came back.  ``back=None``: the
    first excursion that lasted a block, whatever came after."""
    above = (x > threshold) | ~torch.isfinite(x)
    # a median above the threshold needs at least half of x[j:j+k] above it: one count filters the
    # candidates, so heavy-tailed norms do not take a median per candidate (1M rows: 20 s before)
    n = int(x.numel())
    count = torch.cat([torch.zeros(1, dtype=torch.int64), above.cumsum(0)])
    rows = above.nonzero().flatten()
    if back is not None:
        rows = rows[rows > last_calm_block(x, back, k)]
    ends = (rows + k).clamp(max=n)
    rows = rows[count[ends] - count[rows] >= (ends - rows) // 2]
    candidates = rows[:MAX_CANDIDATES].tolist()
    y = torch.where(torch.isfinite(x), x, torch.full_like(x, math.inf))
    for j in candidates:
        if median_of(y[j : j + k]) > threshold:
            return int(j)
    return None


def last_calm_block(x: Tensor, level: float, k: int) -> int:
    """The start of the last whole block ``x[i:i+k]`` whose median is at or below ``level`` (nan/inf:
    above); -1 when none is."""
    found = _calm_block(x, level, k, torch.arange(int(x.numel()) - k + 1).flip(0))
    return -1 if found is None else found


def _calm_block(x: Tensor, threshold: float, k: int, starts: Tensor) -> int | None:
    """The first of ``starts`` (in their order) whose whole block ``x[i:i+k]`` has its median at or
    below ``threshold`` (nan/inf: above); None when none has.  Such a median needs at least
    ``ceil(k/2)`` values at or below it: one count filters the blocks, and at most MAX_CANDIDATES
    medians are taken."""
    n = int(x.numel())
    starts = starts[(starts >= 0) & (starts <= n - k)] if k >= 1 else starts[:0]
    if starts.numel() == 0:
        return None
    below = (x <= threshold) & torch.isfinite(x)
    count = torch.cat([torch.zeros(1, dtype=torch.int64), below.cumsum(0)])
    maybe = starts[count[starts + k] - count[starts] >= (k + 1) // 2]
    y = torch.where(torch.isfinite(x), x, torch.full_like(x, math.inf))
    for i in maybe[:MAX_CANDIDATES].tolist():
        if median_of(y[i : i + k]) <= threshold:
            return int(i)
    return None


def recovered_blowup(
    log: GradLog, loss: Tensor, first_bad: int, end: int, skipped: list[int]
) -> dict[str, Any] | None:
    """The ``recovered_blowup`` finding (verdict ``spikes``): before row ``end`` (an explosion's onset),
    the loss went over LOSS_BLOWUP x its start and stayed over LOSS_STAY x it for a block, then came
    back to its start or under (a whole block's median).  Not an explosion -- the run goes on -- but
    a sign that the steps were too large for that stretch: the learning rate, or its warm-up.

    The losses of the ``skipped`` rows (spike skips: their update never happened) are left out.  A
    stretch that begins with a loss spike over a calm history (:func:`_jumped_from_calm`) and with no
    rise of the learning rate before it is a bad stretch of data, whose loss returns as soon as the
    data does: the spike rules report it."""
    applied = loss.clone()
    if skipped:
        applied[torch.tensor(skipped, dtype=torch.int64)] = math.nan
    counted = _counted_losses(applied, first_bad)
    if counted is None:
        return None
    rows, values, start = counted
    k = block(int(rows.numel()))
    threshold = LOSS_STAY * start
    j = _sustained_onset(values, threshold, k, None)
    if j is None or int(rows[j]) >= end:
        return None
    if _jumped_from_calm(values, j) and not _lr_rose_before(log, int(rows[j]), k):
        return None
    back = _calm_block(values, start, k, torch.arange(j + 1, int(values.numel()) - k + 1))
    if back is None:
        return None
    stretch = values[j:back]
    finite = stretch[torch.isfinite(stretch)]
    top = float(finite.max()) if finite.numel() else math.inf
    if not (top > LOSS_BLOWUP * start):
        return None
    return _recovered_finding(log, rows, values, (j, back, k), start, top)


def _recovered_finding(
    log: GradLog, rows: Tensor, values: Tensor, where: tuple[int, int, int], start: float, top: float
) -> dict[str, Any]:
    """The ``recovered_blowup`` finding of :func:`recovered_blowup` (``where``: the stretch's first
    value, the first value of the calm block after it, the block's size)."""
    j, back, k = where
    row, back_row = int(rows[j]), int(rows[back])
    lr = log.lr[row] if row < len(log.lr) and math.isfinite(log.lr[row]) else None
    at_lr = f"; lr {_num(lr)} there" if lr is not None else ""
    evidence = (
        f"the loss left its start {_num(start)} at step {log.steps[row]} (loss {_num(float(values[j]))}, "
        f"highest {_num(top)}, {_num(top / start)}x the start) and came back: the median of the {k} "
        f"logged losses from step {log.steps[back_row]} is back at or under the start{at_lr}"
    )
    values_ = {"row": row, "start_loss": start, "peak": top, "back_step": log.steps[back_row], "block": k}
    return {
        "kind": "recovered_blowup",
        "verdict": "spikes",
        "step": log.steps[row],
        "layer": None,
        "evidence": evidence,
        "values": {**values_, "lr": lr},
    }


def _jumped_from_calm(values: Tensor, j: int) -> bool:
    """``values[j]`` is a loss spike over the losses before it (the loss spike rule: at least
    SPIKE_MIN_HISTORY of them, more than LOSS_SPIKE_Z standard deviations and LOSS_SPIKE_RATIO x the
    mean of the previous up to LOSS_WINDOW above it)."""
    before = values[max(0, j - LOSS_WINDOW) : j]
    before = before[torch.isfinite(before)]
    if before.numel() < SPIKE_MIN_HISTORY:
        return False
    mean, std = float(before.mean()), float(before.std(unbiased=False))
    x = float(values[j])
    spike = x - mean > LOSS_SPIKE_Z * std and x > LOSS_SPIKE_RATIO * mean
    return mean > 0 and (not math.isfinite(x) or spike)


def _lr_rose_before(log: GradLog, row: int, k: int) -> bool:
    """Group 0's learning rate (as logged) at ``row`` is above its value ``k`` rows before."""
    if row >= len(log.lr):
        return False
    now, then = log.lr[row], log.lr[max(0, row - k)]
    return math.isfinite(now) and math.isfinite(then) and now > then


def loss_blowup(log: GradLog, loss: Tensor, first_bad: int) -> dict[str, Any] | None:
    """The ``blowup`` finding: the loss left its start, or the level it had reached, for good."""
    counted = _counted_losses(loss, first_bad)
    if counted is None:
        return None
    rows, values, start = counted
    peak = (values > LOSS_BLOWUP * start) | torch.isinf(values)
    k = block(int(rows.numel()))
    j = _sustained_onset(values, LOSS_STAY * start, k, start) if peak.any() else None
    ref, ref_text = start, f"its start {_num(start)}"
    if j is None:
        found = _blowup_from_level(values, k)
        if found is None:
            return None
        j, ref = found
        ref_text = f"the level {_num(ref)} it had reached (median of the previous {k} logged losses)"
    row = int(rows[j])
    top = float(values[torch.isfinite(values)].max()) if torch.isfinite(values).any() else math.nan
    after = median_of(torch.where(torch.isfinite(values[j : j + k]), values[j : j + k], math.inf))
    evidence = (
        f"the loss left {ref_text} for good at step {log.steps[row]} "
        f"(loss {_num(float(values[j]))}; median of the next {k} logged losses {_num(after)}, above "
        f"{LOSS_STAY:g}x that; highest finite loss {_num(top)}, blow-up at > {LOSS_BLOWUP:g}x)"
    )
    return {
        "kind": "blowup",
        "verdict": "exploding",
        "step": log.steps[row],
        "layer": None,
        "evidence": evidence,
        "values": {
            "row": row,
            "start_loss": start,
            "loss": float(values[j]),
            "next_median": after,
            "block": k,
        },
    }


def _counted_losses(loss: Tensor, first_bad: int) -> tuple[Tensor, Tensor, float] | None:
    """The rows and values of the logged losses a blow-up is judged on, and the start loss (None: no judging).

    A non-finite loss at or after the first non-finite gradient (row ``first_bad``)
    is its consequence (``nonfinite``), not a blow-up: it is left out."""
    given = ~torch.isnan(loss)
    rows = given.nonzero().flatten()
    if rows.numel() < 2:
        return None
    values = loss[rows].clone()
    finite = torch.isfinite(values)
    if not finite.any():
        return None
    start = _loss_start(values[finite])
    if not start > 0:
        return None
    late = ~finite & (rows >= first_bad)
    values[late] = math.nan
    keep = ~torch.isnan(values)
    return rows[keep], values[keep], start


def _loss_start(x: Tensor) -> float:
    """The start loss: the median of the first START_ROWS finite losses, or of those before the first
    of them above LOSS_BLOWUP x the median of the ones before it (a blow-up in the second update is
    not part of its own start: AdamW at lr 1.0 goes from 0.7 to 458 in two updates)."""
    first = x[:START_ROWS]
    for i in range(1, int(first.numel())):
        if float(first[i]) > LOSS_BLOWUP * median_of(first[:i]):
            return median_of(first[:i])
    return start_level(x)


def _blowup_from_level(values: Tensor, k: int) -> tuple[int, float] | None:
    """A blow-up from the level the loss had reached: the first ``j`` with ``values[j]`` above
    LOSS_BLOWUP x the level -- the median of the previous whole block of ``k`` rows (blocks aligned
    at row 0) -- and the median of ``values[j:j+k]`` (at least BLOCK_MIN of them) and of the last
    ``k`` losses above LOSS_STAY x the level; ``(j, level)``.  Vectorised but for the candidates
    left by a necessary condition (half the next rows above LOSS_STAY x the level), so a heavy-tailed
    or spiky loss of a million rows does not take a median per row."""
    n = int(values.numel())
    m = n // k
    if m < 1 or n < k + BLOCK_MIN:
        return None
    block_level = values[: m * k].view(m, k).median(dim=1).values  # the lower median of each block
    prev = torch.arange(n) // k - 1
    level = block_level[prev.clamp(0, m - 1)]
    tail = median_of(values[-k:])  # "for good": the last block too stays above LOSS_STAY x the level
    hit = (prev >= 0) & (level > 0) & torch.isfinite(level) & (tail > LOSS_STAY * level)
    hit &= (values > LOSS_BLOWUP * level) | ~torch.isfinite(values)
    hit[n - BLOCK_MIN + 1 :] = False
    rows = hit.nonzero().flatten()
    if rows.numel() == 0:
        return None
    ends = (rows + k).clamp(max=n)
    need = (ends - rows) // 2
    keep = torch.zeros(rows.numel(), dtype=torch.bool)
    for c in sorted(set(prev[rows].tolist())):  # at most n / k levels: one count per level
        over = (values > LOSS_STAY * block_level[c]).cumsum(0)
        above = torch.cat([torch.zeros(1, dtype=torch.int64), over])
        mine = prev[rows] == c
        stays = rows > last_calm_block(values, float(block_level[c]), k)  # not back to the level after
        keep |= mine & stays & (above[ends] - above[rows] >= need)
    for j in rows[keep][:MAX_LEVEL_CHECKS].tolist():
        lv = float(level[j])
        if median_of(values[j : j + k]) > LOSS_STAY * lv:
            return int(j), lv
    return None


@dataclass(frozen=True)
class _Growth:
    """What the growth rule measured on the finite norms of a run that grew."""

    x: Tensor  #: the finite norms, in file order
    start: float  #: the start norm (median of the first START_ROWS finite norms)
    k: int  #: rows in a block (:func:`block` of the finite norms)
    tail: float  #: median of the last ``k`` finite norms
    onset: int  #: index in ``x`` from which the norms stay above GROWTH_ONSET_RATIO x the start
    row: int  #: the file row of ``onset``
    grew: bool  #: the last block's median reached GROWTH_RATIO x the start
    peaked: bool  #: some norm reached GROWTH_RATIO x the start, and the norms stayed up from an onset


def norm_growth(
    log: GradLog, norm: Tensor, finite: Tensor, loss: Tensor, notes: list[str]
) -> dict[str, Any] | None:
    """The ``growth`` finding, unless the loss fell meanwhile (then a note says so)."""
    g = _measure_growth(log, norm, finite, notes)
    if g is None:
        return None
    if _loss_fell(loss):
        notes.append(
            f"the gradient norm grew (from {_num(g.start)} to {_num(float(g.x[g.onset :].max()))} from step "
            f"{log.steps[g.row]}) while the loss fell and stayed finite: not counted as an explosion"
        )
        return None
    return _growth_finding(log, g)


def _measure_growth(log: GradLog, norm: Tensor, finite: Tensor, notes: list[str]) -> _Growth | None:
    """The growth of the finite norms when they grew (a block median, a sustained peak, a non-finite end)."""
    idx = finite.nonzero().flatten()
    x = norm[idx]
    m = int(x.numel())
    if m < BLOCK_MIN:
        notes.append(f"{m} finite norm(s): growth needs at least {BLOCK_MIN}, so it was not checked")
        return None
    start = start_level(x)
    if not start > 0:
        return None
    k = block(m)
    # a run whose last block of rows is non-finite (not overflows) ended above every bound
    last = range(max(0, len(log) - k), len(log))
    ends_bad = all(not math.isfinite(log.total_norm[i]) and log.reason.get(i) != OVERFLOW_NAME for i in last)
    tail = median_of(x[-k:])
    grew = m >= GROWTH_MIN_UPDATES and tail >= GROWTH_RATIO * start
    onset = _sustained_onset(x, GROWTH_ONSET_RATIO * start, k, start)
    peaked = bool((x >= GROWTH_RATIO * start).any()) and onset is not None
    if not (grew or peaked or (ends_bad and onset is not None)):
        return None
    if onset is None:
        onset = m - k
    return _Growth(x, start, k, tail, onset, int(idx[onset]), grew, peaked)


def _growth_finding(log: GradLog, g: _Growth) -> dict[str, Any]:
    """The ``growth`` finding: why the norms exploded, from which step, and the layer that grew most."""
    x, start = g.x, g.start
    layer, layer_ratio = _largest_layer_growth(log)
    by_layer = f"; grew most in {layer} ({_num(layer_ratio)}x between per-layer rows)" if layer else ""
    why = (
        f"median of the last {g.k} norms {_num(g.tail)} is {_num(g.tail / start)}x the start {_num(start)}"
        if g.grew
        else f"norm {_num(float(x.max()))} reached {_num(float(x.max()) / start)}x the start {_num(start)}"
        if g.peaked
        else f"the norms rose above {GROWTH_ONSET_RATIO:g}x the start {_num(start)} and ended non-finite"
    )
    evidence = (
        f"{why} (explosion at >= {GROWTH_RATIO:g}x); above {GROWTH_ONSET_RATIO:g}x the start to stay "
        f"from step {log.steps[g.row]} (norm {_num(float(x[g.onset]))}){by_layer}"
    )
    return {
        "kind": "growth",
        "verdict": "exploding",
        "step": log.steps[g.row],
        "layer": layer,
        "evidence": evidence,
        "values": {
            "row": g.row,
            "start_norm": start,
            "tail_median": g.tail,
            "block": g.k,
            "layer_ratio": layer_ratio,
        },
    }


def _loss_fell(loss: Tensor) -> bool:
    """The log has losses, all finite, and the last block's median is below the first's."""
    given = loss[~torch.isnan(loss)]
    if given.numel() < 2 * BLOCK_MIN or not bool(torch.isfinite(given).all()):
        return False
    k = block(int(given.numel()))
    return median_of(given[-k:]) < median_of(given[:k])


def _largest_layer_growth(log: GradLog) -> tuple[str | None, float | None]:
    """The layer whose gradient norm grew most from its first to its last finite value, and that ratio."""
    best: tuple[str | None, float | None] = (None, None)
    for name, cols in log.layers.items():
        g = as_tensor(cols["grad_norm"])
        g = g[torch.isfinite(g)]
        if g.numel() < 2 or not float(g[0]) > 0:
            continue
        ratio = float(g[-1]) / float(g[0])
        if best[1] is None or ratio > best[1]:
            best = (name, ratio)
    return best
