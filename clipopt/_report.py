"""``clipopt report CSV``: verdict, evidence and suggested ``max_norm`` values from a CSVLogger file.

:func:`read_log` reads the CSV into a :class:`GradLog`, :func:`analyze` turns it
into plain, JSON-able data, :func:`format_report` renders that for a terminal,
:func:`format_json` as JSON, and :func:`plot_log` draws it (needs matplotlib, the
``plot`` extra).  Only the standard library is used, except matplotlib, which
is imported by :func:`plot_log` alone.

Terms
-----
*Norm* is the ``total_norm`` column: the pre-clip norm of each update's
combined gradient.  *Finite norms* are the rows whose norm is a finite number,
in file order.  Rows whose norm is non-finite and whose ``reason`` is
``overflow`` are loss-scale overflows of a ``GradScaler``: expected now and
then, they are counted in the summary but are not evidence of explosion.
*Per-layer rows* are the rows that carry per-layer columns (every
``layer_stats``-th update).  A percentile is the linear interpolation between
the closest ranks (numpy's default): the p-th percentile of the sorted values
``x[0..n-1]`` is ``x[lo] + (x[hi] - x[lo]) * (pos - lo)`` with
``pos = (n - 1) * p / 100``, ``lo = floor(pos)``, ``hi = ceil(pos)``; the median
is the 50th percentile.  Standard deviations are population ones
(``ddof=0``, numpy's default).

Rules
-----
*exploding*, non-finite: some row (not an ``overflow`` one) has a non-finite
norm.  Step: the first such row.  Layer: in the first per-layer row at or after
that step, the first layer in column order whose ``nonfinite`` count is > 0;
if none is, the layer with the largest ``grad_norm`` in that row; ``None``
without such a row.

*exploding*, fast growth: with ``m >= GROWTH_MIN_UPDATES`` finite norms and
``k = ceil(GROWTH_BLOCK * m)``, the median of the last ``k`` finite norms is
at least ``GROWTH_RATIO`` times the median ``h`` of the first ``k`` (and
``h > 0``).  Step (onset): the first finite norm above
``GROWTH_ONSET_RATIO * h`` from which on the median of the next ``k`` finite
norms (itself included, fewer at the end) is above it too -- so an isolated
spike is not taken for the onset, and, the criteria being medians of blocks,
isolated spikes do not make growth either.  Layer: the layer whose
``grad_norm`` grew most (ratio of its last to its first finite value in the
per-layer rows, the first > 0); ``None`` without per-layer rows.

*spikes*: the finite norm ``x`` is compared with the previous up to
``SPIKE_WINDOW`` finite norms (at least ``SPIKE_MIN_HISTORY`` of them), of
mean ``mu``; the z-score is taken on natural logarithms, with ``m`` and ``s``
the mean and standard deviation of the window's log-norms (norms > 0, at least
``SPIKE_MIN_HISTORY`` of them): a spike has ``z = (ln x - m) / s > SPIKE_Z``
and ``x >= SPIKE_MIN_RATIO * mu`` (the ratio keeps a z-score of a very quiet
window from calling a small step a spike; ``s == 0`` gives ``z = inf`` when
``ln x > m``).  Gradient norms are closer to log-normal than to normal: on
raw norms, healthy runs with a heavy tail (log-norm standard deviation 0.5, no
spike) had 8-17 false spikes per 12,000 updates; on log-norms none.  Spikes
stay in the window of later updates.  When the norms grow fast (above), spikes at or after the onset
are part of the explosion and are not reported as spikes.  Step: the first
spike; the finding lists every spike step and the ``SPIKE_TOP`` largest by
``z``.  Layer: when a per-layer row exists at the largest spike, the layer whose
``grad_norm`` there is the largest multiple of its own median; else ``None``.

*vanishing* (needs per-layer columns): for each layer with finite
``grad_norm`` values, ``g`` = their median.  A layer vanishes when
``g < VANISH_RELATIVE * median(g of every layer)``, or when the median of
``grad_norm / param_norm`` (rows with both finite and ``param_norm > 0``) is
below ``VANISH_TO_PARAM``.  Step: the first per-layer row in which the layer
met the condition that fired.  Layers without any finite ``grad_norm`` (no
gradient) are not judged.

*healthy*: none of the above.  The verdict is the most severe finding:
exploding > spikes > vanishing > healthy.

Suggestions (from every finite norm, spikes and explosion included)
----------------------------------------------------------------------
``autoclip``: the ``AUTOCLIP_PERCENTILE``-th percentile (AutoClip,
Seetharaman et al. 2020).  ``pascanu``: the range ``PASCANU_LOW`` to
``PASCANU_HIGH`` times the mean norm (Pascanu et al. 2013).  ``zclip``: the
mean plus ``ZCLIP_Z`` population standard deviations, a static version of
ZClip's z-score bound (Kumar et al. 2025).

In the JSON output every float that is not finite is written as a string,
``"nan"``, ``"inf"`` or ``"-inf"``.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from ._layers import LAYER_FIELDS
from ._logging import BASE_COLUMNS
from ._text import fmt_num as _num
from ._text import json_safe

__all__ = [
    "AUTOCLIP_PERCENTILE",
    "GROWTH_BLOCK",
    "GROWTH_MIN_UPDATES",
    "GROWTH_ONSET_RATIO",
    "GROWTH_RATIO",
    "PASCANU_HIGH",
    "PASCANU_LOW",
    "SPIKE_MIN_HISTORY",
    "SPIKE_MIN_RATIO",
    "SPIKE_TOP",
    "SPIKE_WINDOW",
    "SPIKE_Z",
    "VANISH_RELATIVE",
    "VANISH_TO_PARAM",
    "VERDICTS",
    "ZCLIP_Z",
    "GradLog",
    "analyze",
    "format_json",
    "format_report",
    "percentile",
    "plot_log",
    "read_log",
]

#: Verdicts, most severe first.
VERDICTS = ("exploding", "spikes", "vanishing", "healthy")

#: Fast growth: finite norms needed to judge growth at all.
GROWTH_MIN_UPDATES = 20
#: Fast growth: the fraction of the finite norms in the first and in the last block.
GROWTH_BLOCK = 0.10
#: Fast growth: median of the last block / median of the first block at or above which norms explode.
GROWTH_RATIO = 100.0
#: Fast growth: the onset is where the norm first stays above this multiple of the first block's median.
GROWTH_ONSET_RATIO = 10.0

#: Spikes: the rolling window, in finite norms before the update.
SPIKE_WINDOW = 128
#: Spikes: finite norms needed in the window before an update can be a spike.
SPIKE_MIN_HISTORY = 16
#: Spikes: the z-score of the log-norm above which an update is a spike.
SPIKE_Z = 5.0
#: Spikes: a spike is also at least this multiple of the window's mean.
SPIKE_MIN_RATIO = 2.0
#: Spikes: how many of the largest spikes the finding details.
SPIKE_TOP = 5

#: Vanishing: a layer's median grad_norm below this multiple of the median of all layers' medians.
VANISH_RELATIVE = 1e-3
#: Vanishing: a layer's median grad_norm / param_norm below this.
VANISH_TO_PARAM = 1e-6

#: Suggestion ``autoclip``: this percentile of the finite norms.
AUTOCLIP_PERCENTILE = 10.0
#: Suggestion ``pascanu``: this multiple of the mean norm, low end.
PASCANU_LOW = 0.5
#: Suggestion ``pascanu``: this multiple of the mean norm, high end.
PASCANU_HIGH = 10.0
#: Suggestion ``zclip``: mean + this many (population) standard deviations.
ZCLIP_Z = 2.5

_LR_COLUMN = re.compile(r"lr\.\d+")
#: How many spike steps a finding lists.
_MAX_LISTED_STEPS = 100


@dataclass
class GradLog:
    """The rows of a :class:`~clipopt.CSVLogger` file, one list entry per row, in file order.

    ``None`` stands for an empty cell (``total_norm`` is never empty; a
    non-finite norm is ``nan`` or ``inf``).  ``layers`` maps each parameter name (in
    column order) to its :data:`~clipopt.LAYER_FIELDS` columns, each a list
    aligned with :attr:`steps` (``None`` in rows without per-layer
    statistics).  ``notes`` says what reading skipped, if anything.
    """

    path: str
    steps: list[int]
    total_norm: list[float]
    clip_coef: list[float | None]
    clipped: list[bool]
    skipped: list[bool]
    reason: list[str | None]
    max_norm: list[float | None]
    lr: list[float | None]
    micro_batches: list[int | None] = field(default_factory=list)
    layers: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    def layer_rows(self) -> list[int]:
        """Indices of the rows that carry per-layer statistics."""
        if not self.layers:
            return []
        columns = [cols[f] for cols in self.layers.values() for f in LAYER_FIELDS]
        return [i for i in range(len(self.steps)) if any(col[i] is not None for col in columns)]


# ---------------------------------------------------------------------------- reading


def read_log(path: str | os.PathLike[str]) -> GradLog:
    """Read a CSV written by :class:`~clipopt.CSVLogger`.

    Raises :class:`FileNotFoundError`/:class:`OSError` when the file cannot be
    read and :class:`ValueError` (naming the file) when it is not a clipopt
    CSV log, has no rows, or holds a cell that is not a number where one is
    expected.  An incomplete last row (a run killed while writing) is skipped
    with a note.
    """
    name = os.fspath(path)
    if os.path.isdir(name):
        raise ValueError(f"{name} is a directory; pass the CSV file that clipopt.CSVLogger wrote")
    with open(name, newline="", encoding="utf-8", errors="replace") as f:
        try:
            rows = [r for r in csv.reader(f) if r]
        except csv.Error as exc:
            raise ValueError(f"{name} is not a clipopt CSV log (not readable as CSV: {exc})") from None
    if not rows:
        raise ValueError(f"{name} is empty; pass the CSV file that clipopt.CSVLogger wrote")
    header = [c.strip() for c in rows[0]]
    missing = [c for c in BASE_COLUMNS if c not in header]
    if len(missing) == len(BASE_COLUMNS):
        raise ValueError(
            f"{name} is not a clipopt CSV log (its first line is not the header clipopt.CSVLogger "
            f"writes: {','.join(BASE_COLUMNS)},...)"
        )
    if missing:
        raise ValueError(
            f"{name} is not a clipopt CSV log: missing column(s) {', '.join(missing)} "
            f"(expected the header written by clipopt.CSVLogger: {','.join(BASE_COLUMNS)},...)"
        )
    if len(set(header)) != len(header):
        raise ValueError(f"{name} is not a clipopt CSV log: its header repeats a column name")
    at = {c: i for i, c in enumerate(header)}
    layer_columns: dict[str, dict[str, int]] = {}
    for i, col in enumerate(header):
        if col in BASE_COLUMNS or _LR_COLUMN.fullmatch(col):
            continue
        base, _, fld = col.rpartition(".")
        if base and fld in LAYER_FIELDS:
            layer_columns.setdefault(base, {})[fld] = i
    layer_columns = {n: cols for n, cols in layer_columns.items() if len(cols) == len(LAYER_FIELDS)}

    data = rows[1:]
    notes = []
    if data and len(data[-1]) != len(header):
        notes.append(
            f"the last row (line {len(rows)}) has {len(data[-1])} of {len(header)} cells "
            "(a run stopped while writing?); it was ignored"
        )
        data = data[:-1]
    if not data:
        raise ValueError(
            f"{name} has a clipopt CSV header but no rows yet "
            "(CSVLogger writes every flush_every updates and on close())"
        )

    log = GradLog(
        name, [], [], [], [], [], [], [], [], [], {n: {f: [] for f in LAYER_FIELDS} for n in layer_columns}
    )
    log.notes = notes
    for lineno, row in enumerate(data, start=2):
        if len(row) != len(header):
            raise ValueError(f"{name}, line {lineno}: {len(row)} cells where the header has {len(header)}")

        def cell(col: str, row: list[str] = row, lineno: int = lineno) -> float | None:
            return _number(name, lineno, col, row[at[col]])

        step = cell("step")
        if step is None or not math.isfinite(step) or step != int(step):
            raise ValueError(f"{name}, line {lineno}: step must be an integer, got {row[at['step']]!r}")
        log.steps.append(int(step))
        mb = cell("micro_batches")
        log.micro_batches.append(None if mb is None or not math.isfinite(mb) else int(mb))
        norm = cell("total_norm")
        if norm is None:
            raise ValueError(
                f"{name}, line {lineno}: total_norm is empty (CSVLogger writes one in every row)"
            )
        log.total_norm.append(norm)
        log.clip_coef.append(cell("clip_coef"))
        log.clipped.append(_flag(name, lineno, "clipped", row[at["clipped"]]))
        log.skipped.append(_flag(name, lineno, "skipped", row[at["skipped"]]))
        log.reason.append(row[at["reason"]].strip() or None)
        log.max_norm.append(cell("max_norm"))
        log.lr.append(cell("lr"))
        for layer, cols in layer_columns.items():
            out = log.layers[layer]
            for fld, i in cols.items():
                out[fld].append(_number(name, lineno, header[i], row[i]))
    return log


def _number(name: str, lineno: int, col: str, text: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}, line {lineno}: column {col} holds {text[:40]!r}, not a number") from None


def _flag(name: str, lineno: int, col: str, text: str) -> bool:
    text = text.strip()
    if text in ("0", "1", ""):
        return text == "1"
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    raise ValueError(f"{name}, line {lineno}: column {col} must be 0 or 1, got {text[:40]!r}")


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation, as ``numpy.percentile`` by default."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation (``ddof=0``)."""
    n = len(values)
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / n
    return mean, math.sqrt(var)


