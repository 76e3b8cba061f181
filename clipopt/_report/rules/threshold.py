"""The threshold advice: the healthy stretch, the suggested ``max_norm``, and whether clipping was too
tight or too loose.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .. import evidence
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
        "evidence": _EVIDENCE.get(assessment, str)(),
    }


#: The benchmark's evidence for each assessment whose advice is a tool or a change (docs/which-tool.md).
_EVIDENCE = {
    "learning rate": evidence.learning_rate,
    "bad data": evidence.bad_data,
    "missing": evidence.clipping,
    "too loose": evidence.clipping,
    "too tight": evidence.clipping,
}


def _assess_clipping(
    log: GradLog,
    verdict: str,
    findings: list[dict[str, Any]],
    suggested: float | None,
    used: float | None,
    fraction: float,
) -> tuple[str, str]:
    """``(assessment, advice)``: learning rate (:func:`_learning_rate_cause`), bad data
    (:func:`_loss_only_spikes`), unknown, off, missing, too tight, too loose or fine."""
    sug = _num(suggested) if suggested is not None else "-"
    went_wrong = verdict in ("exploding", "spikes")
    lr_cause = _learning_rate_cause(verdict, findings)
    if lr_cause is not None:
        return "learning rate", _learning_rate_advice(log, lr_cause, sug)
    bad_data = _loss_only_spikes(log, verdict, findings)
    if bad_data is not None:
        return "bad data", _bad_data_advice(bad_data, used, fraction, sug)
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


def _learning_rate_cause(verdict: str, findings: list[dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """Why the learning rate, not the clipping bound, is the fix, and the finding that shows it; None
    when it is not.  ``("recovered", f)``: the worst finding is a loss that blew up and came back by
    itself -- the steps were too large for a stretch (early on: a warm-up).  ``("loss first", f)``: the
    loss blew up for good while the gradient norm did not grow, or grew only later -- the norm is not
    what went wrong, so bounding it does not help (an Adam-type optimizer's step does not shrink with
    the gradient)."""
    if verdict == "spikes":
        head = next(f for f in findings if f["verdict"] == "spikes")
        return ("recovered", head) if head["kind"] == "recovered_blowup" else None
    if verdict != "exploding":
        return None
    blowup = next((f for f in findings if f["kind"] == "blowup"), None)
    growth = next((f for f in findings if f["kind"] == "growth"), None)
    norm_went = [f for f in findings if f["verdict"] == "exploding" and f["kind"] == "nonfinite"]
    if blowup is None or norm_went:
        return None
    if growth is None or growth["values"]["row"] > blowup["values"]["row"]:
        return "loss first", blowup
    return None


def _learning_rate_advice(log: GradLog, cause: tuple[str, dict[str, Any]], sug: str) -> str:
    """Lower the learning rate (the one the log recorded at the finding's row) or add a warm-up."""
    why, finding = cause
    row = finding["values"]["row"]
    lr = log.lr[row] if row < len(log.lr) and math.isfinite(log.lr[row]) else None
    at = f" (lr {_num(lr)} at step {finding['step']})" if lr is not None else ""
    if why == "recovered":
        what = "the loss blew up and came back by itself: the steps were too large for that stretch"
    else:
        what = (
            "the loss blew up for good while the gradient norm had not grown: the norm is not what went wrong"
        )
    return (
        f"{what}; lower the learning rate{at} or add a warm-up -- a tighter max_norm does not shrink "
        f"the step of an Adam-type optimizer (suggested from the norms, for the outliers: {sug})"
    )


def _loss_only_spikes(log: GradLog, verdict: str, findings: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``loss_spikes`` finding of a ``spikes`` run whose gradient norm stayed ordinary or was
    clipped: its spike findings are loss spikes, and norm spikes only at updates that clipping bounded
    (a bad shard keeps the loss up for its length, so clipping does not count as handling them).
    None otherwise."""
    if verdict != "spikes":
        return None
    spiky = [f for f in findings if f["verdict"] == "spikes"]
    loss = next((f for f in spiky if f["kind"] == "loss_spikes"), None)
    if loss is None or any(f["kind"] not in ("spikes", "loss_spikes") for f in spiky):
        return None
    norm_rows = [r for f in spiky if f["kind"] == "spikes" for r in f["values"]["rows"]]
    return loss if all(log.clipped[r] for r in norm_rows) else None


def _bad_data_advice(finding: dict[str, Any], used: float | None, fraction: float, sug: str) -> str:
    """SpikeGuard, for loss spikes without a gradient-norm spike: bad batches (a corrupted shard) that
    a bound on the norm lets the model learn from; then what the norms say of ``max_norm``."""
    steps = finding["values"]["steps"]
    shown = ", ".join(str(s) for s in steps[:10]) + (", ..." if len(steps) > 10 else "")
    if used is not None and math.isfinite(used):
        bound = (
            f"max_norm {_num(used)} clipped {100 * fraction:.1f}% of the updates and is not the fix "
            f"(suggested from the norms: {sug})"
        )
    else:
        bound = f"a max_norm would not be the fix (suggested from the norms: {sug})"
    return (
        f"the loss spiked at step(s) {shown} while the gradient norm stayed ordinary (or was clipped): "
        "bad batches, e.g. a corrupted shard, which a bound on the norm still lets the model learn; "
        "skip such updates with spike_guard=SpikeGuard() and check the data of those steps; " + bound
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
