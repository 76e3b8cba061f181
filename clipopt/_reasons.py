"""The skip reasons: one table, read by everything that writes or reads a reason.

A skipped window's reason is an int64 code on the device (:mod:`clipopt._window.decision`
decides it without a host read); :class:`~clipopt.StepStats` turns it into the
reason's name when read.  Every writer and reader takes the names, the
TensorBoard tags and the non-finite classification from :data:`REASONS`:
``StepStats.reason``, the CSV ``reason`` column (:class:`~clipopt.CSVLogger`),
the ``clipopt/<reason>`` tags (:class:`~clipopt.TensorBoardLogger` and the
report's reader), the report's rules, replay, the integrations'
``skipped_<reason>`` keys and the run-of-skips warning.

A new reason is a new row: the next code (existing codes never change, so that
state dicts, CSV files and TensorBoard logs written earlier read the same), a
name, whether it counts as non-finite and what it means (its tag is ``clipopt/<name>``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._log_names import column_tag

__all__ = [
    "DIVERGENCE",
    "NAMES",
    "NOGRAD",
    "NONFINITE",
    "NONFINITE_NAMES",
    "NONFINITE_UPDATE",
    "NORM_OVERFLOW",
    "NO_REASON",
    "OVERFLOW",
    "REASONS",
    "REWIND",
    "SPIKE",
    "Reason",
    "by_code",
    "by_name",
    "name_of",
    "tag_of",
]


@dataclass(frozen=True)
class Reason:
    """One skip reason: its code (on the device), name (``StepStats.reason``, the CSV ``reason``
    column), whether it counts as a non-finite skip, its TensorBoard tag (1.0 in the windows
    skipped for it), what it means, and what to check when every window is skipped for it."""

    code: int
    name: str
    nonfinite: bool
    meaning: str
    remedy: str

    @property
    def tag(self) -> str:
        """Its TensorBoard tag: ``clipopt/<name>`` (:func:`clipopt._log_names.column_tag`)."""
        return column_tag(self.name)


#: Reason codes (int64 on the device); ``NO_REASON``: the window was not skipped.
NO_REASON, NONFINITE, OVERFLOW, SPIKE, DIVERGENCE, NOGRAD, REWIND, NORM_OVERFLOW, NONFINITE_UPDATE = range(9)

#: Every skip reason once, in code order (``REASONS[code - 1].code == code``).
REASONS: tuple[Reason, ...] = (
    Reason(
        NONFINITE,
        "nonfinite",
        True,
        "a gradient element is nan/inf",
        "the gradients are not finite: look for nan/inf in the loss and the inputs "
        "(snapshot_dir= and `clipopt inspect` name the parameter), or lower the learning rate",
    ),
    Reason(
        OVERFLOW,
        "overflow",
        True,
        "a gradient element is nan/inf in a GradScaler run (its normal overflow, or a fault)",
        "the GradScaler overflows every window: the loss is not finite in half precision "
        "even at a small scale; check the loss, or train in bfloat16",
    ),
    Reason(
        SPIKE,
        "spike",
        False,
        "the spike rule of the clip policy (skip_spikes=True) or of a SpikeGuard",
        "every window counts as a spike: the loss or the gradient norm stays far above its recent "
        "level -- a stretch of bad data (a corrupted shard: the skips keep it out of the model; "
        "`clipopt report` on the log gives its steps, and a Rewind's batch columns its batches), or a "
        "run that diverges (lower the learning rate); if neither, the level moved for good and the "
        "rule's history must catch up (a larger z threshold or a shorter window)",
    ),
    Reason(
        DIVERGENCE,
        "divergence",
        False,
        "the data-parallel replicas' gradients or window counters disagree",
        "the data-parallel replicas disagree: every rank must run the same model and steps",
    ),
    Reason(
        NOGRAD,
        "nograd",
        False,
        "no parameter has a gradient in the window",
        "no parameter has a gradient: call loss.backward() before opt.step(), and check requires_grad",
    ),
    Reason(
        REWIND,
        "rewind",
        False,
        "a Rewind restored a copy and discarded the window",
        "Rewind keeps restoring copies: the spikes come back after every rewind",
    ),
    Reason(
        NORM_OVERFLOW,
        "norm_overflow",
        False,
        "every gradient element is finite but the total norm exceeds float32's range (inf), or its "
        "float32 norm overflowed (taken again without overflow) and no bound clips it back below "
        "1.8e19 (2-norm); before #35 any float32 norm that overflowed",
        "the gradients are finite but their float32 norm overflows: the training is "
        "exploding; lower the learning rate or check the loss",
    ),
    Reason(
        NONFINITE_UPDATE,
        "nonfinite_update",
        False,
        "the gradients are finite but the inner optimizer's update is nan/inf, or its float32 norm "
        "overflowed and no bound brings it below 1.8e19 (update_clip or "
        "update_stats: the parameters were put back, the optimizer state too with "
        "UpdateClip(restore_state=True))",
        "the inner optimizer makes a non-finite update from finite gradients: check its eps "
        "(a division by zero) and its state, or lower the learning rate; its state is not put back "
        "unless UpdateClip(..., restore_state=True): once it holds nan/inf, every update is rejected",
    ),
)

#: ``NAMES[code]``: the reason's name, None for :data:`NO_REASON`.
NAMES: tuple[str | None, ...] = (None, *(r.name for r in REASONS))

#: The names of the reasons that count as non-finite skips.
NONFINITE_NAMES: frozenset[str] = frozenset(r.name for r in REASONS if r.nonfinite)

_BY_NAME = {r.name: r for r in REASONS}


def by_code(code: int) -> Reason:
    """The reason with this code (not :data:`NO_REASON`, which is none)."""
    if not 0 < code <= len(REASONS):
        raise ValueError(f"no skip reason has code {code!r}; the codes are 1 to {len(REASONS)}")
    return REASONS[code - 1]


def by_name(name: str) -> Reason | None:
    """The reason with this name; None for a name that is none (e.g. from a newer version)."""
    return _BY_NAME.get(name)


def name_of(code: int) -> str | None:
    """The name of a reason code (``None`` for :data:`NO_REASON`)."""
    return NAMES[code]


def tag_of(name: str) -> str | None:
    """The TensorBoard tag of the reason named ``name``; None for an unknown name."""
    reason = _BY_NAME.get(name)
    return None if reason is None else reason.tag
