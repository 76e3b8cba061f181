"""Where a warning raised inside clipopt points: the first frame of the user's code."""

from __future__ import annotations

import sys
from types import FrameType

__all__ = ["user_stacklevel"]

#: Modules (and packages: every module under them) whose frames are passed over, by name, so that
#: none of them is imported here: clipopt itself; torch's step wrappers (``Optimizer.profile_hook_step``,
#: the one an LR scheduler puts around ``step()``); ``contextlib`` (``with opt.no_sync(model):``); the
#: wrapper ``torch.compile(opt.step)`` runs the step in, torch's ``no_grad``-style decorators and
#: ``torch.compiler.disable``; Accelerate's ``AcceleratedOptimizer.step``; and what Lightning's
#: ``LightningOptimizer.step()`` goes through (the strategy, the precision plugin) before ``step()``.
_PASSED_MODULES = (
    "clipopt",
    "torch.optim.optimizer",
    "torch.optim.lr_scheduler",
    "contextlib",
    "torch._dynamo.eval_frame",
    "torch._compile",
    "torch.utils._contextlib",
    "accelerate.optimizer",
    *(
        f"{lightning}.{module}"
        for lightning in ("lightning.pytorch", "pytorch_lightning")
        for module in ("core.optimizer", "strategies", "plugins.precision")
    ),
)


def _inside(frame: FrameType) -> bool:
    """Whether ``frame`` runs in one of :data:`_PASSED_MODULES` or in a module inside one of them."""
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and any(name == m or name.startswith(m + ".") for m in _PASSED_MODULES)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by this function's caller, name the
    first frame outside clipopt (and the wrappers in :data:`_PASSED_MODULES`): the user's line,
    however deep the call."""
    level, frame = 1, sys._getframe(1)  # level 1: the caller, which calls warnings.warn
    while frame.f_back is not None and _inside(frame):
        frame, level = frame.f_back, level + 1
    return level
