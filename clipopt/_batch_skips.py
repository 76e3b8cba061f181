"""Listed skips: ``opt.rewind.batches(loader, skip=[(start, end), ...])``.

Batches are numbered from 0 over the whole run: every batch drawn from the
loaders given to ``Rewind.batches()`` (dropped ones included), across calls
(epochs) and across restarts (the count is in the Rewind's state dict).
``(start, end)`` drops the batches ``start <= n < end``, like ``range``.
Ranges may overlap and come in any order: a batch is dropped when any range
holds it.

:class:`BatchCount` is the position in the data and the batch range of the
window now open (the CSV's ``batch_start``/``batch_end`` columns), so that
``clipopt report`` can name the batches of a spike skip or a rewind.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from numbers import Integral
from typing import Any

__all__ = ["BatchCount", "SkipList", "check_skip"]

_EXAMPLE = "skip=[(1200, 1300)] (drops batches 1200 to 1299)"


def _pair(item: Any) -> tuple[int, int]:
    """One ``(start, end)`` range, checked."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise TypeError(f"skip must hold (start, end) pairs, got {item!r:.80}; pass e.g. {_EXAMPLE}")
    start, end = item
    for name, v in (("start", start), ("end", end)):
        if not isinstance(v, Integral) or isinstance(v, bool):
            raise TypeError(
                f"skip's {name} must be an int, got {v!r} ({type(v).__name__}) in {tuple(item)!r:.80}; "
                f"pass e.g. {_EXAMPLE}"
            )
    if start < 0:
        raise ValueError(
            f"skip's start must be >= 0, got {tuple(item)!r}; batches count from 0; pass e.g. {_EXAMPLE}"
        )
    if not start < end:
        raise ValueError(
            f"skip's ranges must have start < end, got {tuple(item)!r}: it drops no batch; "
            f"pass e.g. {_EXAMPLE}"
        )
    return int(start), int(end)


def check_skip(skip: Any) -> SkipList:
    """``skip``: a list (or tuple) of ``(start, end)`` pairs of ints, ``0 <= start < end``."""
    if isinstance(skip, (str, bytes)) or not isinstance(skip, Iterable):
        raise TypeError(
            f"skip must be a list of (start, end) pairs, got {type(skip).__name__}; pass e.g. {_EXAMPLE}"
        )
    return SkipList([_pair(item) for item in skip])


class SkipList:
    """Listed ranges, merged into sorted disjoint ``[start, end)`` ranges."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        merged: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self.ranges = merged  #: the merged ranges, in order
        self._starts = [s for s, _ in merged]
        self._ends = [e for _, e in merged]

    def __contains__(self, n: int) -> bool:
        i = bisect.bisect_right(self._starts, n) - 1
        return i >= 0 and n < self._ends[i]


class BatchCount:
    """Batches drawn over the whole run, and where the open window's batches began."""

    def __init__(self) -> None:
        self.next = 0  #: batches drawn so far: the next batch's number
        self.window_start = 0  #: the number of the first batch drawn in the window now open
        self.listed = 0  #: batches dropped because ``skip`` listed them

    def closed(self) -> tuple[int, int]:
        """A window closed: the range ``(start, end)`` of the batches drawn during it; a new one opens."""
        span = (self.window_start, self.next)
        self.window_start = self.next
        return span

    def state(self) -> dict[str, int]:
        """The state dict's fields (the Rewind's)."""
        return {
            "batch_next": self.next,
            "batch_window_start": self.window_start,
            "batches_listed": self.listed,
        }

    def load(self, values: tuple[int, int, int]) -> None:
        self.next, self.window_start, self.listed = values
