"""Data-parallel training with ClippedOptimizer: DDP or FSDP2, gradient accumulation with no_sync.

Runs 2 processes on the CPU (gloo backend); each reads its own shard of the data.
Every rank takes the same skip decision (under DDP one small all-reduce per
window agrees it, and reports replicas whose gradients diverged); loggers given
on every rank write on rank 0.

Run:  python examples/data_parallel.py [--fsdp] [--steps 40] [--csv grads.csv]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import clipopt

WORLD = 2
ACCUMULATION = 4


def train(rank: int, port: int, fsdp: bool, steps: int, csv: str | None) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)  # the same initial weights on every rank
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    )
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = clipopt.ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        max_norm=1.0,
        accumulation_steps=ACCUMULATION,
        loggers=[clipopt.CSVLogger(csv)] if csv else [],  # the same path on every rank: rank 0 writes
    )
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    true_w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    for _ in range(steps * ACCUMULATION):
        x = torch.randn(32, 16, generator=gen)
        y = torch.sin(x @ true_w / 4)
        if rank == 1 and opt.num_windows == 5 and opt.micro_batches == 0:
            x[0, 0] = float("nan")  # one bad micro-batch on one rank: every rank skips that update
        with opt.no_sync(model):  # all-reduce only on each window's last micro-batch
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
    opt.flush()  # collective: every rank calls it
    opt.close()
    if rank == 0:
        print(
            f"{'FSDP2' if fsdp else 'DDP'}: {opt.num_updates} updates applied, {opt.num_skipped} skipped; "
            f"last loss {loss.item():.4f}, last pre-clip norm {float(opt.last_stats.total_norm):.3f}"
        )
    dist.barrier()
    dist.destroy_process_group()
    # On CPU, gloo's teardown can abort a rank at interpreter exit ("terminate called without an
    # active exception", a torch race seen here in about one run in four): leave without it.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--steps", type=int, default=40, help="optimizer updates")
    ap.add_argument("--csv", default=None, help="write one row per update to this CSV file (rank 0)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(train, args=(port, args.fsdp, args.steps, args.csv), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
