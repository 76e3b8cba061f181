"""Applying a window's :class:`~clipopt._window.decision.WindowDecision` to the inner optimizer.

* Fused optimizers (Adam, AdamW, SGD, Adagrad with ``fused=True``) get the skip
  flag as their ``found_inf`` and the remaining scale as ``grad_scale``, as
  ``GradScaler`` hands them: no host read (:func:`step_fused`).
* :func:`apply_window` picks one of them for a window and returns what
  ``step()`` returns, the outcome and which path ran.
* Every other optimizer gets its gradients scaled, the skip flag read once,
  then a step or the gradients discarded (:func:`step_host`).  An optimizer
  that re-evaluates its closure (LBFGS) has each re-evaluation clipped like
  the window (:func:`reevaluating_closure`) and its parameters restored when
  a re-evaluation is not finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._compile import _disable_dynamo
from torch.compiler import is_compiling
from torch.optim import Optimizer

from .. import functional as F
from .._hooks import inner_step
from .._inner import inner_optimizers, is_fused, reevaluates
from .._reasons import NONFINITE
from .coefficient import fused_grad_scale
from .decision import WindowDecision
from .grads import WindowGrads
from .rollback import InnerBackup, nonfinite_loss
from .settings import WindowSettings

__all__ = ["StateReadiness", "apply_window", "is_fused", "reevaluating_closure", "step_fused", "step_host"]


def _fused_inner_step(
    inner: Optimizer, closure: Callable[[], Any] | None, grad_scale: Tensor | None, found_inf: Tensor | None
) -> Any:
    """The fused inner ``step()`` with ``grad_scale``/``found_inf`` set on it, as GradScaler does.

    Under ``torch.compile(opt.step)`` it runs eagerly (:data:`_fused_inner_step_eager`):
    torch never compiles its fused kernels either (``_fused_adamw`` is
    ``torch.compiler.disable``-d), and attributes set on the optimizer inside a
    traced frame do not reach them.
    """
    inner.grad_scale = grad_scale  # type: ignore[attr-defined]
    inner.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return inner_step(inner, closure)
    finally:
        del inner.grad_scale  # type: ignore[attr-defined]
        del inner.found_inf  # type: ignore[attr-defined]


#: ``_fused_inner_step`` hidden from torch.compile; torch's lazy wrapper imports
#: ``torch._dynamo`` at the first call (while compiling), not when clipopt is imported.
_fused_inner_step_eager = _disable_dynamo(_fused_inner_step)


class StateReadiness:
    """Whether every parameter with a gradient already has inner state (then the fused path is safe).

    Before a parameter's first update a fused kernel that is told to skip can
    leave freshly allocated state uninitialised (fused SGD's momentum buffers),
    and a skipped first update must leave no state behind, so such windows
    take the host path.  SGD without momentum keeps no state at all.  Once
    every parameter has state, that is remembered for this state object.
    """

    __slots__ = ("_size", "_state")

    def __init__(self) -> None:
        self._state: Any = None  # the state objects known to hold state for every parameter
        self._size: tuple[int, int] = (0, 0)

    def reset(self) -> None:
        """Forget what was known (a loaded state dict)."""
        self._state = None

    def ready(self, inner: Optimizer, params: Sequence[Tensor]) -> bool:
        known = self._state  # one optimizer, as known (every window): no walk over its groups
        single = known is not None and len(known) == 1 and known[0] is inner.__dict__.get("state")
        if single and self._size == (len(known[0]), len(params)):
            return True
        optimizers = inner_optimizers(inner)  # several: each one's own state
        states = tuple(o.state for o in optimizers)
        size = (sum(len(state) for state in states), len(params))
        known = self._state  # a tuple of each inner optimizer's state, or None
        same = isinstance(known, tuple) and len(known) == len(states) and self._size == size
        if same and all(a is b for a, b in zip(known, states, strict=True)):
            return True
        all_ready = True
        for o in optimizers:
            sgd = isinstance(o, torch.optim.SGD)
            for group in o.param_groups:
                if sgd and group.get("momentum", 0) == 0:
                    continue
                for p in group["params"]:
                    s = o.state.get(p)
                    if not s or any(v is None for v in s.values()):
                        if p.grad is not None:
                            return False
                        all_ready = False
        if all_ready:
            self._state, self._size = states, size
        return True


def step_fused(
    inner: Optimizer,
    d: WindowDecision,
    inner_closure: Callable[[], Any] | None,
    grad_groups: Sequence[Sequence[Tensor]] = (),
    *,
    foreach: bool | None = None,
) -> tuple[Any, bool | Tensor]:
    """Fold the scale into the fused kernel as ``grad_scale``; skip through ``found_inf``.

    With per-group clipping (``grad_groups``: the gradients per parameter group) the kernel's one
    ``grad_scale`` carries the scale of the groups sharing the wrapper's bound; each group in
    ``d.unfolded`` is first multiplied in place by its own scale over that one (an extra pass
    over its gradients only, no host read).  Returns the inner step's result and the outcome
    (the device skip flag, or False).
    """
    if d.group_scales is not None and d.unfolded:
        scales = d.group_scales
        # scale / d.scale: the kernel then divides by 1 / d.scale (a shared coefficient of 0 comes
        # only from a non-finite shared norm, a window that is skipped -- or not finite anyway)
        ratios = [scales[j] / d.scale if _scaled(d.scale) else scales[j] for j in d.unfolded]
        F.scale_groups_([grad_groups[j] for j in d.unfolded], ratios, foreach=foreach)
    grad_scale = d.grad_scale  # the kernel divides the gradients by it; set directly by a plain window
    if grad_scale is None and d.bounded is not None and d.group_scales is None:
        grad_scale = fused_grad_scale(*d.bounded)  # the formula of every fused path, the plain one's
    elif grad_scale is None:
        if isinstance(d.scale, Tensor):
            scale = d.scale if d.scale.dtype == torch.float32 else d.scale.to(torch.float32)
            grad_scale = scale.reciprocal()
        elif d.scale != 1.0:
            # made on the device: torch.tensor(x, device=...) would be a blocking host-to-device copy
            grad_scale = torch.full((), 1.0 / d.scale, dtype=torch.float32, device=d.total_norm.device)
    fused_step = _fused_inner_step_eager if is_compiling() else _fused_inner_step
    out = fused_step(inner, inner_closure, grad_scale, d.skip)
    return out, d.skip if d.skip is not None else False


def step_host(
    inner: Optimizer,
    d: WindowDecision,
    grads: list[Tensor],
    params: list[Tensor],
    loss: Any,
    make_closure: Callable[[list[bool] | None], Callable[[], Any] | None] | None,
    *,
    guard: bool,
    foreach: bool | None,
    grad_groups: Sequence[Sequence[Tensor]] = (),
) -> tuple[Any, bool]:
    """Scale the gradients (each group by its own scale with per-group clipping: ``grad_groups``),
    read the skip flag once, then step or discard.

    ``make_closure(bad)`` builds the inner closure (``make_closure`` is None
    without a closure); with ``guard`` (an optimizer that re-evaluates it) the
    parameters and inner state are copied first and restored when a
    re-evaluation sets ``bad[0]``.  Returns what ``step()`` returns (the inner
    step's result with a closure, else ``loss``) and whether it was skipped.
    """
    if d.skip is not None and _read_skip(d, d.skip, grads, foreach):
        for p in params:
            p.grad = None
        return loss, True
    if d.group_scales is not None:  # per-group clipping: each group by its own scale
        F.scale_groups_(grad_groups, d.group_scales, foreach=foreach)
    elif _scaled(d.scale):
        F.scale_grads_(grads, d.scale, foreach=foreach)
    guard = guard and make_closure is not None and reevaluates(inner)
    backup, bad = (InnerBackup(inner, params), [False]) if guard else (None, None)
    out = inner_step(inner, None if make_closure is None else make_closure(bad))
    if make_closure is None:
        out = loss
    if backup is not None and bad is not None and bad[0]:  # a non-finite re-evaluation: skip
        backup.restore()
        d.skipped_as_nonfinite(NONFINITE)
        return out, True
    return out, False


def _read_skip(d: WindowDecision, skip_flag: Tensor, grads: list[Tensor], foreach: bool | None) -> bool:
    """The skip flag, read once (with whether the norm is ``+inf``).  A skipped window whose norm
    is ``+inf`` and whose elements nobody looked at is looked at now, on the device (one more pass
    over the gradients, only then; no read): all finite means a norm beyond float32's range,
    reason ``"norm_overflow"``, not non-finite."""
    norm = d.total_norm  # a float32 norm is read as it is (+inf stays +inf): no isposinf kernel
    flags = [skip_flag, norm if norm.dtype == torch.float32 else torch.isposinf(norm), d.bad_elements()]
    skip, overflow_read, bad = torch.stack(
        [f if f.dtype == torch.float32 else f.float() for f in flags]
    ).tolist()
    overflowed = overflow_read == (math.inf if norm.dtype == torch.float32 else 1.0)
    if skip and overflowed and d.elements is None:
        maxima = F.get_norms(grads, math.inf, foreach=foreach)
        d.checked_elements(F.nonfinite_grads(grads, maxima, math.inf).amax())
    else:
        d.host_bad = bool(bad)  # what counting the skip would read
    return bool(skip)


def _scaled(scale: float | Tensor) -> bool:
    """Whether ``scale`` changes the gradients (a tensor always may: no host read)."""
    return isinstance(scale, Tensor) or scale != 1.0


def reevaluating_closure(
    loss: Any,
    closure: Callable[[], Any] | None,
    reclip: Callable[[], tuple[Tensor, list[Tensor]]],
    bad: list[bool] | None = None,
) -> Callable[[], Any] | None:
    """First call returns the loss already computed; later calls re-evaluate and clip.

    ``reclip()`` measures and clips the re-evaluated gradients with the window's
    own bound (a policy sees each window once, not each evaluation) and returns
    their non-finite flag and the gradients.  With ``bad`` (a one-element list) each re-evaluation
    is checked on the host: a non-finite loss or gradient sets ``bad[0]`` and
    zeroes the gradients, which ends LBFGS's iterations; the caller then
    restores the window.
    """
    if closure is None:
        return None
    calls = [0]

    def reevaluate() -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return loss
        with torch.enable_grad():
            out = closure()
        with torch.no_grad():
            nonfinite, grads = reclip()
            if bad is not None and (bad[0] or bool(nonfinite.item()) or nonfinite_loss(out)):
                bad[0] = True
                for g in grads:
                    g.zero_()
                out = torch.zeros(()) if isinstance(out, Tensor) else 0.0
        return out

    return reevaluate


def apply_window(
    inner: Optimizer,
    s: WindowSettings,
    d: WindowDecision,
    g: WindowGrads,
    step_result: tuple[Any, Callable[[], Any] | None],
    reclip: Callable[[float | Tensor | None], tuple[Tensor, list[Tensor]]],
    readiness: StateReadiness,
    *,
    host: bool = False,
) -> tuple[Any, bool | Tensor, bool]:
    """Stage 6 (apply): the inner step or the skip of the window decided as ``d`` (settings ``s``).

    ``step_result``: the loss the wrapper's ``step()`` computed and the user's closure (or
    None); ``reclip(max_norm)`` clips a closure's re-evaluation (:func:`reevaluating_closure`).
    Returns ``step()``'s result, the outcome (a bool, or a 0/1 device flag) and whether the
    fused, host-read-free path ran.  ``host``: take the host path even for a fused optimizer (the
    outcome is then known on the host: a Rewind's learning-rate cut counts applied updates).
    """
    loss, closure = step_result
    fused = not host and is_fused(inner) and readiness.ready(inner, g.params)

    def make_closure(bad: list[bool] | None = None) -> Any:
        return reevaluating_closure(loss, closure, lambda: reclip(d.max_norm), bad)

    if fused:
        inner_closure = None if closure is None else make_closure()
        out, skipped = step_fused(inner, d, inner_closure, g.by_group, foreach=s.foreach)
        return (out if closure is not None else loss), skipped, True
    out, skipped = step_host(
        inner,
        d,
        g.grads,
        g.params,
        loss,
        None if closure is None else make_closure,
        guard=s.skip_enabled,
        foreach=s.foreach,
        grad_groups=g.by_group,
    )
    return out, skipped, False
