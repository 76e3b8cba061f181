"""The data-parallel run of ``test_replay``: 2 processes on gloo train ``log_model`` under DDP.

At update 2 rank 1's batch holds a NaN input; the all-reduce carries it into rank
0's gradients too, so both ranks skip the update and each writes its own
snapshot (``-rank0.pt``, ``-rank1.pt``) holding its own batch.
"""

from __future__ import annotations

import torch
from torch import nn

from clipopt import ClippedOptimizer

from .distributed_jobs import init_world, leave_process_group
from .replay_models import BAD_ROW, batch, log_model, mse

WORLD = 2
NAN_RANK = 1
NAN_STEP = 2


def ddp_snapshot_job(rank: int, port: int, out_dir: str) -> None:
    """Three updates under DDP with ``snapshot_dir=out_dir``; rank 1's batch of update 2 has a NaN."""
    init_world(rank, port, WORLD)
    model = nn.parallel.DistributedDataParallel(log_model())
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        max_norm=1.0,
        param_names=model.named_parameters(),  # "module.lin.weight", ...: replay drops the "module."
        snapshot_dir=out_dir,
    )
    for step in range(1, 4):
        x, y = batch(10 * rank + step)
        if rank == NAN_RANK and step == NAN_STEP:
            x[BAD_ROW, 1] = float("nan")
        opt.attach(inputs=x, targets=y)
        mse(model, {"inputs": x, "targets": y}).backward()
        opt.step()
        opt.zero_grad()
    leave_process_group()