def _finite(x: float | None) -> TypeGuard[float]:
    return x is not None and math.isfinite(x)


# ---------------------------------------------------------------------------- analysis


def analyze(log: GradLog) -> dict[str, Any]:
    """The verdict, its findings, suggested ``max_norm`` values and a summary, as plain data.

    Keys: ``file``; ``verdict`` (one of :data:`VERDICTS`); ``findings`` (most
    severe first, each ``kind`` -- ``nonfinite``, ``growth``, ``spikes`` or
    ``vanishing`` --, ``verdict``, ``step``, ``layer`` (or None), ``evidence``
    (a sentence) and ``values`` (its numbers)); ``suggestions`` (each ``name``,
    ``rule``, ``value``, ``low``, ``high`` -- None where not applicable);
    ``summary``; ``notes``.  See the module docstring for the rules.
    """
    n = len(log.steps)
    idx = [i for i in range(n) if _finite(log.total_norm[i])]  # rows with a finite norm
    norms = [x for x in log.total_norm if _finite(x)]
    layer_rows = log.layer_rows()
    notes = list(log.notes)

    findings: list[dict[str, Any]] = []
    nonfinite = _nonfinite_finding(log, layer_rows)
    growth, onset = _growth_finding(log, idx, norms, layer_rows, notes)
    spikes = _spike_finding(log, idx, norms[:onset], layer_rows)
    exploding = [f for f in (nonfinite, growth) if f is not None]
    findings += exploding
    if spikes is not None:
        findings.append(spikes)
    if layer_rows:
        findings += _vanishing_findings(log, layer_rows)
    elif log.layers:
        notes.append("the per-layer columns are empty in every row: vanishing gradients were not checked")
    else:
        notes.append("no per-layer columns: vanishing gradients were not checked (pass layer_stats=k)")
    verdict = next((v for v in VERDICTS if any(f["verdict"] == v for f in findings)), "healthy")

    overflow = sum(1 for i in range(n) if _is_overflow(log, i))
    if overflow:
        notes.append(
            f"{overflow} update(s) overflowed under a GradScaler (reason 'overflow'): loss-scale "
            "calibration, not counted as exploding"
        )
    if growth is not None:
        notes.append(
            "the suggestions use every finite norm, those of the explosion included; "
            "compute them from a healthy stretch of the run for a tighter bound"
        )
    return {
        "file": log.path,
        "verdict": verdict,
        "findings": findings,
        "suggestions": _suggestions(norms),
        "summary": _summary(log, norms, layer_rows, overflow),
        "notes": notes,
    }


