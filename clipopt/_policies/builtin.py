"""Adaptive clipping thresholds: ``max_norm=AutoClip(...) | ZClip(...) | AGC(...)``.

A :class:`ClipPolicy` turns each window's pre-clip norm into that window's
norm bound, on the device: no policy reads a tensor back to the host, so the
fused, sync-free update path stays sync-free.  Non-finite windows never enter
a policy's statistics.  Every policy's state is part of the optimizer's state
dict (``state_dict()["clipopt"]["policy"]``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from .._checks import (
    check_choice,
    check_flag,
    check_optional_positive_float,
    check_positive_float,
    check_positive_int,
)
from .._distributed.collectives import has_dtensor, sharded_unit_norms
from .._state import bad
from .kinds import PolicyWindow, Slots, check_keys_held

__all__ = ["AGC", "AutoClip", "ClipPolicy", "TensorPolicy", "ZClip", "checked_policy_state"]


class ClipPolicy:
    """Base class of the adaptive thresholds.

    Subclasses implement :meth:`threshold` (global-norm policies) or
    :meth:`clip_` (unit-wise policies, ``unitwise = True``), or derive from
    :class:`TensorPolicy` (per-tensor policies; the three kinds are described in
    :mod:`clipopt._policies.kinds`), plus :meth:`state_dict` / :meth:`load_state_dict`.
    State is kept in attributes that are replaced, never written into, so that a ``step()`` that fails
    after the policy saw its window can put the old attributes back.
    """

    #: True for policies that clip the gradients themselves (unit-wise or per-tensor)
    #: instead of bounding the global norm.
    unitwise = False
    #: Why a parameter group's own float ``max_norm`` cannot combine with such a policy.
    in_place_rule = "a unit-wise policy clips every unit against its weight norm"
    #: Whether its statistics take a window whose norm is beyond float32's range of norms
    #: (``functional.norm_range``, 1.8e19 for p = 2) without overflowing; False: such a window is
    #: skipped with reason ``"norm_overflow"`` and the statistics stay as they were (#35).
    takes_beyond_range = True

    def threshold(self, total_norm: Tensor) -> Tensor:
        """The norm bound for a window whose pre-clip norm is ``total_norm`` (0-d, on the device).

        Called once per window, with the window's norm included in the statistics.
        """
        raise NotImplementedError

    def spike(self) -> Tensor | None:
        """1.0 when the latest window should be skipped as a spike (reason ``"spike"``), else None."""
        return None

    def is_spike(self, total_norm: Tensor) -> Tensor | None:
        """1.0 when a window with this norm is a spike by the current statistics, else 0.0.

        Pure (the statistics are not updated); None for policies without a spike
        rule.  Decides whether an anomaly snapshot with reason ``"spike"`` is saved.
        """
        return None

    def clip_(self, params: Sequence[Tensor], scale: float) -> Tensor:
        """Unit-wise policies: clip ``scale * p.grad`` in place, return whether anything was clipped."""
        raise NotImplementedError

    def clip_window_(self, window: PolicyWindow) -> Tensor:
        """Policies that clip in place (``unitwise``): clip the window's gradients, the
        ``window.scale`` included, and return whether anything was clipped (0-d bool)."""
        return self.clip_(window.params, window.scale)

    def settle(self, skip: Tensor | None) -> None:
        """After the window's skip decision (``skip``: 0/1 on the device; None: no skip signal), a
        policy that clips in place takes back what a skipped window changed.  Default: nothing."""

    def take_back(self, skip: Tensor) -> None:
        """After the inner step, when the window is skipped then (``skip``: 0/1 on the device; a
        non-finite update put back), a policy that clips in place takes back what the window
        changed, as :meth:`settle` does.  Default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def _to(self, device: torch.device) -> None:
        """Move tensor state to ``device`` (the gradients' device) the first time it is used."""


