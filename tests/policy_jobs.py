"""The per-tensor policies under FSDP2, run by ``tests/test_policy_fsdp.py`` in 2 gloo processes.

Each rank trains its FSDP2 shards of a small model with ``max_norm=AdaGC(...)`` or
``StableSPAM(...)`` around AdamW, and saves the full parameters next to those of one process
stepping ``pytorch_optimizer``'s optimizer on the mean gradient of both ranks' micro-batches.
The norms and largest ``|g|`` of the sharded tensors must be those of the full tensors.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from pytorch_optimizer import AdaGC as ReferenceAdaGC
from pytorch_optimizer import StableSPAM as ReferenceStableSPAM

from clipopt import AdaGC, ClippedOptimizer, StableSPAM

from .distributed_jobs import _fsdp, _full, _full_grads, _loss, _model, init_world, leave_process_group

UPDATES = 8
SPIKE = {5: 1e3}  # update -> factor on every gradient
ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def _policies() -> dict[str, tuple[Any, Any]]:
    """Name -> (clipopt policy, reference optimizer factory), the same settings."""
    return {
        "adagc": (
            AdaGC(warmup=3),
            lambda params: ReferenceAdaGC(params, warmup_steps=3, **ADAM),
        ),
        "stable_spam": (
            StableSPAM(),
            lambda params: ReferenceStableSPAM(params, update_proj_gap=10**9, **ADAM),
        ),
    }


def _sharded_run(base: torch.nn.Module, rank: int, policy: Any) -> tuple[list[torch.Tensor], list[bool]]:
    """FSDP2 shards of ``base`` trained for :data:`UPDATES` updates: the full parameters, and
    whether each update was clipped."""
    model = _fsdp(base)
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), foreach=False, **ADAM), max_norm=policy)
    clipped = []
    for i in range(UPDATES):
        (_loss(model, rank, i) * SPIKE.get(i, 1.0)).backward()
        opt.step()
        opt.zero_grad()
        clipped.append(bool(opt.last_stats.clipped))  # type: ignore[union-attr]
    return _full(model), clipped


def _reference_run(base: torch.nn.Module, make: Any) -> list[torch.Tensor]:
    """One process: the reference optimizer on the mean gradient over both ranks' micro-batches."""
    plain = copy.deepcopy(base)
    opt = make(list(plain.parameters()))
    for i in range(UPDATES):
        grads = _full_grads(plain, [i])
        for p, g in zip(plain.parameters(), grads, strict=True):
            p.grad = (g * SPIKE.get(i, 1.0)).float()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in plain.parameters()]


def fsdp_policy_job(rank: int, port: int, out_dir: str) -> None:
    init_world(rank, port)
    base = _model()
    res: dict[str, Any] = {}
    for name, (policy, make) in _policies().items():
        params, clipped = _sharded_run(base, rank, policy)
        res[name] = {"params": params, "clipped": clipped, "ref_params": _reference_run(base, make)}
    torch.save(res, os.path.join(out_dir, f"fsdp_policy{rank}.pt"))
    leave_process_group()
