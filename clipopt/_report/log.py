"""The one shape every ``clipopt report`` reader produces: :class:`GradLog` (and :class:`Names`, the
names the user chose), and :func:`from_records`, the step-keyed records (Trainer JSON, TensorBoard)
-> GradLog conversion.  The readers: :mod:`clipopt._report.read` (the registry)."""

from __future__ import annotations

import math
import re
from array import array
from dataclasses import dataclass, field

from .._diagnostics.layers import LAYER_FIELDS
from .._log_names import (
    CLIPPED,
    MAX_NORM,
    MICRO_BATCHES,
    PART_NUMBERS,
    RECOVERY_COLUMNS,
    RERUN,
    RERUN_OUTCOMES,
    SKIPPED,
    UPDATE_COEF,
    UPDATE_NORM,
    column_tag,
)
from .._reasons import NONFINITE, REASONS, by_code

__all__ = ["EXPECTED", "LIGHTNING_LAYER", "GradLog", "Names", "from_records", "rerun_tag"]

#: Lightning's per-layer norm (``grad_2.0_norm/<name>``: a CSV column or a TensorBoard tag).
LIGHTNING_LAYER = re.compile(r"grad_(?:[0-9.]+|inf)_norm/(.+)")
#: The reason of a skipped window whose log names none (TensorBoard logs of earlier versions tagged
#: only some reasons; an untagged skip was a non-finite one).
_UNMARKED = by_code(NONFINITE).name
_NAN = math.nan
#: What a log needs, in the error messages.
EXPECTED = (
    "a step column and a gradient-norm column (total_norm, grad_norm, gradient_norm, a name ending "
    "in total_norm or grad_norm such as Grad/total_norm, or Lightning's grad_2.0_norm_total)"
)


@dataclass
class GradLog:
    """A training log, one entry per update (row), in file order.

    Float columns are ``array('d')``; ``nan`` stands for "not recorded".
    ``loss`` is ``inf`` where a loss was recorded but was not finite.
    ``max_norm`` is ``inf`` where a policy set no bound.  ``reason`` maps a row
    to its skip reason (rows without one are absent).  Per-layer statistics
    exist only in the rows listed in ``layer_rows``; ``layers[name][field]``
    is aligned with ``layer_rows``.  ``source`` names the format;
    ``has_clipping`` is True when the log records clipping (clipopt's
    ``clipped``/``max_norm`` columns); ``notes`` says what reading skipped.
    ``counted`` names the layers whose non-finite element count the log has a
    column (or tag) for: clipopt's, not Lightning's.  ``groups[g]`` holds
    parameter group ``g``'s ``"norm"`` and ``"coef"`` (per-group clipping), one
    value per row, ``nan`` where not recorded; empty without per-group clipping.
    ``recovery[column]`` holds a Rewind's columns (``clipopt._log_names.RECOVERY_COLUMNS``:
    ``batch_start``, ``batch_end``, ``lr_factor``, ``state_reset``; and ``micro_batches`` in a log
    with the batch columns), and the other parts' numbers (``PART_NUMBERS``: ``max_logit``), one value
    per row,
    ``nan`` where not recorded; only those the log has.
    ``rerun`` maps a row to what a :class:`~clipopt.Rerun` found there (``"persistent"`` or
    ``"transient"``; rows not executed again are absent).
    ``norm_column`` and ``loss_column`` name the column (tag, key) read as the
    norm and the loss (None: no loss); ``ignored`` lists those read as nothing,
    in the log's order; ``run`` names the TensorBoard run read (None: the
    path holds one).  ``update_norm`` and ``update_coef`` hold clipopt's
    update statistics (``update_clip=`` or ``update_stats=True``: the norm of
    the inner optimizer's update before bounding, and the coefficient applied),
    one value per row, ``nan`` where not recorded; both are empty when the log
    has no update norm (``update_column`` is then None, else the column or tag
    read).
    """

    path: str
    source: str
    steps: array[int] = field(default_factory=lambda: array("q"))
    total_norm: array[float] = field(default_factory=lambda: array("d"))
    loss: array[float] = field(default_factory=lambda: array("d"))
    lr: array[float] = field(default_factory=lambda: array("d"))
    max_norm: array[float] = field(default_factory=lambda: array("d"))
    clipped: bytearray = field(default_factory=bytearray)
    skipped: bytearray = field(default_factory=bytearray)
    reason: dict[int, str] = field(default_factory=dict)
    layer_rows: array[int] = field(default_factory=lambda: array("q"))
    layers: dict[str, dict[str, array[float]]] = field(default_factory=dict)
    counted: set[str] = field(default_factory=set)
    groups: dict[int, dict[str, array[float]]] = field(default_factory=dict)
    recovery: dict[str, array[float]] = field(default_factory=dict)
    rerun: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    norm_column: str = "total_norm"
    loss_column: str | None = None
    ignored: list[str] = field(default_factory=list)
    run: str | None = None
    has_clipping: bool = False
    update_norm: array[float] = field(default_factory=lambda: array("d"))
    update_coef: array[float] = field(default_factory=lambda: array("d"))
    update_column: str | None = None

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def has_update_norm(self) -> bool:
        """True when the log has an update-norm column (tag): ``update_clip=`` or ``update_stats=True``."""
        return self.update_column is not None

    @property
    def has_loss(self) -> bool:
        """True when some row recorded a loss."""
        return any(not math.isnan(x) for x in self.loss)


