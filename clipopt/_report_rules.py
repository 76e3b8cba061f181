"""The verdict rules of ``clipopt report``, founded on real runs (tests/test_report_corpus.py).

Every rule reads a :class:`~clipopt._report_read.GradLog`: the pre-clip total
norm of each update, the loss when the log has one, the clipping record
(clipopt logs) and the per-layer rows.  Statistics are computed with torch on
float64 columns, so a million updates take a fraction of a second; the norms
are judged on their logarithms (or divided by their maximum), so norms up to
``1e308`` give a verdict rather than an overflow.

Terms
-----
*Finite norms*: rows whose norm is finite, in file order.  *Overflow rows*:
non-finite norm with reason ``overflow`` -- a ``GradScaler`` calibrating its
scale, normal operation, never evidence.  *Start*: the median of the first
:data:`START_ROWS` finite values (norms or losses) -- the scale of the run
before anything happened.  A percentile interpolates linearly between ranks
(numpy's default).

Rules, most severe verdict first
--------------------------------
``exploding`` -- the run left its scale for good:

- *blow-up of the loss* (logs with a loss): some loss is above
  :data:`LOSS_BLOWUP` times the start loss (or is not finite, with no
  non-finite gradient before it), and from a row on the median loss of the
  next :func:`block` rows stays above :data:`LOSS_STAY` times the start.
  Step: that row.  Why: a person decides that a run blew up from its loss; a
  loss that stays an order of magnitude above where it started is a run that
  is lost, even when its gradient norm comes down again (the plain run of
  ``clipopt demo`` blows up at update 5 and then sits at 10x its start loss).
  Likewise from the level the loss had reached: a loss above
  :data:`LOSS_BLOWUP` times the median of the previous whole :func:`block`
  (blocks aligned at the first row), after which the median of the next block
  (at least :data:`BLOCK_MIN` rows) and that of the last block stay above
  :data:`LOSS_STAY` times that median.
  Why: a classifier that learned to a tenth of its start loss and then
  diverges back to chance never goes above its start loss, yet it is lost; a
  bad batch's loss spike that the run recovers from by its end is not.
- *fast growth of the norm*: the median of the last :func:`block` finite norms
  is at least :data:`GROWTH_RATIO` times the start's, or some norm reaches
  :data:`GROWTH_RATIO` times the start and the median of the next block stays
  above :data:`GROWTH_ONSET_RATIO` times it (a blow-up in the first updates,
  which block medians over the whole run miss).  Step (onset): the first norm
  above ``GROWTH_ONSET_RATIO`` x start from which the next block's median
  stays above it.  When the log has a loss that is finite to the end and
  lower at the end than at the start, growth of the norm alone is not an
  explosion (a note says so): the loss is the better witness.  Slow geometric
  growth that ends in an overflow is an explosion from its onset, and the
  non-finite updates that follow are part of it.

``nonfinite`` -- some update (not an overflow row) had a non-finite gradient,
not inside an explosion.  Its own verdict because one bad batch is not an
explosion: clipopt skips it (``skip_nonfinite``) and the run goes on.  Step:
the first such row.  Layer: in that row's own per-layer statistics (clipopt
writes them for every non-finite window, whatever the ``layer_stats``
period) the first parameter, in parameter order, with non-finite elements or a
non-finite gradient norm (a ``nan`` norm with no non-finite element counted is a
parameter without a gradient, e.g. a frozen one; in logs that count none,
Lightning's, a ``nan`` norm is non-finite); in logs without that row, the first per-layer row
after it, and the evidence says it was taken from a later row.

``spikes`` -- isolated large updates:

- *norm spikes*: a finite norm ``x`` with ``z = (ln x - m) / s >``
  :data:`SPIKE_Z`, ``m``/``s`` the mean and standard deviation of the
  logarithms of the previous up to :data:`SPIKE_WINDOW` norms (at least
  :data:`SPIKE_MIN_HISTORY`), and ``x`` at least :data:`SPIKE_MIN_RATIO`
  times their mean.  On logarithms because gradient norms are close to
  log-normal: on raw norms healthy heavy-tailed runs had 8-17 false spikes per
  12,000 updates, on log-norms none.  *A spike that clipping handled is not a
  spike*: a clipped update (clipopt's ``clipped`` column) whose loss over the
  next :data:`HANDLED_ROWS` rows stays below :data:`LOSS_SPIKE_RATIO` times
  the median loss before it is counted as handled (without a loss in the log,
  nothing shows that it was handled, and it is a spike) in the summary, not as evidence -- clipping doing its
  job (``clipopt demo``'s clipped run clips 9 % of its updates, some at 2x the
  rolling mean, and learns).
- *loss spikes* (logs with a loss): a loss more than :data:`LOSS_SPIKE_Z`
  standard deviations above the mean of the previous up to
  :data:`LOSS_WINDOW` losses and above :data:`LOSS_SPIKE_RATIO` times that
  mean (a corrupted batch, a bad data shard: the loss shows it even when
  clipping hides the norm).

``vanishing`` (needs per-layer rows): a layer whose median gradient norm is
below :data:`VANISH_RELATIVE` times the median over layers, or whose median
``grad_norm / param_norm`` is below :data:`VANISH_TO_PARAM`.  Step: its first
per-layer row below.  Why: in a deep saturating net the first layers' gradients
are orders of magnitude below the last ones' while the total norm looks calm.
*A gradient zero by construction is not vanishing*: a bias whose median
gradient norm is also below :data:`VANISH_RELATIVE` times that of its own
weight (``0.bias`` and ``0.weight``, ``bias_ih_l0`` and ``weight_ih_l0``) gets
a note instead -- the gradient reaches that module, so nothing vanished on the
way; gradients that vanish shrink a module's weight and bias together.  A
convolution's bias followed by a BatchNorm is one: the normalisation subtracts
the batch mean, so the bias gets no gradient while the run learns (the
Conv+BatchNorm run of the corpus).  Only a bias against its weight: two
weights of one module (a ``ParameterList``, a stacked RNN) are different
layers, which vanish one after the other.

``healthy`` -- none of the above.

Threshold
---------
``suggested_max_norm``, one number: the :data:`SUGGEST_PERCENTILE`-th
percentile of the *healthy stretch*'s finite norms -- the rows before an
explosion's onset (or before the first non-finite row), spikes left out --
so that clipping bounds the outliers and leaves the typical update alone;
when the run exploded, the median of that stretch instead, since its last
norms already rise towards the blow-up.  The report also says which fraction
of updates was clipped, and whether the ``max_norm`` used looks too tight (more
than :data:`TIGHT_FRACTION` of the updates clipped: the bound then acts as a
smaller learning rate) or too loose (the run exploded or spiked and the bound
did not clip those updates, or it is above :data:`LOOSE_RATIO` times the
suggestion).  Further values for reference: AutoClip's
:data:`AUTOCLIP_PERCENTILE`-th percentile (Seetharaman et al. 2020), Pascanu et
al.'s range of :data:`PASCANU_LOW`-:data:`PASCANU_HIGH` times the mean norm
(2013), and a static ZClip bound, mean + :data:`ZCLIP_Z` standard deviations
(Kumar et al. 2025), of all the finite norms -- or, when the run exploded, of
the healthy stretch the suggestion came from: the blow-up's norms (1e16 and
more in the corpus's exploding runs) would only measure how far it went.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ._reasons import NORM_OVERFLOW, OVERFLOW, REWIND, SPIKE, by_code
from ._report_read import GradLog
from ._report_recovery import escalation_text, skip_list, skip_list_notes
from ._text import fmt_num as _num

__all__ = ["VERDICTS", "analyze", "block", "percentile"]

#: The skip reasons the rules tell apart, by name (as the logs hold them).
_OVERFLOW, _NORM_OVERFLOW, _SPIKE, _REWIND = (
    by_code(c).name for c in (OVERFLOW, NORM_OVERFLOW, SPIKE, REWIND)
)

#: Verdicts, most severe first.
VERDICTS = ("exploding", "nonfinite", "spikes", "vanishing", "healthy")

#: Rows (finite values) whose median is the run's start.
START_ROWS = 3
#: Loss blow-up: a loss above this multiple of the start loss.
LOSS_BLOWUP = 10.0
#: Loss blow-up: the median loss of the next block stays above this multiple of the start.
LOSS_STAY = 3.0
#: Growth: last block's median (or a sustained peak) / start at or above which norms explode.
GROWTH_RATIO = 100.0
#: Growth: the onset is where the next block's median first stays above this multiple of the start.
GROWTH_ONSET_RATIO = 10.0
#: Growth: finite norms needed to judge the block medians.
GROWTH_MIN_UPDATES = 20
#: Blocks: this fraction of the rows, at least BLOCK_MIN rows.
GROWTH_BLOCK = 0.05
BLOCK_MIN = 5

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
#: Handled spikes: rows after a clipped spike whose loss is checked.
HANDLED_ROWS = 5
#: Loss spikes: the rolling window, in losses before the update.
LOSS_WINDOW = 64
#: Loss spikes: z-score above which a loss is a spike.
LOSS_SPIKE_Z = 6.0
#: Loss spikes: a spike is also above this multiple of the window's mean loss.
LOSS_SPIKE_RATIO = 1.5

#: Vanishing: a layer's median grad_norm below this multiple of the median of all layers' medians.
VANISH_RELATIVE = 1e-3
#: Vanishing: a layer's median grad_norm / param_norm below this.
VANISH_TO_PARAM = 1e-6

#: Threshold: the percentile of the healthy stretch's norms suggested as max_norm.
SUGGEST_PERCENTILE = 90.0
#: Threshold: more than this fraction of the updates clipped is too tight.
TIGHT_FRACTION = 0.5
#: Threshold: a max_norm above this multiple of the suggestion is too loose (in a run that went wrong).
LOOSE_RATIO = 10.0
AUTOCLIP_PERCENTILE = 10.0
PASCANU_LOW = 0.5
PASCANU_HIGH = 10.0
ZCLIP_Z = 2.5

_MAX_LISTED_STEPS = 100
_MAX_CANDIDATES = 10_000
_MAX_LEVEL_CHECKS = 1_000


def block(n: int) -> int:
    """Rows in a block of a run of ``n`` rows: ``max(BLOCK_MIN, ceil(GROWTH_BLOCK * n))``, at most n."""
    return min(n, max(BLOCK_MIN, math.ceil(GROWTH_BLOCK * n)))


def _t(values: array[float] | list[float]) -> Tensor:
    """The values as a float64 tensor (a non-empty ``array('d')`` is shared, not copied)."""
    if isinstance(values, array) and values.typecode == "d" and len(values):
        return torch.frombuffer(values, dtype=torch.float64)
    return torch.tensor(list(values), dtype=torch.float64)


def percentile(values: Tensor | list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation, as ``numpy.percentile`` by default.

    Two selections (``torch.kthvalue``), not a sort: a few milliseconds on a million values."""
    x = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.float64)
    n = x.numel()
    if n == 0:
        raise ValueError("percentile of no values")
    pos = (n - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    a = float(torch.kthvalue(x, lo + 1).values)
    b = a if hi == lo else float(torch.kthvalue(x, hi + 1).values)
    return a + (b - a) * (pos - lo) if b != a else a


def _median(x: Tensor) -> float:
    """The median of ``x`` (the 50th percentile, interpolated)."""
    return percentile(x, 50.0)


def _start(x: Tensor) -> float:
    """The start of a run: the median of the first START_ROWS values of ``x``."""
    return _median(x[:START_ROWS])


# ---------------------------------------------------------------------------- the whole analysis


def analyze(log: GradLog) -> dict[str, Any]:
    """The verdict, its findings, the suggested ``max_norm``, the clipping assessment and a summary.

    Keys: ``file``, ``source``, ``run`` (the TensorBoard run, or None), ``columns`` (the names read as
    ``norm`` and ``loss``, and those ``ignored``), ``verdict`` (one of :data:`VERDICTS`),
    ``findings`` (most severe first; each ``kind`` -- ``blowup``, ``growth``,
    ``nonfinite``, ``spikes``, ``loss_spikes`` or ``vanishing`` --,
    ``verdict``, ``step``, ``layer``, ``evidence``, ``values``),
    ``suggested_max_norm``, ``clipping``, ``suggestions``, ``summary``,
    ``notes``.  See the module docstring for the rules.
    """
    n = len(log)
    norm, loss = _t(log.total_norm), _t(log.loss)
    notes = list(log.notes)
    finite = torch.isfinite(norm)
    overflow = _overflow_rows(log)
    bad_rows = (~finite & ~overflow).nonzero().flatten()
    first_bad = int(bad_rows[0]) if bad_rows.numel() else n
    explosions = _explosions(log, norm, finite, loss, first_bad, notes)
    onset = min((f["values"]["row"] for f in explosions), default=n)
    spikes, handled = _norm_spikes(log, norm, loss, min(onset, n))
    findings = [*explosions, *_nonfinite_findings(log, bad_rows, onset, first_bad, explosions)]
    findings += [f for f in (spikes, _loss_spikes(log, loss, min(onset, n))) if f is not None]
    findings += _layer_findings(log, notes)
    findings.sort(key=lambda f: VERDICTS.index(f["verdict"]))
    verdict = findings[0]["verdict"] if findings else "healthy"
    n_overflow = int(overflow.sum())
    notes += _run_notes(log, n_overflow, handled)
    end = min(onset, first_bad) if explosions else n
    spike_rows = set(spikes["values"]["rows"]) if spikes is not None else set()
    stretch, stretch_end = _stretch_for(norm, finite, end, spike_rows, verdict)
    suggested = _suggest(stretch, exploding=verdict == "exploding")
    references = _references(log, norm, stretch, stretch_end) if verdict == "exploding" else None
    return {
        "file": log.path,
        "source": log.source,
        "run": log.run,
        "columns": {"norm": log.norm_column, "loss": log.loss_column, "ignored": list(log.ignored)},
        "verdict": verdict,
        "findings": findings,
        "suggested_max_norm": suggested,
        "clipping": _clipping(log, verdict, findings, suggested),
        "suggestions": _suggestions(norm[finite]) if references is None else references,
        "summary": _summary(log, norm, loss, finite, n_overflow, len(handled)),
        "notes": notes,
    }


def _overflow_rows(log: GradLog) -> Tensor:
    """Rows whose norm is not finite with reason ``overflow``: a GradScaler calibrating, never evidence."""
    overflow = torch.zeros(len(log), dtype=torch.bool)
    for i, r in log.reason.items():
        if r == _OVERFLOW and not math.isfinite(log.total_norm[i]):
            overflow[i] = True
    return overflow


def _explosions(
    log: GradLog, norm: Tensor, finite: Tensor, loss: Tensor, first_bad: int, notes: list[str]
) -> list[dict[str, Any]]:
    """The ``exploding`` findings: a blow-up of the loss, fast growth of the norm (either, both or none)."""
    blowup = _loss_blowup(log, loss, first_bad)
    growth = _growth(log, norm, finite, loss, notes)
    return [f for f in (blowup, growth) if f is not None]


def _nonfinite_findings(
    log: GradLog, bad_rows: Tensor, onset: int, first_bad: int, explosions: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The ``nonfinite`` finding (none or one); part of the explosion when that began no later."""
    if not bad_rows.numel():
        return []
    finding = _nonfinite(log, bad_rows)
    if log.reason.get(first_bad) == _NORM_OVERFLOW:  # finite gradients, a float32 norm over 3.4e38
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
        return _vanishing(log, notes)
    if log.layers:
        notes.append("the per-layer columns are empty in every row: vanishing gradients were not checked")
    else:
        notes.append("no per-layer statistics: vanishing gradients were not checked (clipopt: layer_stats=k)")
    return []


def _run_notes(log: GradLog, n_overflow: int, handled: list[int]) -> list[str]:
    """Notes on overflows under a GradScaler, recovery (SpikeGuard, Rewind) and spikes clipping handled."""
    notes = []
    if n_overflow:
        notes.append(
            f"{n_overflow} update(s) overflowed under a GradScaler (reason 'overflow'): loss-scale "
            "calibration, not counted as a problem"
        )
    notes += _recovery_notes(log)
    if handled:
        notes.append(
            f"{len(handled)} large norm(s) (at step(s) {_steps_text(handled)}) were clipped and the loss "
            "did not jump after them: clipping handled them, so they are not counted as spikes"
        )
    return notes


def _recovery_notes(log: GradLog) -> list[str]:
    """Notes on SpikeGuard skips (reason ``spike``) and Rewind rewinds (reason ``rewind``)."""
    notes = []
    spike_rows = [i for i, r in sorted(log.reason.items()) if r == _SPIKE]
    rewind_rows = [i for i, r in sorted(log.reason.items()) if r == _REWIND]
    spikes, rewinds = [log.steps[i] for i in spike_rows], [log.steps[i] for i in rewind_rows]
    if spikes:
        steps = _steps_text(spikes)
        notes.append(f"{len(spikes)} update(s) skipped as spikes (reason 'spike') at step(s) {steps}")
    if rewinds:
        escalation = escalation_text(log, rewind_rows)
        notes.append(
            f"{len(rewinds)} rewind(s) (reason 'rewind') at step(s) {_steps_text(rewinds)}: the training "
            "state went back to an earlier copy after repeated spikes, and the following batches were dropped"
            + (f"; {escalation}" if escalation else "")
        )
    return notes + skip_list_notes(log, spike_rows, rewind_rows)


def _skip_list(log: GradLog) -> list[list[int]]:
    """The batches of the spike skips and rewinds as ``opt.rewind.batches(skip=...)`` ranges."""
    rows = sorted(log.reason.items())
    return skip_list(log, [i for i, r in rows if r == _SPIKE], [i for i, r in rows if r == _REWIND])


def _steps_text(steps: list[int]) -> str:
    """The first ten steps, comma-separated, with ``...`` when there are more."""
    return ", ".join(str(s) for s in steps[:10]) + (", ..." if len(steps) > 10 else "")


# ---------------------------------------------------------------------------- exploding


def _sustained_onset(x: Tensor, threshold: float, k: int) -> int | None:
    """The first index j with ``x[j] > threshold`` and median of ``x[j:j+k]`` > threshold (nan/inf: above)."""
    above = (x > threshold) | ~torch.isfinite(x)
    # a median above the threshold needs at least half of x[j:j+k] above it: one count filters the
    # candidates, so heavy-tailed norms do not take a median per candidate (1M rows: 20 s before)
    n = int(x.numel())
    count = torch.cat([torch.zeros(1, dtype=torch.int64), above.cumsum(0)])
    rows = above.nonzero().flatten()
    ends = (rows + k).clamp(max=n)
    rows = rows[count[ends] - count[rows] >= (ends - rows) // 2]
    candidates = rows[:_MAX_CANDIDATES].tolist()
    y = torch.where(torch.isfinite(x), x, torch.full_like(x, math.inf))
    for j in candidates:
        if _median(y[j : j + k]) > threshold:
            return int(j)
    return None


def _loss_blowup(log: GradLog, loss: Tensor, first_bad: int) -> dict[str, Any] | None:
    """The ``blowup`` finding: the loss left its start, or the level it had reached, for good."""
    counted = _counted_losses(loss, first_bad)
    if counted is None:
        return None
    rows, values, start = counted
    peak = (values > LOSS_BLOWUP * start) | torch.isinf(values)
    k = block(int(rows.numel()))
    j = _sustained_onset(values, LOSS_STAY * start, k) if peak.any() else None
    ref, ref_text = start, f"its start {_num(start)}"
    if j is None:
        found = _blowup_from_level(values, k)
        if found is None:
            return None
        j, ref = found
        ref_text = f"the level {_num(ref)} it had reached (median of the previous {k} logged losses)"
    row = int(rows[j])
    top = float(values[torch.isfinite(values)].max()) if torch.isfinite(values).any() else math.nan
    after = _median(torch.where(torch.isfinite(values[j : j + k]), values[j : j + k], math.inf))
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
    start = _start(values[finite])
    if not start > 0:
        return None
    late = ~finite & (rows >= first_bad)
    values[late] = math.nan
    keep = ~torch.isnan(values)
    return rows[keep], values[keep], start


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
    tail = _median(values[-k:])  # "for good": the last block too stays above LOSS_STAY x the level
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
        keep |= mine & (above[ends] - above[rows] >= need)
    for j in rows[keep][:_MAX_LEVEL_CHECKS].tolist():
        lv = float(level[j])
        if _median(values[j : j + k]) > LOSS_STAY * lv:
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


def _growth(
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
    start = _start(x)
    if not start > 0:
        return None
    k = block(m)
    # a run whose last block of rows is non-finite (not overflows) ended above every bound
    last = range(max(0, len(log) - k), len(log))
    ends_bad = all(not math.isfinite(log.total_norm[i]) and log.reason.get(i) != _OVERFLOW for i in last)
    tail = _median(x[-k:])
    grew = m >= GROWTH_MIN_UPDATES and tail >= GROWTH_RATIO * start
    onset = _sustained_onset(x, GROWTH_ONSET_RATIO * start, k)
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
    return _median(given[-k:]) < _median(given[:k])


def _largest_layer_growth(log: GradLog) -> tuple[str | None, float | None]:
    """The layer whose gradient norm grew most from its first to its last finite value, and that ratio."""
    best: tuple[str | None, float | None] = (None, None)
    for name, cols in log.layers.items():
        g = _t(cols["grad_norm"])
        g = g[torch.isfinite(g)]
        if g.numel() < 2 or not float(g[0]) > 0:
            continue
        ratio = float(g[-1]) / float(g[0])
        if best[1] is None or ratio > best[1]:
            best = (name, ratio)
    return best


# ---------------------------------------------------------------------------- non-finite


def _nonfinite(log: GradLog, bad_rows: Tensor) -> dict[str, Any]:
    """The ``nonfinite`` finding: the first non-finite update, how many were applied, and its layer."""
    first = int(bad_rows[0])
    step = log.steps[first]
    skipped = sum(log.skipped[int(i)] for i in bad_rows[:1_000_000].tolist())
    applied = int(bad_rows.numel()) - skipped
    layer, how, bad_layers, layer_step = _nonfinite_layer(log, first)
    tail = ""
    if applied and first + 1 < len(log) and all(not math.isfinite(v) for v in log.total_norm[first + 1 :]):
        tail = "; it was applied and every later update is non-finite too (the parameters went non-finite)"
    evidence = (
        f"total norm {_num(log.total_norm[first])} at step {step}, the first of {bad_rows.numel()} non-finite "  # noqa: E501
        f"update(s) ({skipped} skipped, {applied} applied); {how}{tail}"
    )
    return {
        "kind": "nonfinite",
        "verdict": "nonfinite",
        "step": step,
        "layer": layer,
        "evidence": evidence,
        "values": {
            "row": first,
            "total_norm": log.total_norm[first],
            "count": int(bad_rows.numel()),
            "applied": applied,
            "layer_step": layer_step,
            "nonfinite_layers": bad_layers,
        },
    }


def _nonfinite_layer(log: GradLog, first: int) -> tuple[str | None, str, dict[str, int], int | None]:
    """The layer of the first non-finite row ``first``: ``(layer, how it was found, bad layers, step)``.

    Taken from the first per-layer row at or after it; ``bad layers`` maps each
    non-finite parameter to its count of non-finite elements (-1: not counted)."""
    pos = next((p for p, r in enumerate(log.layer_rows) if r >= first), None)
    if pos is None:
        return None, "no per-layer statistics were recorded at or after it", {}, None
    layer_step = log.steps[log.layer_rows[pos]]
    bad_layers = _nonfinite_layers_at(log, pos)
    own = layer_step == log.steps[first]
    where = "in its own per-layer row" if own else f"in the next per-layer row (step {layer_step}), a guess"
    if not bad_layers:
        return None, f"no parameter recorded non-finite elements {where}", bad_layers, layer_step
    layer = next(iter(bad_layers))
    how = (
        f"first parameter with a non-finite gradient {where}: {layer} "
        f"({len(bad_layers)} of {len(log.layers)} non-finite)"
    )
    return layer, how, bad_layers, layer_step


def _nonfinite_layers_at(log: GradLog, pos: int) -> dict[str, int]:
    """The parameters non-finite in per-layer row ``pos``, in parameter order, with their counts."""
    bad_layers = {}
    for name, cols in log.layers.items():
        count, g = cols["nonfinite"][pos], cols["grad_norm"][pos]
        # a non-finite norm is a non-finite gradient where the log counts no non-finite elements
        # (Lightning); where it counts them (clipopt), the count decides: a nan norm without one is a
        # parameter without a gradient, an inf norm without one a finite gradient whose float32 norm
        # overflowed (elements of 1e25), not the parameter that went non-finite
        counted = name in log.counted
        if (math.isfinite(count) and count > 0) or (not counted and not math.isfinite(g)):
            bad_layers[name] = int(count) if math.isfinite(count) else -1
    return bad_layers


# ---------------------------------------------------------------------------- spikes


def _rolling(x: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
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


def _norm_spikes(
    log: GradLog, norm: Tensor, loss: Tensor, end: int
) -> tuple[dict[str, Any] | None, list[int]]:
    """Norm spikes before row ``end`` and the steps of the spikes clipping handled."""
    spikes: list[dict[str, Any]] = []
    handled: list[int] = []
    for row, x, mean, z in _log_norm_outliers(norm[:end]):
        if log.clipped[row] and _loss_calm_after(loss, row):
            handled.append(log.steps[row])
            continue
        spikes.append({"row": row, "step": log.steps[row], "norm": x, "mean": mean, "z": z})
    return (_norm_spikes_finding(log, spikes) if spikes else None), handled


def _log_norm_outliers(head: Tensor) -> list[tuple[int, float, float, float]]:
    """The rows of ``head`` whose log-norm is a spike over the rolling window: ``(row, norm, mean, z)``.

    A spike has at least SPIKE_MIN_HISTORY finite norms before it, a z-score of
    its logarithm above SPIKE_Z, and a norm of at least SPIKE_MIN_RATIO x the
    window's mean (``mean``)."""
    idx = (torch.isfinite(head) & (head > 0)).nonzero().flatten()
    x = head[idx]
    if x.numel() <= SPIKE_MIN_HISTORY:
        return []
    logs = x.log()
    mean_log, std_log, count = _rolling(logs, SPIKE_WINDOW)
    scale = float(x.max())
    mean_raw = _rolling(x / scale, SPIKE_WINDOW)[0] * scale
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
        f"updates and >= {SPIKE_MIN_RATIO:g}x their mean) at step(s) {_steps_text(steps)}; "
        f"largest at step {big['step']}: norm {_num(big['norm'])}, {_num(big['norm'] / big['mean'])}x the "
        f"rolling mean {_num(big['mean'])}, z = {_num(big['z'])}{at_layer}"
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
            "rows": [s["row"] for s in spikes],
            "steps_truncated": len(steps) > _MAX_LISTED_STEPS,
            "top": top,
        },
    }


