"""The names of clipopt's log columns (CSV) and scalar tags (TensorBoard), for writers and readers.

:class:`~clipopt.CSVLogger` and :class:`~clipopt.TensorBoardLogger` write
these names; ``clipopt report``'s reader (:mod:`clipopt._report.read`,
:mod:`clipopt._report.names`) finds them by the same names.  The skip
reasons' own tags are rows of :data:`clipopt._reasons.REASONS`.  The names
never change: logs written by earlier versions must read the same.
"""

from __future__ import annotations

import re

__all__ = [
    "column_tag",
    "BASE_COLUMNS",
    "BATCH_END",
    "BATCH_START",
    "PART_COLUMNS",
    "PART_NUMBERS",
    "RECOVERY_COLUMNS",
    "RERUN",
    "RERUN_OUTCOMES",
    "CLIPPED",
    "CLIP_COEF",
    "GROUP_COLUMN",
    "GROUP_KINDS",
    "GROUP_TAG",
    "LAYERS_TAG",
    "LOSS",
    "LR",
    "LR_FACTOR",
    "MAX_LOGIT",
    "MAX_NORM",
    "MICRO_BATCHES",
    "REASON",
    "SKIPPED",
    "STATE_RESET",
    "STEP",
    "TAG_PREFIX",
    "TOTAL_NORM",
    "UPDATE_COLUMNS",
    "UPDATE_COEF",
    "UPDATE_NORM",
    "group_column",
    "group_tag",
    "layer_column",
    "layer_tag",
    "lr_name",
]

#: What every clipopt TensorBoard tag starts with (``clipopt/<column>``).
TAG_PREFIX = "clipopt/"

STEP = "step"
MICRO_BATCHES = "micro_batches"
TOTAL_NORM = "total_norm"  #: the pre-clip norm
CLIP_COEF = "clip_coef"
CLIPPED = "clipped"  #: 0/1
SKIPPED = "skipped"  #: 0/1
REASON = "reason"  #: CSV only: the skip reason's name (TensorBoard: the reason's own tag)
MAX_NORM = "max_norm"
LR = "lr"  #: group 0's; ``lr.<g>`` for a further group (:func:`lr_name`)
LOSS = "loss"

#: The columns every :class:`~clipopt.CSVLogger` row has, in order.
BASE_COLUMNS = (STEP, MICRO_BATCHES, TOTAL_NORM, CLIP_COEF, CLIPPED, SKIPPED, REASON, MAX_NORM, LR, LOSS)

#: ``update_clip``/``update_stats``: the update's norm before clipping and the coefficient applied
#: (CSV columns after the per-group ones; TensorBoard ``clipopt/update_norm``, ``clipopt/update_coef``).
UPDATE_NORM = "update_norm"
UPDATE_COEF = "update_coef"
UPDATE_COLUMNS = (UPDATE_NORM, UPDATE_COEF)

#: A Rewind's columns (after the base ones, when the optimizer has a Rewind): the batches
#: ``opt.rewind.batches()`` drew during the window, ``batch_start <= n < batch_end`` (empty before it
#: is used); with ``lr_cut``, the factor the window's learning rates were multiplied by (1: none);
#: with ``reset_state``, 1 in the row of a rewind that zeroed the optimizer's moment buffers.
BATCH_START = "batch_start"
BATCH_END = "batch_end"
LR_FACTOR = "lr_factor"
STATE_RESET = "state_reset"
RECOVERY_COLUMNS = (BATCH_START, BATCH_END, LR_FACTOR, STATE_RESET)

#: ``qk_clip``: the largest attention logit of the window (over the heads QKClip watches; agreed
#: across the replicas), as softmax sees it; empty or ``nan`` where not measured.
MAX_LOGIT = "max_logit"

#: The cells of the other parts (``_part.Part.columns``), read as ``StepStats.<column>`` (None when
#: the part is off) and written after the Rewind's columns.
PART_COLUMNS: tuple[str, ...] = ("rerun", MAX_LOGIT)
#: Those of :data:`PART_COLUMNS` that hold numbers (the report reads them as such).
PART_NUMBERS: tuple[str, ...] = (MAX_LOGIT,)

#: ``Rerun``'s column (``StepStats.rerun``) and what it holds where a window was executed again; its
#: TensorBoard tags are ``clipopt/rerun/<outcome>`` (1 where it happened).
RERUN = "rerun"
RERUN_OUTCOMES = ("persistent", "transient")

#: Per-group clipping's columns and tags: each group's pre-clip norm and its coefficient.
GROUP_KINDS = ("norm", "coef")
#: A per-group column (``group_norm.<g>``): kind, group index.
GROUP_COLUMN = re.compile(r"group_(norm|coef)\.([0-9]+)")
#: A per-group tag (``clipopt/group_norm/<g>``): kind, group index.
GROUP_TAG = re.compile(re.escape(TAG_PREFIX) + r"group_(norm|coef)/([0-9]+)")
#: What the per-layer tags start with (``clipopt/layers/<name>/<field>``).
LAYERS_TAG = TAG_PREFIX + "layers/"


def column_tag(column: str) -> str:
    """The TensorBoard tag of a column (``clipopt/<column>``)."""
    return TAG_PREFIX + column


def lr_name(group: int) -> str:
    """The learning-rate column (and tag suffix) of parameter group ``group``: ``lr``, ``lr.1``, ..."""
    return LR if group == 0 else f"{LR}.{group}"


def group_column(kind: str, group: int) -> str:
    """The CSV column of a group's ``kind`` (``"norm"`` or ``"coef"``): ``group_norm.<g>``."""
    return f"group_{kind}.{group}"


def group_tag(kind: str, group: int) -> str:
    """The TensorBoard tag of a group's ``kind``: ``clipopt/group_norm/<g>``."""
    return f"{TAG_PREFIX}group_{kind}/{group}"


def layer_column(name: str, field: str) -> str:
    """The CSV column of one layer's statistic: ``<name>.<field>``."""
    return f"{name}.{field}"


def layer_tag(name: str, field: str) -> str:
    """The TensorBoard tag of one layer's statistic: ``clipopt/layers/<name>/<field>``."""
    return f"{LAYERS_TAG}{name}/{field}"
