"""The report's lines on a :class:`~clipopt.Rerun`'s re-executions (the ``rerun`` column).

A window whose decision was an anomaly (a non-finite gradient or loss, a spike) was executed
again: ``persistent`` where the same outcome came back (the data or the numerics; the window was
handled as without a rerun), ``transient`` where it did not (a fault, or a non-deterministic
kernel; the rerun's result stood).  The report counts both and gives the transient steps.

*Repeated transient events*: :data:`REPEATED_TRANSIENT` or more in one log.  Why: one
transient event can be a non-deterministic kernel meeting a borderline window; the same data
giving different answers again and again is how silent data corruption shows (Megatron-LM's
rerun state machine exists to find it: a result that does not reproduce points at the device,
not the data), so the report says that a device may be faulty.
"""

from __future__ import annotations

from ..._log_names import RERUN_OUTCOMES
from ..log import GradLog
from .common import steps_text

__all__ = ["REPEATED_TRANSIENT", "rerun_counts", "rerun_notes"]

#: From this many transient events in one log, the report says that a device may be faulty.
REPEATED_TRANSIENT = 2

_PERSISTENT, _TRANSIENT = RERUN_OUTCOMES


def rerun_counts(log: GradLog) -> dict[str, int]:
    """How many windows were executed again, by outcome (the summary's ``rerun``)."""
    return {o: sum(1 for v in log.rerun.values() if v == o) for o in RERUN_OUTCOMES}


def rerun_notes(log: GradLog) -> list[str]:
    """The count of re-executed windows by outcome, and -- for repeated transient events -- that a
    device may be faulty; ``[]`` when no window was executed again."""
    if not log.rerun:
        return []
    transient = [log.steps[i] for i, o in sorted(log.rerun.items()) if o == _TRANSIENT]
    persistent = [log.steps[i] for i, o in sorted(log.rerun.items()) if o == _PERSISTENT]
    said = (
        f"{len(log.rerun)} anomalous update(s) executed again (Rerun): {len(persistent)} persistent "
        "(the same outcome again: the data or the numerics, handled as without a rerun)"
    )
    if transient:
        said += (
            f", {len(transient)} transient at step(s) {steps_text(transient)} (a different outcome: "
            "a fault or a non-deterministic kernel; the rerun's result was used)"
        )
    notes = [said]
    if len(transient) >= REPEATED_TRANSIENT:
        notes.append(
            f"transient anomalies repeat ({len(transient)} updates gave a different result when "
            "executed again): a device may be faulty (silent data corruption or a flaky kernel); "
            "the tracker file (Rerun(tracker=...)) lists each event with the ranks that saw the "
            "non-finite value first (Rerun.watch under DDP): run the hardware diagnostics on them"
        )
    return notes
