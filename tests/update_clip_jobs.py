"""The gloo job of ``tests/window/test_update_clip.py``: ``UpdateClip`` under DDP and FSDP2, 2 CPU ranks.

Each rank saves what clipopt did (full parameters, update norms and coefficients, reasons, the
settings check's error) next to an independent single-process reference: a plain model given
every rank's micro-batches (the mean gradient), the bare AdamW step, and the update bounded by
hand in float64 NumPy.  The test compares; a job that raises fails the spawn and so the test.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clipopt import ClippedOptimizer, UpdateClip

from .distributed_jobs import WORLD, init_world, leave_process_group
from .helpers import ZeroDivideSGD, mlp

LR = 1e-2
WINDOWS = 4
#: The bounds every scenario uses: some windows bounded, by the reference's own measure.
LIMITS: dict[str, dict[str, float]] = {"max_rms": {"max_rms": 0.008}, "max_norm": {"max_norm": 0.05}}


def _loss(model: nn.Module, rank: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + index)
    x, y = torch.randn(5, 6, generator=gen) * 3, torch.randn(5, 3, generator=gen)
    return nn.functional.mse_loss(model(x), y)


def _coefs(mode: str, updates: list[torch.Tensor]) -> tuple[list[float], float]:
    """Each tensor's coefficient by the published rule, in float64, and the total norm."""
    arrays = [u.double().numpy() for u in updates]
    total = math.sqrt(sum(float((a * a).sum()) for a in arrays))
    if mode == "max_rms":
        limit = LIMITS[mode]["max_rms"]
        return [1.0 / max(1.0, math.sqrt(float((a * a).mean())) / limit) for a in arrays], total
    return [1.0 / max(1.0, total / LIMITS[mode]["max_norm"])] * len(arrays), total


def reference(mode: str) -> dict[str, Any]:
    """One process: per window the mean gradient of every rank's micro-batch, AdamW, the update
    bounded by hand.  Returns the parameters, update norms and smallest coefficients."""
    plain = mlp((6, 8, 3))
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, foreach=True)
    norms, coefs = [], []
    for i in range(WINDOWS):
        opt.zero_grad()
        for r in range(WORLD):
            (_loss(plain, r, i) / WORLD).backward()
        before = [p.detach().clone() for p in plain.parameters()]
        opt.step()
        with torch.no_grad():
            updates = [p - b for p, b in zip(plain.parameters(), before, strict=True)]
            c, total = _coefs(mode, updates)
            for p, b, u, coef in zip(plain.parameters(), before, updates, c, strict=True):
                p.copy_((b.double() + coef * u.double()).float())
        norms.append(total)
        coefs.append(min(c))
    return {"params": [p.detach().clone() for p in plain.parameters()], "norms": norms, "coefs": coefs}


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()
    ]


def _fsdp(plain: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(plain)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _run(model: nn.Module, opt: ClippedOptimizer, rank: int, windows: int = WINDOWS) -> dict[str, Any]:
    """Train ``windows`` windows on this rank's micro-batches; what clipopt did."""
    after = []
    for i in range(windows):
        _loss(model, rank, i).backward()
        opt.step()
        opt.zero_grad()
        after.append(_full(model))
    stats = list(opt.stats)
    return {
        "params": after[-1],
        "after": after,
        "norms": [s.update_norm for s in stats],
        "coefs": [s.update_coef for s in stats],
        "reasons": [s.reason for s in stats],
    }


def _settings_error(rank: int) -> str | None:
    """Rank 1 builds its UpdateClip with another limit: the first step raises on every rank."""
    model = nn.parallel.DistributedDataParallel(mlp((6, 8, 3)))
    limit = 0.008 if rank == 0 else 0.009
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), update_clip=UpdateClip(max_rms=limit)
    )
    _loss(model, rank, 0).backward()
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


def _stages(rank: int) -> dict[str, Any]:
    """Pipeline stages: rank r holds its own layer (norm_group=WORLD), UpdateClip(max_norm=...) over
    both; stage 0's optimizer divides by zero in its third step.  Returns, per window, the norm of
    the change this stage applied, and what clipopt recorded."""
    torch.manual_seed(rank)
    model = nn.Linear(6, 3)
    inner = ZeroDivideSGD(model.parameters(), lr=0.1, bad_calls={3} if rank == 0 else set())
    bound = UpdateClip(max_norm=0.05)
    opt = ClippedOptimizer(inner, None, norm_group=dist.group.WORLD, replica_group=None, update_clip=bound)
    changes = []
    for i in range(4):
        _loss(model, rank, i).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        change = torch.cat(
            [(p.detach() - b).double().reshape(-1) for p, b in zip(model.parameters(), before, strict=True)]
        )
        changes.append(float(change.norm()))
    stats = list(opt.stats)
    return {
        "changes": changes,
        "norms": [s.update_norm for s in stats],
        "coefs": [s.update_coef for s in stats],
        "reasons": [s.reason for s in stats],
    }


def update_clip_job(rank: int, port: int, out_dir: str) -> None:
    init_world(rank, port)
    res: dict[str, Any] = {}
    for mode, limits in LIMITS.items():
        plain = mlp((6, 8, 3))
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
        inner = torch.optim.AdamW(ddp.parameters(), lr=LR, foreach=True)
        res[f"ddp-{mode}"] = _run(ddp, ClippedOptimizer(inner, None, update_clip=UpdateClip(**limits)), rank)
        sharded = _fsdp(plain)
        inner = torch.optim.AdamW(sharded.parameters(), lr=LR, foreach=True)
        res[f"fsdp-{mode}"] = _run(
            sharded, ClippedOptimizer(inner, None, update_clip=UpdateClip(**limits)), rank
        )
    sharded = _fsdp(mlp((6, 8, 3)))
    inner = ZeroDivideSGD(sharded.parameters(), lr=LR, bad_calls={2})
    res["fsdp-nonfinite"] = _run(sharded, ClippedOptimizer(inner, None, update_stats=True), rank, windows=3)
    for kind in ("ddp", "fsdp"):  # rank 1's optimizer alone divides by zero in its second step
        plain = mlp((6, 8, 3))
        model = nn.parallel.DistributedDataParallel(plain) if kind == "ddp" else _fsdp(plain)
        inner = ZeroDivideSGD(model.parameters(), lr=LR, bad_calls={2} if rank == 1 else set())
        opt = ClippedOptimizer(inner, None, update_clip=UpdateClip(max_norm=1.0))
        res[f"{kind}-nonfinite-one-rank"] = _run(model, opt, rank, windows=3)
    res["stages"] = _stages(rank)
    res["settings"] = _settings_error(rank)
    torch.save(res, f"{out_dir}/update_clip{rank}.pt")
    leave_process_group()
