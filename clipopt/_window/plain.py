"""The plain window: measure, clip by one norm bound, then step or skip, in the fewest operations.

Most runs turn on nothing but a norm bound (and accumulation): no per-group options, no
:class:`~clipopt.ClipPolicy`, no value clipping, no per-layer statistics due at this window, no
loggers or snapshots, no GradScaler, no recovery, no update clipping, no replicas to agree with,
and ``step()`` gets no closure.  Such a window (``WindowSettings.plain`` or ``between_stats``,
and the wrapper's other features off) closes here: the same stages as the general close
(docs/design.md, 'Order of operations') with the same outcome, record and counters
(tests/window/test_plain_close.py runs both on the same windows and compares them), but none of
the general close's bookkeeping for features that are off:

* measure: each gradient's norm (one foreach kernel where it can), their norm (the total, divided
  by the micro-batches with ``reduction="mean"``) and its non-finite flag; the total cannot
  overflow on finite gradients (:func:`clipopt.functional.finite_total`: looked at on the CPU in
  the kernel, on an accelerator by :func:`decide_host` after its read, not on the fused path);
  a window whose norm is beyond its range of norms (:func:`clipopt.functional.beyond`: float32's
  unless every gradient is float64; the general close's rule) is skipped (reason
  ``"norm_overflow"``) unless its bound clips it below that range (:func:`unbounded`, decided on
  the host from the value already read);
* clip: on a fused optimizer the kernel's ``grad_scale = max(1, (total + 1e-6) / max_norm)``
  (times the micro-batches with ``"mean"``), computed directly, by the formula every fused path
  takes (:mod:`clipopt._window.coefficient`); the record's coefficient
  ``min(1, max_norm / (total + 1e-6))`` and ``clipped`` (``coef < 1``) are computed from the
  recorded norm when first read (``StepStats.clip_coef``).  On any other optimizer the
  coefficient is computed as torch's ``clip_grad_norm_`` computes it, and scales the gradients;
* decide: the non-finite flag is the one skip signal (reason ``"nonfinite"`` when it skips), and
  the counters take it as it is (``WrapperState`` counts waiting flags when read);
* apply: a fused optimizer gets the flag as ``found_inf`` (no host read,
  :func:`~clipopt._window.apply.step_fused`); any other optimizer has its gradients scaled after
  one read of the total norm, or, when that norm is not finite, discarded -- an ``inf`` norm has
  its elements looked at on the device, as the general host step does, to tell a non-finite
  gradient from a norm above float32's range (reason ``"norm_overflow"``).

Nothing changes before the inner step (:func:`~clipopt._window.apply.step_fused` or
:func:`apply_host`): a failing decision leaves the window open, a failing step discards it (its
gradients may have changed), as in the general close.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import functional as F
from .._hooks import inner_step
from .._reasons import NONFINITE, NORM_OVERFLOW
from .._tensors import cpu_value as _cpu_value
from .apply import step_fused
from .coefficient import Constants, constants, fused_grad_scale
from .decision import WindowDecision
from .settings import WindowSettings

__all__ = ["apply_host", "close_plain", "decide_fused", "decide_host", "unbounded"]


def decide_fused(s: WindowSettings, grads: list[Tensor], loss: Tensor | float | None) -> WindowDecision:
    """Stages 2-5 of a plain window on a fused optimizer, without a host read: the window's record
    with the fused kernel's ``grad_scale`` and ``found_inf`` (``skip``).

    The kernel divides the gradients by ``grad_scale = max(1, (total + 1e-6) / max_norm)``
    (times the micro-batches with ``"mean"``), computed directly; the record's ``clip_coef``,
    ``min(1, max_norm / (total + 1e-6))``, is left to be computed from the norm when it is read
    (``StepStats.clip_coef``)."""
    total, c, _, beyond = _measure(s, grads)
    d = WindowDecision(total, _nonfinite(total, c))
    d.loss = loss
    if s.max_norm is not None:
        d.max_norm, d.coef, d.clipped = s.max_norm, None, None
    d.grad_scale = fused_grad_scale(total, s.max_norm, s.divisor, c)  # the formula of every fused path
    if s.skip_enabled:  # the one signal: its reason is recorded where it skips (read only then)
        d.skip, d.reason = d.nonfinite, NONFINITE
        if beyond is not None and unbounded(s, beyond, grads):
            _skip_norm_overflow(d, c)
    return d


def decide_host(
    s: WindowSettings, grads: list[Tensor], loss: Tensor | float | None
) -> tuple[WindowDecision, bool]:
    """Stages 2-5 of a plain window on any other optimizer, with one read of the norm: a finite
    norm (or skipping off) is a window to apply, ``skip`` None; otherwise ``skip`` is its
    non-finite flag, for :func:`apply_host`.  Also returns whether the gradients are uniform (dense,
    of one dtype and device, measured by one foreach kernel: scaled by one too).  The coefficient is
    torch's, bit for bit: ``clamp(max_norm / (total + 1e-6), max=1)``."""
    total, c, uniform, beyond = _measure(s, grads)
    value = total.item() if s.skip_enabled else 0.0  # the one host read
    if value == math.inf and not F.host_reads(total):  # an accelerator's kernel could not look: now it can
        raw = F.finite_total(total, grads, s.norm_type, overflow=True)
        total = raw.div(c.divisor) if s.divisor != 1.0 else raw
        value = total.item()  # a window whose float32 norm overflowed: read once more
        if F.beyond(value * s.divisor, s.norm_type, grads):
            beyond = value
    finite = math.isfinite(value)
    d = WindowDecision(total, c.zero if finite else _nonfinite(total, c))
    d.loss = loss
    if s.max_norm is not None:
        coef = (total + c.eps).reciprocal_().mul_(c.max_norm).clamp_max_(c.one)
        d.max_norm, d.coef, d.clipped = s.max_norm, coef, None  # clipped: read as coef < 1
        d.scale = coef.mul(c.inv) if s.divisor != 1.0 else coef
    elif s.divisor != 1.0:
        d.scale = 1.0 / s.divisor
    if finite and beyond is not None and s.skip_enabled and unbounded(s, beyond, grads):
        _skip_norm_overflow(d, c)
    if not finite:
        d.skip, d.reason = d.nonfinite, NONFINITE
        if value == math.inf:  # every element may be finite and the norm overflowed: look (no read)
            maxima = F.get_norms(grads, math.inf, foreach=s.foreach)
            d.checked_elements(F.nonfinite_grads(grads, maxima, math.inf).amax())
    return d, uniform