def _loss_calm_after(loss: Tensor, row: int) -> bool:
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
    ref = _median(before)
    return _median(after) <= LOSS_SPIKE_RATIO * ref if ref > 0 else True


def _loss_spikes(log: GradLog, loss: Tensor, end: int) -> dict[str, Any] | None:
    """The ``loss_spikes`` finding: losses before row ``end`` far above the rolling mean before them."""
    head = loss[:end]
    idx = torch.isfinite(head).nonzero().flatten()
    x = head[idx]
    if x.numel() <= SPIKE_MIN_HISTORY:
        return None
    mean, std, count = _rolling(x, LOSS_WINDOW)
    hit = (count >= SPIKE_MIN_HISTORY) & (x - mean > LOSS_SPIKE_Z * std) & (x > LOSS_SPIKE_RATIO * mean)
    hit &= mean > 0
    pos = hit.nonzero().flatten().tolist()
    if not pos:
        return None
    rows = [int(idx[p]) for p in pos]
    steps = [log.steps[r] for r in rows]
    big = max(pos, key=lambda p: float((x[p] - mean[p]) / std[p].clamp(min=1e-300)))
    evidence = (
        f"{len(pos)} loss spike(s) (> {LOSS_SPIKE_Z:g} std and > {LOSS_SPIKE_RATIO:g}x the mean of the previous "  # noqa: E501
        f"up to {LOSS_WINDOW} losses) at step(s) {_steps_text(steps)}; largest at step {log.steps[int(idx[big])]}: "  # noqa: E501
        f"loss {_num(float(x[big]))} against a rolling mean {_num(float(mean[big]))}"
    )
    return {
        "kind": "loss_spikes",
        "verdict": "spikes",
        "step": steps[0],
        "layer": None,
        "evidence": evidence,
        "values": {"count": len(pos), "steps": steps[:_MAX_LISTED_STEPS], "rows": rows[:_MAX_LISTED_STEPS]},
    }