def _is_overflow(log: GradLog, i: int) -> bool:
    return log.reason[i] == "overflow" and not math.isfinite(log.total_norm[i])


def _nonfinite_finding(log: GradLog, layer_rows: list[int]) -> dict[str, Any] | None:
    bad = [i for i, x in enumerate(log.total_norm) if not math.isfinite(x) and not _is_overflow(log, i)]
    if not bad:
        return None
    first = bad[0]
    step = log.steps[first]
    applied = sum(1 for i in bad if not log.skipped[i])
    layer = None
    layer_step = None
    bad_layers: dict[str, int] = {}
    how = "no per-layer statistics were recorded at or after it"
    row = next((r for r in layer_rows if r >= first), None)
    if row is not None:
        layer_step = log.steps[row]
        for name, cols in log.layers.items():
            count = cols["nonfinite"][row]
            if count is not None and (count > 0 or math.isnan(count)):
                bad_layers[name] = int(count) if math.isfinite(count) else -1
        if bad_layers:
            layer = next(iter(bad_layers))
            how = (
                f"first layer with non-finite gradient elements at step {layer_step}: {layer} "
                f"({len(bad_layers)} of {len(log.layers)} layers non-finite)"
            )
        else:
            norms = {n: c["grad_norm"][row] for n, c in log.layers.items()}
            finite = {n: v for n, v in norms.items() if v is not None and not math.isnan(v)}
            if finite:
                layer = max(finite, key=lambda n: finite[n])
                how = (
                    f"no layer recorded non-finite elements at step {layer_step}, the first per-layer "
                    f"row after it; largest gradient norm there: {layer} ({_num(finite[layer])})"
                )
    evidence = (
        f"total norm {_num(log.total_norm[first])} at step {step}, the first of {len(bad)} non-finite "
        f"update(s) ({len(bad) - applied} skipped, {applied} applied); {how}"
    )
    return {
        "kind": "nonfinite",
        "verdict": "exploding",
        "step": step,
        "layer": layer,
        "evidence": evidence,
        "values": {
            "total_norm": log.total_norm[first],
            "count": len(bad),
            "applied": applied,
            "layer_step": layer_step,
            "nonfinite_layers": bad_layers,
        },
    }


