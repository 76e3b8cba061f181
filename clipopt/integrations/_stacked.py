"""A framework's own gradient clipping stacked in front of clipopt's: told once, naming the setting.

A framework that clips before ``optimizer.step()`` (the Hugging Face ``Trainer``'s
``max_grad_norm``, default 1.0, also in TRL's ``SFTConfig``; Lightning's
``gradient_clip_val``) hands clipopt gradients already bounded: clipopt then
records norms no larger than the framework's bound and its own ``max_norm``
never acts, with nothing said.  The callbacks of :mod:`clipopt.integrations`
call :func:`warn_stacked_clip` when they see such a setting.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

__all__ = ["StackedClipWarning", "clips_before_clipopt", "stacked_clip_message", "warn_stacked_clip"]

#: Frames of these packages are passed over, so that the warning names the user's ``fit``/``train`` line.
_FRAMEWORK_MODULES = ("clipopt", "transformers", "trl", "lightning", "pytorch_lightning", "accelerate")


class StackedClipWarning(UserWarning):
    """A framework clips the gradients before clipopt sees them."""


def clips_before_clipopt(value: Any) -> bool:
    """Whether a framework's clip setting (``max_grad_norm``, ``gradient_clip_val``) turns its clipping
    on: a finite number above 0 (the frameworks clip only then; None, 0 and negative values leave it
    off, and an infinite bound bounds nothing)."""
    if value is None or isinstance(value, bool):
        return False
    try:
        number = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and number > 0


def stacked_clip_message(setting: str, value: Any, fix: str) -> str:
    """The warning: which setting clips, what clipopt then records, and how to turn it off."""
    return (
        f"{setting}={value!r} clips the gradients before clipopt sees them: clipopt records gradients "
        f"already bounded by {value!r} (in norm, or element-wise with Lightning's "
        "gradient_clip_algorithm='value') and its own max_norm (and SpikeGuard's norm signal) never acts. "
        f"Turn the framework's clipping off with {fix} and let clipopt clip."
    )


def _outside_frameworks() -> int:
    """The ``stacklevel`` naming the first frame outside clipopt and the frameworks (the user's call)."""
    level, frame = 2, sys._getframe(2)  # level 2: the caller of warn_stacked_clip
    while frame.f_back is not None:
        name = frame.f_globals.get("__name__")
        if not (isinstance(name, str) and name.split(".")[0] in _FRAMEWORK_MODULES):
            break
        frame, level = frame.f_back, level + 1
    return level


def warn_stacked_clip(setting: str, value: Any, fix: str) -> None:
    """Warn (:class:`StackedClipWarning`) that ``setting=value`` clips before clipopt; ``fix`` turns it
    off."""
    message = stacked_clip_message(setting, value, fix)
    warnings.warn(message, StackedClipWarning, stacklevel=_outside_frameworks())
