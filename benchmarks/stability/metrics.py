"""The figures computed from the runs: LR sensitivity, divergence, and the helps-test.

LR sensitivity is the summary statistic of Wortsman et al. 2023, "Small-scale proxies for
large-scale Transformer training instabilities" (arXiv 2309.14322), §2: for an algorithm ``A``
trained at learning rates ``eta`` in ``[a, b]``,

    LR sensitivity = E_eta[ min(l(A(eta)), l_0) - l* ],   l* = min_eta l(A(eta)),

with ``l_0`` the loss at initialisation, so that a run that diverged (or ended above where it
started) counts as ``l_0`` and no worse.  The expectation is the mean over the sweep's grid of
learning rates, as the paper computes it on its grid.  Here ``l`` is the final held-out loss, and
a non-finite loss is taken as ``l_0``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def clamped(loss: float, init_loss: float) -> float:
    """``min(loss, init_loss)``, a non-finite loss counting as ``init_loss``."""
    return min(loss, init_loss) if math.isfinite(loss) else init_loss


def lr_sensitivity(losses: Mapping[float, float], init_loss: float) -> float:
    """The paper's LR sensitivity of one sweep: final loss per learning rate, and the loss at init.

    ``mean over lr of min(loss(lr), init_loss) - min over lr of min(loss(lr), init_loss)``.
    """
    if not losses:
        raise ValueError("lr_sensitivity needs the loss of at least one learning rate, got none")
    values = [clamped(v, init_loss) for v in losses.values()]
    return statistics.fmean(values) - min(values)


def best_loss(losses: Mapping[float, float], init_loss: float) -> float:
    """``l*``: the lowest (clamped) final loss over the sweep."""
    return min(clamped(v, init_loss) for v in losses.values())


def diverged(loss: float, init_loss: float) -> bool:
    """A run diverged when its final held-out loss is non-finite or not below the loss at init."""
    return not math.isfinite(loss) or loss >= init_loss


@dataclass(frozen=True)
class Verdict:
    """The helps-test of one treatment against the baseline, over paired seeds."""

    helps: bool
    lower_on_every_seed: bool  #: sensitivity lower than the baseline's on each seed
    best_no_worse: bool  #: mean best-lr loss at most the baseline's + ``tolerance``
    seeds: int
    mean_difference: float  #: mean of (treatment - baseline) sensitivity over the seeds
    spread: float  #: the sample standard deviation of that difference (nan with one seed)


#: Nats by which a treatment's best-lr loss may exceed the baseline's and still be "no worse".
BEST_LOSS_TOLERANCE = 0.01


def helps(
    treatment: Sequence[tuple[float, float]],
    baseline: Sequence[tuple[float, float]],
    min_seeds: int = 3,
    tolerance: float = BEST_LOSS_TOLERANCE,
) -> Verdict:
    """Whether a treatment helps: its sensitivity is lower than the baseline's on every one of at
    least ``min_seeds`` paired seeds, and its mean best-lr loss is no worse than the baseline's
    (at most ``tolerance`` nats above).  Each sequence holds ``(sensitivity, best loss)`` per seed,
    in the same seed order."""
    if len(treatment) != len(baseline):
        raise ValueError(
            f"helps needs the same seeds on both sides, got {len(treatment)} and {len(baseline)} seeds"
        )
    diffs = [t[0] - b[0] for t, b in zip(treatment, baseline, strict=True)]
    lower = bool(diffs) and all(d < 0 for d in diffs)
    no_worse = bool(diffs) and (
        statistics.fmean(t[1] for t in treatment) <= statistics.fmean(b[1] for b in baseline) + tolerance
    )
    return Verdict(
        helps=lower and no_worse and len(diffs) >= min_seeds,
        lower_on_every_seed=lower,
        best_no_worse=no_worse,
        seeds=len(diffs),
        mean_difference=statistics.fmean(diffs) if diffs else math.nan,
        spread=statistics.stdev(diffs) if len(diffs) > 1 else math.nan,
    )