def _growth_finding(
    log: GradLog, idx: list[int], norms: list[float], layer_rows: list[int], notes: list[str]
) -> tuple[dict[str, Any] | None, int]:
    """The growth finding (or None) and the onset's index in ``norms`` (``len(norms)`` without growth)."""
    m = len(norms)
    if m < GROWTH_MIN_UPDATES:
        notes.append(f"{m} finite norm(s): growth needs at least {GROWTH_MIN_UPDATES}, so it was not checked")
        return None, m
    k = math.ceil(GROWTH_BLOCK * m)
    head, tail = _median(norms[:k]), _median(norms[-k:])
    if not head > 0 or tail < GROWTH_RATIO * head:
        return None, m
    threshold = GROWTH_ONSET_RATIO * head
    onset = next(
        (j for j in range(m) if norms[j] > threshold and _median(norms[j : j + k]) > threshold),
        m - k,  # unreachable: the last block's median is above it
    )
    step = log.steps[idx[onset]]
    layer, layer_ratio = _largest_layer_growth(log, layer_rows)
    by_layer = f"; grew most in {layer} ({_num(layer_ratio)}x between per-layer rows)" if layer else ""
    evidence = (
        f"median norm of the last {k} updates {_num(tail)} is {_num(tail / head)}x that of the first {k} "
        f"({_num(head)}; explosion at >= {GROWTH_RATIO:g}x); above {GROWTH_ONSET_RATIO:g}x the initial "
        f"median to stay from step {step} (norm {_num(norms[onset])}){by_layer}"
    )
    finding = {
        "kind": "growth",
        "verdict": "exploding",
        "step": step,
        "layer": layer,
        "evidence": evidence,
        "values": {
            "block": k,
            "head_median": head,
            "tail_median": tail,
            "ratio": tail / head,
            "onset_norm": norms[onset],
            "layer_ratio": layer_ratio,
        },
    }
    return finding, onset


