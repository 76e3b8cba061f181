"""The 2-process gloo job of ``tests/test_spike_distributed.py``: SpikeGuard and Rewind under DDP.

Rank 1 alone gets spiking batches (targets 1000 times larger) at known windows,
and the guard watches the loss only: without agreement rank 0 (normal loss)
would apply what rank 1 skips.  Each rank saves what it decided and its final
state; the test compares the ranks.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from clipopt import ClippedOptimizer, Rewind, SpikeGuard

from .distributed_jobs import init_world, leave_process_group
from .helpers import mlp

WORLD = 2
SPIKES = (12, 14)  #: batch indices (0-based) that spike on rank 1
WINDOWS = 24


def spike_job(rank: int, port: int, out_dir: str) -> None:
    init_world(rank, port, WORLD)
    for kind in ("ddp", "fsdp"):
        result = _run(kind, rank)
        torch.save(result, os.path.join(out_dir, f"{kind}{rank}.pt"))
    leave_process_group()


def _run(kind: str, rank: int) -> dict[str, Any]:
    """DDP: SpikeGuard + Rewind; FSDP2 (DTensor parameters): SpikeGuard (with Rewind: test_rewind_fsdp)."""
    plain = mlp((5, 4, 3))  # Linear(5, 4), Tanh, Linear(4, 3), global seed 0
    rewind = None
    if kind == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(plain)
        rewind = Rewind(every=5, keep=2, spikes=2, within=5, skip_batches=2, module=model, check_every=1)
    else:
        from torch.distributed.fsdp import fully_shard

        model = plain
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        spike_guard=SpikeGuard(z_thresh=50.0, window=8, warmup=4, signals=("loss",)),
        rewind=rewind,
    )
    gen = torch.Generator().manual_seed(10 + rank)  # every rank its own data
    batches = []
    for i in range(WINDOWS):
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
        batches.append((x, y * 1000 if rank == 1 and i in SPIKES else y))
    reasons, losses = [], []
    for x, y in opt.rewind.batches(batches) if opt.rewind is not None else batches:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        assert opt.last_stats is not None
        reasons.append(opt.last_stats.reason)
        losses.append(float(loss))
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in plain.parameters()]
    return {
        "reasons": reasons,
        "rewinds": opt.rewinds,
        "log": [] if rewind is None else [e.to_dict() for e in rewind.log],
        "params": [p.detach().clone() for p in params],
        "history": opt.spike_guard.history["loss"] if opt.spike_guard is not None else [],
        "losses": losses,
    }
