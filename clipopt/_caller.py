"""Where a warning raised inside clipopt points: the first frame of the user's code."""

from __future__ import annotations

import os
import sys

from torch.optim import optimizer as _torch_optimizer

__all__ = ["user_stacklevel"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: torch's step wrapper (``Optimizer.profile_hook_step``) sits between ``step()`` and the wrapper's own.
_PASSED = (os.path.abspath(_torch_optimizer.__file__),)


def _inside(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE) or path in _PASSED


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by this function's caller, name the
    first frame outside clipopt (and torch's step wrapper): the user's line, however deep the call."""
    level, frame = 1, sys._getframe(1)  # level 1: the caller, which calls warnings.warn
    while frame.f_back is not None and _inside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level