def _largest_layer_growth(log: GradLog, layer_rows: list[int]) -> tuple[str | None, float | None]:
    best: tuple[str | None, float | None] = (None, None)
    for name, cols in log.layers.items():
        values = [v for v in (cols["grad_norm"][r] for r in layer_rows) if _finite(v)]
        if len(values) < 2 or not values[0] > 0:
            continue
        ratio = float(values[-1]) / float(values[0])
        if best[1] is None or ratio > best[1]:
            best = (name, ratio)
    return best


def _spike_finding(
    log: GradLog, idx: list[int], norms: list[float], layer_rows: list[int]
) -> dict[str, Any] | None:
    """Spikes among ``norms`` (the finite norms before a growth onset; ``idx`` maps them to rows)."""
    spikes: list[dict[str, Any]] = []
    for j in range(SPIKE_MIN_HISTORY, len(norms)):
        window = norms[max(0, j - SPIKE_WINDOW) : j]
        x = norms[j]
        mean = math.fsum(window) / len(window)
        if x <= 0 or x < SPIKE_MIN_RATIO * mean or x <= mean:  # x <= 0: only in hand-made files
            continue
        logs = [math.log(v) for v in window if v > 0]
        if len(logs) < SPIKE_MIN_HISTORY:  # mostly zero norms: no scale to judge by
            continue
        log_mean, log_std = _mean_std(logs)
        excess = math.log(x) - log_mean
        z = excess / log_std if log_std > 0 else (math.inf if excess > 0 else 0.0)
        if z > SPIKE_Z:
            spikes.append({"step": log.steps[idx[j]], "norm": x, "mean": mean, "log_std": log_std, "z": z})
    if not spikes:
        return None
    top = sorted(spikes, key=lambda s: -s["z"])[:SPIKE_TOP]
    big = top[0]
    layer = None
    row = next((r for r in layer_rows if log.steps[r] == big["step"]), None)
    if row is not None:
        layer = _most_unusual_layer(log, layer_rows, row)
    steps = [s["step"] for s in spikes]
    listed = ", ".join(str(s) for s in steps[:10]) + (", ..." if len(steps) > 10 else "")
    at_layer = f"; at that step {layer} had the largest gradient norm against its median" if layer else ""
    evidence = (
        f"{len(spikes)} spike(s) (log-norm z > {SPIKE_Z:g} over the previous up to {SPIKE_WINDOW} "
        f"updates and >= {SPIKE_MIN_RATIO:g}x their mean) at step(s) {listed}; "
        f"largest at step {big['step']}: norm {_num(big['norm'])}, "
        f"{_num(big['norm'] / big['mean'])}x the rolling mean "
        f"{_num(big['mean'])}, z = {_num(big['z'])}{at_layer}"
    )
    return {
        "kind": "spikes",
        "verdict": "spikes",
        "step": steps[0],
        "layer": layer,
        "evidence": evidence,
        "values": {
            "count": len(spikes),
            "steps": steps[:_MAX_LISTED_STEPS],
            "steps_truncated": len(steps) > _MAX_LISTED_STEPS,
            "top": top,
        },
    }


def _most_unusual_layer(log: GradLog, layer_rows: list[int], row: int) -> str | None:
    best: tuple[str | None, float] = (None, -math.inf)
    for name, cols in log.layers.items():
        x = cols["grad_norm"][row]
        history = [v for v in (cols["grad_norm"][r] for r in layer_rows) if _finite(v)]
        if not _finite(x) or not history:
            continue
        med = _median(history)
        ratio = float(x) / med if med > 0 else math.inf
        if ratio > best[1]:
            best = (name, ratio)
    return best[0]


