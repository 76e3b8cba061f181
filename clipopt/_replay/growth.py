"""Which layer's gradient grew most in a spike window, against its history in the optimizer state.

A snapshot holds the window's gradients and the inner optimizer's state from
*before* the window's update, and that state is a running statistic of the
previous windows' gradients.  Per parameter, the history norm is estimated as:

- Adam, AdamW, NAdam, RAdam (``exp_avg_sq``, ``betas``):
  ``sqrt(sum(exp_avg_sq) / (1 - beta2**step))``, the root mean square gradient norm;
- RMSprop (``square_avg``, ``alpha``): ``sqrt(sum(square_avg) / (1 - alpha**step))``;
- Adagrad (``sum``): ``sqrt((sum(sum) - initial_accumulator_value * numel) / step)``;
- SGD with momentum (``momentum_buffer``): ``norm(buf) * (1 - momentum) / (1 - dampening)``,
  the norm of the mean gradient (smaller than the RMS when gradients are noisy, so
  growth ratios of noisy layers read high).

The growth of a parameter is the window's gradient norm over that estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .._inner import flat_state_dict

__all__ = ["LayerGrowth", "layer_growth"]


@dataclass(frozen=True)
class LayerGrowth:
    """One parameter's gradient in the snapshot's window against its history."""

    #: Parameter name (as in the snapshot).
    name: str
    #: Norm of the window's (pre-clip, combined) gradient.
    grad_norm: float
    #: Estimated gradient norm over the previous windows (see the module docstring).
    history_norm: float
    #: ``grad_norm / history_norm`` (inf when the history is zero).
    ratio: float
    #: The optimizer state the history came from, e.g. ``"exp_avg_sq"``.
    source: str

    def as_dict(self) -> dict[str, Any]:
        """Plain data."""
        return {
            "name": self.name,
            "grad_norm": self.grad_norm,
            "history_norm": self.history_norm,
            "ratio": self.ratio,
            "source": self.source,
        }


def layer_growth(snap: Mapping[str, Any]) -> tuple[list[LayerGrowth], str | None]:
    """Every parameter's :class:`LayerGrowth`, largest ratio first, and why there is none (or None).

    Parameters without a gradient, without optimizer state or without a
    finite gradient norm are left out.
    """
    optimizer = flat_state_dict(snap["optimizer"])  # several inner optimizers: one layout
    groups = optimizer.get("param_groups", [])
    state = optimizer.get("state", {})
    ids = [(i, g) for g in groups for i in g.get("params", [])]
    names = list(snap["params"])
    if len(ids) != len(names):
        return [], "the optimizer state does not match the snapshot's parameters"
    out = []
    for name, (index, group) in zip(names, ids, strict=True):
        grad = snap["grads"].get(name)
        history = _history(state.get(index), group)
        if grad is None or history is None:
            continue
        norm = float(grad.detach().double().norm())
        if not math.isfinite(norm):
            continue
        ratio = norm / history[0] if history[0] > 0 else math.inf
        out.append(LayerGrowth(name, norm, history[0], ratio, history[1]))
    if not out:
        why = "the inner optimizer keeps no gradient history (no state yet, or SGD without momentum)"
        return [], why
    out.sort(key=lambda g: -g.ratio)
    return out, None


def _history(st: Any, group: Mapping[str, Any]) -> tuple[float, str] | None:
    """(estimated history norm, state name) of one parameter, or None."""
    if not isinstance(st, Mapping):
        return None
    step = _number(st.get("step"))
    if "exp_avg_sq" in st and "betas" in group and step:
        corr = 1.0 - float(group["betas"][1]) ** step
        return math.sqrt(_sum(st["exp_avg_sq"]) / corr), "exp_avg_sq"
    if "square_avg" in st and "alpha" in group and step:
        corr = 1.0 - float(group["alpha"]) ** step
        return math.sqrt(_sum(st["square_avg"]) / corr), "square_avg"
    if "sum" in st and step:
        acc = st["sum"]
        init = float(group.get("initial_accumulator_value", 0.0)) * acc.numel()
        return math.sqrt(max(_sum(acc) - init, 0.0) / step), "sum"
    buf = st.get("momentum_buffer")
    if isinstance(buf, Tensor) and float(group.get("dampening", 0.0)) < 1.0:
        scale = (1.0 - float(group.get("momentum", 0.0))) / (1.0 - float(group.get("dampening", 0.0)))
        return float(buf.double().norm()) * scale, "momentum_buffer"
    return None


def _sum(t: Tensor) -> float:
    return float(t.detach().double().sum())


def _number(value: Any) -> float:
    if isinstance(value, Tensor):
        return float(value.item())
    return float(value) if isinstance(value, (int, float)) else 0.0