class AutoClip(ClipPolicy):
    """The ``percentile``-th percentile of the history of total norms (Seetharaman et al. 2020).

    The history holds the pre-clip norms of the finite windows so far, the
    current one included, up to the latest ``history`` of them (a ring buffer on
    the device; the paper keeps all of them).

    Args:
        percentile: in (0, 100]; the paper's best results were around 10.
        history: how many recent norms the percentile is taken over.
    """

    def __init__(self, percentile: float = 10.0, history: int = 10_000) -> None:
        p = check_optional_positive_float("percentile", percentile, "10")
        if p is None or p > 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile!r}; pass e.g. percentile=10")
        self.percentile = p
        self.history = check_positive_int("history", history)
        self._buffer = torch.full((self.history,), math.nan)
        self._index = torch.zeros((), dtype=torch.int64)  # finite norms written so far (on the device)

    def _to(self, device: torch.device) -> None:
        if self._buffer.device != device:
            self._buffer = self._buffer.to(device)
            self._index = self._index.to(device)

    def threshold(self, total_norm: Tensor) -> Tensor:
        self._to(total_norm.device)
        finite = torch.isfinite(total_norm)
        slot = (self._index % self.history).reshape(1)
        value = torch.where(finite, total_norm.to(self._buffer.dtype), self._buffer[slot][0])
        # new tensors, not writes into the old ones: a step that fails later restores the old ones
        self._buffer = self._buffer.index_put((slot,), value.reshape(1))  # non-finite: writes nothing back
        self._index = self._index + finite.to(torch.int64)
        return torch.nanquantile(self._buffer, self.percentile / 100.0)

    def state_dict(self) -> dict[str, Any]:
        return {"buffer": self._buffer.clone(), "index": self._index.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buffer, index = state.get("buffer"), state.get("index")
        if isinstance(index, int):
            index = torch.tensor(index)
        if (
            not isinstance(buffer, Tensor)
            or buffer.shape != (self.history,)
            or not isinstance(index, Tensor)
            or index.numel() != 1
        ):
            raise ValueError(
                f"invalid AutoClip state: expected a buffer of {self.history} norms and an index; "
                "pass the state saved by an AutoClip with the same history"
            )
        self._buffer = buffer.detach().to(self._buffer.device, torch.float32, copy=True)
        self._index = index.detach().reshape(()).to(self._buffer.device, torch.int64, copy=True)

    def __repr__(self) -> str:
        return f"AutoClip(percentile={self.percentile:g}, history={self.history})"


class ZClip(ClipPolicy):
    """Z-score clipping against an EMA of the norm's mean and variance (Kumar et al. 2025).

    For the first ``warmup_steps`` finite windows the statistics are collected
    (and only ``max_grad_norm``, if set, bounds the norm); then their mean and
    variance start two EMAs.  A window whose norm ``g`` has
    ``z = (g - mean) / (std + eps) > z_thresh`` is a spike: its bound is
    ``mean + z_thresh * std / (z / z_thresh) * clip_factor``
    (``clip_option="adaptive_scaling"``) or ``mean`` (``"mean"``); other windows
    are not bounded (but by ``max_grad_norm``).  The EMAs are updated with the
    clipped norm: ``mean <- alpha*mean + (1-alpha)*g'``,
    ``var <- alpha*var + (1-alpha)*(g' - mean)^2`` — not for spikes when
    ``skip_update_on_spike``.  With ``skip_spikes=True`` a spike window is
    skipped instead of clipped, with reason ``"spike"``.
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        max_grad_norm: float | None = None,
        eps: float = 1e-6,
        warmup_steps: int = 25,
        clip_option: str = "adaptive_scaling",
        clip_factor: float = 1.0,
        skip_update_on_spike: bool = False,
        skip_spikes: bool = False,
    ) -> None:
        a = check_optional_positive_float("alpha", alpha, "0.97")
        if a is None or a >= 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}; pass e.g. alpha=0.97")
        self.alpha = a
        self.z_thresh = check_positive_float("z_thresh", z_thresh, "2.5")
        self.max_grad_norm = check_optional_positive_float("max_grad_norm", max_grad_norm, "1.0")
        self.eps = check_positive_float("eps", eps, "1e-6")
        self.warmup_steps = check_positive_int("warmup_steps", warmup_steps)
        self.clip_option = check_choice("clip_option", clip_option, ("adaptive_scaling", "mean"))
        self.clip_factor = check_positive_float("clip_factor", clip_factor, "1.0")
        self.skip_update_on_spike = check_flag("skip_update_on_spike", skip_update_on_spike)
        self.skip_spikes = check_flag("skip_spikes", skip_spikes)
        # count, sum, sum of squares (warm-up), mean, var -- float64 on the device
        self._stats = torch.zeros(5, dtype=torch.float64)
        self._spike: Tensor | None = None

    def _to(self, device: torch.device) -> None:
        if self._stats.device != device:
            self._stats = self._stats.to(device)

    def _score(self, total_norm: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(finite, g0, warm, std, z, spike) of a window's norm against the current statistics."""
        self._to(total_norm.device)
        count, _, _, mean, var = self._stats.unbind()
        g = total_norm.to(torch.float64)
        finite = torch.isfinite(g)
        g0 = torch.where(finite, g, 0.0)
        warm = count < self.warmup_steps  # still collecting
        std = var.clamp_min(0).sqrt()
        z = (g0 - mean) / (std + self.eps)
        return finite, g0, warm, std, z, finite & ~warm & (z > self.z_thresh)

    def is_spike(self, total_norm: Tensor) -> Tensor:
        return self._score(total_norm)[5].to(torch.float32)

    def threshold(self, total_norm: Tensor) -> Tensor:
        finite, g0, warm, std, z, spike = self._score(total_norm)
        count, total, squares, mean, var = self._stats.unbind()
        if self.clip_option == "adaptive_scaling":
            bound = (mean + self.z_thresh * std / (z / self.z_thresh)) * self.clip_factor
        else:
            bound = mean
        limit = torch.where(spike, bound, math.inf)
        clipped = torch.minimum(g0, limit)  # the EMAs see ZClip's own bound, not max_grad_norm (as zclip)
        if self.max_grad_norm is not None:
            limit = limit.clamp(max=self.max_grad_norm)
        # warm-up sums; the EMAs start from their mean and variance when the count reaches warmup_steps
        add = (finite & warm).to(torch.float64)
        count2 = count + add
        total2 = total + add * g0
        squares2 = squares + add * g0 * g0
        starts = warm & (count2 >= self.warmup_steps)
        mean_w = total2 / count2.clamp_min(1)
        var_w = (squares2 / count2.clamp_min(1) - mean_w * mean_w).clamp_min(0)
        update = finite & ~warm
        if self.skip_update_on_spike:
            update = update & ~spike
        mean_e = self.alpha * mean + (1 - self.alpha) * clipped
        var_e = self.alpha * var + (1 - self.alpha) * (clipped - mean_e) ** 2
        mean2 = torch.where(starts, mean_w, torch.where(update, mean_e, mean))
        var2 = torch.where(starts, var_w, torch.where(update, var_e, var))
        self._stats = torch.stack([count2, total2, squares2, mean2, var2])
        self._spike = spike.to(torch.float32) if self.skip_spikes else None
        return limit.to(total_norm.dtype)

    def spike(self) -> Tensor | None:
        return self._spike

    def state_dict(self) -> dict[str, Any]:
        return {"stats": self._stats}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stats = state.get("stats")
        if not isinstance(stats, Tensor) or stats.shape != (5,):
            raise ValueError("invalid ZClip state: expected 5 statistics; pass the state a ZClip saved")
        self._stats = stats.detach().to(self._stats.device, torch.float64, copy=True)

    def __repr__(self) -> str:
        return (
            f"ZClip(alpha={self.alpha:g}, z_thresh={self.z_thresh:g}, max_grad_norm={self.max_grad_norm}, "
            f"warmup_steps={self.warmup_steps}, clip_option={self.clip_option!r}, "
            f"skip_spikes={self.skip_spikes})"
        )


class AGC(ClipPolicy):
    """Adaptive gradient clipping, unit-wise (Brock et al. 2021).

    For each unit ``i`` of each parameter (a row of a weight — all dimensions
    but the first; a whole vector for 1-d parameters):
    ``G_i <- G_i * min(1, clip_factor * max(||W_i||, eps) / max(||G_i||, 1e-6))``.
    Used as ``max_norm=AGC(...)`` it replaces the global norm bound; the
    recorded ``clip_coef`` is 1.0 and ``clipped`` says whether any unit was clipped.
    """

    unitwise = True

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3) -> None:
        self.clip_factor = check_positive_float("clip_factor", clip_factor, "0.01")
        self.eps = check_positive_float("eps", eps, "1e-3")

    def clip_(self, params: Sequence[Tensor], scale: float) -> Tensor:
        grads = [(p, p.grad) for p in params if p.grad is not None]
        if any(g.is_sparse for _, g in grads):  # checked before any gradient changes
            raise TypeError("AGC does not support sparse gradients; use a float max_norm or None")
        clipped: list[Tensor] = []
        if has_dtensor([g for _, g in grads]):  # FSDP2 / tensor parallel: norms of the full units
            units = sharded_unit_norms(grads)
        else:
            units = [_unit_norms(p, g) for p, g in grads]
        for w_norm, g_norm, g in units:
            g_norm = g_norm * scale
            limit = self.clip_factor * w_norm.clamp_min(self.eps)
            coef = (limit / g_norm.clamp_min(1e-6)).clamp(max=1.0)
            clipped.append((coef < 1.0).any())
            g.mul_((coef * scale).to(g.dtype))
        if not clipped:
            return torch.zeros((), dtype=torch.bool)
        return torch.stack(clipped).any()

    def __repr__(self) -> str:
        return f"AGC(clip_factor={self.clip_factor:g}, eps={self.eps:g})"


