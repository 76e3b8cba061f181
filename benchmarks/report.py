"""``clipopt report`` on a 1,000,000-row clipopt CSV: time to read, analyse and render (target <= 3 s).

Run: ``PYTHONPATH=. python benchmarks/report.py [--rows N]``.  Writes a synthetic
log (log-normal norms, a falling loss, per-layer rows every 100 updates) once
into a temporary folder, then times ``read_log`` + ``analyze`` + ``format_report``
three times and prints the median and the peak memory of the columns.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

from clipopt._report.report import analyze, format_report, read_log

HEADER = "step,micro_batches,total_norm,clip_coef,clipped,skipped,reason,max_norm,lr,loss"


def write(path: Path, rows: int, sigma: float = 0.4) -> None:
    """``sigma``: the spread of log-norms (and, above 0.4, of the loss's noise): 2.0 is a heavy-tailed run."""
    rng = random.Random(0)
    layers = ["0.weight", "0.bias", "2.weight", "2.bias"]
    fields = ["grad_norm", "grad_max", "grad_min", "nonfinite", "param_norm"]
    with path.open("w") as f:
        f.write(HEADER + "," + ",".join(f"{n}.{x}" for n in layers for x in fields) + "\n")
        empty = "," * (len(layers) * len(fields))
        for i in range(1, rows + 1):
            norm = math.exp(rng.gauss(0.0, sigma))
            coef = min(1.0, 2.0 / (norm + 1e-6))
            loss = 3.0 * math.exp(-i / rows) + rng.random() * 0.1
            if sigma > 0.4:
                loss *= math.exp(rng.gauss(0.0, sigma))
            base = f"{i},1,{norm!r},{coef!r},{int(coef < 1)},0,,2.0,0.001,{loss!r}"
            if i % 100 == 0:
                f.write(base + "," + ",".join("0.5,0.1,0.0,0,3.0" for _ in layers) + "\n")
            else:
                f.write(base + empty + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--sigma", type=float, default=0.4, help="log-norm spread; 2.0: heavy-tailed")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as `clipopt report` does
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "grads.csv"
        write(path, args.rows, args.sigma)
        size = path.stat().st_size / 1e6
        times, read_times = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            log = read_log(path)
            t1 = time.perf_counter()
            report = analyze(log)
            format_report(report)
            times.append(time.perf_counter() - t0)
            read_times.append(t1 - t0)
        tracemalloc.start()
        log = read_log(path)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"rows: {args.rows:,} ({size:.0f} MB), verdict: {report['verdict']}")
        print(f"read_log: median {statistics.median(read_times):.2f} s")
        print(f"read + analyze + render: median {statistics.median(times):.2f} s (target <= 3 s)")
        print(
            f"peak Python memory while reading: {peak / 1e6:.0f} MB (columns: {len(log) * 8 * 6 / 1e6:.0f} MB)"  # noqa: E501
        )


if __name__ == "__main__":
    main()
