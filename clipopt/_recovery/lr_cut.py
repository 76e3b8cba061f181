"""A Rewind's learning-rate cut: ``Rewind(..., lr_cut=(factor, updates))``.

After a rewind every parameter group's learning rate is multiplied by
``factor`` for the next ``updates`` *applied* updates (a skipped window does
not count), then it is as the scheduler sets it again.

The cut never writes a learning rate that a scheduler could see: the factor is
applied just before the inner ``step()`` and the group's own value put back
right after it (:func:`cut_applied`).  So a scheduler that sets
``group["lr"]`` from its formula (``LambdaLR``, ``OneCycleLR``, Lightning's and
the Hugging Face Trainer's ``scheduler.step()``) or from the current value
(``ExponentialLR``, ``StepLR``) computes exactly what it would without the cut,
and the logged ``lr`` stays the scheduler's (the ``lr_factor`` column says
the cut).  A tensor learning rate (fused or capturable optimizers) is
multiplied in place and copied back from a clone: the same tensor object, the
same value bit for bit.

While a cut is active the window takes the host path (one host read, like a
non-fused optimizer): whether its update was applied must be known to count it.
An update put back after the step (reason ``"nonfinite_update"``, with
``UpdateClip`` or ``update_stats``) is not applied and does not count: the cut
window then reads that outcome too (:meth:`LrCut.counted` runs once the
window's outcome is final).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from numbers import Integral, Real
from typing import Any

from torch import Tensor

__all__ = ["LrCut", "check_lr_cut", "cut_applied"]

_EXAMPLE = (
    "lr_cut=(0.5, 100) (halve the learning rate for the 100 updates after a Rewind restores a copy), "
    "or lr_cut=None"
)


def check_lr_cut(value: Any) -> tuple[float, int] | None:
    """``lr_cut``: None, or ``(factor, updates)`` with ``0 < factor <= 1`` and ``updates`` an int >= 1."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(
            f"lr_cut must be a pair (factor, updates) or None, got {value!r:.80}; pass e.g. {_EXAMPLE}"
        )
    factor, updates = value
    if not isinstance(factor, Real) or isinstance(factor, bool):
        raise TypeError(
            f"lr_cut's factor must be a float in (0, 1], got {factor!r} ({type(factor).__name__}); "
            f"pass e.g. {_EXAMPLE}"
        )
    if not (0.0 < float(factor) <= 1.0) or math.isnan(float(factor)):
        raise ValueError(f"lr_cut's factor must be in (0, 1], got {factor!r}; pass e.g. {_EXAMPLE}")
    if not isinstance(updates, Integral) or isinstance(updates, bool):
        raise TypeError(
            f"lr_cut's updates must be an int >= 1, got {updates!r} ({type(updates).__name__}); "
            f"pass e.g. {_EXAMPLE}"
        )
    if updates < 1:
        raise ValueError(f"lr_cut's updates must be an int >= 1, got {updates!r}; pass e.g. {_EXAMPLE}")
    return float(factor), int(updates)


class LrCut:
    """The cut's setting and how many applied updates it still lasts (host integers only)."""

    def __init__(self, factor: float, updates: int) -> None:
        self.factor = factor  #: what every group's learning rate is multiplied by
        self.updates = updates  #: applied updates a cut lasts
        self.left = 0  #: applied updates the current cut still lasts (0: none active)

    def start(self) -> None:
        """A rewind happened: the next ``updates`` applied updates are cut (a running cut restarts)."""
        self.left = self.updates

    @property
    def active(self) -> bool:
        """Whether the next update is cut."""
        return self.left > 0

    def counted(self, skipped: bool) -> None:
        """The window the cut applied to was decided (``skipped`` read on the host): count an update."""
        if not skipped and self.left > 0:
            self.left -= 1


@contextmanager
def cut_applied(factor: float | None, groups: Sequence[dict[str, Any]]) -> Iterator[None]:
    """Every group's ``"lr"`` multiplied by ``factor`` inside the block, its own value put back after.

    A float is put back as the object it was; a tensor is multiplied in place and copied back
    from a clone taken before (bit-identical, the same tensor).  A tensor several groups share
    (torch gives every group the one tensor of ``AdamW(params, lr=torch.tensor(...))``) is
    multiplied once.  ``factor`` None: nothing changes.
    """
    if factor is None:
        yield
        return
    saved = [g["lr"] for g in groups]  # the objects, put back (floats) or written back into (tensors)
    tensors = {id(lr): (lr, lr.clone()) for lr in saved if isinstance(lr, Tensor)}  # each tensor once
    try:
        for lr, _ in tensors.values():
            lr.mul_(factor)
        for g, lr in zip(groups, saved, strict=True):
            if not isinstance(lr, Tensor):
                g["lr"] = lr * factor
        yield
    finally:
        for lr, value in tensors.values():
            lr.copy_(value)
        for g, lr in zip(groups, saved, strict=True):
            if not isinstance(lr, Tensor):
                g["lr"] = lr
