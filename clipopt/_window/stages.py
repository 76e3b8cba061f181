"""The stages of a window's close that decide on the device: measure, agree, clip and decide.

Each stage is a function of the window's :class:`~clipopt._window.settings.WindowSettings`
(read from the optimizer when the window closes) and its
:class:`~clipopt._window.grads.WindowGrads`; the optimizer calls them in the order of
docs/design.md, 'Order of operations' (``clipopt._window.runtime.Runtime._finish``) and keeps no state here.

* :func:`check_clippable` — stage 1 (combine), before anything changes: value clipping
  refuses complex gradients.
* :func:`measure` — stage 2 (measure): the pre-clip norm of the combined gradient,
  its non-finite flag (a :class:`~clipopt._window.decision.WindowDecision`) and,
  when asked, each gradient's norm as the window's candidate bad row.
* :func:`agree` — stage 2 (measure), DDP replicas: one decision on every rank.
* :func:`clip_and_decide` — stages 4-5 (clip, decide): value clipping, the norm
  bound (or the policy's), then the skip signals in priority order.
* :func:`reclip` — a closure's re-evaluation (LBFGS), measured and clipped
  with the window's own bound.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from .._diagnostics.badrow import any_nonfinite, norm_with_row, row_of_norms
from .._diagnostics.layers import LayerStats
from .._distributed.collectives import reduce_norm_over
from .._distributed.replicas import ReplicaDecision
from .._policies.kinds import PolicyWindow, policy_window
from .._reasons import DIVERGENCE, NONFINITE, NORM_OVERFLOW, OVERFLOW, SPIKE
from .._tensors import cpu_value as _cpu_value
from .decision import (
    SkipSignal,
    SkipSource,
    WindowDecision,
    clip_,
    clip_groups_,
    decide_skip,
    measured_groups,
    policy_spike,
)
from .grads import WindowGrads
from .settings import WindowSettings

__all__ = ["agree", "check_clippable", "clip_and_decide", "measure", "reclip"]


def check_clippable(s: WindowSettings, g: WindowGrads) -> None:
    """Raise before anything is measured, saved or clamped when a value bound meets complex gradients."""
    if s.plan is not None and s.plan.any_value_clipping:
        for group, value in zip(g.by_group, s.plan.clip_values, strict=True):
            if value is not None:
                F.check_value_clippable(group)
    elif s.plan is None and s.clip_value is not None:
        F.check_value_clippable(g.grads)


def measure(
    s: WindowSettings, g: WindowGrads, names: list[str] | None
) -> tuple[WindowDecision, LayerStats | None]:
    """Stage 2 (measure): the pre-clip norm of the combined gradient and its non-finite flag.

    Given the parameters' ``names`` (per-layer rows are logged), the same pass keeps each
    gradient's norm as the window's candidate bad row (see :mod:`clipopt._diagnostics.badrow`).  With
    per-group options the groups' norms come from the same per-gradient norms.
    """
    inv = 1.0 / s.divisor
    if s.plan is not None:
        norms = g.norms(g.grads, s.norm_type, s.foreach)
        row = None
        if names is not None:
            row = row_of_norms(norms, g.grads, g.params, names, norm_type=s.norm_type, inv=inv)
        sizes = [len(group) for group in g.by_group]
        local = None if g.shards is not None else g.grads  # a sharded norm's shards: not rescued here
        d = measured_groups(norms, sizes, s.plan.shared, local, norm_type=s.norm_type, divisor=s.divisor)
        if row is not None:
            d.elements = any_nonfinite(row)
        return d, row
    row = None
    if names is not None:
        raw_norm, row = norm_with_row(
            g.grads, g.params, names, norm_type=s.norm_type, foreach=s.foreach, inv=inv
        )
        if s.norm_group is not None:  # pipeline stages: the norm of all of them (the row stays local)
            raw_norm = reduce_norm_over(raw_norm, s.norm_type, s.norm_group)
    else:
        raw_norm = g.total_norm(g.grads, s.norm_type, s.foreach, s.norm_group)
    total_norm = raw_norm / s.divisor if s.divisor != 1.0 else raw_norm
    d = WindowDecision(total_norm, F.nonfinite_flag(total_norm))
    if row is not None and s.norm_group is None:  # the row looked at the elements (of this stage only)
        d.elements = any_nonfinite(row)
    return d, row


def agree(
    replicas: ReplicaDecision,
    d: WindowDecision,
    n: int,
    window: int,
    loss: Tensor | float | None,
    *,
    watch_loss: bool,
    sharded: bool,
) -> tuple[WindowDecision, Tensor | None]:
    """DDP replicas: one decision on every rank (one scalar collective), with their divergence
    (FSDP2: the ranks' check that rode in the norm's reduction, as the divergence).

    When a SpikeGuard watches the loss (``watch_loss``), the largest window ``loss`` over the
    ranks comes from the same collective (FSDP2, ``sharded``: from one scalar all-reduce of its
    own), so every rank scores the same value; it is returned beside the decision, else None.
    """
    if replicas.active and sharded:  # FSDP2: the ranks' check rode in the norm's reduction
        d.divergence = replicas.divergence  # their counters or settings differ: skip on every rank
        return d, replicas.agree_loss(loss, d.total_norm.device) if watch_loss else None
    if not replicas.active:
        return d, None
    shared = loss if watch_loss else None
    norm, nonfinite = replicas.agree(d.total_norm, d.nonfinite, n, window, shared)
    agreed = WindowDecision(norm, nonfinite, replicas.divergence)
    if d.shared_norm is not None:  # per-group clipping: a policy sees no window some rank found bad
        agreed.group_norms = d.group_norms
        agreed.shared_norm = torch.where(nonfinite > 0, math.nan, d.shared_norm)
    return agreed, replicas.agreed_loss if shared is not None else None


def clip_and_decide(
    s: WindowSettings,
    d: WindowDecision,
    g: WindowGrads,
    param_groups: list[dict[str, Any]],
    sources: Sequence[SkipSource] = (),
    reevaluated: tuple[float | Tensor | None] | None = None,
) -> None:
    """Stages 4-5 (clip, decide), all on the device (see :mod:`clipopt._window.decision`).

    ``reevaluated=(max_norm,)``: a closure's re-evaluation, clipped with the window's own bound;
    a global-norm policy and the window-level skip signals (``sources`` among them) saw the
    window once already.  With per-group options each group is clipped by its own bound or
    with the others sharing the wrapper's (``clip_groups_``).
    """
    policy = s.policy if reevaluated is None or s.unitwise else None  # in place: clips every evaluation
    max_norm = s.max_norm if reevaluated is None else reevaluated[0]
    # finite, but beyond the gradients' range of norms (functional.range_dtype; taken again without
    # overflow where torch's norm overflowed: the CPU only, no sync)
    beyond = reevaluated is None and s.skip_enabled
    beyond = beyond and F.beyond_range(d.total_norm, s.norm_type, s.divisor, grads=g.grads)
    saved = dict(vars(policy)) if beyond and policy is not None else None
    window = _policy_window(s, d, g, reevaluated is None) if policy is not None and policy.unitwise else None
    _clip(s, d, g, param_groups, window, policy, max_norm)
    overflow = _unbounded(s, d, g, policy) if beyond else None
    decide_skip(d, _signals(s, d, policy, sources if reevaluated is None else None, overflow))
    if window is not None and policy is not None:  # a skipped window: its statistics as they were
        policy.settle(d.skip)
    if saved is not None and overflow is not None and _cpu_value(overflow) > 0:
        vars(policy).clear()  # skipped as "norm_overflow": the policy as if it never saw the window
        vars(policy).update(saved)


def _clip(
    s: WindowSettings,
    d: WindowDecision,
    g: WindowGrads,
    param_groups: list[dict[str, Any]],
    window: PolicyWindow | None,
    policy: Any,
    max_norm: float | Tensor | None,
) -> None:
    """Stage 4 (clip): :func:`clip_groups_` with per-group options, else :func:`clip_`."""
    if s.plan is not None:
        clip_groups_(
            d,
            g.by_group,
            [group["params"] for group in param_groups],
            s.plan,
            window,
            norm_type=s.norm_type,
            divisor=s.divisor,
            foreach=s.foreach,
            norms_of=functools.partial(g.norms, norm_type=s.norm_type, foreach=s.foreach),
            policy=policy,
            max_norm=max_norm,
        )
    else:
        norm_of = functools.partial(
            g.total_norm, norm_type=s.norm_type, foreach=s.foreach, norm_group=s.norm_group
        )
        clip_(
            d,
            g.grads,
            window,
            clip_value=s.clip_value,
            divisor=s.divisor,
            foreach=s.foreach,
            norm_of=norm_of,
            policy=policy,
            max_norm=max_norm,
        )


def _unbounded(s: WindowSettings, d: WindowDecision, g: WindowGrads, policy: Any) -> Tensor:
    """1.0 (float32) when a window whose norm is beyond its gradients' range of norms
    (:func:`clipopt.functional.norm_range` in :func:`~clipopt.functional.range_dtype`) is still
    beyond it once clipped: the norm of the gradients the inner step would take (as clipped in
    place, times what still multiplies them; one more pass over them, for such a window only) -- or
    when ``policy`` cannot take such a norm into its statistics (``ClipPolicy.takes_beyond_range``).
    Then it is skipped, reason ``"norm_overflow"``, as before #35."""
    p = s.norm_type
    if d.group_scales is not None:
        sizes = [len(group) for group in g.by_group]
        groups = F.group_norms(g.norms(g.grads, p, s.foreach), sizes, p).double()
        applied = F.finite_norm_of(groups * d.group_scales.double(), p)
    else:
        applied = g.total_norm(g.grads, p, s.foreach, s.norm_group).double() * d.scale
    flag = applied >= F.norm_range(p, F.range_dtype(g.grads))
    if policy is not None and not policy.takes_beyond_range:
        flag = torch.ones_like(flag)
    return flag.to(torch.float32)


