"""The whole analysis: every rule over one :class:`~clipopt._report.log.GradLog`, the findings in
order, the summary.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .. import evidence
from ..read import GradLog
from .attention import logit_growth, logit_note
from .common import (
    NORM_OVERFLOW_NAME,
    OVERFLOW_NAME,
    REWIND_NAME,
    SPIKE_NAME,
    VERDICTS,
    as_tensor,
    block,
    median_of,
    start_level,
    steps_text,
)
from .exploding import loss_blowup, norm_growth, recovered_blowup
from .nonfinite import nonfinite_finding
from .rates import clip_throttle, spike_score, throttle_note
from .recovery import escalation_text, skip_list, skip_list_notes
from .rerun import rerun_counts, rerun_notes
from .spikes import loss_spikes, norm_spikes, skips_handled
from .threshold import clipping_advice, reference_thresholds, stretch_for, suggest, suggestions
from .update import update_rules, update_summary
from .vanishing import vanishing_findings


def analyze(log: GradLog) -> dict[str, Any]:
    """The verdict, its findings, the suggested ``max_norm``, the clipping assessment and a summary.

    Keys: ``file``, ``source``, ``run`` (the TensorBoard run, or None), ``columns`` (the names read as
    ``norm`` and ``loss``, and those ``ignored``), ``verdict`` (one of :data:`VERDICTS`), ``findings``
    (most severe first; each ``kind`` -- ``blowup``, ``growth``, ``nonfinite``, ``recovered_blowup``,
    ``spikes``, ``loss_spikes``, ``update_spikes`` or ``vanishing`` --, ``verdict``, ``step``, ``layer``,
    ``evidence``, ``values``), ``suggested_max_norm``, ``clipping``, ``suggestions``, ``summary``, ``notes``,
    ``update`` (None: no update norm), ``spike_score``/``throttle`` (:mod:`.rates`), ``attention``
    (:mod:`.attention`: the ``max_logit`` column of ``qk_clip``; None without)."""
    n = len(log)
    norm, loss = as_tensor(log.total_norm), as_tensor(log.loss)
    notes = list(log.notes)
    finite, overflow, bad_rows, first_bad = _bad_rows(log, norm)
    explosions = _explosions(log, norm, finite, loss, first_bad, notes)
    onset = min((f["values"]["row"] for f in explosions), default=n)
    spike_skips = [i for i, r in sorted(log.reason.items()) if r == SPIKE_NAME]
    guarded = frozenset(skips_handled(loss, spike_skips))
    spikes, handled = norm_spikes(log, norm, loss, min(onset, n), guarded)
    findings = [*explosions, *_nonfinite_findings(log, bad_rows, onset, first_bad, explosions)]
    recovered = recovered_blowup(log, loss, first_bad, onset, spike_skips)
    findings += [f for f in (recovered, spikes, loss_spikes(log, loss, min(onset, n), guarded)) if f]
    update = update_rules(log, norm, loss, min(onset, n))
    findings += [update.finding] if update is not None and update.finding is not None else []
    findings += _layer_findings(log, notes)
    findings.sort(key=lambda f: VERDICTS.index(f["verdict"]))
    verdict = _verdict(findings)
    grad_verdict = _verdict([f for f in findings if f["kind"] != "update_spikes"])  # max_norm's advice
    n_overflow = int(overflow.sum())
    notes += _run_notes(log, n_overflow, handled, guarded) + _update_notes(update.handled if update else [])
    end = min(onset, first_bad) if explosions else n
    spike_rows = (set(spikes["values"]["rows"]) if spikes is not None else set()) | guarded
    stretch, stretch_end = stretch_for(norm, finite, end, spike_rows, verdict)
    suggested = suggest(stretch, exploding=verdict == "exploding")
    references = reference_thresholds(log, norm, stretch, stretch_end) if verdict == "exploding" else None
    return {
        "file": log.path,
        "source": log.source,
        "run": log.run,
        "columns": {"norm": log.norm_column, "loss": log.loss_column, "ignored": list(log.ignored)},
        "verdict": verdict,
        "findings": findings,
        "suggested_max_norm": suggested,
        "clipping": clipping_advice(log, grad_verdict, findings, suggested),
        "suggestions": suggestions(norm[finite]) if references is None else references,
        "summary": _summary(log, norm, loss, finite, n_overflow, len(handled), guarded),
        "notes": notes,
        "update": _with_evidence(update_summary(log, update, stretch_end), verdict),
        **_rates(log, norm, loss, notes),
    }


def _bad_rows(log: GradLog, norm: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Which norms are finite, which rows are GradScaler overflows, the rows whose norm is not finite
    for another reason, and the first of them (``len(log)``: none)."""
    finite = torch.isfinite(norm)
    overflow = _overflow_rows(log)
    bad_rows = (~finite & ~overflow).nonzero().flatten()
    return finite, overflow, bad_rows, int(bad_rows[0]) if bad_rows.numel() else len(log)


