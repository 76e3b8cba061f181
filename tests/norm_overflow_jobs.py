"""The gloo job of ``tests/window/test_norm_overflow.py``: a window whose float32 norm overflows on
finite gradients, under DDP and FSDP2 (per-tensor norms over shards), 2 CPU ranks (#35).

Each rank saves what clipopt did (the recorded norm, skipped, reason, the full parameters) beside
an independent single-process reference: the plain model given every rank's micro-batch (the mean
gradient), its norm in Python floats (float64), and the SGD step ``-g / norm`` taken by hand.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from clipopt import ClippedOptimizer

from .distributed_jobs import WORLD, _fsdp, init_world, leave_process_group
from .helpers import mlp

#: The loss of the second window is multiplied by this: its gradients are finite, ~1e20.
SCALE = 1e20


def _loss(model: nn.Module, rank: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + index)
    x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
    loss = nn.functional.mse_loss(model(x), y)
    return loss * SCALE if index == 1 else loss


def reference() -> dict[str, Any]:
    """One process, two windows: the mean gradient of every rank's micro-batch, its norm in Python
    floats, and SGD (lr 1) on the gradient clipped to norm 1 in float64."""
    plain = mlp((6, 8, 3))
    norms = []
    for i in range(2):
        for p in plain.parameters():
            p.grad = None
        for r in range(WORLD):
            (_loss(plain, r, i) / WORLD).backward()
        grads = [p.grad.double() for p in plain.parameters() if p.grad is not None]
        values = [abs(v) for g in grads for v in g.reshape(-1).tolist()]
        m = max(values)
        norm = m * math.fsum((v / m) ** 2 for v in values) ** 0.5
        coef = min(1.0, 1.0 / (norm + 1e-6))
        with torch.no_grad():
            for p, g in zip(plain.parameters(), grads, strict=True):
                p.copy_((p.double() - coef * g).float())
        norms.append(norm)
    return {"params": [p.detach().clone() for p in plain.parameters()], "norms": norms}


def _stage(rank: int) -> nn.Module:
    torch.manual_seed(rank)
    return nn.Linear(6, 3)


def stages_reference() -> float:
    """Pipeline stages: rank r's own layer (:func:`_stage`) on its own micro-batch of the second
    window; the norm of both stages' gradients in Python floats."""
    values = []
    for rank in range(WORLD):
        layer = _stage(rank)
        _loss(layer, rank, 1).backward()
        values += [abs(v) for p in layer.parameters() for v in p.grad.double().reshape(-1).tolist()]
    m = max(values)
    return m * math.fsum((v / m) ** 2 for v in values) ** 0.5


def _stages(rank: int) -> dict[str, Any]:
    """Pipeline stages (``norm_group=WORLD``): each rank's own layer, the norm over both."""
    import torch.distributed as dist

    layer = _stage(rank)
    opt = ClippedOptimizer(
        torch.optim.SGD(layer.parameters(), lr=1.0), 1.0, norm_group=dist.group.WORLD, replica_group=None
    )
    _loss(layer, rank, 1).backward()
    opt.step()
    stats = opt.last_stats
    assert stats is not None
    return {"norm": stats.total_norm, "skipped": stats.skipped}


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()
    ]


def norm_overflow_job(rank: int, port: int, out_dir: str) -> None:
    init_world(rank, port)
    res: dict[str, Any] = {}
    for kind in ("ddp", "fsdp"):
        plain = mlp((6, 8, 3))
        model = nn.parallel.DistributedDataParallel(copy.deepcopy(plain)) if kind == "ddp" else _fsdp(plain)
        opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), max_norm=1.0)
        for i in range(2):
            _loss(model, rank, i).backward()
            opt.step()
            opt.zero_grad()
        stats = list(opt.stats)
        res[kind] = {
            "norms": [s.total_norm for s in stats],
            "skipped": [s.skipped for s in stats],
            "reasons": [s.reason for s in stats],
            "params": _full(model),
        }
    res["stages"] = _stages(rank)
    torch.save(res, f"{out_dir}/norm_overflow{rank}.pt")
    leave_process_group()