def _most_unusual_layer(log: GradLog, row: int) -> str | None:
    """The layer with the largest gradient norm against its median at row ``row`` (None: no per-layer row)."""
    pos = next((p for p, r in enumerate(log.layer_rows) if r == row), None)
    if pos is None:
        return None
    best: tuple[str | None, float] = (None, -math.inf)
    for name, cols in log.layers.items():
        g = _t(cols["grad_norm"])
        x = float(g[pos])
        history = g[torch.isfinite(g)]
        if not math.isfinite(x) or history.numel() == 0:
            continue
        med = _median(history)
        ratio = x / med if med > 0 else math.inf
        if ratio > best[1]:
            best = (name, ratio)
    return best[0]


# ---------------------------------------------------------------------------- vanishing


def _vanishing(log: GradLog, notes: list[str]) -> list[dict[str, Any]]:
    """One ``vanishing`` finding per layer whose gradients are far below the others' or its weights', but
    for the parameters whose gradient is zero by construction (:func:`_zero_by_construction`): a note."""
    medians, ratios = _layer_medians(log)
    if not medians:
        return []
    reference = _median(torch.tensor(list(medians.values()), dtype=torch.float64))
    findings, by_construction = [], []
    for name, med in medians.items():
        found = _vanishing_finding(log, name, med, ratios[name], reference)
        if found is None:
            continue
        sibling = _zero_by_construction(name, medians)
        if sibling is None:
            findings.append(found)
        else:
            by_construction.append(f"{name} (median {_num(med)}; {sibling} {_num(medians[sibling])})")
    if by_construction:
        listed = ", ".join(by_construction[:10]) + (", ..." if len(by_construction) > 10 else "")
        notes.append(
            f"{len(by_construction)} parameter(s) with a gradient far below that of another parameter of "
            f"the same module: {listed}; the gradient reaches that module, so this is not vanishing but a "
            "gradient that is zero by construction (e.g. a bias followed by a normalisation, which "
            "removes the mean)"
        )
    return findings


