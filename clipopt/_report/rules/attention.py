"""Attention-logit growth, from a log's ``max_logit`` column (``qk_clip=QKClip(model)``, #35).

The largest pre-softmax attention logit of a window (over the heads QKClip watches, as softmax
sees it) is recorded in the windows QKClip measured.  Over those rows, in file order: *start* is
the median of the first :data:`~.common.START_ROWS` recorded values (the report's start of a
run), *end* the median of the last :func:`~.common.block`.  The logits *grow* when the end is at
least :data:`LOGIT_GROWTH_RATIO` times the start and at least :data:`LOGIT_LARGE` (with at least
:data:`LOGIT_MIN_ROWS` recorded rows).  Why: attention-logit growth is a main cause of loss spikes
in large transformers (Dehghani et al. 2023, ViT-22B; Wortsman et al. 2023): the softmax of a few
growing logits tends to one-hot and its gradient vanishes; it shows in the logits long before the
loss spikes.  A number, and a note when they grow, not a verdict: a run whose logits grow may
still be learning.  With ``qk_clip`` the value is measured before each window's cap, so a run it
caps stays near its threshold.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..._log_names import MAX_LOGIT
from .. import evidence
from ..log import GradLog
from .common import as_tensor, block, median_of, start_level

__all__ = ["LOGIT_GROWTH_RATIO", "LOGIT_LARGE", "LOGIT_MIN_ROWS", "logit_growth", "logit_note"]

#: The end's median at least this multiple of the start's: the logits grow.
LOGIT_GROWTH_RATIO = 4.0

#: ... and at least this large: ``exp(10)`` is 22,000, a softmax already far from uniform (below it
#: the growth of a logit from 0.5 to 2 at the start of a run, which means nothing, is left alone).
LOGIT_LARGE = 10.0

#: Recorded rows needed to judge.
LOGIT_MIN_ROWS = 10


def logit_growth(log: GradLog) -> dict[str, Any] | None:
    """The ``attention`` key of the report: the recorded logits' start, end, largest (and its step),
    their ratio and whether they grow; None when the log has no ``max_logit`` column or fewer than
    LOGIT_MIN_ROWS recorded (finite) values."""
    column = log.recovery.get(MAX_LOGIT)
    if column is None:
        return None
    values = as_tensor(column)
    rows = torch.isfinite(values).nonzero().flatten()
    x = values[rows]
    if x.numel() < LOGIT_MIN_ROWS:
        return None
    k = block(int(x.numel()))
    start, end = start_level(x), median_of(x[-k:])
    top = int(x.argmax())
    ratio = end / start if start > 0 else math.inf
    return {
        "column": MAX_LOGIT,
        "recorded": int(x.numel()),
        "start": start,
        "end": end,
        "max": float(x[top]),
        "max_step": log.steps[int(rows[top])],
        "ratio": ratio,
        "growing": end >= LOGIT_LARGE and ratio >= LOGIT_GROWTH_RATIO,
    }


def logit_note(attention: dict[str, Any] | None) -> list[str]:
    """The report's note on growing attention logits (none otherwise)."""
    if attention is None or not attention["growing"]:
        return []
    return [
        f"the largest attention logit grew from {attention['start']:.3g} to {attention['end']:.3g} "
        f"(medians of the first and last recorded windows; {attention['max']:.3g} at step "
        f"{attention['max_step']}): attention-logit growth precedes loss spikes in transformers; cap "
        "it with qk_clip=QKClip(model, threshold=...) or normalise the queries and keys (qk-layernorm)"
        + (f"; {measured}" if (measured := evidence.attention()) else "")
    ]
