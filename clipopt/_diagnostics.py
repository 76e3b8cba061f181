"""Diagnostics of a window: parameter names, the candidate bad row, anomaly snapshot payloads.

The optimizer decides *when* (``layer_stats=k`` due, a snapshot when
:func:`clipopt._decision.read_anomaly` finds the window non-finite, diverged
or spiking); this module computes *what*: the norm pass that also keeps a
per-layer row (:func:`norm_with_row`), the names (:func:`layer_names`) and
the payload a :class:`~clipopt._snapshot.SnapshotWriter` saves
(:func:`snapshot_payload`).  Everything sees the pre-clip gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from . import functional as F
from ._badrow import candidate_row
from ._layers import LayerStats
from ._snapshot import now, process_rank, to_saveable, versions

__all__ = ["layer_names", "norm_with_row", "row_of_norms", "snapshot_payload"]


def layer_names(param_groups: list[dict[str, Any]], names: Mapping[Tensor, str]) -> list[str]:
    """The name of every parameter, in parameter-group order (see ``param_names``)."""
    out: list[str] = []
    seen: set[str] = set()
    for gi, group in enumerate(param_groups):
        own = group.get("param_names")
        for i, p in enumerate(group["params"]):
            name = names.get(p) or (own[i] if own is not None and i < len(own) else None)
            name = name or f"group{gi}.{i}"
            if name in seen:  # a group added later repeats a name: qualified, so no tensor is lost
                name = f"group{gi}.{name}" if f"group{gi}.{name}" not in seen else f"group{gi}.{i}"
            seen.add(name)
            out.append(name)
    return out


def norm_with_row(
    grads: list[Tensor],
    params: list[Tensor],
    names: list[str],
    *,
    norm_type: float,
    foreach: bool | None,
    inv: float,
) -> tuple[Tensor, LayerStats | None]:
    """The summed gradients' total norm, and from the same pass each gradient's norm as the
    window's candidate bad row (see :mod:`clipopt._badrow`)."""
    norms = F.get_norms(grads, norm_type, foreach=foreach)
    raw_norm = torch.linalg.vector_norm(norms, norm_type)
    return raw_norm, row_of_norms(norms, params, names, norm_type=norm_type, inv=inv)


def row_of_norms(
    norms: Tensor, params: list[Tensor], names: list[str], *, norm_type: float, inv: float
) -> LayerStats:
    """The window's candidate bad row from the per-gradient norms already computed (``norms[j]``:
    the ``j``-th parameter with a gradient)."""
    with_grad = [i for i, p in enumerate(params) if p.grad is not None]
    return candidate_row(names, with_grad, norms, inv, norm_type == 2.0)


def snapshot_payload(
    *,
    step: int,
    reason: str,
    micro_batches: int,
    total_norm: Tensor,
    names: list[str],
    params: list[Tensor],
    inv: float,
    optimizer_state: dict[str, Any],
    layers: LayerStats,
    attached: Mapping[str, list[Any]],
    scale: float | None,
) -> dict[str, Any]:
    """What an anomaly snapshot holds (format 1; see :func:`clipopt.load_snapshot`).

    ``scale`` is the GradScaler's loss scale of the window (None without a scaler):
    :func:`clipopt.replay` needs it to tell an overflow of the scale from a fault.
    """
    return {
        "format": 1,
        "step": step,
        "reason": reason,
        "micro_batches": micro_batches,
        "total_norm": float(total_norm.item()),
        "params": {name: p.detach().to("cpu", copy=True) for name, p in zip(names, params, strict=True)},
        "grads": {
            name: (p.grad.detach() * inv).to("cpu")
            for name, p in zip(names, params, strict=True)
            if p.grad is not None
        },
        "optimizer": optimizer_state,
        "layer_stats": layers.as_dict(),
        "attached": {
            name: to_saveable(values[0] if len(values) == 1 else values, name)
            for name, values in attached.items()
        },
        "versions": versions(),
        "time": now(),
        "rank": process_rank(),
        "scale": scale,
    }
