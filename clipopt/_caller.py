"""Where a warning raised inside clipopt points: the first frame of the user's code."""

from __future__ import annotations

import contextlib
import os
import sys
from types import FrameType

from torch.optim import lr_scheduler as _torch_lr_scheduler
from torch.optim import optimizer as _torch_optimizer

__all__ = ["user_stacklevel"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Frames passed over as well: torch's step wrappers (``Optimizer.profile_hook_step``, and the
#: one an LR scheduler puts around ``step()``), and ``contextlib`` (``with opt.no_sync(model):``).
_PASSED = tuple(os.path.abspath(str(m.__file__)) for m in (_torch_optimizer, _torch_lr_scheduler, contextlib))
#: Modules (and packages: every module under them) whose frames are passed over too, by name, so
#: that none of them is imported here: the wrapper ``torch.compile(opt.step)`` runs the step in,
#: torch's ``no_grad``-style decorators and ``torch.compiler.disable``, Accelerate's
#: ``AcceleratedOptimizer.step``, and what Lightning's ``LightningOptimizer.step()`` goes through
#: (the strategy, the precision plugin) before it calls ``step()``.
_PASSED_MODULES = tuple(
    [
        "torch._dynamo.eval_frame",
        "torch._compile",
        "torch.utils._contextlib",
        "accelerate.optimizer",
        *(
            f"{lightning}.{module}"
            for lightning in ("lightning.pytorch", "pytorch_lightning")
            for module in ("core.optimizer", "strategies", "plugins.precision")
        ),
    ]
)


def _inside(frame: FrameType) -> bool:
    path = os.path.abspath(frame.f_code.co_filename)
    return path.startswith(_PACKAGE) or path in _PASSED or _passed_module(frame.f_globals.get("__name__"))


def _passed_module(name: object) -> bool:
    """Whether module ``name`` is one of :data:`_PASSED_MODULES` or inside one of them."""
    return isinstance(name, str) and any(name == m or name.startswith(m + ".") for m in _PASSED_MODULES)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by this function's caller, name the
    first frame outside clipopt (and the wrappers in :data:`_PASSED` and :data:`_PASSED_MODULES`):
    the user's line, however deep the call."""
    level, frame = 1, sys._getframe(1)  # level 1: the caller, which calls warnings.warn
    while frame.f_back is not None and _inside(frame):
        frame, level = frame.f_back, level + 1
    return level