@dataclass(frozen=True)
class Names:
    """The names the user chose (``--loss NAME``, ``--norm NAME``); None: recognised ones."""

    loss: str | None = None
    norm: str | None = None


def from_records(
    name: str,
    source: str,
    records: dict[int, dict[str, float]],
    layers: dict[str, dict[int, dict[str, float]]],
    groups: dict[int, dict[str, dict[int, float]]] | None = None,
) -> GradLog:
    """A GradLog from step -> {"norm", "loss", "lr", "max_norm", "clipped", "skipped", and each skip
    reason's tag (``clipopt/nograd``, ...: 1.0 where the window was skipped for it), and
    ``update_norm``/``update_coef`` when the log has them} (and ``groups``: group -> "norm"/"coef"
    -> step -> value).  A skipped window without a reason's tag (a log of an earlier version)
    reads as "nonfinite".  The update columns are filled when some record has an update norm."""
    log = GradLog(name, source)
    index: dict[int, int] = {}
    for step in sorted(records):
        rec = records[step]
        if "norm" not in rec:
            continue
        index[step] = len(log.steps)
        log.steps.append(step)
        log.total_norm.append(rec["norm"])
        loss = rec.get("loss", _NAN)  # a recorded loss that is not finite (NaN too) reads as inf
        log.loss.append(loss if math.isfinite(loss) or "loss" not in rec else math.inf)
        log.lr.append(rec.get("lr", _NAN))
        log.max_norm.append(rec.get(MAX_NORM, _NAN))
        log.clipped.append(1 if rec.get(CLIPPED, 0.0) > 0.5 else 0)
        skipped = rec.get(SKIPPED, 0.0) > 0.5
        log.skipped.append(1 if skipped else 0)
        if skipped:
            marked = [r.name for r in REASONS if rec.get(r.tag, 0.0) > 0.5]
            log.reason[len(log.steps) - 1] = marked[0] if marked else _UNMARKED
        for outcome in RERUN_OUTCOMES:  # a Rerun's tag (clipopt/rerun/<outcome>)
            if rec.get(rerun_tag(outcome), 0.0) > 0.5:
                log.rerun[len(log.steps) - 1] = outcome
    if any(UPDATE_NORM in records[s] for s in index):
        for key, out in ((UPDATE_NORM, log.update_norm), (UPDATE_COEF, log.update_coef)):
            out.extend(records[s].get(key, _NAN) for s in log.steps)
    rows = sorted({s for per in layers.values() for s in per if s in index})
    log.layer_rows.extend(index[s] for s in rows)
    log.counted = {n for n, per in layers.items() if any("nonfinite" in v for v in per.values())}
    for lname, per in layers.items():
        log.layers[lname] = {f: array("d", (per.get(s, {}).get(f, _NAN) for s in rows)) for f in LAYER_FIELDS}
    for g, kinds in sorted((groups or {}).items()):
        log.groups[g] = {
            k: array("d", (kinds.get(k, {}).get(s, _NAN) for s in log.steps)) for k in ("norm", "coef")
        }
    for key in (*RECOVERY_COLUMNS, *PART_NUMBERS, MICRO_BATCHES):  # a Rewind's and the parts', where recorded
        if any(key in records[s] for s in log.steps):
            log.recovery[key] = array("d", (records[s].get(key, _NAN) for s in log.steps))
    return log


def rerun_tag(outcome: str) -> str:
    """The TensorBoard tag of a Rerun outcome (``clipopt/rerun/<outcome>``)."""
    return column_tag(f"{RERUN}/{outcome}")
