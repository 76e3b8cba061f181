"""The update of one window: copied before the inner step, measured, bounded and applied after it.

For ``update_clip=`` and ``update_stats=``, :func:`start_update` copies the
parameters (with ``UpdateClip(..., restore_state=True)`` also the inner state: an
:class:`~clipopt._window.rollback.InnerBackup`, into the buffers of an
:class:`~clipopt._window.update_copy.UpdateCopy` kept from window to window) just
before the inner step; :meth:`WindowUpdate.finish`, just after it, takes the update
``u = p_after - p_before`` on the device and

1. measures it: each tensor's L2 norm, piece by piece on the CPU (each piece's
   difference in a scratch buffer that stays in the core's cache: the update is never
   written to memory), tensor by tensor elsewhere (a DTensor's over its shards, as the
   gradient norm is: :class:`~clipopt._distributed.collectives.ShardedGrads`), and the
   norm of all (over pipeline stages with ``norm_group``): ``StepStats.update_norm``, which
   cannot overflow on a finite update (on the CPU, the gradient norm's rule:
   :func:`clipopt.functional.finite_group_norms`);
2. rejects a non-finite update from finite gradients -- or one whose float32 norm overflowed
   and that the bound leaves beyond its range of norms (1.8e19 unless every parameter is
   float64; known on the CPU only: the gradient norm's rule, #35) --, alike on every rank (under DDP an
   ``all_reduce(MAX)`` of the flag, on the device; FSDP2 and pipeline stages share the
   norm already): the parameters are put back (the inner state too with
   ``restore_state=True``), the window is skipped with reason ``"nonfinite_update"`` and
   adds nothing to the ``z`` history, nor to a per-tensor policy's statistics
   (``ClipPolicy.take_back``);
3. bounds it (``UpdateClip``): ``p = lerp(p_after, p_before, 1 - coef)``, which is
   ``p_before + coef * u`` and leaves ``p_after`` as it is when ``coef`` is 1; the
   coefficient (the smallest with ``max_rms``; 0 for a rejected update) is
   ``StepStats.update_coef``.

The bound and the put-back are one pass over the parameters.  On the CPU the
decision is read on the host (:func:`~clipopt._tensors.cpu_values`: there is no
device to wait for): a rejected update is copied back, a tensor whose coefficient
is 1 is not touched.  On an accelerator nothing is read: the bound is a ``lerp`` with
the coefficient on the device, then a select (``torch.where``) puts the parameters
back where the update was rejected (:meth:`~clipopt._window.rollback.InnerBackup.restore_where`;
with ``restore_state=True`` the first update of a parameter, which creates its state,
reads the flag once: putting it back means removing that state).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import functional as F
from .._checks import check_flag
from .._distributed.collectives import ShardedGrads, has_dtensor, reduce_norm_over
from .._part import Part, Window
from .._policies.builtin import ClipPolicy
from .._reasons import NONFINITE_UPDATE
from .._tensors import cpu_values
from .decision import WindowDecision
from .rollback import InnerBackup, local_view
from .update_copy import UpdateCopy

__all__ = ["HOST_DECIDED", "PIECE_NUMEL", "UpdateStats", "UpdateWork", "WindowUpdate", "start_update"]

#: Device types whose update is decided on the host (reading a flag there waits for nothing).
HOST_DECIDED = frozenset({"cpu"})

#: On the CPU, a tensor's update norm is taken over pieces of this many elements: each piece's
#: difference goes into a scratch buffer small enough to stay in the core's cache.
PIECE_NUMEL = 1 << 16


class Bound(Protocol):
    """What bounds an update (:class:`~clipopt._window.update_clip.UpdateClip`, which imports this
    module)."""

    restore_state: bool

    def coefficients(self, norms: Tensor, numels: Sequence[int], total: Tensor) -> Tensor: ...

    def remember(self, total: Tensor, applied: Tensor) -> None: ...


def start_update(
    clip: Bound | None,
    params: list[Tensor],
    optimizer: Optimizer,
    parts: tuple[UpdateCopy, tuple[Any] | None],
    window: tuple[Any, ClipPolicy | None],
) -> WindowUpdate:
    """Copy ``params`` (and, with ``clip`` an ``UpdateClip(restore_state=True)``, their inner
    state) just before the inner step of ``optimizer``, into the buffers of ``parts`` (the
    :class:`UpdateCopy` reused from window to window, and ``(group,)``, the DDP replicas' process
    group (None: the default one), or None without replicas: the ranks agree on a rejected
    update).  ``window``: the pipeline stages' ``norm_group`` and the window's policy (it takes back
    a window put back)."""
    buffers, replicas = parts
    backup = buffers.take(optimizer, params, clip is not None and clip.restore_state)
    agree = replicas if replicas is not None and not has_dtensor(params) else None
    return WindowUpdate(clip, params, backup, (*window, agree), buffers.scratch)


class UpdateWork:
    """What :class:`~clipopt._window.update_clip.UpdateClip` and :class:`UpdateStats` share
    (:attr:`~clipopt._part.Part.shares`): the copy's buffers (:class:`UpdateCopy`, kept from
    window to window while one of them is on, dropped with it when both are off) and the window's
    update from the inner step's start to its end.  The first of them in the registry's order
    (``UpdateClip``) starts and finishes it, the other finds it done: with both on the update is
    copied and measured once.  Copying it (the wrapper's ``deepcopy``, pickling) copies nothing."""

    __slots__ = ("_started", "_update", "copy")

    def __init__(self) -> None:
        self.copy = UpdateCopy()  #: the buffers
        self._update: WindowUpdate | None = None  # started, not finished
        self._started: weakref.ref[Window] | None = None  # the window it was started for

    def __reduce__(self) -> tuple[type[UpdateWork], tuple[()]]:
        return UpdateWork, ()

    def start(self, clip: Bound | None, w: Window) -> None:
        """Just before the inner step of window ``w``: copy what the update is taken from (once per
        window: a second call for the same window does nothing)."""
        if self._started is not None and self._started() is w:
            return
        s = w.settings
        agree = (w.replica_group,) if w.replicated else None
        self._update = start_update(clip, w.params, w.inner, (self.copy, agree), (s.norm_group, s.policy))
        self._started = weakref.ref(w)

    def finish(self, w: Window, d: WindowDecision, skipped: bool | Tensor) -> bool | Tensor:
        """Just after the inner step of window ``w``: the update measured, bounded or put back
        (:meth:`WindowUpdate.finish`), once; the window's outcome."""
        update, self._update = self._update, None
        if update is None or self._started is None or self._started() is not w:
            return skipped
        return update.finish(d, skipped)


class UpdateStats(Part):
    """``update_stats=True``: the update's norm recorded (``StepStats.update_norm``) without a bound,
    from the same copy as :class:`~clipopt._window.update_clip.UpdateClip`'s (a non-finite update
    from finite gradients is put back, reason ``"nonfinite_update"``)."""

    keyword = "update_stats"
    off = False
    shares = UpdateWork

    @classmethod
    def build(cls, value: Any, inner: Optimizer) -> UpdateStats | None:
        """A bool (``TypeError`` otherwise); None when False."""
        return cls() if check_flag(cls.keyword, value) else None

    def value(self) -> bool:
        return True

    def settings(self) -> dict[str, object]:
        return {}

    def before_step(self, w: Window, d: Any) -> None:
        w.shared[UpdateWork].start(None, w)

    def after_step(self, w: Window, d: Any, skipped: bool | Tensor) -> bool | Tensor:
        out: bool | Tensor = w.shared[UpdateWork].finish(w, d, skipped)
        return out


def _piece_norm(a: Tensor, b: Tensor, scratch: Tensor) -> Tensor:
    """``||a - b||`` of two contiguous CPU tensors, piece by piece through ``scratch`` (float32, or
    float64 for float64 tensors)."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    pieces = zip(torch.split(a.view(-1), PIECE_NUMEL), torch.split(b.view(-1), PIECE_NUMEL), strict=True)
    norms = [
        torch.linalg.vector_norm(torch.sub(x, y, out=scratch[: x.numel()]), dtype=acc) for x, y in pieces
    ]
    total: Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


def update_norms(
    now: Sequence[Tensor], before: Sequence[Tensor], scratch: Callable[[torch.dtype, int], Tensor]
) -> Tensor:
    """Each tensor's ``||now - before||`` (float32), without holding the whole update: large real
    CPU tensors piece by piece (:data:`PIECE_NUMEL`, through ``scratch(dtype, numel)``, a kept
    buffer), other large tensors one at a time, the small ones together (``_foreach_sub``,
    :func:`clipopt.functional.get_norms`)."""
    found: list[Tensor | None] = [None] * len(now)
    small: list[int] = []
    for i, (a, b) in enumerate(zip(now, before, strict=True)):
        if a.numel() <= PIECE_NUMEL or a.is_complex() or not (a.is_contiguous() and b.is_contiguous()):
            small.append(i)
        elif a.device.type == "cpu" and a.dtype.is_floating_point:
            found[i] = _piece_norm(a, b, scratch(a.dtype, PIECE_NUMEL))
        else:
            found[i] = F.get_norms([a - b])[0]
    if small:
        diffs = torch._foreach_sub([now[i] for i in small], [before[i] for i in small])
        for i, n in zip(small, F.get_norms(diffs), strict=True):
            found[i] = n
    device = now[0].device
    return torch.stack([n.to(device, torch.float32) for n in found if n is not None])


class WindowUpdate:
    """One window's update: the copy taken before the inner step, finished after it."""

    __slots__ = ("_agree", "_backup", "_clip", "_norm_group", "_params", "_policy", "_scratch")

    def __init__(
        self,
        clip: Bound | None,
        params: list[Tensor],
        backup: InnerBackup,
        context: tuple[Any, Any, tuple[Any] | None],
        scratch: Callable[[torch.dtype, int], Tensor],
    ) -> None:
        """``context``: the ``norm_group`` (pipeline stages), the clipping policy (or None), and
        ``(group,)`` for DDP replicas that agree on a rejected update (None: no agreement needed);
        ``scratch(dtype, numel)``: a kept CPU buffer for the update's pieces."""
        self._clip, self._params, self._backup = clip, params, backup
        self._norm_group, self._policy, self._agree = context
        self._scratch = scratch

    def _norms(self, now: list[Tensor], before: list[Tensor]) -> Tensor:
        """Each tensor's update norm (float32, a DTensor's over its shards)."""
        if has_dtensor(self._params):  # the shards' updates, one at a time would not do: reduced together
            updates = torch._foreach_sub(now, before)
            return ShardedGrads(self._params).norms(updates, 2.0, None).to(torch.float32)
        return update_norms(now, before, self._scratch)

    def _finite(self, norms: Tensor, now: list[Tensor], before: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The update's norms and their total, none overflowing on a finite update: the gradient
        norm's rule (:func:`clipopt.functional.finite_group_norms`), the update taken as a whole
        only where its float32 norm overflowed (on the CPU; a DTensor's norms are over its shards:
        left as they are)."""
        pieces = None if has_dtensor(self._params) else _Updates(now, before)
        norms, total, _ = F.finite_group_norms(norms, [len(now)], pieces, 2.0)
        return norms, total

    def _unbounded(self, norms: Tensor, total: Tensor, coef: Tensor) -> Tensor:
        """True where an update whose norm is beyond its range of norms (float32's, 1.8e19, unless
        every parameter is float64: ``functional.range_dtype``) is still beyond it once bounded
        (``coef``: one for all, or each tensor's; the stages' norm with ``norm_group``): it is put
        back, as before #35 (the gradient norm's rule, docs/design.md)."""
        if coef.dim() == 0:
            applied = total.double() * coef
        else:
            applied = F.finite_norm_of(norms.double() * coef.double(), 2.0)
            if self._norm_group is not None:  # every stage decides alike (each is beyond: one total)
                applied = reduce_norm_over(applied, 2.0, self._norm_group)
        return applied >= F.norm_range(2.0, F.range_dtype(self._params))

    def _agreed(self, bad: Tensor) -> Tensor:
        """``bad``, the largest over the DDP replicas (one collective on the device, no host read)."""
        if self._agree is None:
            return bad
        dist = torch.distributed
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self._agree[0])
        return bad

    @torch.no_grad()
    def finish(self, d: WindowDecision, skipped: bool | Tensor) -> bool | Tensor:
        """Measure, reject or bound the update the inner step made; returns the window's outcome
        (skipped before, or now for a non-finite update: a bool where both are known on the host,
        else a 0/1 device flag) and sets ``d.update_norm``, ``d.update_coef`` and, for a rejected
        update, ``d.reason``."""
        now = [local_view(p) for p in self._params]
        before = [local_view(v) for v in self._backup.values]
        norms, total = self._finite(self._norms(now, before), now, before)
        if self._norm_group is not None:  # pipeline stages: every stage decides alike
            total = reduce_norm_over(total, 2.0, self._norm_group)
        coef = torch.ones((), dtype=torch.float32, device=total.device)
        shrink: Tensor | None = None
        if self._clip is not None:
            coef = self._clip.coefficients(norms, [p.numel() for p in self._params], total)
            # 1 - coef; none for a norm that is nan (gradients applied on request): nothing to scale by
            shrink = torch.nan_to_num(1.0 - coef, nan=0.0)
        flag = ~torch.isfinite(total) & (d.nonfinite == 0)
        if F.beyond_range(total, 2.0, grads=self._params):  # finite, beyond range (the CPU: no sync)
            flag = flag | self._unbounded(norms, total, coef)
        bad = self._agreed(flag.to(torch.float32))
        rejected: bool | None = None  # known on the host
        if total.device.type in HOST_DECIDED:
            rejected = self._apply_on_host(bad, shrink, now, before)
        else:
            self._apply_on_device(bad, shrink, now, before)
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
            self._clip.remember(total, (1.0 - outcome) * torch.isfinite(total))
        if rejected is not None and isinstance(skipped, bool):  # the host knows it: no read later
            return skipped or rejected
        return outcome

    def _apply_on_host(
        self, bad: Tensor, shrink: Tensor | None, now: list[Tensor], before: list[Tensor]
    ) -> bool:
        """CPU: the flag and the coefficients read on the host (no device to wait for); a rejected
        update copied back, every tensor whose coefficient is below 1 bounded, the others left.
        Returns whether the update was rejected."""
        values = cpu_values(bad if shrink is None else torch.cat([bad.reshape(1), shrink.reshape(-1)]))
        if values[0] > 0:
            self._backup.put_back()
            return True
        if shrink is None:
            return False
        weights = values[1:] * len(now) if shrink.dim() == 0 else values[1:]  # one for all, or each its own
        picked = [i for i, w in enumerate(weights) if w > 0.0]
        if picked:
            torch._foreach_lerp_(
                [now[i] for i in picked], [before[i] for i in picked], [weights[i] for i in picked]
            )
        return False

    def _apply_on_device(
        self, bad: Tensor, shrink: Tensor | None, now: list[Tensor], before: list[Tensor]
    ) -> None:
        """An accelerator: nothing read; the bound a ``lerp`` by the device coefficients, then the
        put-back a select where the update is rejected."""
        if shrink is not None:
            weights = list(shrink.unbind()) if shrink.dim() else [shrink] * len(now)
            torch._foreach_lerp_(now, before, weights)
        self._backup.restore_where(bad)


class _Updates(Sequence[Tensor]):
    """The update ``now - before`` of each tensor, taken when first asked for (for the norm without
    overflow: :func:`clipopt.functional.finite_norms` reads each once)."""

    def __init__(self, now: list[Tensor], before: list[Tensor]) -> None:
        self._now, self._before = now, before

    def __len__(self) -> int:
        return len(self._now)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [a - b for a, b in zip(self._now[i], self._before[i], strict=True)]
        return self._now[i] - self._before[i]


def _as_flag(skipped: bool | Tensor, device: torch.device) -> Tensor:
    """The outcome as a 0/1 float32 flag on ``device``, made there (no host-to-device copy)."""
    if isinstance(skipped, Tensor):
        return skipped.to(device, torch.float32)
    return torch.full((), float(skipped), dtype=torch.float32, device=device)
