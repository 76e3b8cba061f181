"""``max_norm=StableSPAM(...)``: Stable-SPAM's gradient part, AdaClip then AdaGN, per tensor.

Huang et al. 2025, "Stable-SPAM: How to Train in 4-Bit More Stably than 16-Bit Adam";
the gradient transformation of ``pytorch_optimizer.StableSPAM`` (docs/choosing-max-norm.md,
'Per-tensor policies').
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .._checks import check_positive_float
from .builtin import TensorPolicy
from .kinds import (
    PolicyWindow,
    bias_correction,
    check_decay,
    checked_state,
    put,
    ready,
    scaled_grads,
    slots,
    take,
)

__all__ = ["StableSPAM"]

_KEYS = ("m_max", "m_norm", "v_norm", "count")


class StableSPAM(TensorPolicy):
    """AdaClip and AdaGN of Stable-SPAM, per gradient tensor.

    For tensor ``i`` at its ``t``-th healthy window (``g`` its gradient):

    * AdaClip: ``m_max_i <- theta * m_max_i + (1 - theta) * max|g|``; the elements with
      ``|g| > m_hat = m_max_i / (1 - theta**t)`` become ``g / max|g| * m_hat``.
    * AdaGN: with ``n = ||g||`` after AdaClip, ``m_i <- gamma1 * m_i + (1 - gamma1) * n``,
      ``v_i <- gamma2 * v_i + (1 - gamma2) * n**2``, and
      ``g <- g / n * (m_i / (1 - gamma1**t)) / (sqrt(v_i / (1 - gamma2**t)) + eps)``.
      A tensor whose ``n`` is 0 keeps its gradient (zero) and its ``m_i``, ``v_i``.

    ``max|g|`` and the norms are of the whole tensors (over all shards under FSDP2/DTensor).
    Only healthy windows (finite, replicas agreeing) move the statistics and count in ``t``; a
    window whose float32 norm overflowed on finite gradients is skipped (``"norm_overflow"``):
    its squared norms would overflow the float32 statistics (#35).
    Stable-SPAM's momentum reset and its cosine schedule of ``gamma1`` are parts of its
    optimizer, not of the gradient: they are not here.  ``StepStats.max_norm`` is None;
    ``clipped`` says whether AdaClip scaled an element or AdaGN lowered a tensor's norm.

    Args:
        gamma1: the decay of the norm's EMA, in [0, 1).
        gamma2: the decay of the squared norm's EMA, in [0, 1).
        theta: the decay of the EMA of each tensor's largest ``|g|``, in [0, 1).
        eps: added to the root of the squared norm's EMA (> 0).
    """

    #: Its float32 EMA of each tensor's squared norm overflows on a norm beyond float32's range of
    #: norms (1.8e19): such a window is skipped, reason ``"norm_overflow"``, its statistics as they were.
    takes_beyond_range = False

    def __init__(
        self, gamma1: float = 0.7, gamma2: float = 0.9, theta: float = 0.999, eps: float = 1e-8
    ) -> None:
        self.gamma1 = check_decay("gamma1", gamma1, "0.7")
        self.gamma2 = check_decay("gamma2", gamma2, "0.9")
        self.theta = check_decay("theta", theta, "0.999")
        self.eps = check_positive_float("eps", eps, "1e-8")
        super().__init__()
        self._m_max = torch.zeros(0)  #: EMA of each tensor's largest |g|
        self._m_norm = torch.zeros(0)  #: EMA of each tensor's norm after AdaClip
        self._v_norm = torch.zeros(0)  #: EMA of its square
        self._count = torch.zeros((), dtype=torch.float64)  #: healthy windows seen

    def clip_window_(self, window: PolicyWindow) -> Tensor:
        grads = scaled_grads("StableSPAM", window)
        if not grads:
            return torch.zeros((), dtype=torch.bool)
        peaks = window.norms(grads, math.inf)  # each tensor's largest |g|
        self._slots, where = slots(self._slots, window, peaks.device)
        size = len(self._slots.keys)
        states = [ready(s, size, 0.0, peaks) for s in (self._m_max, self._m_norm, self._v_norm)]
        m_max, m_norm, v_norm = (take(s, where) for s in states)
        t = self._count.to(peaks.device) + 1
        m_max = m_max.lerp(peaks.to(m_max.dtype), 1.0 - self.theta)
        limits = m_max / bias_correction(self.theta, t, m_max.dtype)
        for g, limit, peak in zip(grads, limits.unbind(), peaks.unbind(), strict=True):
            limit, peak = limit.to(g.dtype), peak.to(g.dtype)
            g.copy_(torch.where(g.abs() > limit, g / peak * limit, g))
        norms = window.norms(grads, 2.0).to(m_norm.dtype)
        active = norms > 0
        m_norm = torch.where(active, m_norm.lerp(norms, 1.0 - self.gamma1), m_norm)
        v_norm = torch.where(active, v_norm.lerp(norms.square(), 1.0 - self.gamma2), v_norm)
        m_hat = m_norm / bias_correction(self.gamma1, t, m_norm.dtype)
        v_hat = v_norm / bias_correction(self.gamma2, t, v_norm.dtype)
        target = m_hat / (v_hat.sqrt() + self.eps)
        one = torch.ones_like(norms)
        torch._foreach_div_(
            grads,
            [n.to(g.dtype) for n, g in zip(torch.where(active, norms, one).unbind(), grads, strict=True)],
        )
        torch._foreach_mul_(
            grads,
            [c.to(g.dtype) for c, g in zip(torch.where(active, target, one).unbind(), grads, strict=True)],
        )
        if window.update:
            ok = window.healthy
            new = [
                put(s, where, torch.where(ok, after, take(s, where)))
                for s, after in zip(states, (m_max, m_norm, v_norm), strict=True)
            ]
            count = t - 1
            self.commit(
                _m_max=(states[0], new[0]),
                _m_norm=(states[1], new[1]),
                _v_norm=(states[2], new[2]),
                _count=(count, count + ok.to(count.dtype)),
            )
        return ((peaks.to(limits.dtype) > limits) | (active & (target < norms))).any()

    def state_dict(self) -> dict[str, Any]:
        return {
            "m_max": self._m_max,
            "m_norm": self._m_norm,
            "v_norm": self._v_norm,
            "count": self._count,
            "keys": self._slots.tensor(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checked, keys = checked_state("StableSPAM", state, _KEYS)
        self._m_max, self._m_norm, self._v_norm = (checked[k].clone() for k in _KEYS[:3])
        self._count = checked["count"].reshape(()).to(torch.float64, copy=True)
        self._slots = keys

    def __repr__(self) -> str:
        return (
            f"StableSPAM(gamma1={self.gamma1!r}, gamma2={self.gamma2!r}, theta={self.theta!r}, "
            f"eps={self.eps!r})"
        )