def _weight_of(name: str) -> str | None:
    """The weight a bias is added to: ``0.bias`` -> ``0.weight``, ``rnn.bias_ih_l0`` ->
    ``rnn.weight_ih_l0``, ``attn.in_proj_bias`` -> ``attn.in_proj_weight``; None for a name whose last
    part is not a bias."""
    module, dot, leaf = name.rpartition(".")
    return module + dot + leaf.replace("bias", "weight") if "bias" in leaf else None


def _zero_by_construction(name: str, medians: dict[str, float]) -> str | None:
    """The weight of the bias ``name`` (:func:`_weight_of`) when ``name``'s median gradient norm is below
    VANISH_RELATIVE times that weight's, else None.

    Why: gradients vanish layer by layer, so a module's weight and bias shrink
    together (the deep-sigmoid run of the corpus: within 6x of each other,
    both 1e-12); a bias whose gradient is 1e-7 of its own module's weight's is
    cancelled by what follows it -- a BatchNorm subtracts the batch mean, so a
    convolution's bias before it gets no gradient at all -- and the layers
    around it learn.  Only a bias against its own weight: the other parameters
    of a module may be other layers (``nn.ParameterList`` weights ``ws.0`` ...
    ``ws.14``, a stacked RNN's ``weight_ih_l0`` ... ``weight_ih_l11``), whose
    gradients vanish one after the other."""
    weight = _weight_of(name)
    if weight is None or weight not in medians:
        return None
    return weight if medians[name] < VANISH_RELATIVE * medians[weight] else None


