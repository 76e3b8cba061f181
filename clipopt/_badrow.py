"""The per-layer row of a window that went bad, whatever the ``layer_stats`` period (SPEC §3).

With ``layer_stats=k`` the full per-layer statistics are computed every k-th
window.  So that the report can name the first parameter whose gradient went
non-finite in *any* window, every other window also gets a cheap candidate row
-- the norm of each parameter's combined gradient, one ``torch._foreach_norm``
pass over the gradients, on the device, with no host read -- which the loggers
write only when the window's total norm turned out non-finite (they read the
norm anyway).  In that row ``grad_norm`` is the parameter's gradient norm and
``nonfinite`` is 1 when it is not finite (an indicator, not a count: counting
elements would be a second pass); ``grad_max``, ``grad_min`` and
``param_norm`` are ``nan`` (not computed).  Costs one read of the gradients per
window, only with ``layer_stats`` on (``benchmarks/diagnostics.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._layers import LAYER_FIELDS, LayerStats

__all__ = ["candidate_row"]

_NORM = LAYER_FIELDS.index("grad_norm")
_NONFINITE = LAYER_FIELDS.index("nonfinite")


def candidate_row(params: Sequence[Tensor], names: Sequence[str], scale: float) -> LayerStats | None:
    """Per-parameter gradient norms of ``scale * p.grad`` as a ``[P, 5]`` row; None without gradients."""
    grads = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
    if not grads:
        return None
    device = grads[0][1].device
    dense = [g.to_dense() if g.is_sparse else g for _, g in grads]
    if all(g.device == device and not g.is_sparse for _, g in grads) and device.type in ("cpu", "cuda"):
        norms: list[Tensor] = list(torch._foreach_norm(dense, 2.0, dtype=torch.float32))
    else:
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in dense]
    values = torch.full((len(params), len(LAYER_FIELDS)), float("nan"), dtype=torch.float32, device=device)
    index = torch.tensor([i for i, _ in grads], device=device)
    column = torch.stack([n.to(device) for n in norms]) * scale
    values[index, _NORM] = column
    values[index, _NONFINITE] = (~torch.isfinite(column)).to(torch.float32)
    return LayerStats(names, values)
