"""Cost of the diagnostics: per-layer statistics and CSV logging, per update.

    python benchmarks/diagnostics.py [--rounds 7] [--threads 2] [--optimizer AdamW-fused]

On a 25M-parameter transformer-shaped model, time per update (the mean over a
block of 10 windows, median over interleaved rounds) of ClippedOptimizer with
max_norm=1.0 and:

* ``plain``        no diagnostics;
* ``layers@1``     ``layer_stats=True`` (statistics every update);
* ``layers@10``    ``layer_stats=10``;
* ``csv``          ``loggers=[CSVLogger(...)]`` (one row per update, flushed every 100);
* ``csv+layers@10`` both.

A last line times ``layers@10`` window by window: the windows between
statistics windows, and what its statistics window costs over a plain one.
``x plain`` divides the medians; ``x plain, paired`` is the median over rounds of each
round's ratio to that round's ``plain`` block (the order of the configurations rotates
every round), steadier on a shared machine.  Also the host reads per block of 10
windows.  Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench import OPTIMIZERS, ParamModel, paired_ratio, rotated, transformer_shapes  # noqa: E402
from clipopt import ClippedOptimizer, CSVLogger  # noqa: E402
from tests.hostreads import count_host_reads  # noqa: E402

BLOCK = 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--optimizer", default="AdamW-fused", choices=list(OPTIMIZERS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = ParamModel(transformer_shapes(768, 3) + transformer_shapes(512, 1))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 0.05
    grads = [p.grad for p in params]
    saved = [g.clone() for g in grads if g is not None]
    n_params = sum(p.numel() for p in params)
    tmp = Path(tempfile.mkdtemp())
    new = OPTIMIZERS[args.optimizer]

    def make(**kw: object) -> ClippedOptimizer:
        return ClippedOptimizer(new(params), max_norm=1.0, **kw)  # type: ignore[arg-type]

    configs = {
        "plain": make(),
        "layers@1": make(layer_stats=True),
        "layers@10": make(layer_stats=10),
        "csv": make(loggers=[CSVLogger(tmp / "a.csv")]),
        "csv+layers@10": make(layer_stats=10, loggers=[CSVLogger(tmp / "b.csv")]),
    }

    windows: dict[str, list[list[float]]] = {k: [] for k in configs}  # each round's window times

    def block(opt: ClippedOptimizer, name: str | None = None) -> float:
        each = []
        for _ in range(BLOCK):
            torch._foreach_copy_(grads, saved)  # type: ignore[arg-type]
            t0 = time.perf_counter()
            opt.step()
            each.append(time.perf_counter() - t0)
        if name is not None:
            windows[name].append(each)
        return sum(each) / BLOCK

    for opt in configs.values():
        block(opt)  # warm-up: state, first-update path
    times: dict[str, list[float]] = {k: [] for k in configs}
    names = list(configs)
    for r in range(args.rounds):  # the order rotates every round: no configuration always runs first
        for name in rotated(names, r):
            times[name].append(block(configs[name], name))
    reads = {}
    for name, opt in configs.items():
        with count_host_reads() as r:
            block(opt)
        reads[name] = len(r)
    base = statistics.median(times["plain"])
    print(
        f"{n_params / 1e6:.1f}M parameters, {len(params)} tensors, {args.optimizer}, "
        f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} rounds of {BLOCK}"
    )
    print()
    print("| diagnostics | ms / update | x plain | x plain, paired | host reads / 10 updates |")
    print("|---|---|---|---|---|")
    for name in configs:
        med = statistics.median(times[name])
        paired = paired_ratio(times[name], times["plain"])
        print(f"| {name} | {med * 1e3:.2f} | {med / base:.3f} | {paired:.3f} | {reads[name]} |")
    # window by window (the 10th of each block is layers@10's statistics window): steadier than a block
    at = [statistics.median(w[i] for w in windows["plain"]) for i in range(BLOCK)]
    stats_at = [statistics.median(w[i] for w in windows["layers@10"]) for i in range(BLOCK)]
    plain_window, between = statistics.median(at), statistics.median(stats_at[: BLOCK - 1])
    extra = stats_at[-1] - plain_window
    print()
    print(
        f"Window by window (medians): plain {plain_window * 1e3:.2f} ms; layers@10 between statistics "
        f"windows {between * 1e3:.2f} ms, its statistics window {stats_at[-1] * 1e3:.2f} ms "
        f"(+{extra * 1e3:.2f} ms = {extra / plain_window:.2f} of a plain window: "
        f"+{100 * extra / plain_window / BLOCK:.1f} % per update at k={BLOCK})."
    )


if __name__ == "__main__":
    main()
