"""The threshold advice: the healthy stretch, the suggested ``max_norm``, and whether clipping was too
tight or too loose.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..read import GradLog
from ..text import fmt_num as _num
from .common import (
    AUTOCLIP_PERCENTILE,
    GROWTH_ONSET_RATIO,
    LOOSE_RATIO,
    PASCANU_HIGH,
    PASCANU_LOW,
    START_ROWS,
    SUGGEST_PERCENTILE,
    TIGHT_FRACTION,
    ZCLIP_Z,
    as_tensor,
    median_of,
    percentile,
)


def healthy_stretch(norm: Tensor, end: int, spike_rows: set[int]) -> Tensor:
    """The finite positive norms before row ``end``, spikes left out (none: the first START_ROWS ones)."""
    head = norm[:end]
    keep = torch.isfinite(head) & (head > 0)
    for r in spike_rows:
        if r < end:
            keep[r] = False
    x = head[keep]
    if x.numel() == 0:
        x = norm[torch.isfinite(norm) & (norm > 0)][:START_ROWS]
    return x


def stretch_for(
    norm: Tensor, finite: Tensor, end: int, spike_rows: set[int], verdict: str
) -> tuple[Tensor, int]:
    """The healthy stretch's norms before row ``end`` (spikes left out), and the row where it ends.

    When the run exploded, the stretch ends where the norms first left their
    start's order (:data:`GROWTH_ONSET_RATIO` x the start), if that is earlier;
    one of the first START_ROWS norms is compared with the start norms before
    it (a blow-up in the second update is not part of its own start)."""
    if verdict == "exploding":
        start = norm[finite][:START_ROWS]
        if start.numel():
            above = (norm[:end] > GROWTH_ONSET_RATIO * median_of(start)).nonzero().flatten()
            end = min(_early_onset(norm, finite, end), int(above[0]) if above.numel() else end)
    return healthy_stretch(norm, end, spike_rows), end


def _early_onset(norm: Tensor, finite: Tensor, end: int) -> int:
    """The first of the first START_ROWS finite rows (before ``end``) whose norm is above
    GROWTH_ONSET_RATIO x the median of the finite norms before it; ``end`` when none is."""
    rows = finite.nonzero().flatten()[:START_ROWS].tolist()
    for k in range(1, len(rows)):
        if rows[k] < end and float(norm[rows[k]]) > GROWTH_ONSET_RATIO * median_of(norm[rows[:k]]):
            return int(rows[k])
    return end


def suggest(stretch: Tensor, *, exploding: bool) -> float | None:
    """The stretch's SUGGEST_PERCENTILE-th percentile (its median when the run exploded); None when empty."""
    if stretch.numel() == 0:
        return None
    return percentile(stretch, 50.0 if exploding else SUGGEST_PERCENTILE)


def clipping_advice(
    log: GradLog, verdict: str, findings: list[dict[str, Any]], suggested: float | None
) -> dict[str, Any]:
    """How clipping was used: the fraction clipped, the last ``max_norm`` and its assessment with advice."""
    n = len(log)
    clipped = sum(log.clipped)
    mn = as_tensor(log.max_norm)
    bounds = mn[~torch.isnan(mn)]
    used = float(bounds[-1]) if bounds.numel() else None
    fraction = clipped / n if n else 0.0
    assessment, advice = _assess_clipping(log, verdict, findings, suggested, used, fraction)
    return {
        "recorded": log.has_clipping,
        "clipped": clipped,
        "clipped_fraction": fraction,
        "max_norm": used,
        "assessment": assessment,
        "advice": advice,
    }


def _assess_clipping(
    log: GradLog,
    verdict: str,
    findings: list[dict[str, Any]],
    suggested: float | None,
    used: float | None,
    fraction: float,
) -> tuple[str, str]:
    """``(assessment, advice)``: unknown, off, missing, too tight, too loose or fine."""
    sug = _num(suggested) if suggested is not None else "-"
    went_wrong = verdict in ("exploding", "spikes")
    if not log.has_clipping:
        return "unknown", f"the log does not record clipping; suggested max_norm {sug}"
    if used is None or math.isinf(used):
        if went_wrong:
            return "missing", f"no norm clipping, and the run went wrong: use max_norm={sug}"
        return "off", f"norm clipping was off (no max_norm); suggested max_norm {sug}"
    if fraction > TIGHT_FRACTION:
        return "too tight", (
            f"max_norm {_num(used)} clipped {100 * fraction:.0f}% of the updates: at that rate "
            f"it acts as a smaller learning rate; suggested max_norm {sug}"
        )
    if went_wrong and (
        _unclipped_bad(log, findings) or (suggested is not None and used > LOOSE_RATIO * suggested)
    ):
        return (
            "too loose",
            f"max_norm {_num(used)} did not bound the updates that went wrong; suggested max_norm {sug}",
        )
    return "fine", (
        f"max_norm {_num(used)} clipped {100 * fraction:.1f}% of the updates; "
        f"it looks right (suggested from the norms: {sug})"
    )


def _unclipped_bad(log: GradLog, findings: list[dict[str, Any]]) -> bool:
    """Some exploding or spike finding's row has a finite norm that was not clipped."""
    bad_rows = [f["values"].get("row") for f in findings if f["verdict"] in ("exploding", "spikes")]
    return any(r is not None and not log.clipped[r] and math.isfinite(log.total_norm[r]) for r in bad_rows)


def reference_thresholds(log: GradLog, norm: Tensor, stretch: Tensor, end: int) -> list[dict[str, Any]]:
    """The reference values of an exploded run: from its healthy stretch ``stretch`` (the norms before
    row ``end``, or the first START_ROWS norms when none is), not from the blow-up's norms."""
    head = norm[:end]
    if end < len(log) and bool((torch.isfinite(head) & (head > 0)).any()):
        where = f" before step {log.steps[end]}"
    else:
        where = "" if end >= len(log) else " at the start"
    return suggestions(stretch, where)


def suggestions(norms: Tensor, where: str = "") -> list[dict[str, Any]]:
    """The reference values: AutoClip's percentile, Pascanu et al.'s range, a static ZClip bound.

    ``where`` (`` before step 5``): which rows ``norms`` are, when not all the finite norms."""
    if norms.numel() == 0:
        return []
    scale = float(norms.abs().max()) or 1.0
    scaled = norms / scale
    mean = float(scaled.mean()) * scale
    std = float(scaled.std(unbiased=False)) * scale
    n = int(norms.numel())
    of = f"the {n} finite norms{where}"
    mean_of = where
    return [
        {
            "name": "autoclip",
            "rule": f"the {AUTOCLIP_PERCENTILE:g}th percentile of {of} (AutoClip, Seetharaman et al. 2020)",
            "value": percentile(norms, AUTOCLIP_PERCENTILE),
            "low": None,
            "high": None,
        },
        {
            "name": "pascanu",
            "rule": f"{PASCANU_LOW:g} to {PASCANU_HIGH:g} times the mean norm {_num(mean)}{mean_of} (Pascanu et al. 2013)",  # noqa: E501
            "value": None,
            "low": PASCANU_LOW * mean,
            "high": PASCANU_HIGH * mean,
        },
        {
            "name": "zclip",
            "rule": f"mean {_num(mean)} + {ZCLIP_Z:g} x std {_num(std)}{mean_of} (a static ZClip bound, Kumar et al. 2025)",  # noqa: E501
            "value": mean + ZCLIP_Z * std if math.isfinite(mean + ZCLIP_Z * std) else math.inf,
            "low": None,
            "high": None,
        },
    ]
