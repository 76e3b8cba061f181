"""A warning when updates keep being skipped: a run in which every update is skipped is not silent.

:class:`SkipRun` follows the outcome of every window and warns once
(``RuntimeWarning``, naming the user's line) when :data:`WARN_AFTER` windows in a
row were skipped, whatever the reason and whether or not
``max_consecutive_nonfinite`` is set; an applied update re-arms it.

No host read is added to find out: a window's outcome is counted once the host
knows it anyway.  A window decided on the host (every optimizer but a fused one,
and windows without gradients) is known when it closes; a window decided on the
device (a fused optimizer) once its :class:`~clipopt.StepStats` were read --
by a logger (``CSVLogger`` every ``flush_every`` windows, and at ``close()``),
by :func:`clipopt.materialize`, or by reading ``opt.last_stats.skipped``.  Until
then the windows wait in order (at most :data:`PENDING` of them; beyond that the
oldest are dropped and the count starts again).  The warning itself reads the
reasons of the run once (:func:`clipopt.materialize`).
"""

from __future__ import annotations

import collections
import warnings

from .._caller import user_stacklevel
from .._diagnostics.stats import StepStats, materialize
from .._reasons import by_name

__all__ = ["PENDING", "WARN_AFTER", "SkipRun"]

#: Skipped windows in a row that make the warning.
WARN_AFTER = 10

#: Windows whose outcome the host does not know yet, kept at most (a logger flushing less often
#: than this, on a fused optimizer, may not see its runs warned about).
PENDING = 256


class SkipRun:
    """The current run of skipped windows, as far as the host knows the outcomes (see the module)."""

    __slots__ = ("pending", "run", "warned")

    def __init__(self) -> None:
        #: Windows whose outcome is not known on the host yet, oldest first.
        self.pending: collections.deque[StepStats] = collections.deque()
        #: The skipped windows in a row known so far (only the first ``WARN_AFTER`` are kept).
        self.run: list[StepStats] = []
        #: The current run was warned about.
        self.warned = False

    def follow(self, stats: StepStats) -> None:
        """Add the window just recorded; count every window whose outcome is now known."""
        if len(self.pending) >= PENDING:  # unknown for too long: the run cannot be followed
            self.pending.clear()
            self.run, self.warned = [], False
        self.pending.append(stats)
        self.advance()

    def advance(self) -> None:
        """Count the waiting windows in order, as long as their outcome is known (no host read)."""
        while self.pending:
            skipped = self.pending[0].known_skipped()
            if skipped is None:
                return
            stats = self.pending.popleft()
            if not skipped:
                self.run, self.warned = [], False
                continue
            if len(self.run) < WARN_AFTER:
                self.run.append(stats)
            if len(self.run) >= WARN_AFTER and not self.warned:
                self.warned = True
                warnings.warn(_message(self.run, stats.step), RuntimeWarning, stacklevel=user_stacklevel())


def _message(run: list[StepStats], last: int) -> str:
    """The warning for the run of skipped windows ``run`` (from its first step to ``last``)."""
    materialize(run)  # their reasons: one host read, once per run
    counts = collections.Counter(s.reason for s in run)
    reasons = ", ".join(f"{reason!r} x{n}" for reason, n in counts.most_common())
    found = [by_name(r) for r, _ in counts.most_common() if r is not None]
    checks = "; ".join(r.remedy for r in found if r is not None)
    first = run[0].step
    since = "the start" if first == 1 else f"step {first - 1}"
    return (
        f"clipopt: {last - first + 1} updates in a row were skipped (steps {first}-{last}, reasons: "
        f"{reasons}): no update has been applied since {since}; {checks}.  Shown once per run of "
        "skipped updates (an applied update starts a new one)."
    )
