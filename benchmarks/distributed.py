"""The optimizer side of a data-parallel update: clipopt against clip_grad_norm_ + step(), DDP and FSDP2.

Runs ``--world`` processes on the CPU (gloo).  Per update it times, interleaved
(A B A B ...) with medians over ``--rounds``:

* ``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_(params, 1.0)`` then ``inner.step()``;
* ``clipopt``: ``ClippedOptimizer(inner, max_norm=1.0).step()`` (one window, k = 1);

* ``clipopt-local``: the same with ``replica_group=None`` (no agreement collective);

on the same synthetic gradients (restored outside the timing), and counts the
``torch.distributed`` collectives each issues per update (DTensor's own
reductions inside ``clip_grad_norm_`` go through functional collectives and are
not counted).  Under DDP clipopt's one collective is the
agreement of the skip decision (``clip_grad_norm_`` issues none); under FSDP2
both reduce the norm over the shards (one scalar each).  The machine is shared:
compare the ratio, not the milliseconds.

Run:  python benchmarks/distributed.py [--world 2] [--width 512] [--layers 4] [--rounds 30]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from clipopt import ClippedOptimizer


def _count_collectives() -> list[int]:
    count = [0]
    for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            count[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return count


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _run(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    count = _count_collectives()
    results: dict[str, Any] = {}
    for mode in ("ddp", "fsdp2"):
        base = _model(args.width, args.layers)
        if mode == "ddp":
            models = [nn.parallel.DistributedDataParallel(copy.deepcopy(base)) for _ in range(3)]
        else:
            from torch.distributed.fsdp import fully_shard

            models = []
            for _ in range(3):
                m = copy.deepcopy(base)
                for layer in m:
                    fully_shard(layer)
                fully_shard(m)
                models.append(m)
        x = torch.randn(8, args.width)
        for m in models:
            m(x).square().mean().backward()
        grads = [[p.grad.detach().clone() * 50 for p in m.parameters()] for m in models]
        inners = [torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True) for m in models]
        plain_opt = inners[0]
        clipped = ClippedOptimizer(inners[1], max_norm=1.0)
        local = ClippedOptimizer(inners[2], max_norm=1.0, replica_group=None)
        params = [list(m.parameters()) for m in models]

        def restore(i: int, params: list[list[Any]] = params, grads: list[list[Any]] = grads) -> None:
            for p, g in zip(params[i], grads[i], strict=True):
                p.grad.copy_(g)

        def plain(params: list[list[Any]] = params, inner: Any = plain_opt) -> None:
            torch.nn.utils.clip_grad_norm_(params[0], 1.0)
            inner.step()

        methods = (
            ("clip_grad_norm_", plain, 0),
            ("clipopt", clipped.step, 1),
            ("clipopt-local", local.step, 2),
        )
        times: dict[str, list[float]] = {"clip_grad_norm_": [], "clipopt": [], "clipopt-local": []}
        calls: dict[str, int] = {}
        for r in range(args.rounds + 2):
            for name, fn, i in methods:
                restore(i)
                dist.barrier()
                before = count[0]
                t0 = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - t0
                calls[name] = count[0] - before
                if r >= 2:  # the first rounds create state and check settings (once)
                    times[name].append(elapsed)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        results[mode] = {
            "ms": med,
            "ratio": med["clipopt"] / med["clip_grad_norm_"],
            "ratio_local": med["clipopt-local"] / med["clip_grad_norm_"],
            "collectives_per_update": calls,
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/distributed.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    mp.spawn(_run, args=(port, args, args.out), nprocs=args.world, join=True)
    with open(args.out) as f:
        results = json.load(f)
    params = args.layers * (args.width * args.width + args.width)
    print(f"{args.world} processes (gloo, CPU), {params / 1e6:.2f}M parameters, AdamW foreach, k = 1")
    print("clipopt-local: replica_group=None (no agreement collective under DDP)")
    print(f"{'':6} {'clip_grad_norm_ ms':>18} {'clipopt ms':>11} {'ratio':>6} {'local':>6}  collectives")
    for mode, r in results.items():
        print(
            f"{mode:6} {r['ms']['clip_grad_norm_']:18.2f} {r['ms']['clipopt']:11.2f} {r['ratio']:6.2f} "
            f"{r['ratio_local']:6.2f}  "
            f"clip_grad_norm_ {r['collectives_per_update']['clip_grad_norm_']}, "
            f"clipopt {r['collectives_per_update']['clipopt']}"
        )


if __name__ == "__main__":
    main()