class TensorPolicy(ClipPolicy):
    """Base class of the per-tensor policies: each gradient tensor clipped by statistics of its own.

    A subclass implements :meth:`clip_window_` (scale the gradients in place, return whether
    any was clipped, a 0-d bool), :meth:`state_dict`, :meth:`load_state_dict` and a
    ``__repr__`` that shows every setting (the ranks compare it).  Its statistics live in
    tensors on the device that are replaced, never written into (``UndoPoint`` puts the old
    ones back when a close fails), updated with ``torch.where(window.healthy, new, old)`` and
    set through :meth:`commit`, so that :meth:`settle` puts them back when the window is
    skipped for any reason (a SpikeGuard's spike included).
    """

    unitwise = True  # clips in place: no global norm bound
    #: why a parameter group's own float ``max_norm`` cannot combine with the policy
    in_place_rule = "a per-tensor policy sets each tensor's norm from its own statistics"

    def __init__(self) -> None:
        self._undo: dict[str, Tensor] = {}  #: the statistics before the latest window, until settled
        self._settled: dict[str, Tensor] = {}  #: those of the latest settled window (for take_back)
        #: whose statistics each entry is (by inner optimizer and index in it, never by a position in
        #: the wrapper's flat list of parameters: they follow their tensors through add_param_group)
        self._slots = Slots()

    def check_held(self, sizes: Sequence[int]) -> None:
        """``ValueError`` when the (loaded) statistics name a parameter that the wrapper's inner
        optimizers, holding ``sizes`` parameters each, do not have."""
        check_keys_held(type(self).__name__, self._slots, sizes)

    def commit(self, **changes: tuple[Tensor, Tensor]) -> None:
        """Set each attribute ``name=(old, new)`` to ``new``, keeping ``old`` until :meth:`settle`."""
        self._undo = {name: old for name, (old, _) in changes.items()}
        for name, (_, new) in changes.items():
            setattr(self, name, new)

    def settle(self, skip: Tensor | None) -> None:
        undo, self._undo = self._undo, {}
        self._settled = undo  # this window's: take_back() may still need them after the inner step
        if skip is not None:
            self.take_back(skip)

    def take_back(self, skip: Tensor) -> None:
        for name, old in self._settled.items():
            setattr(self, name, torch.where(skip > 0, old, getattr(self, name)))

    def clip_window_(self, window: PolicyWindow) -> Tensor:
        raise NotImplementedError

    def clip_(self, params: Sequence[Tensor], scale: float) -> Tensor:
        raise TypeError(
            f"{type(self).__name__} clips through clip_window_(window); "
            "pass it as ClippedOptimizer(..., max_norm=policy)"
        )


