"""A Rewind's optimizer-state reset: ``Rewind(..., reset_state=True)``, as SPAM does.

At a rewind, after the copy is restored, the inner optimizer's *moment
buffers* are zeroed: every floating-point tensor in ``state[p]`` of every
parameter (Adam's ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``, SGD's
``momentum_buffer``, Lion's ``exp_avg``, Adan's ``exp_avg_diff``...), in place
(the same tensors, on their device, no host read).  Kept as they are: the
step counters (the entry named ``step``, a tensor or a number, so bias
correction and warm-up schedules continue), integer tensors, and every
non-tensor entry.  An optimizer that keeps a copy of the parameters in its
state (schedule-free's ``z``, Prodigy's ``p0``) would lose it: do not use
``reset_state`` with those.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["KEPT", "is_moment", "reset_moments"]

#: State entries never zeroed: step counters.
KEPT = frozenset({"step"})


def is_moment(key: Any, value: Any) -> bool:
    """Whether a state entry counts as a moment buffer (zeroed at a reset)."""
    return isinstance(value, Tensor) and value.is_floating_point() and key not in KEPT


@torch.no_grad()
def reset_moments(state: Any) -> int:
    """Zero the moment buffers of ``state`` (an optimizer's ``state``: parameter -> dict); how many."""
    zeroed = 0
    for entry in state.values():
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            if is_moment(key, value):
                value.zero_()
                zeroed += 1
    return zeroed
