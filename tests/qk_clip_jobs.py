"""The gloo job of ``tests/distributed/test_qk_clip_distributed.py``: QKClip on 2 ranks, under DDP and
under FSDP2 (``fully_shard``: the attention's ``in_proj_weight`` split by rows, the query rows on rank 0,
the key rows across both ranks).

Each rank feeds its own batch, so each measures other logits; the ranks must agree on the largest
(``all_reduce(MAX)``) and apply the same cap, each to the rows it holds.  The job saves, per rank,
its batch, the full weights before and after one window (SGD at lr 0: the weights change by the cap
alone) and the recorded ``max_logit``; the test computes the reference from both ranks' batches.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from clipopt import ClippedOptimizer, QKClip

from .distributed_jobs import init_world, leave_process_group

E, H, L = 16, 4, 5
THRESHOLD = 20.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.out = nn.Linear(E, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, x, x)[0])


def net() -> Net:
    """The same model on every rank (seed 0), its attention weights scaled so that logits reach ~100."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.attn.in_proj_weight.mul_(6.0)
        model.attn.in_proj_bias.normal_()
    return model


def batch(rank: int) -> torch.Tensor:
    """Rank 1's batch is four times rank 0's scale: its logits are the larger ones."""
    torch.manual_seed(100 + rank)
    return torch.randn(2, L, E) * (0.5 + 1.5 * rank)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _window(model: nn.Module, rank: int) -> dict[str, Any]:
    """One window of SGD at lr 0 with QKClip; the weights before and after, and the recorded logit."""
    qk = QKClip(model, threshold=THRESHOLD)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), max_norm=None, qk_clip=qk)
    attn = model.module.attn if hasattr(model, "module") else model.attn
    before = [_full(attn.in_proj_weight), _full(attn.in_proj_bias)]
    x = batch(rank)
    model(x).square().mean().backward()
    opt.step()
    after = [_full(attn.in_proj_weight), _full(attn.in_proj_bias)]
    return {"x": x, "before": before, "after": after, "max_logit": opt.last_stats.max_logit}


def qk_clip_job(rank: int, port: int, out_dir: str) -> None:
    init_world(rank, port)
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    res: dict[str, Any] = {"ddp": _window(DistributedDataParallel(net()), rank)}
    sharded = copy.deepcopy(net())
    fully_shard(sharded)
    assert type(sharded.attn.in_proj_weight).__name__ == "DTensor"
    res["fsdp"] = _window(sharded, rank)
    torch.save(res, os.path.join(out_dir, f"qk{rank}.pt"))
    leave_process_group()