def _vanishing_findings(log: GradLog, layer_rows: list[int]) -> list[dict[str, Any]]:
    medians: dict[str, float] = {}
    ratios: dict[str, list[tuple[int, float]]] = {}
    for name, cols in log.layers.items():
        grads = [float(g) for g in (cols["grad_norm"][r] for r in layer_rows) if _finite(g)]
        if not grads:
            continue
        medians[name] = _median(grads)
        pairs = []
        for r in layer_rows:
            g, p = cols["grad_norm"][r], cols["param_norm"][r]
            if _finite(g) and _finite(p) and p > 0:
                pairs.append((r, float(g) / float(p)))
        ratios[name] = pairs
    if not medians:
        return []
    reference = _median(list(medians.values()))
    out = []
    for name, med in medians.items():
        pairs = ratios[name]
        ratio = _median([v for _, v in pairs]) if pairs else None
        relative = med < VANISH_RELATIVE * reference
        to_param = ratio is not None and ratio < VANISH_TO_PARAM
        if not (relative or to_param):
            continue
        column = log.layers[name]["grad_norm"]
        if relative:
            first = next(r for r in layer_rows if _finite(g := column[r]) and g < VANISH_RELATIVE * reference)
        else:
            first = next(r for r, v in pairs if v < VANISH_TO_PARAM)
        parts = []
        if relative:
            parts.append(
                f"median gradient norm {_num(med)} is {_num(med / reference) if reference > 0 else '0'}x "
                f"the median over layers ({_num(reference)}; vanishing below {VANISH_RELATIVE:g}x)"
            )
        if ratio is not None:
            below = f"; vanishing below {VANISH_TO_PARAM:g}" if to_param else ""
            parts.append(f"median grad_norm/param_norm {_num(ratio)}{below}")
        out.append(
            {
                "kind": "vanishing",
                "verdict": "vanishing",
                "step": log.steps[first],
                "layer": name,
                "evidence": f"{name}: " + "; ".join(parts) + f" (first below at step {log.steps[first]})",
                "values": {
                    "median_grad_norm": med,
                    "reference": reference,
                    "median_grad_to_param": ratio,
                    "relative": relative,
                    "to_param": to_param,
                },
            }
        )
    return out


def _suggestions(norms: list[float]) -> list[dict[str, Any]]:
    if not norms:
        return []
    mean, std = _mean_std(norms)
    n = len(norms)
    return [
        {
            "name": "autoclip",
            "rule": (
                f"the {AUTOCLIP_PERCENTILE:g}th percentile of the {n} recorded finite norms "
                "(AutoClip, Seetharaman et al. 2020)"
            ),
            "value": percentile(norms, AUTOCLIP_PERCENTILE),
            "low": None,
            "high": None,
        },
        {
            "name": "pascanu",
            "rule": (
                f"{PASCANU_LOW:g} to {PASCANU_HIGH:g} times the mean norm {_num(mean)} (Pascanu et al. 2013)"
            ),
            "value": None,
            "low": PASCANU_LOW * mean,
            "high": PASCANU_HIGH * mean,
        },
        {
            "name": "zclip",
            "rule": (
                f"mean {_num(mean)} + {ZCLIP_Z:g} x population std {_num(std)} of the norms "
                "(a static ZClip-style z-score bound, Kumar et al. 2025)"
            ),
            "value": mean + ZCLIP_Z * std,
            "low": None,
            "high": None,
        },
    ]


def _summary(log: GradLog, norms: list[float], layer_rows: list[int], overflow: int) -> dict[str, Any]:
    n = len(log.steps)
    clipped = sum(log.clipped)
    bounds = [x for x in log.max_norm if _finite(x)]
    max_norm = None if not bounds else {"min": min(bounds), "max": max(bounds), "last": bounds[-1]}
    unbounded = any(x is not None and math.isinf(x) for x in log.max_norm)
    return {
        "updates": n,
        "first_step": log.steps[0],
        "last_step": log.steps[-1],
        "clipped": clipped,
        "clipped_fraction": clipped / n,
        "skipped": sum(log.skipped),
        "nonfinite": sum(1 for x in log.total_norm if not math.isfinite(x)),
        "overflow": overflow,
        "finite_norms": len(norms),
        "norm_min": min(norms) if norms else None,
        "norm_median": _median(norms) if norms else None,
        "norm_max": max(norms) if norms else None,
        "max_norm": max_norm,
        "max_norm_unbounded": unbounded,
        "layers": len(log.layers),
        "layer_rows": len(layer_rows),
    }


# ---------------------------------------------------------------------------- rendering


