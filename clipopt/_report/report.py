"""``clipopt report PATH``: verdict, evidence and a suggested ``max_norm`` from a training log.

The stages, one module each: :mod:`clipopt._report.read` reads any supported
log (clipopt's CSV, any CSV with a gradient-norm column, a Trainer
``trainer_state.json``, Lightning's ``metrics.csv``, a TensorBoard folder)
into a :class:`GradLog`; :mod:`clipopt._report.rules` turns it into the verdict
(its docstring documents every rule and the reason for it);
:func:`format_report` and :func:`format_json` render that; :func:`plot_log`
(:mod:`clipopt._report.plot`, needs matplotlib) draws it.

In the JSON output every float that is not finite is written as a string,
``"nan"``, ``"inf"`` or ``"-inf"``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from .read import GradLog, read_log
from .rules import VERDICTS, analyze, percentile
from .text import fmt_num as _num
from .text import json_safe

__all__ = [
    "VERDICTS",
    "GradLog",
    "analyze",
    "format_json",
    "format_report",
    "percentile",
    "plot_log",
    "read_log",
]


def plot_log(log: GradLog, report: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw the log (see :func:`clipopt._report.plot.plot_log`); ImportError with a hint without matplotlib."""  # noqa: E501
    from .plot import plot_log as _plot

    _plot(log, report, path)


def format_json(report: Mapping[str, Any]) -> str:
    """The report as JSON; non-finite floats become ``"nan"``, ``"inf"`` or ``"-inf"``."""
    return json.dumps(json_safe(report), indent=2, allow_nan=False)


_KIND_TEXT = {
    "blowup": "the loss blew up",
    "recovered_blowup": "the loss blew up and came back",
    "growth": "fast-growing gradient norm",
    "nonfinite": "non-finite gradient",
    "spikes": "gradient norm spikes",
    "loss_spikes": "loss spikes",
    "update_spikes": "update norm spikes without a gradient spike",
    "vanishing": "vanishing layer gradient",
}


def verdict_line(report: Mapping[str, Any]) -> str:
    """``verdict: exploding (the loss blew up; step 5)``: the first line of the report."""
    findings, s = report["findings"], report["summary"]
    if not findings and s["losses"] == s["loss_nonfinite"]:  # no loss, or not one finite
        read = "no finite loss was read" if s["losses"] else "no loss was read"
        return (
            f"verdict: healthy (judged on the gradient norm alone: {read}; {_skips_handled_text(s)}"
            "no blow-up, non-finite, spiking or vanishing gradients)"
        )
    if not findings:
        handled = _skips_handled_text(s)
        return f"verdict: healthy ({handled}no blow-up, non-finite, spiking or vanishing gradients)"
    head = findings[0]
    where = [f"step {head['step']}"] if head["step"] is not None else []
    if head["layer"] is not None:
        where.append(f"layer {head['layer']}")
    return f"verdict: {report['verdict']} ({_KIND_TEXT[head['kind']]}; {', '.join(where)})"


def _skips_handled_text(s: Mapping[str, Any]) -> str:
    """``2 spike(s) skipped and handled, at step(s) 80, 140; ``: the spike skips after which the loss
    stayed calm (a SpikeGuard doing its job), or ``""``."""
    steps = s.get("skipped_spikes_handled") or []
    if not steps:
        return ""
    shown = ", ".join(str(x) for x in steps[:10]) + (", ..." if len(steps) > 10 else "")
    return f"{len(steps)} spike(s) skipped and handled, at step(s) {shown}; "


def format_report(report: Mapping[str, Any]) -> str:
    """The report for a terminal: verdict, file, the names read and ignored, evidence, suggested
    max_norm, clipping, summary, notes."""
    lines = [
        *_header_lines(report),
        "",
        *_evidence_lines(report),
        "",
        *_threshold_lines(report),
        "",
        *_summary_lines(report["summary"], _every_update(report), report.get("update")),
        *_score_lines(report.get("spike_score")),
    ]
    if report["notes"]:
        lines += ["", "Notes:"]
        lines += [f"  - {note}" for note in report["notes"]]
    return "\n".join(lines)


def _score_lines(score: Mapping[str, Any] | None) -> list[str]:
    """The loss's spike score (OLMo-core's SpikeScore), comparable across runs; nothing without one."""
    if score is None:
        return []
    return [
        f"  spike score: {score['score']:.2f}% ({score['spikes']} of {score['scored']} updates with a loss "
        f"more than {score['sigmas']:g} standard deviations above the mean of the {score['window']} before)"
    ]


