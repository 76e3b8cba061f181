"""The 2-process gloo job of ``tests/recovery/test_rerun.py``: Rerun under DDP.

Rank 1 alone gets a NaN in its input at window ``FAULT + 1``: on its first execution only (a
transient fault), or on every execution (persistent).  Each rank saves its windows' outcomes,
the ranks its Rerun named, and its final parameters, beside those of a clean run.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any

import torch
from torch import nn

from clipopt import ClippedOptimizer, Rerun

from .distributed_jobs import init_world, leave_process_group
from .helpers import mlp

WORLD = 2
WINDOWS = 6
FAULT = 3  #: the batch (0-based) whose input rank 1 corrupts


def rerun_job(rank: int, port: int, out_dir: str) -> None:
    init_world(rank, port, WORLD)
    tracker = os.path.join(out_dir, "tracker.jsonl")
    result = {
        "clean": _run(rank, None, ()),
        "transient": _run(rank, Rerun(tracker=tracker), (1,)),
        "persistent": _run(rank, Rerun(tracker=tracker), (1, 2)),
        "local-loss": _run(rank, Rerun(), (1, 2), nan_loss=True),
        "grad-fault": _run(rank, Rerun(), (1,), nan_grad=True),
        "grad-fault-unwatched": _run(rank, Rerun(), (1,), nan_grad=True, watch=False),
        "fsdp-clean": _run(rank, None, (), fsdp=True),
        "fsdp-transient": _run(rank, Rerun(), (1,), fsdp=True),
    }
    torch.save(result, os.path.join(out_dir, f"rerun{rank}.pt"))
    leave_process_group()


def _run(
    rank: int,
    rerun: Rerun | None,
    fault_calls: tuple[int, ...],
    *,
    fsdp: bool = False,
    nan_loss: bool = False,
    nan_grad: bool = False,
    watch: bool = True,
) -> dict[str, Any]:
    """DDP (``fsdp``: FSDP2, each Linear sharded, then the whole) over ``mlp((5, 4, 3))``, SGD with
    momentum through ``step(closure=...)``; rank 1's input at batch FAULT holds a NaN on the
    executions ``fault_calls`` (1: the first); ``nan_loss``: instead, rank 1's closure returns a
    NaN loss there, its gradients finite; ``nan_grad``: instead, rank 1's backward pass turns its
    own gradients NaN before DDP reduces them, its loss finite (``watch``: ``Rerun.watch``)."""
    plain = mlp((5, 4, 3))
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in plain:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model: nn.Module = fully_shard(plain)
    else:
        model = nn.parallel.DistributedDataParallel(plain)
        if rerun is not None and watch:
            rerun.watch(model)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), max_norm=1.0, rerun=rerun
    )
    gen = torch.Generator().manual_seed(10 + rank)  # every rank its own data
    batches = [(torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(WINDOWS)]
    calls: Counter[int] = Counter()
    for i, (x, y) in enumerate(batches):

        def closure(i: int = i, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            calls[i] += 1
            hit = rank == 1 and i == FAULT and calls[i] in fault_calls
            if hit and not (nan_loss or nan_grad):
                x = x.clone()
                x[0, 0] = math.nan
            out = model(x)
            if hit and nan_grad:
                out.register_hook(lambda g: g * math.nan)
            loss = ((out - y) ** 2).mean()
            loss.backward()
            return loss.detach() * math.nan if hit and nan_loss else loss

        opt.step(closure=closure)
        opt.zero_grad()
    events = [] if rerun is None else [e for e in rerun.events if e["window"] == FAULT + 1]
    return {
        "reruns": [s.rerun for s in opt.stats],
        "skipped": [bool(s.skipped) for s in opt.stats],
        "ranks": events[-1]["ranks"] if events else None,
        "params": [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in plain.parameters()
        ],
    }