def format_json(report: Mapping[str, Any]) -> str:
    """The report as JSON; non-finite floats become ``"nan"``, ``"inf"`` or ``"-inf"``."""
    return json.dumps(json_safe(report), indent=2, allow_nan=False)


def format_report(report: Mapping[str, Any]) -> str:
    """The report for a terminal: verdict line, evidence, suggested max_norm values, summary, notes."""
    verdict = report["verdict"]
    findings = report["findings"]
    s = report["summary"]
    if findings:
        head = findings[0]
        where = [f"step {head['step']}"] if head["step"] is not None else []
        if head["layer"] is not None:
            where.append(f"layer {head['layer']}")
        lines = [f"verdict: {verdict} ({_KIND_TEXT[head['kind']]}; {', '.join(where)})"]
    else:
        lines = ["verdict: healthy (no non-finite, fast-growing, spiking or vanishing gradient norms)"]
    lines.append(f"file: {report['file']} ({s['updates']} updates, steps {s['first_step']}-{s['last_step']})")

    lines += ["", "Evidence:"]
    if findings:
        lines += [f"  - [{f['kind']}] {f['evidence']}" for f in findings]
    else:
        lines.append("  - none of the rules fired (they are listed in the docstring of clipopt._report)")

    lines += ["", "Suggested max_norm:"]
    if report["suggestions"]:
        rows = []
        for sug in report["suggestions"]:
            value = (
                _num(sug["value"])
                if sug["value"] is not None
                else f"{_num(sug['low'])} - {_num(sug['high'])}"
            )
            rows.append([sug["name"], value, sug["rule"]])
        lines += _table(rows)
    else:
        lines.append("  none (no finite norm recorded)")

    lines += ["", "Summary:"]
    if s["max_norm"] is None and s.get("max_norm_unbounded"):
        used = "adaptive, no bound reached (e.g. ZClip between spikes)"
    elif s["max_norm"] is None and s["clipped"]:
        used = "none recorded: unit-wise clipping (AGC) or value clipping"
    elif s["max_norm"] is None:
        used = "none (norm clipping off)"
    elif s["max_norm"]["min"] == s["max_norm"]["max"]:
        used = _num(s["max_norm"]["last"])
    else:
        mn = s["max_norm"]
        used = f"{_num(mn['min'])} - {_num(mn['max'])} (last {_num(mn['last'])})"
    norms = (
        f"min {_num(s['norm_min'])}, median {_num(s['norm_median'])}, max {_num(s['norm_max'])} "
        f"({s['finite_norms']} finite)"
        if s["finite_norms"]
        else "no finite norm"
    )
    rows = [
        ["updates", f"{s['updates']}"],
        ["clipped", f"{s['clipped']} ({100 * s['clipped_fraction']:.1f}%)"],
        ["skipped", f"{s['skipped']}"],
        ["non-finite", f"{s['nonfinite']}" + (f" ({s['overflow']} overflow)" if s["overflow"] else "")],
        ["total norm", norms],
        ["max_norm used", used],
        [
            "layers",
            f"{s['layers']} ({s['layer_rows']} rows with per-layer statistics)" if s["layers"] else "-",
        ],
    ]
    lines += _table(rows)
    if report["notes"]:
        lines += ["", "Notes:"]
        lines += [f"  - {note}" for note in report["notes"]]
    return "\n".join(lines)


_KIND_TEXT = {
    "nonfinite": "non-finite gradient norm",
    "growth": "fast-growing gradient norm",
    "spikes": "gradient norm spikes",
    "vanishing": "vanishing layer gradient",
}


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]) for r in rows]






# ---------------------------------------------------------------------------- plotting

_INSTALL = (
    "drawing the plot needs matplotlib, which is not installed; install it with: pip install 'clipopt[plot]'"
)