def _layer_medians(log: GradLog) -> tuple[dict[str, float], dict[str, Tensor]]:
    """Per layer with a finite gradient norm: its median, and its ``grad_norm / param_norm`` per row (nan:
    not both finite and positive)."""
    medians: dict[str, float] = {}
    ratios: dict[str, Tensor] = {}
    for name, cols in log.layers.items():
        g, p = _t(cols["grad_norm"]), _t(cols["param_norm"])
        ok = torch.isfinite(g)
        if not ok.any():
            continue
        medians[name] = _median(g[ok])
        both = ok & torch.isfinite(p) & (p > 0)
        ratios[name] = torch.where(both, g / p.clamp(min=1e-300), math.nan)
    return medians, ratios


def _vanishing_finding(
    log: GradLog, name: str, med: float, r: Tensor, reference: float
) -> dict[str, Any] | None:
    """Layer ``name``'s ``vanishing`` finding (None: not vanishing), against the median over layers."""
    r_ok = r[~torch.isnan(r)]
    ratio = _median(r_ok) if r_ok.numel() else None
    relative = med < VANISH_RELATIVE * reference
    to_param = ratio is not None and ratio < VANISH_TO_PARAM
    if not (relative or to_param):
        return None
    g = _t(log.layers[name]["grad_norm"])
    below = (g < VANISH_RELATIVE * reference) if relative else (r < VANISH_TO_PARAM)
    first = int(below.nonzero().flatten()[0]) if below.any() else 0
    step = log.steps[log.layer_rows[first]]
    parts = []
    if relative:
        rel = _num(med / reference) if reference > 0 else "0"
        parts.append(
            f"median gradient norm {_num(med)} is {rel}x the median over layers ({_num(reference)}; "
            f"vanishing below {VANISH_RELATIVE:g}x)"
        )
    if ratio is not None:
        tail = f"; vanishing below {VANISH_TO_PARAM:g}" if to_param else ""
        parts.append(f"median grad_norm/param_norm {_num(ratio)}{tail}")
    return {
        "kind": "vanishing",
        "verdict": "vanishing",
        "step": step,
        "layer": name,
        "evidence": f"{name}: " + "; ".join(parts) + f" (first below at step {step})",
        "values": {
            "median_grad_norm": med,
            "reference": reference,
            "median_grad_to_param": ratio,
            "relative": relative,
            "to_param": to_param,
        },
    }