def _policy_window(s: WindowSettings, d: WindowDecision, g: WindowGrads, update: bool) -> PolicyWindow:
    """What a policy that clips in place (unit-wise, per-tensor) sees of the window (``update``:
    not a closure's re-evaluation)."""
    return policy_window(
        g.params,
        g.grads,
        keys=g.keys,
        divisor=s.divisor,
        norms=lambda grads, p: g.norms(list(grads), p, s.foreach),
        norm_group=s.norm_group,
        flags=(d.nonfinite, d.divergence),
        update=update,
    )


def _signals(
    s: WindowSettings,
    d: WindowDecision,
    policy: Any,
    sources: Sequence[SkipSource] | None,
    overflow: Tensor | None = None,
) -> list[SkipSignal]:
    """The skip signals in priority order: divergence, non-finite (or overflow), a norm beyond
    float32's range that clipping left beyond it (``overflow``, :func:`_unbounded`), the policy's
    spike, the extra sources; only the non-finite one for a closure's re-evaluation (``sources``
    None)."""
    bad = _nonfinite_signals(s, d)
    if sources is None:
        return bad
    spike = SkipSignal(SPIKE, policy_spike(None if s.unitwise else policy))
    return [
        SkipSignal(DIVERGENCE, d.divergence),
        *bad,
        *([] if overflow is None else [SkipSignal(NORM_OVERFLOW, overflow)]),
        spike,
        *[SkipSignal(x.code, x.flag(d)) for x in sources],
    ]


