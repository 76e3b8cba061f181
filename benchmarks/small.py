"""Small models: the fixed cost of a clipopt window against torch's clip + step.

    python benchmarks/small.py                  # 6 rows, 51 rounds, 1 thread
    python benchmarks/small.py --rounds 2       # smoke run, a few seconds

Three models of parameters only (8 tensors of 16x16, 40 of 64x64, 100 of
256x256), each with AdamW ``fused=True`` and ``foreach=True``.  Per row, four
variants run interleaved (A B C D A B C D ... one update each per round) with
``bench.measure`` and the median over rounds is reported:

* ``bare``    ``inner.step()``;
* ``torch``   ``torch.nn.utils.clip_grad_norm_(params, 1.0)`` then ``inner.step()``;
* ``clipopt`` ``ClippedOptimizer(inner, max_norm=1.0, accumulation_steps=1).step()``;
* ``clipopt-noskip`` the same with ``skip_nonfinite=False``: no skip flag, so a fused inner step
  gets no ``found_inf`` (torch then corrects no step counter: on CPU one ``sub_`` per parameter).

Gradients (total norm well above 1, so clipping is active) are restored before
every timed call, outside the timing, the same way for every variant.  Each row
also reports the Python function calls of one ``opt.step()`` that closes a
window (cProfile, after warm-up; the bare ``inner.step()`` for reference) and
the time of a micro-batch ``step()`` call (``accumulation_steps=4``, calls that
do not close the window: the first of a window, right after the closing update
of the previous one, and the second and third).  Writes ``small.md`` and ``small.json`` into
``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import OPTIMIZERS, ROOT, Method, ParamModel, measure

from clipopt import ClippedOptimizer

MODELS: dict[str, tuple[int, int]] = {  # name: (tensors, side)
    "8 tensors of 16x16": (8, 16),
    "40 tensors of 64x64": (40, 64),
    "100 tensors of 256x256": (100, 256),
}
SMALL_OPTIMIZERS = ("AdamW-fused", "AdamW-foreach")


def python_calls(step: Callable[[], Any], restore: Callable[[], None], warmup: int = 3) -> int:
    """Python function calls (cProfile's total) of one ``step()`` after ``warmup`` calls."""
    for _ in range(warmup):
        restore()
        step()
    restore()
    prof = cProfile.Profile()
    prof.runcall(step)
    return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]


def micro_call_s(opt: ClippedOptimizer, rounds: int, windows: int = 20) -> tuple[float, float]:
    """Time of a non-closing ``step()`` (accumulation_steps=4): the first call of a window, and
    the second and third; each the median over ``rounds`` samples of ``windows`` windows.

    The closing call runs untimed; gradients are left as they are (a non-closing call does not
    read them).  The first call after a closing one makes the same Python calls as the others
    but runs with caches that the closing update has just filled with tensor data."""
    first: list[float] = []
    later: list[float] = []
    for _ in range(rounds):
        t_first = t_later = 0.0
        for _ in range(windows):
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            opt.step()
            opt.step()
            t2 = time.perf_counter()
            opt.step()
            t_first += t1 - t0
            t_later += t2 - t1
        first.append(t_first / windows)
        later.append(t_later / (2 * windows))
    return statistics.median(first), statistics.median(later)


def small_methods(params: list[torch.nn.Parameter], opt_name: str) -> list[Method]:
    """The four variants of a row, each with its own optimizer over the same parameters."""
    new = OPTIMIZERS[opt_name]
    bare, ref = new(params), new(params)
    window = ClippedOptimizer(new(params), max_norm=1.0)
    noskip = ClippedOptimizer(new(params), max_norm=1.0, skip_nonfinite=False)

    def clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        ref.step()

    return [
        Method("bare", bare.step, [bare]),
        Method("clip_grad_norm_", clip_then_step, [ref]),
        Method("clipopt", window.step, [window.optimizer]),
        Method("clipopt-noskip", noskip.step, [noskip.optimizer]),
    ]


def measure_row(tensors: int, side: int, opt_name: str, rounds: int) -> dict[str, float]:
    model = ParamModel([(side, side)] * tensors)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)  # total norm well above 1: clipping is active
    saved = [p.grad.clone() for p in params if p.grad is not None]
    grads = [p.grad for p in params]

    def restore() -> None:
        torch._foreach_copy_(grads, saved)  # type: ignore[arg-type]

    res = measure(model, small_methods(params, opt_name), saved, rounds)
    new = OPTIMIZERS[opt_name]
    bare_calls = python_calls(new(params).step, restore)
    window = ClippedOptimizer(new(params), max_norm=1.0, accumulation_steps=1)
    micro_first, micro_later = micro_call_s(
        ClippedOptimizer(new(params), max_norm=1.0, accumulation_steps=4), rounds
    )
    return {
        "bare_s": res["bare"]["update_s"],
        "torch_s": res["clip_grad_norm_"]["update_s"],
        "clipopt_s": res["clipopt"]["update_s"],
        "ratio": res["clipopt"]["update_s"] / res["clip_grad_norm_"]["update_s"],
        "noskip_s": res["clipopt-noskip"]["update_s"],
        "noskip_ratio": res["clipopt-noskip"]["update_s"] / res["clip_grad_norm_"]["update_s"],
        "host_reads": res["clipopt"]["host_reads"],
        "calls_bare": bare_calls,
        "calls_clipopt": python_calls(window.step, restore),
        "micro_first_s": micro_first,
        "micro_later_s": micro_later,
    }


def fmt_time(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us / 1e3:.2f} ms" if us >= 2000 else f"{us:,.0f} µs"


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"torch {meta['torch']}, {meta['threads']} CPU thread(s), median of {meta['rounds']} "
        f"interleaved rounds, {meta['date']}, load average {meta['load']}.",
        "",
        "| model | bare step | torch clip + step | clipopt | clipopt / torch "
        "| without the sync-free skip | Python calls (clipopt window / bare step) "
        "| micro-batch call (1st / 2nd, 3rd) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kind = r["optimizer"].split("-")[1]
        lines.append(
            f"| {r['model']}, {kind} | {fmt_time(r['bare_s'])} | {fmt_time(r['torch_s'])} "
            f"| {fmt_time(r['clipopt_s'])} | {r['ratio']:.2f} | {r['noskip_ratio']:.2f} "
            f"| {r['calls_clipopt']} / {r['calls_bare']} "
            f"| {r['micro_first_s'] * 1e6:.2f} / {r['micro_later_s'] * 1e6:.2f} µs |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=51, help="interleaved rounds (default 51)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for small.md/.json")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for model_name, (tensors, side) in MODELS.items():
        for opt_name in SMALL_OPTIMIZERS:
            row: dict[str, Any] = {
                "model": model_name,
                "optimizer": opt_name,
                **measure_row(tensors, side, opt_name, args.rounds),
            }
            rows.append(row)
            print(
                f"{model_name} {opt_name}: bare {fmt_time(row['bare_s'])}, torch {fmt_time(row['torch_s'])}, "
                f"clipopt {fmt_time(row['clipopt_s'])}, calls {row['calls_clipopt']}",
                flush=True,
            )
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": args.threads,
        "rounds": args.rounds,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "small.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = render(rows, meta)
    (out / "small.md").write_text(table)
    print()
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
