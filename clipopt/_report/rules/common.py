"""Shared by the verdict rules: the thresholds (each founded on the corpus) and small statistics."""

from __future__ import annotations

import math
from array import array

import torch
from torch import Tensor

from ..._reasons import NORM_OVERFLOW, OVERFLOW, REWIND, SPIKE, by_code

#: The skip reasons the rules tell apart, by name (as the logs hold them).
OVERFLOW_NAME, NORM_OVERFLOW_NAME, SPIKE_NAME, REWIND_NAME = (
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


#: Update spikes: a gradient-norm spike this many rows before an update spike explains it (momentum
#: carries a gradient into the next updates: Adam's 0.9 keeps a third of it after 10).
UPDATE_ECHO_ROWS = 10


#: UpdateClip(z=...) suggestion: at least this z (below 3 std a bound acts on ordinary updates).
UPDATE_Z_MIN = 3.0


#: UpdateClip(z=...) suggestion: the history UpdateClip keeps by default (its ``window``).
UPDATE_Z_WINDOW = 128


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


MAX_LISTED_STEPS = 100


MAX_CANDIDATES = 10_000


MAX_LEVEL_CHECKS = 1_000


def block(n: int) -> int:
    """Rows in a block of a run of ``n`` rows: ``max(BLOCK_MIN, ceil(GROWTH_BLOCK * n))``, at most n."""
    return min(n, max(BLOCK_MIN, math.ceil(GROWTH_BLOCK * n)))


def as_tensor(values: array[float] | list[float]) -> Tensor:
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


def median_of(x: Tensor) -> float:
    """The median of ``x`` (the 50th percentile, interpolated)."""
    return percentile(x, 50.0)


def start_level(x: Tensor) -> float:
    """The start of a run: the median of the first START_ROWS values of ``x``."""
    return median_of(x[:START_ROWS])


def steps_text(steps: list[int]) -> str:
    """The first ten steps, comma-separated, with ``...`` when there are more."""
    return ", ".join(str(s) for s in steps[:10]) + (", ..." if len(steps) > 10 else "")