def _header_lines(report: Mapping[str, Any]) -> list[str]:
    """The verdict line, the file line (format, updates, steps) and the names read and ignored."""
    return [
        verdict_line(report),
        f"file: {report['file']} ({report['source']}; {_rows_text(report)})",
        _names_line(report),
    ]


def _every_update(report: Mapping[str, Any]) -> bool:
    """True when a row is an update: clipopt's own log, or one row per step (consecutive steps)."""
    s = report["summary"]
    own = report["source"] == "clipopt CSV" or report["columns"]["norm"] == "clipopt/total_norm"
    return own or bool(s["last_step"] - s["first_step"] + 1 == s["updates"])


def _rows_text(report: Mapping[str, Any]) -> str:
    """``200 updates, steps 1-200``; ``60 rows logged at steps 10-600`` when rows were logged every
    few updates (a Trainer's ``logging_steps``)."""
    s = report["summary"]
    if _every_update(report):
        return f"{s['updates']} updates, steps {s['first_step']}-{s['last_step']}"
    return f"{s['updates']} rows logged at steps {s['first_step']}-{s['last_step']}"


#: What a log's names are called, by source (default: columns).
_NOUNS = {"TensorBoard": "tags", "Trainer trainer_state.json": "log_history keys"}
#: At most this many ignored names are listed in the text (``--json`` lists all).
_MAX_IGNORED = 12


def _names_line(report: Mapping[str, Any]) -> str:
    """``tags read: Grad/total_norm as the norm, Loss/train as the loss; ignored: Loss/test``."""
    cols = report["columns"]
    loss = f"{cols['loss']} as the loss" if cols["loss"] is not None else "no loss (--loss NAME picks one)"
    ignored = cols["ignored"]
    shown = ", ".join(ignored[:_MAX_IGNORED]) or "none"
    if len(ignored) > _MAX_IGNORED:
        shown += f", ... ({len(ignored) - _MAX_IGNORED} more)"
    noun = _NOUNS.get(report["source"], "columns")
    update = report.get("update")
    if update is not None:  # update_clip / update_stats
        loss += f", {update['column']} as the update norm"
    return f"{noun} read: {cols['norm']} as the norm, {loss}; ignored: {shown}"


def _evidence_lines(report: Mapping[str, Any]) -> list[str]:
    """``Evidence:``, one line per finding, most severe first."""
    if not report["findings"]:
        return [
            "Evidence:",
            "  - none of the rules fired (they are listed in the documentation, page 'Choosing max_norm')",
        ]
    return ["Evidence:", *(f"  - [{f['kind']}] {f['evidence']}" for f in report["findings"])]


def _threshold_lines(report: Mapping[str, Any]) -> list[str]:
    """``Suggested max_norm:``, the clipping advice and the reference values (AutoClip, Pascanu, ZClip)."""
    suggested = report["suggested_max_norm"]
    lines = [
        f"Suggested max_norm: {_num(suggested) if suggested is not None else 'none (no finite norm)'}",
        f"  clipping: {report['clipping']['advice']}",
        *_evidence_line(report["clipping"].get("evidence")),
    ]
    if report["suggestions"]:
        lines.append("  for reference:")
        rows = [[sug["name"], _suggestion_value(sug), sug["rule"]] for sug in report["suggestions"]]
        lines += ["  " + line for line in _table(rows)]
    return lines + _update_clip_lines(report.get("update"))


def _evidence_line(sentence: str | None) -> list[str]:
    """``  evidence: ...``: what the stability benchmark measured for that advice (none: nothing)."""
    return [f"  evidence: {sentence}"] if sentence else []


def _update_clip_lines(update: Mapping[str, Any] | None) -> list[str]:
    """``Suggested update_clip:`` and how each bound was chosen (nothing without an update norm)."""
    if update is None:
        return []
    sug = update["suggested"]
    if sug is None:
        return ["Suggested update_clip: none (no finite update norm)"]
    z = f" or UpdateClip(z={sug['z']:g})" if sug["z"] is not None else ""
    lines = [
        f"Suggested update_clip: UpdateClip(max_norm={_num(sug['max_norm'])}){z}",
        f"  max_norm: the largest of the healthy stretch's {sug['healthy_updates']} update norms "
        "(spikes left out): it bounds no healthy update",
    ]
    if sug["z"] is not None:
        lines.append(
            f"  z: the smallest (in half steps, at least 3) under which the bound of UpdateClip(z=..., "
            f"window={sug['window']}) bounds no update of that stretch"
        )
    else:
        lines.append(
            f"  z: none (no update of that stretch came after {sug['window'] // 2} others, when the bound "
            f"of UpdateClip(z=..., window={sug['window']}) starts)"
        )
    if sug["spikes"]:
        bounded = sug["spikes_bounded"]
        lines.append(
            f"  of the {sug['spikes']} update spike(s) found, max_norm bounds {bounded['max_norm']}"
            + (f" and z bounds {bounded['z']}" if sug["z"] is not None else "")
        )
    return lines + _evidence_line(update.get("evidence"))


