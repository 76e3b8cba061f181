"""``max_norm=AdaGC(...)``: each gradient tensor clipped against an EMA of its own clipped norms.

Wang et al. 2025, "AdaGC: Improving Training Stability for Large Language Model
Pretraining"; the rule of ``pytorch_optimizer.AdaGC`` (docs/choosing-max-norm.md,
'Per-tensor policies').
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .._checks import check_int_at_least, check_positive_float
from .builtin import TensorPolicy
from .kinds import PolicyWindow, check_decay, checked_state, put, ready, scaled_grads, slots, take

__all__ = ["AdaGC"]

#: The statistics in the state dict (``count`` last: :func:`~.kinds.checked_state`), beside ``keys``.
_NAMES = ("gamma", "start", "count")

#: The floor of the norms (``pytorch_optimizer.AdaGC``'s ``eps`` at its default, 1e-8).
EPS = 1e-8


class AdaGC(TensorPolicy):
    """Per-tensor adaptive gradient clipping against an EMA of each tensor's clipped norm.

    Each window's gradient ``g_i`` of tensor ``i`` is scaled by
    ``h_i = min(1, lambda_rel * max(gamma_i, eps) / max(||g_i||, eps))`` and the EMA moves:
    ``gamma_i <- beta * gamma_i + (1 - beta) * ||h_i g_i||``.  During the warm-up (the
    first update, and every update numbered below ``warmup``, counting from 1 as
    ``pytorch_optimizer`` does) every tensor is clipped globally instead:
    ``h = min(1, lambda_abs / (||g|| + eps))`` with ``||g||`` the norm of all of them, and
    ``gamma_i`` is the smallest ``||h g_i||`` so far.  ``eps`` is 1e-8.  A tensor first seen later
    (a parameter group added since) has a warm-up of its own, its updates counted from its first,
    as ``pytorch_optimizer`` counts a group's steps from its first.

    Norms are of the whole tensors (over all shards under FSDP2/DTensor), after any value
    clipping.  Only healthy windows (finite, replicas agreeing) move the statistics and
    count towards the warm-up.  ``StepStats.max_norm`` is None; ``clipped`` says whether
    any tensor was scaled down.

    Args:
        beta: the EMA's decay, in [0, 1).
        lambda_rel: each tensor's bound relative to its EMA (> 0).
        lambda_abs: the global norm bound during the warm-up (> 0).
        warmup: the update number from which the per-tensor rule applies (>= 0).
    """

    def __init__(
        self, beta: float = 0.98, lambda_rel: float = 1.05, lambda_abs: float = 1.0, warmup: int = 100
    ) -> None:
        self.beta = check_decay("beta", beta, "0.98")
        self.lambda_rel = check_positive_float("lambda_rel", lambda_rel, "1.05")
        self.lambda_abs = check_positive_float("lambda_abs", lambda_abs, "1.0")
        self.warmup = check_int_at_least("warmup", warmup, 0, 100)
        super().__init__()
        self._gamma = torch.zeros(0)  #: each tensor's EMA (nan: not seen yet), made at the first window
        #: each tensor's first healthy window (``_count`` then; inf: not seen yet): its warm-up's start
        self._start = torch.zeros(0, dtype=torch.float64)
        self._count = torch.zeros((), dtype=torch.float64)  #: healthy windows seen

    def clip_window_(self, window: PolicyWindow) -> Tensor:
        grads = scaled_grads("AdaGC", window)
        if not grads:
            return torch.zeros((), dtype=torch.bool)
        norms = window.norms(grads, 2.0)
        self._slots, where = slots(self._slots, window, norms.device)
        size, count = len(self._slots.keys), self._count.to(norms.device)
        state, starts = ready(self._gamma, size, math.nan, norms), ready(self._start, size, math.inf, count)
        gamma, start = take(state, where), take(starts, where)
        n = norms.to(gamma.dtype)
        warm = count + 1 - start < self.warmup  # a tensor not seen yet (start inf) too
        c_abs = (self.lambda_abs / (window.total(norms).to(gamma.dtype) + EPS)).clamp_max(1.0)
        c_rel = (self.lambda_rel * gamma.clamp_min(EPS) / n.clamp_min(EPS)).clamp_max(1.0)
        coef = torch.where(warm, c_abs, c_rel)
        torch._foreach_mul_(grads, [c.to(g.dtype) for c, g in zip(coef.unbind(), grads, strict=True)])
        if window.update:
            clipped = window.norms(grads, 2.0).to(gamma.dtype)  # as the reference: the clipped tensor's norm
            seen = torch.where(torch.isnan(gamma), clipped, torch.minimum(gamma, clipped))
            new = torch.where(warm, seen, gamma.lerp(clipped, 1.0 - self.beta))
            first = start.clamp(max=count)  # this window's count for a tensor not seen yet
            self.commit(
                _gamma=(state, put(state, where, torch.where(window.healthy, new, gamma))),
                _start=(starts, put(starts, where, torch.where(window.healthy, first, start))),
                _count=(count, count + window.healthy.to(count.dtype)),
            )
        return (coef < 1.0).any()

    def state_dict(self) -> dict[str, Any]:
        return {
            "gamma": self._gamma,
            "start": self._start,
            "count": self._count,
            "keys": self._slots.tensor(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checked, keys = checked_state("AdaGC", state, _NAMES, unseen={"gamma": math.nan, "start": math.inf})
        self._gamma = checked["gamma"].clone()
        gamma, start = checked["gamma"], checked["start"].to(torch.float64)
        # inf exactly where gamma is nan (not seen yet): the warm-up test reads only the start
        self._start = torch.where(gamma.isnan(), math.inf, start.nan_to_num(posinf=0.0))
        self._count = checked["count"].reshape(()).to(torch.float64, copy=True)
        self._slots = keys

    def __repr__(self) -> str:
        return (
            f"AdaGC(beta={self.beta!r}, lambda_rel={self.lambda_rel!r}, lambda_abs={self.lambda_abs!r}, "
            f"warmup={self.warmup!r})"
        )
