"""torch's step wrapper (``Optimizer.profile_hook_step``): when it must run, and an inner step past it.

torch wraps every optimizer class's ``step`` in ``profile_hook_step``, which opens a
``record_function`` (about 10 us per call on CPU, profiler or not), runs the global and the
optimizer's own step hooks around the step, and calls ``_optimizer_step_code()`` (an empty method
a profiler can see).  With no hook registered and no profiler recording, only that cost is left.
The wrapper's own ``step()`` is not wrapped (``step.hooked``) and takes torch's wrapper only when
:func:`step_hooked` says so; :func:`inner_step` does the same for the inner optimizer's ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import profiler as _profiler_module
from torch.compiler import is_compiling
from torch.optim import Optimizer
from torch.optim import optimizer as _optim_module

__all__ = ["inner_step", "step_hooked"]

#: Whether a profiler records in this thread (``torch.autograd._profiler_enabled``, looked up once).
#: A profiler of every thread (``profile_all_threads``) started in another thread is not seen by it:
#: ``torch.autograd.profiler._is_profiler_enabled`` is the process-wide flag torch sets then.
_profiler_enabled: Callable[[], bool] = torch.autograd._profiler_enabled  # type: ignore[attr-defined]

#: torch's global optimizer hooks (``register_optimizer_step_pre_hook`` and its post-hook twin fill them).
_GLOBAL_PRE_HOOKS = _optim_module._global_optimizer_pre_hooks
_GLOBAL_POST_HOOKS = _optim_module._global_optimizer_post_hooks


def step_hooked(compiling: bool) -> bool:
    """Whether ``step()`` must run inside torch's ``profile_hook_step`` although the optimizer has no
    step hook of its own (its caller tests those first): a global optimizer hook is registered, or
    a profiler records (``compiling``: torch.compile traces the call, which has no profiler hook and
    cannot trace the query)."""
    hooks = bool(_GLOBAL_PRE_HOOKS or _GLOBAL_POST_HOOKS)
    return hooks or (not compiling and (_profiler_enabled() or _profiler_module._is_profiler_enabled))


def _step_of(self: Optimizer) -> None:
    """A stand-in ``step`` to take the code of torch's wrapper from."""


#: The code object of every wrapper ``profile_hook_step`` makes: a class's ``step`` with it is
#: torch's wrapper, whatever else decorates the function inside.
_TORCH_WRAPPER_CODE = Optimizer.profile_hook_step(_step_of).__code__


def inner_step(inner: Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """``inner.step(closure)`` (``inner.step()`` without one), past torch's wrapper when it would only
    cost time: the class's ``step`` is torch's wrapper, the instance's ``step`` is not replaced (an LR
    scheduler attached to the inner optimizer wraps it there), the inner optimizer has no step hook,
    no global hook is registered, no profiler records and nothing is being compiled.  Then the
    wrapped function runs, and ``_optimizer_step_code()`` after it, as in torch's wrapper."""
    step = type(inner).step
    raw: Callable[..., Any] | None = getattr(step, "__wrapped__", None)
    bypass = (
        getattr(step, "__code__", None) is _TORCH_WRAPPER_CODE
        and "step" not in inner.__dict__
        and not getattr(inner, "_optimizer_step_pre_hooks", True)
        and not getattr(inner, "_optimizer_step_post_hooks", True)
    )
    # (while compiling: torch's wrapper, and no profiler query traced, as the wrapper's own step())
    if raw is None or not bypass or is_compiling() or step_hooked(False):
        return inner.step() if closure is None else inner.step(closure)
    out = raw(inner) if closure is None else raw(inner, closure)
    inner._optimizer_step_code()
    return out
