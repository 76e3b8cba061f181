"""What rescuing an overflowed float32 norm on an accelerator would cost every window (#35).

    nice -n 10 python benchmarks/overflow_cost.py [--threads 2] [--rounds 41]

An accelerator's fused and general closes do not read the norm (a read is a host sync), so
whether a rescue is needed is not known on the host, and whatever looks would run in every
window, healthy or not.  On the CPU, as a proxy for the device work (the same foreach kernels,
no host read), this times, interleaved, the median of:

* ``norm``: the window's norm pass as an accelerator takes it: ``_foreach_norm`` of the
  gradients, stacked, and their norm (``vector_norm``) in float32;
* ``select``: on top of it, the norm of the per-tensor norms again in float64 and
  ``torch.where(isinf(total), that, total)`` (torch's bits where it is finite): rescues a window
  whose per-tensor norms are finite but whose combination overflowed;
* ``select+rule``: and the rule every rescued window must pass (issue #35, part 1: applied only
  where the bound clips it below float32's range of norms), folded into the skip flag on the
  device: the coefficient's norm against the range, and the flag's maximum;
* ``max pass``: on top of ``norm``, each gradient's largest ``|g|`` (``_foreach_norm(.., inf)``,
  one more read of every gradient): what telling a tensor's own overflowed norm from a
  non-finite element takes without a host read.

Each addition is timed on its own (the norms already taken) and printed with ``(norm + it) /
norm``; results/overflow_cost.{json,md} keep the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from clipopt import functional as F

MIXES = {
    "100 x 512 (tiny)": [(512,)] * 100,
    "transformer d=512": [(1536, 512), (512, 512), (2048, 512), (512, 2048)] * 3 + [(512,)] * 12,
    "20 x 4M": [(4096, 1024)] * 20,
}

OUT = Path(__file__).parent / "results"


def _norm(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    norms = torch.stack(torch._foreach_norm(grads, 2.0))
    return norms, torch.linalg.vector_norm(norms, 2.0)


def _select(norms: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    wide = torch.linalg.vector_norm(norms, 2.0, dtype=torch.float64).to(torch.float32)
    return torch.where(torch.isinf(total), wide, total)


def _select_rule(norms: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    over = torch.isinf(total)
    rescued = _select(norms, total)
    coef = (rescued + F.EPS).reciprocal().clamp_max(1.0)  # max_norm 1.0
    flag = (over & (rescued * coef >= F.norm_range(2.0))).to(torch.float32)
    return torch.maximum(flag, (rescued - rescued).ne(0.0).to(torch.float32))


def _max_pass(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.isfinite(torch.stack(torch._foreach_norm(grads, math.inf))).all()


def _time(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The median of each of ``fns`` (interleaved, after one warm-up call each), in microseconds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=41)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    head = f"torch {torch.__version__}, {args.threads} threads, CPU, median of {args.rounds} rounds (us)"
    print(head)
    for name, shapes in MIXES.items():
        grads = [torch.randn(s, generator=gen) for s in shapes]
        norms, total = _norm(grads)
        med = _time(
            {
                "norm": lambda g=grads: _norm(g),
                "select": lambda n=norms, t=total: _select(n, t),
                "select+rule": lambda n=norms, t=total: _select_rule(n, t),
                "max pass": lambda g=grads: _max_pass(g),
            },
            args.rounds,
        )
        row: dict[str, object] = {"shapes": name, "numel": sum(g.numel() for g in grads), "us": med}
        ratio = {k: 1.0 + v / med["norm"] for k, v in med.items() if k != "norm"}
        row["ratio"] = ratio
        rows.append(row)
        print(
            f"{name:20} norm {med['norm']:9.1f} us  "
            + "  ".join(f"{k} +{med[k]:.1f} us x{ratio[k]:.3f}" for k in ratio)
        )
    OUT.mkdir(exist_ok=True)
    (OUT / "overflow_cost.json").write_text(json.dumps({"setup": head, "rows": rows}, indent=1) + "\n")
    lines = [
        "# What rescuing an overflowed norm on an accelerator would cost every window (#35)",
        "",
        f"`python benchmarks/overflow_cost.py`: {head}; each addition timed alone, and the norm pass"
        " with it as a ratio to the norm pass alone.",
        "",
        "| shapes | elements | norm pass (us) | + select (us) | + select and rule (us) | + max pass (us) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        us, ratio = r["us"], r["ratio"]
        assert isinstance(us, dict) and isinstance(ratio, dict)
        cells = [f"+{us[k]:.1f} (x{ratio[k]:.3f})" for k in ("select", "select+rule", "max pass")]
        lines.append(f"| {r['shapes']} | {r['numel']:,} | {us['norm']:.1f} | " + " | ".join(cells) + " |")
    (OUT / "overflow_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