def _unit_norms(p: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """AGC's ``(||W_i||, ||G_i||, G)`` per unit (row, or whole tensor), in at least float32."""
    dims = tuple(range(1, g.ndim)) if g.ndim > 1 else None
    acc = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None
    w_norm = torch.linalg.vector_norm(p.detach(), dim=dims, keepdim=True, dtype=acc)
    g_norm = torch.linalg.vector_norm(g, dim=dims, keepdim=True, dtype=acc)
    if not g.is_complex() and F.overflowed(g_norm):  # finite units whose float32 norm overflowed
        over = tuple(range(g.ndim)) if dims is None else dims  # each unit max-scaled (#35)
        unit = g.abs().amax(dim=over, keepdim=True).double()
        unit = torch.where(unit > 0, unit, torch.ones_like(unit))
        wide = torch.linalg.vector_norm(g.double() / unit, dim=over, keepdim=True) * unit
        g_norm = F.narrowed(wide.reshape(g_norm.shape), g_norm)
    return w_norm, g_norm, g


def checked_policy_state(
    state: Any, policy: ClipPolicy | None, sizes: Sequence[int] | None = None
) -> dict[str, Any] | None:
    """The policy's saved state (``'clipopt.policy'``), checked by loading it into a copy of the
    policy first (``ValueError``, touching nothing); None when none was saved or there is no policy.
    ``sizes``: the parameters each inner optimizer holds; a per-tensor policy's state naming any
    other parameter is refused (#32)."""
    if state is None or policy is None:
        return None
    if not isinstance(state, dict):
        raise bad(f"'clipopt.policy' must be a dict, got {type(state).__name__}")
    checked = copy.deepcopy(policy)
    checked.load_state_dict(state)  # raises ValueError, touching nothing
    if sizes is not None and isinstance(checked, TensorPolicy):
        checked.check_held(sizes)
    return state
