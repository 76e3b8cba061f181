"""The names ``clipopt report`` recognises: one table for every reader.

A CSV column, a TensorBoard scalar tag and a key of a Trainer's
``log_history`` are all chosen here, by :func:`pick`, so that every format
recognises the same names: first the exact names of the table, in order of
preference, then the first name (in the log's order) that matches the kind's
pattern.  A name the user gives (``--loss NAME``, ``--norm NAME``) replaces the
choice; one that is not in the log is an error naming it and listing the names
there (:func:`choose`).  The update norm and its coefficient (``update_clip=``,
``update_stats=True``) are read by clipopt's exact names only: a log without
them reads as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from .._log_names import LOSS, LR, TOTAL_NORM, UPDATE_COEF, UPDATE_NORM, column_tag

__all__ = [
    "LOSS_NAMES",
    "LR_NAMES",
    "NORM_NAMES",
    "STEP_NAMES",
    "UPDATE_COEF_NAMES",
    "UPDATE_NORM_NAMES",
    "choose",
    "is_validation",
    "pick",
]

#: Step columns, in order of preference.
STEP_NAMES = ("step", "global_step", "trainer/global_step", "iteration", "iter")
#: Gradient-norm names, in order of preference; then Lightning's ``grad_<p>_norm_total``, then a training
#: name ending in ``total_norm``, ``grad_norm`` or ``gradient_norm`` (``*/total_norm``).
NORM_NAMES = (
    column_tag(TOTAL_NORM),
    "total_norm",
    "grad_norm",
    "gradient_norm",
    "train/grad_norm",
    "train/total_norm",
    "Grad/total_norm",
    "grad/total_norm",
)
#: Loss names, in order of preference; then a training name one of whose ``/``-parts ends in ``loss``
#: or ``loss_step`` (``Loss/train``, ``train/loss``, Lightning's ``loss_step``, but not ``val_loss``,
#: ``Loss/test`` or the per-epoch ``loss_epoch``).
LOSS_NAMES = (
    column_tag(LOSS),
    "loss",
    "train_loss",
    "train/loss",
    "Loss/train",
    "loss/train",
    "train_loss_step",
    "training_loss",
)
#: Learning-rate names, in order of preference; then a name starting with ``lr-`` or ``lr/`` (Lightning's
#: LearningRateMonitor) or ending in ``/lr`` or ``/learning_rate``.
LR_NAMES = (column_tag(LR), "lr", "learning_rate", "train/learning_rate", "train/lr")
#: Update-norm names (clipopt's ``update_clip``/``update_stats``: TensorBoard tag, CSV column); no pattern.
UPDATE_NORM_NAMES = (column_tag(UPDATE_NORM), UPDATE_NORM)
#: The update coefficient's names, read with the update norm; no pattern.
UPDATE_COEF_NAMES = (column_tag(UPDATE_COEF), UPDATE_COEF)

_LIGHTNING_TOTAL = re.compile(r"grad_(?:[0-9.]+|inf)_norm_total")
_HELD_OUT = "val|valid|validation|eval|evaluation|test|dev"
#: A validation, evaluation, test or dev-set metric: one of these words between separators (lower case).
_VALIDATION = re.compile(rf"(?:^|[/_.\- ])(?:{_HELD_OUT})(?:[/_.\- ]|$)")
#: The same word at the start of a camelCase name or part (``valLoss``, ``Loss/evalLoss``).
_VALIDATION_CAMEL = re.compile(rf"(?:^|[/_.\- ])(?i:{_HELD_OUT})(?=[A-Z])")


def is_validation(name: str) -> bool:
    """True for a validation, evaluation, test or dev-set metric (``val_loss``, ``eval/loss``,
    ``Loss/test``, ``dev_loss``, ``valLoss``)."""
    return _VALIDATION.search(name.lower()) is not None or _VALIDATION_CAMEL.search(name) is not None


def _per_layer(low: str) -> bool:
    """A per-layer name (clipopt's ``<layer>.grad_norm`` column or ``clipopt/layers/...`` tag)."""
    return low.endswith(".grad_norm") or "layers/" in low


def _lightning_total(name: str) -> bool:
    return _LIGHTNING_TOTAL.fullmatch(name) is not None


def _norm_like(name: str) -> bool:
    low = name.lower()
    return (
        low.endswith(("total_norm", "grad_norm", "gradient_norm"))
        and not _per_layer(low)
        and not is_validation(name)
    )


def _loss_like(name: str) -> bool:
    low = name.lower()
    return (
        any(part.endswith(("loss", "loss_step")) for part in low.split("/"))
        and "layers/" not in low
        and not is_validation(name)
    )


def _lr_like(name: str) -> bool:
    return name.startswith(("lr-", "lr/")) or name.lower().endswith(("/lr", "/learning_rate"))


#: kind -> (the exact names, the patterns tried after them, in order).
_TABLE: dict[str, tuple[tuple[str, ...], tuple[Callable[[str], bool], ...]]] = {
    "step": (STEP_NAMES, ()),
    "norm": (NORM_NAMES, (_lightning_total, _norm_like)),
    "loss": (LOSS_NAMES, (_loss_like,)),
    "lr": (LR_NAMES, (_lr_like,)),
    "update": (UPDATE_NORM_NAMES, ()),
    "update_coef": (UPDATE_COEF_NAMES, ()),
}


def pick(kind: str, names: Sequence[str]) -> str | None:
    """The name of ``names`` read as ``kind`` (``"step"``, ``"norm"``, ``"loss"``, ``"lr"``, ``"update"`` or
    ``"update_coef"``): the first exact name of the table present, else the first of ``names``
    matching a pattern; None: none."""
    exact, patterns = _TABLE[kind]
    present = set(names)
    for n in exact:
        if n in present:
            return n
    for matches in patterns:
        for n in names:
            if matches(n):
                return n
    return None


def choose(kind: str, names: Sequence[str], given: str | None, where: str, noun: str) -> str | None:
    """``given`` (the user's ``--loss``/``--norm``) when ``names`` has it, else :func:`pick`'s choice.

    A ``given`` name that ``where`` lacks is a ``ValueError`` naming it and listing the names there
    (``noun``: column, scalar tag or log_history key)."""
    if given is None:
        return pick(kind, names)
    if given not in names:
        shown = ", ".join(names[:40]) + (f", ... ({len(names) - 40} more)" if len(names) > 40 else "")
        raise ValueError(
            f"{where} has no {noun} {given!r} (--{kind} {given}); its {noun}s: {shown or 'none'}"
        )
    return given