def plot_log(log: GradLog, report: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw the total norm over updates and, with per-layer columns, a per-layer heatmap; save to ``path``.

    Panel 1: the total norm per step on a log scale, the ``max_norm`` used (when
    recorded), the AutoClip suggestion, clipped updates (dots), spikes (circles)
    and skipped or non-finite updates (red crosses along the top).  Panel 2, when
    the log has per-layer columns: ``log10(grad_norm)`` per layer (rows) and
    per-layer step (columns), non-finite cells crossed out.  The format follows
    the file name's extension (PNG by default).  Uses ``matplotlib.figure.Figure``
    with the Agg canvas: pyplot and the process's backend are left alone.

    Raises :class:`ImportError` with an install hint when matplotlib is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.transforms import blended_transform_factory
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc

    layer_rows = log.layer_rows()
    names = list(log.layers)
    heat = bool(layer_rows and names)
    height = 4.0 + (min(1.0 + 0.18 * len(names), 9.0) if heat else 0.0)
    fig = Figure(figsize=(11.0, height), layout="constrained")
    FigureCanvasAgg(fig)
    if heat:
        ax, hax = fig.subplots(2, 1, sharex=True, height_ratios=[4.0, height - 4.0])
    else:
        ax, hax = fig.subplots(1, 1), None

    steps = log.steps
    xs = [steps[i] for i, x in enumerate(log.total_norm) if _finite(x) and x > 0]
    ys = [float(x) for x in log.total_norm if _finite(x) and x > 0]
    ax.plot(xs, ys, lw=0.9, color="tab:blue", label="total norm (pre-clip)")
    clipped = [
        (steps[i], float(x)) for i, x in enumerate(log.total_norm) if log.clipped[i] and _finite(x) and x > 0
    ]
    if clipped:
        ax.scatter(
            *zip(*clipped, strict=True),
            s=8,
            color="tab:orange",
            alpha=0.7,
            lw=0,
            zorder=3,
            label=f"clipped ({len(clipped)})",
        )
    spike = next((f for f in report["findings"] if f["kind"] == "spikes"), None)
    if spike is not None:
        spike_steps = set(spike["values"]["steps"])
        points = [
            (steps[i], float(x))
            for i, x in enumerate(log.total_norm)
            if steps[i] in spike_steps and _finite(x)
        ]
        if points:
            ax.scatter(
                *zip(*points, strict=True),
                s=60,
                facecolors="none",
                edgecolors="tab:purple",
                lw=1.5,
                zorder=4,
                label=f"spike ({spike['values']['count']})",
            )
    bounds = [(steps[i], float(b)) for i, b in enumerate(log.max_norm) if _finite(b)]
    if bounds:
        bx, by = zip(*bounds, strict=True)
        ax.step(bx, by, where="post", color="black", ls="--", lw=1.0, label="max_norm used")
    autoclip = next((s for s in report["suggestions"] if s["name"] == "autoclip"), None)
    if autoclip is not None and autoclip["value"] > 0:
        ax.axhline(
            autoclip["value"],
            color="tab:green",
            ls=":",
            lw=1.2,
            label=f"AutoClip suggestion p{AUTOCLIP_PERCENTILE:g} = {_num(autoclip['value'])}",
        )
    bad = [steps[i] for i in range(len(steps)) if log.skipped[i] or not _finite(log.total_norm[i])]
    if bad:
        top = blended_transform_factory(ax.transData, ax.transAxes)
        ax.scatter(
            bad,
            [0.97] * len(bad),
            transform=top,
            marker="x",
            s=30,
            color="tab:red",
            zorder=5,
            clip_on=False,
            label=f"skipped / non-finite ({len(bad)})",
        )
    if ys or bounds or autoclip is not None:
        ax.set_yscale("log")
    ax.set_ylabel("gradient norm")
    ax.set_title(f"{os.path.basename(log.path)}: verdict: {report['verdict']}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0.0)
    if hax is None:
        ax.set_xlabel("update (step)")
    else:
        _heatmap(fig, hax, log, layer_rows, names)
    fig.savefig(os.fspath(path), dpi=110)


def _heatmap(fig: Any, ax: Any, log: GradLog, layer_rows: list[int], names: list[str]) -> None:
    steps = [log.steps[r] for r in layer_rows]
    if len(steps) == 1:
        edges = [steps[0] - 0.5, steps[0] + 0.5]
    else:
        mids = [(a + b) / 2 for a, b in itertools.pairwise(steps)]
        edges = [steps[0] - (mids[0] - steps[0]), *mids, steps[-1] + (steps[-1] - mids[-1])]
    grid: list[list[float]] = []
    bad_x: list[float] = []
    bad_y: list[float] = []
    for y, name in enumerate(names):
        cols = log.layers[name]
        line = []
        for x, r in enumerate(layer_rows):
            g, count = cols["grad_norm"][r], cols["nonfinite"][r]
            line.append(math.log10(g) if _finite(g) and g > 0 else math.nan)
            if (count is not None and (count > 0 or math.isnan(count))) or (g is not None and math.isinf(g)):
                bad_x.append(steps[x])
                bad_y.append(y)
        grid.append(line)
    mesh = ax.pcolormesh(
        edges, [y - 0.5 for y in range(len(names) + 1)], grid, cmap="viridis", shading="flat"
    )
    ax.set_facecolor("0.85")
    if bad_x:
        ax.scatter(bad_x, bad_y, marker="x", s=14, color="tab:red")
    every = max(1, math.ceil(len(names) / 40))
    ax.set_yticks(
        list(range(0, len(names), every)), [names[i] for i in range(0, len(names), every)], fontsize=7
    )
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel("update (step)")
    crosses = "; red x: non-finite elements" if bad_x else ""
    ax.set_title(f"per-layer gradient norm (log10; grey: no value{crosses})", fontsize="medium")
    fig.colorbar(mesh, ax=ax, label="log10 grad_norm", pad=0.01)
