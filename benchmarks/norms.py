"""Total-norm kernels on this machine: clipopt.functional.get_total_norm against torch.

    python benchmarks/norms.py [--threads 2] [--rounds 21]

For each p in (1, 2, 3, inf) and three shape mixes it times, interleaved, the
median of ``clipopt.functional.get_total_norm`` (the per-device choice: dot or
aminmax for large CPU tensors, ``_foreach_norm`` otherwise), the same with
``foreach=True`` forced, and ``torch.nn.utils.get_total_norm``; it prints the
ratios and the relative error of each against a float64 reference.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from clipopt import functional as F

MIXES = {
    "100 x 512 (tiny)": [(512,)] * 100,
    "transformer d=512": [(1536, 512), (512, 512), (2048, 512), (512, 2048)] * 3 + [(512,)] * 12,
    "20 x 4M": [(4096, 1024)] * 20,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} rounds")
    print(
        f"{'shapes':20} {'p':>4} {'clipopt ms':>11} {'foreach ms':>11} {'torch ms':>9} {'x torch':>8} "
        f"{'err clipopt':>12} {'err torch':>10}"
    )
    for name, shapes in MIXES.items():
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p in (1.0, 2.0, 3.0, math.inf):
            fns = {
                "clipopt": lambda g=grads, q=p: F.get_total_norm(g, q),
                "foreach": lambda g=grads, q=p: F.get_total_norm(g, q, foreach=True),
                "torch": lambda g=grads, q=p: torch.nn.utils.get_total_norm(g, q),
            }
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            truth = torch.nn.utils.get_total_norm([g.double() for g in grads], p).item()
            err = {k: abs(f().item() - truth) / truth for k, f in fns.items()}
            print(
                f"{name:20} {p:>4} {med['clipopt']:>11.3f} {med['foreach']:>11.3f} {med['torch']:>9.3f} "
                f"{med['clipopt'] / med['torch']:>8.2f} {err['clipopt']:>12.1e} {err['torch']:>10.1e}"
            )


if __name__ == "__main__":
    main()