# ---------------------------------------------------------------------------- threshold


def _healthy_stretch(norm: Tensor, end: int, spike_rows: set[int]) -> Tensor:
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


def _stretch_for(
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
            above = (norm[:end] > GROWTH_ONSET_RATIO * _median(start)).nonzero().flatten()
            end = min(_early_onset(norm, finite, end), int(above[0]) if above.numel() else end)
    return _healthy_stretch(norm, end, spike_rows), end


def _early_onset(norm: Tensor, finite: Tensor, end: int) -> int:
    """The first of the first START_ROWS finite rows (before ``end``) whose norm is above
    GROWTH_ONSET_RATIO x the median of the finite norms before it; ``end`` when none is."""
    rows = finite.nonzero().flatten()[:START_ROWS].tolist()
    for k in range(1, len(rows)):
        if rows[k] < end and float(norm[rows[k]]) > GROWTH_ONSET_RATIO * _median(norm[rows[:k]]):
            return int(rows[k])
    return end


def _suggest(stretch: Tensor, *, exploding: bool) -> float | None:
    """The stretch's SUGGEST_PERCENTILE-th percentile (its median when the run exploded); None when empty."""
    if stretch.numel() == 0:
        return None
    return percentile(stretch, 50.0 if exploding else SUGGEST_PERCENTILE)


def _clipping(
    log: GradLog, verdict: str, findings: list[dict[str, Any]], suggested: float | None
) -> dict[str, Any]:
    """How clipping was used: the fraction clipped, the last ``max_norm`` and its assessment with advice."""
    n = len(log)
    clipped = sum(log.clipped)
    mn = _t(log.max_norm)
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


def _references(log: GradLog, norm: Tensor, stretch: Tensor, end: int) -> list[dict[str, Any]]:
    """The reference values of an exploded run: from its healthy stretch ``stretch`` (the norms before
    row ``end``, or the first START_ROWS norms when none is), not from the blow-up's norms."""
    head = norm[:end]
    if end < len(log) and bool((torch.isfinite(head) & (head > 0)).any()):
        where = f" before step {log.steps[end]}"
    else:
        where = "" if end >= len(log) else " at the start"
    return _suggestions(stretch, where)


def _suggestions(norms: Tensor, where: str = "") -> list[dict[str, Any]]:
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


def _summary(
    log: GradLog, norm: Tensor, loss: Tensor, finite: Tensor, overflow: int, handled: int
) -> dict[str, Any]:
    """The summary's figures: updates, clipping, non-finite rows, norms, max_norm, losses, layers, groups,
    spike skips and rewinds (``skip``: their batches as ``[start, end]`` ranges, ``[]`` without the
    batch columns)."""
    n = len(log)
    x = norm[finite]
    given = loss[~torch.isnan(loss)]
    fin_loss = given[torch.isfinite(given)]
    k = block(int(fin_loss.numel())) if fin_loss.numel() else 0
    mn = _t(log.max_norm)
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
        "spike_skips": sum(1 for r in log.reason.values() if r == _SPIKE),
        "rewinds": sum(1 for r in log.reason.values() if r == _REWIND),
        "skip": _skip_list(log),
        "nonfinite": int((~finite).sum()),
        "overflow": overflow,
        "finite_norms": int(x.numel()),
        "norm_min": float(x.min()) if x.numel() else None,
        "norm_median": _median(x) if x.numel() else None,
        "norm_max": float(x.max()) if x.numel() else None,
        "max_norm": {"min": bounds[0], "max": bounds[1], "last": bounds[2]} if bounds else None,
        "max_norm_unbounded": bool(torch.isinf(mn).any()),
        "losses": int(given.numel()),
        "loss_start": _start(fin_loss) if k else None,
        "loss_end": _median(fin_loss[-k:]) if k else None,
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
        norm, coef = _t(kinds["norm"]), _t(kinds["coef"])
        finite = norm[torch.isfinite(norm)]
        recorded = coef[~torch.isnan(coef)]
        clipped = int((recorded < 1.0).sum())
        out.append(
            {
                "group": g,
                "norm_median": _median(finite) if finite.numel() else None,
                "norm_max": float(finite.max()) if finite.numel() else None,
                "clipped": clipped,
                "clipped_fraction": clipped / int(recorded.numel()) if recorded.numel() else 0.0,
            }
        )
    return out
