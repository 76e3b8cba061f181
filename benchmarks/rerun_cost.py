"""The cost of ``Rerun`` on a healthy run, and of one rerun.

    nice -n 10 python benchmarks/rerun_cost.py                 # 15 rounds of 20 windows, 1 thread
    python benchmarks/rerun_cost.py --rounds 5 --windows 10 --width 256

One training step through the closure form (``opt.step(closure=...)``: forward, backward, clip,
AdamW step) of an MLP (4 Linear layers of ``--width``, batch 64, dropout 0.1), for:

* ``closure``  ``ClippedOptimizer(AdamW, max_norm=1.0)`` (the baseline of the ratios);
* ``rerun``    the same with ``rerun=Rerun()``, no anomaly: what a healthy run pays (the RNG states
  captured at each window's first closure, the decision read on the host once per window);
* ``rerun-fault`` the same with a NaN written into a gradient on the first execution of every
  ``--fault-every``-th window (a transient fault): what the reruns add on top (each one executes
  the window's closure again).

Methods run interleaved with the order rotating every round, ``--windows`` windows per method
per round; ``x closure`` is the median of each round's own ratio to ``closure`` (robust to a
shared machine's load drifting between rounds).  Closure calls are counted.  Writes
``rerun_cost.md`` and ``.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import cpu_name, paired_ratio, rotated  # noqa: E402

from clipopt import ClippedOptimizer, Rerun  # noqa: E402

METHODS = ("closure", "rerun", "rerun-fault")


class _Run:
    """One method's model, optimizer and data, trained a few windows at a time."""

    def __init__(self, method: str, width: int, fault_every: int) -> None:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1)]
        self.model = nn.Sequential(*layers, nn.Linear(width, 10))
        rerun = Rerun() if method != "closure" else None
        self.opt = ClippedOptimizer(
            torch.optim.AdamW(self.model.parameters(), lr=1e-3), max_norm=1.0, rerun=rerun
        )
        self.fault_every = fault_every if method == "rerun-fault" else 0
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(64, width, generator=gen), torch.randint(0, 10, (64,), generator=gen)
        self.window = 0
        self.calls = 0

    def windows(self, n: int) -> None:
        for _ in range(n):
            self.window += 1
            first = [True]
            fault = self.fault_every > 0 and self.window % self.fault_every == 0

            def closure(first: list[bool] = first, fault: bool = fault) -> torch.Tensor:
                self.calls += 1
                loss = nn.functional.cross_entropy(self.model(self.x), self.y)
                loss.backward()
                if fault and first[0]:
                    self.model[0].weight.grad[0, 0] = math.nan
                first[0] = False
                return loss

            self.opt.step(closure=closure)
            self.opt.zero_grad()


def measure(rounds: int, windows: int, width: int, fault_every: int) -> dict[str, Any]:
    runs = {m: _Run(m, width, fault_every) for m in METHODS}
    for run in runs.values():  # warm-up
        run.windows(3)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(rounds):
        for m in rotated(list(METHODS), r):
            start = time.perf_counter()
            runs[m].windows(windows)
            times[m].append((time.perf_counter() - start) / windows)
    total = 3 + rounds * windows
    return {
        m: {
            "median_ms": 1e3 * statistics.median(times[m]),
            "x_closure": paired_ratio(times[m], times["closure"]),
            "closure_calls_per_window": runs[m].calls / total,
            "reruns": len(runs[m].opt.rerun.events) if runs[m].opt.rerun is not None else 0,
        }
        for m in METHODS
    }


def render(rows: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# Rerun's cost (benchmarks/rerun_cost.py)",
        "",
        f"{meta['cpu']}, torch {meta['torch']}, {meta['threads']} thread(s), MLP width {meta['width']}, "
        f"{meta['rounds']} rounds of {meta['windows']} windows per method, a fault every "
        f"{meta['fault_every']} windows in `rerun-fault`.",
        "",
        "| method | ms per window (median) | x closure (paired) | closure calls per window | reruns |",
        "|---|---|---|---|---|",
    ]
    for m, row in rows.items():
        lines.append(
            f"| `{m}` | {row['median_ms']:.3f} | {row['x_closure']:.3f} | "
            f"{row['closure_calls_per_window']:.3f} | {row['reruns']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--fault-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = measure(args.rounds, args.windows, args.width, args.fault_every)
    meta = {
        "cpu": cpu_name(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": args.threads,
        "rounds": args.rounds,
        "windows": args.windows,
        "width": args.width,
        "fault_every": args.fault_every,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rerun_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    text = render(rows, meta)
    (args.out / "rerun_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