def _rates(log: GradLog, norm: Tensor, loss: Tensor, notes: list[str]) -> dict[str, Any]:
    """The run's rates (:mod:`clipopt._report.rules.rates`) and its attention logits
    (:mod:`clipopt._report.rules.attention`); a throttling bound's and growing logits' notes join
    ``notes``."""
    throttle, attention = clip_throttle(log, norm), logit_growth(log)
    notes += throttle_note(throttle) + logit_note(attention)
    return {"spike_score": spike_score(log, loss), "throttle": throttle, "attention": attention}


def _with_evidence(update: dict[str, Any] | None, verdict: str) -> dict[str, Any] | None:
    """The update summary, with what UpdateClip did in the stability benchmark (``evidence``) when the
    run went wrong (a healthy run's suggestion needs no case made for it)."""
    if update is not None and verdict in ("exploding", "spikes", "nonfinite"):
        update["evidence"] = evidence.update_bounds()
    return update


def _verdict(findings: list[dict[str, Any]]) -> str:
    """The most severe verdict of ``findings`` (healthy: none)."""
    return min((f["verdict"] for f in findings), key=VERDICTS.index, default="healthy")


def _update_notes(handled: list[int]) -> list[str]:
    """A note on the update spikes that ``UpdateClip`` bounded and after which the loss stayed calm."""
    if not handled:
        return []
    return [
        f"{len(handled)} large update norm(s) (at step(s) {steps_text(handled)}) were bounded by "
        "update_clip and the loss did not jump after them: they are not counted as update spikes"
    ]


def _overflow_rows(log: GradLog) -> Tensor:
    """Rows whose norm is not finite with reason ``overflow``: a GradScaler calibrating, never evidence."""
    overflow = torch.zeros(len(log), dtype=torch.bool)
    for i, r in log.reason.items():
        if r == OVERFLOW_NAME and not math.isfinite(log.total_norm[i]):
            overflow[i] = True
    return overflow


def _explosions(
    log: GradLog, norm: Tensor, finite: Tensor, loss: Tensor, first_bad: int, notes: list[str]
) -> list[dict[str, Any]]:
    """The ``exploding`` findings: a blow-up of the loss, fast growth of the norm (either, both or none)."""
    blowup = loss_blowup(log, loss, first_bad)
    growth = norm_growth(log, norm, finite, loss, notes)
    return [f for f in (blowup, growth) if f is not None]


