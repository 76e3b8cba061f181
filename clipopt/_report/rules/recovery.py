"""The report's lines on a Rewind's escalation and batches, from its log columns.

A log written with a :class:`~clipopt.Rewind` has ``batch_start``/``batch_end``
(the batches ``opt.rewind.batches()`` drew during each window), and with
``lr_cut``/``reset_state`` the ``lr_factor``/``state_reset`` columns
(:mod:`clipopt._log_names`).  From them the report says what each rewind did
and which batches the spike skips and rewinds were drawn from, and which ones a
rewind dropped (``skip_batches``), as the ``skip=`` list of
``opt.rewind.batches(loader, skip=...)`` that leaves them out on a restart.

A rewind's drops are the first batches drawn after it: ``batches()`` draws and
drops them before it yields the next batch, so they open the range of the next
window that drew batches, before the ``micro_batches`` batches that window used.
"""

from __future__ import annotations

import math

from ..._log_names import BATCH_END, BATCH_START, LR_FACTOR, MICRO_BATCHES, STATE_RESET
from ..log import GradLog

__all__ = ["batch_ranges", "dropped_ranges", "escalation_text", "skip_list", "skip_list_notes"]


def batch_ranges(log: GradLog, rows: list[int]) -> list[tuple[int, int]]:
    """The ``(start, end)`` batches of each of ``rows`` that recorded them (``end > start``), in order."""
    starts, ends = log.recovery.get(BATCH_START), log.recovery.get(BATCH_END)
    if starts is None or ends is None:
        return []
    out = []
    for i in rows:
        start, end = starts[i], ends[i]
        if math.isfinite(start) and math.isfinite(end) and end > start:
            out.append((int(start), int(end)))
    return out


def dropped_ranges(log: GradLog, rewinds: list[int]) -> dict[int, tuple[int, int]]:
    """The batches each of the ``rewinds`` rows dropped (``skip_batches``), by rewind row: the start of
    the range of the next row that drew batches, up to the batches that window used (its
    ``micro_batches``; without it, the usual number of batches per window: the median range).
    A rewind that dropped none is absent."""
    starts, ends = log.recovery.get(BATCH_START), log.recovery.get(BATCH_END)
    if starts is None or ends is None or not rewinds:
        return {}
    used = log.recovery.get(MICRO_BATCHES)
    drew = [i for i in range(len(starts)) if math.isfinite(starts[i]) and ends[i] > starts[i]]
    typical = sorted(ends[i] - starts[i] for i in drew)[len(drew) // 2] if drew else 1.0
    out = {}
    for rewind in rewinds:
        nxt = next((i for i in drew if i > rewind), None)
        if nxt is None:
            continue
        n = used[nxt] if used is not None and math.isfinite(used[nxt]) and used[nxt] > 0 else typical
        start, end = int(starts[nxt]), int(ends[nxt] - n)
        if end > start:
            out[rewind] = (start, end)
    return out


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges sorted and joined where they overlap or touch."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def skip_list(log: GradLog, spikes: list[int], rewinds: list[int]) -> list[list[int]]:
    """The ``skip=`` list (merged ``[start, end]`` ranges) of the spike-skip and rewind rows; ``[]``
    when the log has no batch columns (the report's summary, ``skip``)."""
    dropped = list(dropped_ranges(log, rewinds).values())
    return [[a, b] for a, b in merged(batch_ranges(log, sorted(spikes + rewinds)) + dropped)]


def _range_text(r: tuple[int, int]) -> str:
    return f"{r[0]}" if r[1] == r[0] + 1 else f"{r[0]}-{r[1] - 1}"


def skip_list_notes(log: GradLog, spikes: list[int], rewinds: list[int]) -> list[str]:
    """The batches of the spike-skip rows ``spikes`` and rewind rows ``rewinds``, and the ``skip=`` list."""
    rows = sorted(spikes + rewinds)
    ranges = batch_ranges(log, rows)
    if not ranges:
        return []
    kinds = {i: "spike" for i in spikes} | {i: "rewind" for i in rewinds}
    dropped = dropped_ranges(log, rewinds)
    parts = []
    for i in rows:
        own = batch_ranges(log, [i])
        if own:
            drop = f", then dropped batch {_range_text(dropped[i])}" if i in dropped else ""
            parts.append(f"step {log.steps[i]} ({kinds[i]}): batch {_range_text(own[0])}{drop}")
    pairs = ", ".join(f"({a}, {b})" for a, b in skip_list(log, spikes, rewinds))
    return [
        "batches drawn by opt.rewind.batches() in the spike skips and rewinds: "
        + "; ".join(parts[:10])
        + ("; ..." if len(parts) > 10 else ""),
        f"to leave those batches out on a restart: opt.rewind.batches(loader, skip=[{pairs}])",
    ]


def escalation_text(log: GradLog, rewinds: list[int]) -> str:
    """What the rewinds did beyond restoring (``lr_cut``, ``reset_state``), or ``""``."""
    said = []
    factors = log.recovery.get(LR_FACTOR)
    if factors is not None and rewinds:
        first = rewinds[0]
        cut = [i for i in range(first, len(factors)) if math.isfinite(factors[i]) and factors[i] < 1.0]
        applied = sum(1 for i in cut if not log.skipped[i])
        if cut:
            said.append(
                f"the learning rate was multiplied by {factors[cut[0]]:g} after them "
                f"(lr_cut; {applied} applied update(s) in all)"
            )
    resets = log.recovery.get(STATE_RESET)
    if resets is not None:
        n = sum(1 for i in rewinds if resets[i] > 0.5)
        if n:
            said.append(f"{n} of them zeroed the optimizer's moment buffers (reset_state)")
    return "; ".join(said)
