"""The update of one window: copied before the inner step, measured, bounded and applied after it.

For ``update_clip=`` and ``update_stats=``, :func:`start_update` copies the
parameters and the inner state (an :class:`~clipopt._window.rollback.InnerBackup`, into the
buffers of an :class:`~clipopt._window.update_copy.UpdateCopy` kept from window to window)
just before the inner step; :meth:`WindowUpdate.finish`, just after it, forms ``u = p_after - p_before``
on the device and

1. measures it: each tensor's L2 norm (a DTensor's over its shards, as the
   gradient norm is: :class:`~clipopt._distributed.collectives.ShardedGrads`), the norm of all
   (over pipeline stages with ``norm_group``): ``StepStats.update_norm``;
2. rejects a non-finite update from finite gradients: parameters and inner
   state are put back (a device select written into each tensor, no host read), the window is skipped
   with reason ``"nonfinite_update"`` and adds nothing to the ``z`` history, nor to a
   per-tensor policy's statistics (``ClipPolicy.take_back``);
3. bounds it (``UpdateClip``): ``p = p_after - (1 - coef) * u``, which is
   ``p_before + coef * u`` and leaves ``p_after`` bit for bit when ``coef`` is 1;
   the coefficient (the smallest with ``max_rms``; 0 for a rejected update) is
   ``StepStats.update_coef``.

No host read once the inner optimizer has state on the parameters' device
(fused and foreach optimizers after their first step): see
:meth:`~clipopt._window.rollback.InnerBackup.restore_where`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import functional as F
from .._checks import check_flag
from .._distributed.collectives import ShardedGrads, has_dtensor, reduce_norm_over
from .._inner import inner_optimizers, reevaluates
from .._policies.builtin import ClipPolicy
from .._reasons import NONFINITE_UPDATE
from .decision import WindowDecision
from .rollback import InnerBackup, local_view
from .update_clip import UpdateClip
from .update_copy import UpdateCopy

__all__ = ["WindowUpdate", "check_update_options", "start_update"]


def check_update_options(update_clip: Any, update_stats: Any, optimizer: Optimizer) -> tuple[Any, bool]:
    """``update_clip`` must be an :class:`UpdateClip` or None, ``update_stats`` a bool; an optimizer
    that re-evaluates its closure (LBFGS) cannot have its step bounded afterwards."""
    if update_clip is not None and not isinstance(update_clip, UpdateClip):
        raise TypeError(
            f"update_clip must be an UpdateClip or None, got {type(update_clip).__name__}; "
            "pass e.g. update_clip=UpdateClip(max_rms=1.0)"
        )
    check_flag("update_stats", update_stats)
    lbfgs = [type(o).__name__ for o in inner_optimizers(optimizer) if reevaluates(o)]
    if update_clip is not None and lbfgs:
        raise ValueError(
            f"update_clip={update_clip!r} cannot bound the step of {lbfgs[0]}: its line search and "
            "curvature pairs assume the step it took; pass update_clip=None "
            "(update_stats=True records the update norm)"
        )
    return update_clip, update_stats


def start_update(owner: Any, params: list[Tensor], optimizer: Optimizer, buffers: UpdateCopy) -> WindowUpdate:
    """Copy ``params`` and their inner state just before the inner step of ``optimizer``, into
    ``buffers`` (the owner's, reused from window to window).

    ``owner`` is the :class:`~clipopt.ClippedOptimizer`: its public ``update_clip``,
    ``update_stats``, ``norm_group`` and ``max_norm`` (a policy takes back a window put back) are
    read (and the first two checked: they may have been reassigned since the constructor checked
    them)."""
    clip, _ = check_update_options(owner.update_clip, owner.update_stats, optimizer)
    policy = owner.max_norm if isinstance(owner.max_norm, ClipPolicy) else None
    backup = buffers.take(optimizer, params)
    return WindowUpdate(clip, params, backup, (owner.norm_group, policy), buffers.updates)


class WindowUpdate:
    """One window's update: the copy taken before the inner step, finished after it."""

    __slots__ = ("_backup", "_clip", "_norm_group", "_params", "_policy", "_updates")

    def __init__(
        self,
        clip: UpdateClip | None,
        params: list[Tensor],
        backup: InnerBackup,
        context: tuple[Any, Any],
        updates: list[Tensor] | None = None,
    ) -> None:
        """``context``: the ``norm_group`` (pipeline stages) and the clipping policy (or None)."""
        self._clip, self._params, self._backup = clip, params, backup
        self._norm_group, self._policy = context
        self._updates = updates  # buffers to write the update into (else it is made anew)

    def _update(self, now: list[Tensor], before: list[Tensor]) -> list[Tensor]:
        """``u = now - before``, written into the buffers when there are (one pass, no new tensor)."""
        if self._updates is None:
            return list(torch._foreach_sub(now, before))
        for u, a, b in zip(self._updates, now, before, strict=True):
            torch.sub(a, b, out=u)
        return self._updates

    def _norms(self, updates: Sequence[Tensor]) -> Tensor:
        """Each tensor's update norm (float32, a DTensor's over its shards)."""
        if has_dtensor(self._params):
            return ShardedGrads(self._params).norms(updates, 2.0, None).to(torch.float32)
        return F.get_norms(updates, 2.0).to(torch.float32)

    @torch.no_grad()
    def finish(self, d: WindowDecision, skipped: bool | Tensor) -> Tensor:
        """Measure, reject or bound the update the inner step made; returns the window's outcome
        (a 0/1 device flag: skipped before, or now for a non-finite update) and sets
        ``d.update_norm``, ``d.update_coef`` and, for a rejected update, ``d.reason``."""
        now = [local_view(p) for p in self._params]
        before = [local_view(v) for v in self._backup.values]
        updates = self._update(now, before)
        norms = self._norms(updates)
        total = torch.linalg.vector_norm(norms)
        if self._norm_group is not None:  # pipeline stages: every stage decides alike
            total = reduce_norm_over(total, 2.0, self._norm_group)
        bad = (~torch.isfinite(total) & (d.nonfinite == 0)).to(torch.float32)  # finite gradients only
        coef = torch.ones((), dtype=torch.float32, device=total.device)
        if self._clip is not None:
            coef = self._clip.coefficients(norms, [p.numel() for p in self._params], total)
            shrink = 1.0 - coef  # float32: a 0-d tensor scales every dtype as a scalar would
            torch._foreach_mul_(updates, list(shrink.unbind()) if self._clip.per_tensor else shrink)
            torch._foreach_sub_(now, updates)
        self._backup.restore_where(bad)  # parameters and state, where the update is rejected
        on = bad > 0
        if self._policy is not None:  # its statistics as they were before the window, too
            self._policy.take_back(bad)
        outcome = _as_flag(skipped, total.device)
        outcome = torch.maximum(outcome, bad)
        reason = d.reason
        if not isinstance(reason, Tensor):  # decided on the host: a fill, no host-to-device copy
            reason = torch.full((), reason, dtype=torch.int64, device=total.device)
        d.reason = torch.where(on, NONFINITE_UPDATE, reason)
        d.nonfinite_only = False  # the outcome is no longer the gradients' flag alone
        d.update_norm = total
        d.update_coef = torch.where(on, 0.0, coef.min())
        if self._clip is not None:  # a non-finite norm (skip_nonfinite=False) never enters the history
            self._clip.commit(total, (1.0 - outcome) * torch.isfinite(total))
        return outcome


def _as_flag(skipped: bool | Tensor, device: torch.device) -> Tensor:
    """The outcome as a 0/1 float32 flag on ``device``, made there (no host-to-device copy)."""
    if isinstance(skipped, Tensor):
        return skipped.to(device, torch.float32)
    return torch.full((), float(skipped), dtype=torch.float32, device=device)
