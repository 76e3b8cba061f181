"""Two rates a report gives for any run, comparable across runs: the spike score of the loss and how much
the norm bound throttles the updates (#35).

*Spike score* (OLMo-core's SpikeScore): the share, in percent, of the updates whose loss is more than
:data:`SCORE_SIGMAS` standard deviations above the mean of the :data:`SCORE_WINDOW` updates before it
(population standard deviation; finite losses only, in file order; an update is scored once
:data:`SCORE_WINDOW` losses precede it).  A run with none scores 0; a number, not a verdict: it
compares runs (a change of data or learning rate) rather than judging one.

*Throttle*: a clipopt log records the bound of every update, so each applied update's coefficient is
``min(1, max_norm / (norm + 1e-6))``.  When the bound cuts most applied updates by
:data:`THROTTLE_COEF` or less (a fifth of their size or smaller; at least :data:`THROTTLE_SHARE` of
them, over at least :data:`THROTTLE_MIN_UPDATES`), it no longer catches the rare large gradient: it
scales every step, like a smaller learning rate.  The classic case is a global bound over Muon's
weight matrices and AdamW's other parameters, where the matrices' gradients set a coefficient that
throttles everything (docs/concepts.md, 'Several inner optimizers').
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..log import GradLog
from .common import as_tensor, median_of

__all__ = [
    "SCORE_SIGMAS",
    "SCORE_WINDOW",
    "THROTTLE_COEF",
    "THROTTLE_SHARE",
    "clip_throttle",
    "spike_score",
    "throttle_note",
]

#: Spike score: the updates before each one that its loss is compared with.
SCORE_WINDOW = 128

#: Spike score: a loss this many standard deviations above the window's mean is a spike.
SCORE_SIGMAS = 6.0

#: Throttle: a coefficient at or below this cuts the update to a fifth of its size or less.
THROTTLE_COEF = 0.2

#: Throttle: the share of applied updates cut that much from which the bound throttles the run.
THROTTLE_SHARE = 0.5

#: Throttle: the applied updates with a recorded bound needed to judge.
THROTTLE_MIN_UPDATES = 20


def spike_score(log: GradLog, loss: Tensor) -> dict[str, Any] | None:
    """The loss's spike score (see the module docstring), None when fewer than ``SCORE_WINDOW + 1``
    finite losses were recorded.  ``steps``: the spikes' steps (the first 100)."""
    finite = torch.isfinite(loss)
    values, rows = loss[finite], finite.nonzero().flatten()
    if values.numel() <= SCORE_WINDOW:
        return None
    windows = values.unfold(0, SCORE_WINDOW, 1)[:-1]  # the SCORE_WINDOW losses before each scored one
    mean, std = windows.mean(dim=1), windows.std(dim=1, correction=0)
    scored = values[SCORE_WINDOW:]
    spikes = (scored > mean + SCORE_SIGMAS * std).nonzero().flatten() + SCORE_WINDOW
    return {
        "score": 100.0 * spikes.numel() / scored.numel(),
        "spikes": int(spikes.numel()),
        "scored": int(scored.numel()),
        "window": SCORE_WINDOW,
        "sigmas": SCORE_SIGMAS,
        "steps": [log.steps[int(rows[i])] for i in spikes[:100]],
    }


def clip_throttle(log: GradLog, norm: Tensor) -> dict[str, Any] | None:
    """How much the recorded bound cut the applied updates (see the module docstring): the share cut
    to ``THROTTLE_COEF`` or less, the median coefficient and whether that throttles the run; None
    without a recorded bound (logs of other tools) or with too few applied updates.  With per-group
    clipping each group's recorded coefficient is judged (``groups``: those that are throttled)."""
    n = len(log)
    applied = (
        torch.tensor([not s for s in log.skipped], dtype=torch.bool)
        if log.skipped
        else torch.ones(n, dtype=torch.bool)
    )
    if log.groups:
        coefs: dict[int | None, Tensor] = {g: as_tensor(k["coef"]) for g, k in sorted(log.groups.items())}
    else:
        bound = as_tensor(log.max_norm)
        if bound.numel() != n:
            return None
        coefs = {None: (bound / (norm + 1e-6)).clamp(max=1.0)}
    judged = {}
    for g, coef in coefs.items():
        rows = applied & torch.isfinite(coef) & torch.isfinite(norm)
        if int(rows.sum()) >= THROTTLE_MIN_UPDATES:
            c = coef[rows]
            judged[g] = (float((c <= THROTTLE_COEF).float().mean()), median_of(c), int(rows.sum()))
    if not judged:
        return None
    worst = max(judged, key=lambda g: judged[g][0])
    share, median, updates = judged[worst]
    return {
        "share": share,
        "median_coef": median,
        "updates": updates,
        "throttled": share >= THROTTLE_SHARE,
        "groups": [g for g, (s, _, _) in judged.items() if g is not None and s >= THROTTLE_SHARE],
    }


def throttle_note(throttle: dict[str, Any] | None) -> list[str]:
    """The report's note on a bound that throttles the run (none otherwise)."""
    if throttle is None or not throttle["throttled"]:
        return []
    where = f" of parameter group(s) {', '.join(map(str, throttle['groups']))}" if throttle["groups"] else ""
    return [
        f"the norm bound cut {throttle['share']:.0%} of the applied updates{where} to a fifth of their "
        f"size or less (median coefficient {throttle['median_coef']:.3g}): it scales every step like "
        "a smaller learning rate instead of catching the rare large gradient; raise max_norm toward "
        "the suggested value, or with Muon leave its groups out of norm clipping "
        "({'params': ..., 'max_norm': None}; docs/concepts.md, 'Several inner optimizers')"
    ]