def _suggestion_value(sug: Mapping[str, Any]) -> str:
    """A reference value, or its range ``low - high``."""
    if sug["value"] is not None:
        return _num(sug["value"])
    return f"{_num(sug['low'])} - {_num(sug['high'])}"


def _summary_lines(
    s: Mapping[str, Any], every_update: bool = True, update: Mapping[str, Any] | None = None
) -> list[str]:
    """``Summary:`` and its table: updates (logged rows unless ``every_update``), loss, clipped, skipped,
    non-finite, norms, max_norm, the update norm (``update``: when the log has it), layers, parameter
    groups."""
    rows = [
        ["updates" if every_update else "logged rows", f"{s['updates']}"],
        ["loss", _loss_text(s)],
        ["clipped", f"{s['clipped']} ({100 * s['clipped_fraction']:.1f}%)"],
        ["skipped", f"{s['skipped']}"],
        *([["rewinds", f"{s['rewinds']}"]] if s.get("rewinds") else []),
        ["non-finite", f"{s['nonfinite']}" + (f" ({s['overflow']} overflow)" if s["overflow"] else "")],
        ["total norm", _norms_text(s)],
        ["max_norm used", _max_norm_text(s)],
        *([["update norm", _update_text(update)]] if update is not None else []),
        [
            "layers",
            f"{s['layers']} ({s['layer_rows']} rows with per-layer statistics)" if s["layers"] else "-",
        ],
    ]
    rows += [[f"group {g['group']}", _group_text(g)] for g in s.get("groups", [])]
    return ["Summary:", *_table(rows)]


def _norms_text(s: Mapping[str, Any]) -> str:
    """``min 0.1, median 0.8, max 3 (200 finite)``: the total norms of the summary."""
    if not s["finite_norms"]:
        return "no finite norm"
    return (
        f"min {_num(s['norm_min'])}, median {_num(s['norm_median'])}, max {_num(s['norm_max'])} "
        f"({s['finite_norms']} finite)"
    )


def _update_text(u: Mapping[str, Any]) -> str:
    """``median 0.003, max 0.02 (200 applied); bounded 0``: the update norms of the report."""
    if not u["recorded"]:
        return "no finite update norm"
    return (
        f"median {_num(u['median'])}, max {_num(u['max'])} ({u['recorded']} applied); "
        f"bounded by update_clip {u['bounded']}"
    )


def _loss_text(s: Mapping[str, Any]) -> str:
    """``2.3 at the start, 0.4 at the end (200 logged)``: the loss of the summary."""
    if not s["losses"]:
        return "not in the log (clipopt: opt.step(loss=loss))"
    nonfinite = f", {s['loss_nonfinite']} non-finite" if s["loss_nonfinite"] else ""
    ends = f"{_num(s['loss_start'])} at the start, {_num(s['loss_end'])} at the end"
    return f"{ends} ({s['losses']} logged{nonfinite})"


def _group_text(g: Mapping[str, Any]) -> str:
    """``median norm 0.8, max 3.1; clipped 12 (4.0%)``: one parameter group's line."""
    norms = (
        f"median norm {_num(g['norm_median'])}, max {_num(g['norm_max'])}"
        if g["norm_median"] is not None
        else "no finite norm"
    )
    return f"{norms}; clipped {g['clipped']} ({100 * g['clipped_fraction']:.1f}%)"


def _max_norm_text(s: Mapping[str, Any]) -> str:
    """How ``max_norm`` was used: one bound, a range, adaptive, or none."""
    if s["max_norm"] is None and s.get("max_norm_unbounded"):
        return "adaptive, no bound reached (e.g. ZClip between spikes)"
    if s["max_norm"] is None and s["clipped"]:
        return "none recorded: unit-wise clipping (AGC) or value clipping"
    if s["max_norm"] is None:
        return "none (norm clipping off or not recorded)"
    mn = s["max_norm"]
    if mn["min"] == mn["max"]:
        return _num(mn["last"])
    return f"{_num(mn['min'])} - {_num(mn['max'])} (last {_num(mn['last'])})"


def _table(rows: list[list[str]]) -> list[str]:
    """Rows as aligned columns (the last one unpadded), each line indented by two spaces."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]) for r in rows]
