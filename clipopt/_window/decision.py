"""One decision per window, taken on the device: :class:`WindowDecision` and its reason codes.

The stages of a window's close (docs/design.md, 'Order of operations') fill one record:

* stage 2 (measure): :func:`clipopt._window.stages.measure` (:func:`measured_groups` with
  per-group options) and :func:`clipopt._window.stages.agree` set ``total_norm``, ``nonfinite``
  and (data parallelism) ``divergence``;
* stage 4 (clip): :func:`clip_` (:func:`clip_groups_`): value clipping, then the norm
  bound or a policy's: ``max_norm``, ``coef``, ``scale``, ``clipped``;
* stage 5 (decide): :func:`decide_skip`: the skip signals, in priority order, give
  ``skip`` and the ``reason`` code, both on the device.

Everything after reads the record: the fused step (``skip`` is its
``found_inf``), the host step, the counters, :class:`~clipopt.StepStats`,
the loggers and the snapshots.  The reason is an int64 code until read
(the table of :mod:`clipopt._reasons` maps it to its name; docs/design.md,
'Reasons').  The spike rule of a :class:`~clipopt.ClipPolicy` is asked only
here (:func:`policy_spike`,
:func:`spike_rule`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import Tensor

from .. import functional as F
from .._reasons import (
    DIVERGENCE,
    NO_REASON,
    NOGRAD,
    NONFINITE,
    NORM_OVERFLOW,
    OVERFLOW,
    REASONS,
    SPIKE,
    name_of,
)

if TYPE_CHECKING:
    from .._policies.builtin import ClipPolicy
    from .._policies.kinds import PolicyWindow
    from .groups import GroupPlan

__all__ = [
    "NONFINITE_CODES",
    "SkipSignal",
    "SkipSource",
    "WindowDecision",
    "clip_",
    "clip_groups_",
    "decide_skip",
    "measured_groups",
    "policy_spike",
    "read_anomaly",
    "spike_rule",
]

#: The codes of the reasons that count as non-finite skips (``max_consecutive_nonfinite``'s run).
NONFINITE_CODES: tuple[int, ...] = tuple(r.code for r in REASONS if r.nonfinite)


class SkipSignal(NamedTuple):
    """One reason to skip a window: ``flag`` is 1.0 (skip) or 0.0 on the device, None when off."""

    code: int
    flag: Tensor | None


class SkipSource(Protocol):
    """An extra skip signal (extension point: ``SpikeGuard``, a rewind; see ARCHITECTURE.md).

    ``flag(d)`` is called once per window, after clipping, with the window's
    decision so far; it returns a 0/1 float tensor on the device (never read on
    the host) or None (no opinion).  Its ``code`` is the reason recorded when it
    is the first signal that skips the window.
    """

    code: int

    def flag(self, d: WindowDecision) -> Tensor | None: ...


class WindowDecision:
    """What was measured and decided for one window; filled by the stages in order, read by all."""

    __slots__ = (
        "bounded",
        "clipped",
        "coef",
        "divergence",
        "elements",
        "grad_scale",
        "group_coefs",
        "group_norms",
        "group_scales",
        "host_bad",
        "loss",
        "max_norm",
        "nonfinite",
        "nonfinite_only",
        "reason",
        "scale",
        "shared_norm",
        "skip",
        "total_norm",
        "unfolded",
        "update_coef",
        "update_norm",
    )

    def __init__(self, total_norm: Tensor, nonfinite: Tensor, divergence: Tensor | None = None) -> None:
        #: Pre-clip norm of the combined gradient (float32): the recorded ``total_norm``.
        self.total_norm = total_norm
        #: 1.0 when ``total_norm`` is not finite, else 0.0 (the one non-finite marker).
        self.nonfinite = nonfinite
        #: 1.0 when data-parallel replicas disagreed (_distributed/replicas.py), None without agreement.
        self.divergence = divergence
        #: 1.0 when some gradient element is nan/inf, 0.0 when all are finite (the norm may still have
        #: overflowed); None when the elements were not looked at (``nonfinite`` stands for it).
        self.elements: Tensor | None = None
        #: :meth:`bad_elements` as already read on the host (with the skip flag), else None.
        self.host_bad: bool | None = None
        #: The norm bound of this window (a policy's threshold), or None when norm clipping is off.
        self.max_norm: float | Tensor | None = None
        #: Norm-clipping coefficient ``min(1, max_norm / (norm + 1e-6))`` (1.0: off; None: when read).
        self.coef: float | Tensor | None = 1.0
        #: What still multiplies the gradients: ``coef`` / micro-batches (``mean``) or ``coef``.
        self.scale: float | Tensor = 1.0
        #: What a fused kernel divides the gradients by, set directly (plain window), else None.
        self.grad_scale: Tensor | None = None
        #: (norm, bound, micro-batches) of :func:`clip_`: the fused ``grad_scale`` (_window/coefficient.py).
        self.bounded: tuple[Tensor, float | Tensor | None, float] | None = None
        #: Whether clipping (value, norm or unit-wise) changed the gradient; None: ``coef < 1``, when read.
        self.clipped: bool | Tensor | None = False
        #: 1.0 when the window is skipped; None: no skip signal is on (the host knows: never skipped).
        self.skip: Tensor | None = None
        #: Why it is skipped: a code of :mod:`clipopt._reasons` (int64 tensor, or an int), NO_REASON where
        #: not skipped; a plain window's (``_window.plain``) is its one signal's code, read where it skips.
        self.reason: int | Tensor = NO_REASON
        #: True when ``nonfinite`` is the only skip signal (a skip is then a non-finite one).
        self.nonfinite_only = True
        #: The window's combined loss (0-d tensor), a float, or None when no loss was given.
        self.loss: Tensor | float | None = None
        # Per-group clipping (a group's own 'max_norm'/'clip_value'); all None when one bound clips all.
        #: Each group's pre-clip norm (1-d, one entry per parameter group, like ``total_norm``).
        self.group_norms: Tensor | None = None
        #: Each group's norm-clipping coefficient: the common ``coef`` for the groups sharing the
        #: wrapper's bound, their own for the others (1.0 for a group left out).
        self.group_coefs: Tensor | None = None
        #: What multiplies each group's gradients (its coefficient / micro-batches).
        self.group_scales: Tensor | None = None
        #: The groups whose gradients ``scale`` does not cover (their own bound, or left out): a fused
        #: kernel folds ``scale`` into its one ``grad_scale``, so these take an extra pass first.
        self.unfolded: tuple[int, ...] = ()
        #: The common pre-clip norm of the groups sharing the wrapper's bound (``nan`` when the window
        #: is not finite): what a policy sees.  None without per-group clipping (it sees ``total_norm``).
        self.shared_norm: Tensor | None = None
        #: The update's norm before clipping and the coefficient applied (``update_clip``/``update_stats``).
        self.update_norm: Tensor | None = None
        self.update_coef: Tensor | None = None

    @classmethod
    def empty(
        cls, device: torch.device | None, max_norm: float | None, reason: int = NOGRAD
    ) -> WindowDecision:
        """A window skipped on the host before it was measured: no parameter has a gradient
        (reason ``"nograd"``), or a rewind discarded it (``"rewind"``)."""
        zero = torch.zeros((), dtype=torch.float32, device=device)
        d = cls(zero, zero)
        d.max_norm, d.reason, d.nonfinite_only = max_norm, reason, False
        return d

    def skipped_as_nonfinite(self, code: int) -> None:
        """The host found the window non-finite after the device decided (a closure's re-evaluation)."""
        self.nonfinite = torch.ones_like(self.nonfinite)
        self.elements, self.host_bad = None, True
        self.reason = code

    def bad_elements(self) -> Tensor:
        """1.0 when the window's gradients hold a nan/inf element (as far as known: ``nonfinite``
        when the elements were not looked at)."""
        return self.nonfinite if self.elements is None else self.elements

    def checked_elements(self, elements: Tensor) -> None:
        """The elements were looked at after the skip was decided (``elements``: 1.0 when one is
        nan/inf): a non-finite skip whose elements are all finite gets reason ``"norm_overflow"``
        (on the device) and no longer counts as non-finite."""
        self.elements = elements.to(self.nonfinite.dtype)
        finite = self.elements == 0
        reason = self.reason
        if isinstance(reason, Tensor):
            self.reason = torch.where(_nonfinite_code(reason) & finite, NORM_OVERFLOW, reason)
        elif reason in NONFINITE_CODES:
            self.reason = torch.where(finite, NORM_OVERFLOW, reason)
        self.nonfinite_only = False

    def counted_nonfinite(self, skipped: bool | Tensor, enabled: bool) -> bool | Tensor:
        """Whether the skip extends the run of non-finite skips (``max_consecutive_nonfinite``).

        ``skipped`` is the outcome (a bool read on the host, or the device flag).
        The non-finite flag is never read here: after a host-decided skip whose
        cause the host does not know, it is returned as the device flag (the
        counters then count on the device, as on the fused path).
        """
        if self.nonfinite_only:
            return skipped
        bad = self.bad_elements()
        if isinstance(skipped, bool):
            if not (skipped and enabled):
                return False
            return self.host_bad if self.host_bad is not None else bad  # unknown: counted on the device
        return bad if enabled else torch.zeros_like(bad)


def _nonfinite_code(reason: Tensor) -> Tensor:
    """True on the device where ``reason`` is the code of a non-finite reason."""
    hit = reason == NONFINITE_CODES[0]
    for code in NONFINITE_CODES[1:]:
        hit = hit | (reason == code)
    return hit


def decide_skip(d: WindowDecision, signals: Sequence[SkipSignal]) -> None:
    """``skip`` and ``reason`` from the signals, first (highest priority) first; on the device.

    ``skip`` is the maximum of the flags that are on; ``reason`` the code of the
    first of them that is 1.0.  With no signal on, ``skip`` stays None.
    """
    active = [(s.code, s.flag) for s in signals if s.flag is not None]
    d.nonfinite_only = all(code in NONFINITE_CODES for code, _ in active)  # a skip is non-finite
    skip: Tensor | None = None
    reason: int | Tensor = NO_REASON
    for code, flag in reversed(active):
        if skip is None:  # the last signal: its code where it is on, else NO_REASON (0): no where()
            # (the window's own non-finite flag is exactly 0.0 or 1.0: converted as it is)
            hit = (flag if flag is d.nonfinite else flag > 0).to(torch.int64)
            reason = hit if code == 1 else hit * code
        else:
            reason = torch.where(flag > 0, code, reason)
        skip = flag if skip is None else torch.maximum(flag, skip)
    d.skip, d.reason = skip, reason


def policy_spike(policy: ClipPolicy | None) -> Tensor | None:
    """A policy's skip signal for the window its ``threshold()`` just saw (reason ``"spike"``)."""
    return None if policy is None else policy.spike()


def spike_rule(policy: ClipPolicy | None, total_norm: Tensor) -> Tensor | None:
    """1.0 when a window with this norm is a spike by the policy's current statistics (pure), else None
    for policies without a spike rule; decides a snapshot with reason ``"spike"``."""
    return None if policy is None else policy.is_spike(total_norm)


def read_anomaly(
    d: WindowDecision,
    policy: ClipPolicy | None,
    with_divergence: bool,
    overflow: bool,
    guard_spike: Tensor | None = None,
) -> tuple[bool, str | None]:
    """For diagnostics (one host read): whether the window is non-finite, and what makes it an anomaly
    worth a snapshot: ``"nonfinite"`` (``"overflow"`` with a scaler: GradScaler's normal
    operation, or a fault; :func:`clipopt.replay` tells them apart), else ``"divergence"``
    (with ``with_divergence``), else ``"spike"`` by the policy's spike rule
    (:func:`spike_rule`; asked whether or not spikes are skipped) or by ``guard_spike``
    (a SpikeGuard's rule, 0/1), else None.
    """
    spike = spike_rule(policy, d.total_norm if d.shared_norm is None else d.shared_norm)
    if guard_spike is not None:
        spike = guard_spike if spike is None else torch.maximum(spike.to(guard_spike.dtype), guard_spike)
    divergence = d.divergence if with_divergence else None
    flags = [d.nonfinite] + [t.to(d.nonfinite.dtype) for t in (divergence, spike) if t is not None]
    values = [v > 0 for v in torch.stack(flags).tolist()] if len(flags) > 1 else [bool(d.nonfinite.item())]
    bad = values[0]
    diverged = divergence is not None and values[1]
    spiked = spike is not None and values[-1]
    if bad:
        return True, name_of(OVERFLOW if overflow else NONFINITE)
    return False, name_of(DIVERGENCE if diverged else SPIKE if spiked else NO_REASON)


def clip_(
    d: WindowDecision,
    grads: list[Tensor],
    window: PolicyWindow | None,
    *,
    clip_value: float | None,
    divisor: float,
    foreach: bool | None,
    norm_of: Callable[[list[Tensor]], Tensor],
    policy: ClipPolicy | None,
    max_norm: float | Tensor | None,
) -> None:
    """Stage 4 (clip), on the device: value clipping, then the norm bound (``max_norm``, or the policy's).

    ``grads``: the window's summed gradients (``divisor`` micro-batches), measured by ``norm_of``
    (sharded / pipeline norms included).  A policy that clips in place (unit-wise or per-tensor)
    clips them itself from ``window``, the ``1/divisor`` included."""
    inv = 1.0 / divisor
    norm = d.total_norm
    clipped: bool | Tensor = False
    if clip_value is not None:
        # clamp(g / n, ±c) == clamp(g, ±c·n) / n: the division folds into the final scale.
        F.clip_grads_value_(grads, clip_value * divisor, foreach=foreach)
        norm = norm_of(grads) * inv
        clipped = norm < d.total_norm
    if policy is not None and policy.unitwise and window is not None:
        unit_clipped = policy.clip_window_(window)  # applies the 1/n as well
        d.clipped = unit_clipped | clipped if isinstance(clipped, Tensor) else unit_clipped
        return
    if policy is not None:
        max_norm = policy.threshold(d.total_norm)
    coef: float | Tensor = 1.0
    if max_norm is not None:
        coef = F.clip_coef(norm, max_norm)
        clipped = (coef < 1.0) | clipped if isinstance(clipped, Tensor) else coef < 1.0
    d.max_norm, d.coef, d.clipped = max_norm, coef, clipped
    d.scale, d.bounded = (coef * inv if divisor != 1.0 else coef), (norm, max_norm, divisor)


def measured_groups(
    norms: Tensor,
    sizes: Sequence[int],
    shared: Sequence[bool],
    grads: Sequence[Tensor] | None,
    *,
    norm_type: float,
    divisor: float,
) -> WindowDecision:
    """Stage 2 (measure) with per-group options, from each gradient's norm (``norms``, one read;
    ``sizes``: how many belong to each group): the total norm, each group's norm and the shared
    groups' common norm are p-norms of those, divided by ``divisor`` (micro-batches, ``mean``),
    taken so that none overflows on finite gradients (:func:`clipopt.functional.finite_group_norms`;
    ``grads``: the gradients of ``norms``, None where they are shards of a sharded norm).  A
    policy sees the common norm, ``nan`` when the window is not finite or no shared group has a
    gradient (it never enters a policy's statistics)."""
    _, raw, groups = F.finite_group_norms(norms, sizes, grads, norm_type)
    total = raw / divisor if divisor != 1.0 else raw
    d = WindowDecision(total, F.nonfinite_flag(total))
    d.group_norms = groups / divisor if divisor != 1.0 else groups
    common = F.shared_norm(d.group_norms, shared, norm_type)
    if not any(s and size for s, size in zip(shared, sizes, strict=True)):  # nothing for a policy to see
        common = torch.full_like(common, math.nan)
    d.shared_norm = torch.where(d.nonfinite > 0, math.nan, common)
    return d


def clip_groups_(
    d: WindowDecision,
    grads: Sequence[Sequence[Tensor]],
    params: Sequence[Sequence[Tensor]],
    plan: GroupPlan,
    window: PolicyWindow | None,
    *,
    norm_type: float,
    divisor: float,
    foreach: bool | None,
    norms_of: Callable[[list[Tensor]], Tensor],
    policy: ClipPolicy | None,
    max_norm: float | Tensor | None,
) -> None:
    """Stage 4 (clip) with per-group options (``plan``), on the device; ``grads``/``params`` per group.

    Value clipping takes each group's bound; the norms after it are read again only for the
    clamped groups (``norms_of``: per-tensor norms, sharded ones included).  The groups without
    their own ``max_norm`` share ``max_norm`` (or the policy's threshold, fed their common norm
    ``d.shared_norm``) and one coefficient ``d.coef``, which is ``d.scale``; a policy that clips
    in place (unit-wise or per-tensor) clips them itself, from ``window`` restricted to them.
    The other groups are listed in ``d.unfolded`` with their scale in ``d.group_scales``.
    ``d.group_norms`` (pre-clip, set when measured) must be there.
    """
    if d.group_norms is None:
        raise ValueError("clip_groups_ needs the window's group norms (d.group_norms); measure them first")
    inv = 1.0 / divisor
    post, clipped = _value_clip_groups(d.group_norms, grads, plan, norm_type, divisor, foreach, norms_of)
    d.unfolded = tuple(j for j, shared in enumerate(plan.shared) if not shared)
    if policy is not None and policy.unitwise and window is not None:
        shared_params = [p for j, ps in enumerate(params) if plan.shared[j] for p in ps]
        shared_grads = [g for j, gs in enumerate(grads) if plan.shared[j] for g in gs]
        unit = policy.clip_window_(window.restricted(shared_params, shared_grads))
        d.clipped = unit | clipped
        one = torch.ones_like(d.group_norms)
        d.group_coefs = one
        d.group_scales = torch.stack([one[j] if s else one[j] * inv for j, s in enumerate(plan.shared)])
        return  # d.coef and d.scale stay 1.0: AGC applied the 1/n itself
    if policy is not None:
        shared = d.shared_norm if d.shared_norm is not None else d.total_norm
        max_norm = policy.threshold(shared)
    if not any(s and grads[j] for j, s in enumerate(plan.shared)):
        max_norm = None  # no gradient shares the wrapper's bound this window: it bounds nothing
    coefs = F.group_clip_coefs(post, plan.bounds, plan.shared, max_norm, norm_type)
    first = next((j for j, s in enumerate(plan.shared) if s), None)
    coef: float | Tensor = coefs[first] if first is not None and max_norm is not None else 1.0
    d.max_norm, d.coef, d.group_coefs = max_norm, coef, coefs
    d.clipped = (coefs < 1.0).any() | clipped
    d.group_scales = coefs * inv if divisor != 1.0 else coefs
    d.scale = coef * inv if divisor != 1.0 else coef


def _value_clip_groups(
    pre: Tensor,
    grads: Sequence[Sequence[Tensor]],
    plan: GroupPlan,
    norm_type: float,
    divisor: float,
    foreach: bool | None,
    norms_of: Callable[[list[Tensor]], Tensor],
) -> tuple[Tensor, Tensor]:
    """Value-clip each group by its bound (``g / n`` clamped as ``g`` by ``c * n``); return the
    groups' norms after it (only the clamped groups read again) and whether any norm dropped."""
    picked = [j for j, v in enumerate(plan.clip_values) if v is not None and grads[j]]
    if not picked:
        return pre, torch.zeros((), dtype=torch.bool, device=pre.device)
    values = [None if v is None else v * divisor for v in plan.clip_values]
    F.clip_groups_value_(grads, values, foreach=foreach)
    flat = [g for j in picked for g in grads[j]]
    again = F.group_norms(norms_of(flat), [len(grads[j]) for j in picked], norm_type) / divisor
    post = list(pre.unbind())
    for slot, j in enumerate(picked):
        post[j] = again[slot].to(pre.dtype)
    after = torch.stack(post)
    return after, (after < pre).any()