def _nonfinite_findings(
    log: GradLog, bad_rows: Tensor, onset: int, first_bad: int, explosions: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The ``nonfinite`` finding (none or one); part of the explosion when that began no later."""
    if not bad_rows.numel():
        return []
    finding = nonfinite_finding(log, bad_rows)
    if log.reason.get(first_bad) == NORM_OVERFLOW_NAME:  # finite gradients, a float32 norm over 3.4e38
        finding["verdict"] = "exploding"
        finding["evidence"] += (
            "; its gradients were finite, their float32 norm overflowed (reason 'norm_overflow')"
        )
    elif explosions and onset <= first_bad:
        finding["verdict"] = "exploding"
        finding["evidence"] += " (part of the explosion above)"
    return [finding]


def _layer_findings(log: GradLog, notes: list[str]) -> list[dict[str, Any]]:
    """The ``vanishing`` findings from the per-layer rows, or a note on why they were not checked."""
    if log.layer_rows:
        return vanishing_findings(log, notes)
    if log.layers:
        notes.append("the per-layer columns are empty in every row: vanishing gradients were not checked")
    else:
        notes.append("no per-layer statistics: vanishing gradients were not checked (clipopt: layer_stats=k)")
    return []


def _run_notes(log: GradLog, n_overflow: int, handled: list[int], guarded: frozenset[int]) -> list[str]:
    """Notes on overflows under a GradScaler, recovery (SpikeGuard, Rewind; ``guarded``: the spike
    skips that handled their spike) and spikes clipping handled."""
    notes = []
    if n_overflow:
        notes.append(
            f"{n_overflow} update(s) overflowed under a GradScaler (reason 'overflow'): loss-scale "
            "calibration, not counted as a problem"
        )
    notes += _recovery_notes(log, guarded) + rerun_notes(log)
    if handled:
        notes.append(
            f"{len(handled)} large norm(s) (at step(s) {steps_text(handled)}) were clipped and the loss "
            "did not jump after them: clipping handled them, so they are not counted as spikes"
        )
    return notes


def _recovery_notes(log: GradLog, guarded: frozenset[int]) -> list[str]:
    """Notes on SpikeGuard skips (reason ``spike``; ``guarded``: those that handled their spike) and
    Rewind rewinds (reason ``rewind``)."""
    notes = []
    spike_rows = [i for i, r in sorted(log.reason.items()) if r == SPIKE_NAME]
    rewind_rows = [i for i, r in sorted(log.reason.items()) if r == REWIND_NAME]
    spikes, rewinds = [log.steps[i] for i in spike_rows], [log.steps[i] for i in rewind_rows]
    if spikes:
        steps = steps_text(spikes)
        n = sum(1 for i in spike_rows if i in guarded)
        handled = (
            ": the loss stayed calm after each, so the skips handled them (not counted as spikes)"
            if n == len(spikes)
            else f"; after {n} of them the loss stayed calm: those are handled (not counted as spikes)"
            if n
            else ""
        )
        said = f"{len(spikes)} update(s) skipped as spikes (reason 'spike') at step(s) {steps}"
        notes.append(said + handled)
    if rewinds:
        escalation = escalation_text(log, rewind_rows)
        notes.append(
            f"{len(rewinds)} rewind(s) (reason 'rewind') at step(s) {steps_text(rewinds)}: the training "
            "state went back to an earlier copy after repeated spikes, and the following batches were dropped"
            + (f"; {escalation}" if escalation else "")
        )
    return notes + skip_list_notes(log, spike_rows, rewind_rows)


def _skip_list(log: GradLog) -> list[list[int]]:
    """The batches of the spike skips and rewinds as ``opt.rewind.batches(skip=...)`` ranges."""
    rows = sorted(log.reason.items())
    return skip_list(log, [i for i, r in rows if r == SPIKE_NAME], [i for i, r in rows if r == REWIND_NAME])


def _summary(
    log: GradLog,
    norm: Tensor,
    loss: Tensor,
    finite: Tensor,
    overflow: int,
    handled: int,
    guarded: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """The summary's figures: updates, clipping, non-finite rows, norms, max_norm, losses, layers, groups,
    spike skips (``skipped_spikes_handled``: the steps of those that handled their spike) and rewinds
    (``skip``: their batches as ``[start, end]`` ranges, ``[]`` without the batch columns)."""
    n = len(log)
    x = norm[finite]
    given = loss[~torch.isnan(loss)]
    fin_loss = given[torch.isfinite(given)]
    k = block(int(fin_loss.numel())) if fin_loss.numel() else 0
    mn = as_tensor(log.max_norm)
    fin = mn[torch.isfinite(mn)]
    bounds = [float(fin.min()), float(fin.max()), float(fin[-1])] if fin.numel() else []
    return {
        "updates": n,
        "first_step": log.steps[0],
        "last_step": log.steps[-1],
        "clipped": sum(log.clipped),
        "clipped_fraction": sum(log.clipped) / n,
        "handled_spikes": handled,
        "skipped": sum(log.skipped),
        "spike_skips": sum(1 for r in log.reason.values() if r == SPIKE_NAME),
        "skipped_spikes_handled": [log.steps[i] for i in sorted(guarded)],
        "rewinds": sum(1 for r in log.reason.values() if r == REWIND_NAME),
        "rerun": rerun_counts(log),
        "skip": _skip_list(log),
        "nonfinite": int((~finite).sum()),
        "overflow": overflow,
        "finite_norms": int(x.numel()),
        "norm_min": float(x.min()) if x.numel() else None,
        "norm_median": median_of(x) if x.numel() else None,
        "norm_max": float(x.max()) if x.numel() else None,
        "max_norm": {"min": bounds[0], "max": bounds[1], "last": bounds[2]} if bounds else None,
        "max_norm_unbounded": bool(torch.isinf(mn).any()),
        "losses": int(given.numel()),
        "loss_start": start_level(fin_loss) if k else None,
        "loss_end": median_of(fin_loss[-k:]) if k else None,
        "loss_nonfinite": int((~torch.isfinite(given)).sum()),
        "layers": len(log.layers),
        "layer_rows": len(log.layer_rows),
        "groups": _group_summary(log),
    }


def _group_summary(log: GradLog) -> list[dict[str, Any]]:
    """Per parameter group (per-group clipping): median finite norm, and how often its coefficient was
    below 1 (the group was norm-clipped), over the rows that recorded it."""
    out = []
    for g, kinds in sorted(log.groups.items()):
        norm, coef = as_tensor(kinds["norm"]), as_tensor(kinds["coef"])
        finite = norm[torch.isfinite(norm)]
        recorded = coef[~torch.isnan(coef)]
        clipped = int((recorded < 1.0).sum())
        out.append(
            {
                "group": g,
                "norm_median": median_of(finite) if finite.numel() else None,
                "norm_max": float(finite.max()) if finite.numel() else None,
                "clipped": clipped,
                "clipped_fraction": clipped / int(recorded.numel()) if recorded.numel() else 0.0,
            }
        )
    return out