def apply_host(
    inner: Optimizer,
    d: WindowDecision,
    grads: list[Tensor],
    params: list[Tensor],
    foreach: bool | None,
    uniform: bool,
) -> bool:
    """Stage 6 (apply) of a plain window that :func:`decide_host` decided: scale and step, or (a norm
    that is not finite) the general host step; returns whether it skipped."""
    if d.skip is not None:  # the norm is not finite: the window is discarded
        for p in params:
            p.grad = None
        return True
    if uniform and isinstance(d.scale, Tensor):
        torch._foreach_mul_(grads, d.scale)  # as torch's clip_grads_with_norm_ scales them
    elif isinstance(d.scale, Tensor) or d.scale != 1.0:
        F.scale_grads_(grads, d.scale, foreach=foreach)
    inner_step(inner)
    return False


def close_plain(
    inner: Optimizer,
    s: WindowSettings,
    grads: list[Tensor],
    params: list[Tensor],
    loss: Tensor | float | None,
    fused: bool,
    discard: Callable[[BaseException], None],
) -> tuple[WindowDecision, bool | Tensor]:
    """Stages 2-6 of a plain window (``fused``: the fused path, its state ready): its record and
    outcome.  Nothing changes before the inner step; when the step fails, ``discard(exc)`` drops the
    window (its gradients may have changed) before the error propagates."""
    grad_mode = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch.no_grad() without its context object (~1 us)
    try:
        if fused:
            d, uniform = decide_fused(s, grads, loss), True
        else:
            d, uniform = decide_host(s, grads, loss)
        try:
            if fused:
                return d, step_fused(inner, d, None)[1]
            return d, apply_host(inner, d, grads, params, s.foreach, uniform)
        except BaseException as exc:
            discard(exc)
            raise
    finally:
        torch._C._set_grad_enabled(grad_mode)


def _measure(s: WindowSettings, grads: list[Tensor]) -> tuple[Tensor, Constants, bool, float | None]:
    """Stage 2's norm of the summed gradients of ``s.divisor`` micro-batches (divided by them with
    ``reduction="mean"``), the window's :class:`Constants`, whether the gradients are uniform:
    dense, on one device, of dtypes a foreach kernel takes (measured by one, and scaled by one),
    and the norm's value where the host knows, without a sync, that the summed gradients' norm is
    beyond its range of norms (:func:`clipopt.functional.beyond`, the general close's rule; taken
    again without overflow where torch's norm overflowed; on the CPU), else None."""
    p = s.norm_type
    raw = F.foreach_total_norm(grads, p, s.foreach, check=False)
    uniform = raw is not None
    beyond = False
    if raw is None:
        raw = F.get_total_norm(grads, p, foreach=s.foreach)  # (taken again inside where it overflowed)
        beyond = F.beyond_range(raw, p, grads=grads)
    elif F.host_reads(raw):
        value = _cpu_value(raw)  # foreach_total_norm's check: the one read, the general close's rule
        if value == math.inf:
            raw = F.finite_total(raw, grads, p, overflow=True)
            beyond = F.beyond_range(raw, p, grads=grads)
        else:  # a finite norm at the range's limit (a 0-d gradient of 3e19: |g| is not squared)
            beyond = F.beyond(value, p, grads)
    c = constants(raw, s.max_norm, s.divisor)
    total = raw.div(c.divisor) if s.divisor != 1.0 else raw
    return total, c, uniform, _cpu_value(total) if beyond else None


def unbounded(s: WindowSettings, norm: float, grads: list[Tensor]) -> bool:
    """Whether a window of ``grads`` whose norm of summed gradients is beyond their range of norms
    (``norm``: divided by the micro-batches with ``"mean"``; the range: that of
    :func:`clipopt.functional.range_dtype`) would still be beyond it once clipped by the bound
    ``s.max_norm`` (``norm * min(1, max_norm / (norm + 1e-6))``; no bound: ``norm``): then it is
    skipped."""
    applied = norm if s.max_norm is None else norm * min(1.0, s.max_norm / (norm + F.EPS))
    return F.beyond(applied, s.norm_type, grads)


def _skip_norm_overflow(d: WindowDecision, c: Constants) -> None:
    """Skip ``d`` with reason ``"norm_overflow"``: its elements are all finite (not counted as non-finite)."""
    d.skip, d.reason = torch.ones_like(d.nonfinite), NORM_OVERFLOW
    d.elements, d.host_bad, d.nonfinite_only = torch.zeros_like(c.zero), False, False


def _nonfinite(total: Tensor, c: Constants) -> Tensor:
    """1.0 (float32) where ``total`` is nan or ±inf, else 0.0: :func:`clipopt.functional.nonfinite_flag`
    with its zero as a tensor."""
    diff = total - total
    return (diff if diff.dtype == torch.float32 else diff.float()).ne_(c.zero)