def _nonfinite_signals(s: WindowSettings, d: WindowDecision) -> list[SkipSignal]:
    """The window's norm is not finite: non-finite gradients (``"overflow"`` with a GradScaler), or,
    where the elements were looked at (``d.elements``) and are all finite, a norm beyond float32's
    range (``"norm_overflow"``; a smaller one was taken without overflow where the host could look:
    :func:`clipopt.functional.finite_total`); skipped alike, but only the former counts as
    non-finite."""
    code = OVERFLOW if s.scaled else NONFINITE
    if not s.skip_enabled:
        return [SkipSignal(code, None)]
    if d.elements is None:
        return [SkipSignal(code, d.nonfinite)]
    return [
        SkipSignal(code, d.nonfinite * d.elements),
        SkipSignal(NORM_OVERFLOW, d.nonfinite * (1 - d.elements)),
    ]


def reclip(
    s: WindowSettings, g: WindowGrads, param_groups: list[dict[str, Any]], max_norm: float | Tensor | None
) -> tuple[Tensor, list[Tensor]]:
    """A closure's re-evaluation: measured and clipped with the window's bound ``max_norm``, then
    scaled; returns its non-finite flag and the gradients."""
    d, _ = measure(s, g, None)
    clip_and_decide(s, d, g, param_groups, reevaluated=(max_norm,))
    if d.group_scales is not None:
        F.scale_groups_(g.by_group, d.group_scales, foreach=s.foreach)
    elif isinstance(d.scale, Tensor) or d.scale != 1.0:
        F.scale_grads_(g.grads, d.scale, foreach=s.foreach)
    return d.nonfinite, g.grads
