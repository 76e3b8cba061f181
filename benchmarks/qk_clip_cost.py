"""The cost of ``qk_clip=QKClip(model)`` on a training step of a small transformer (#35 item 2).

    nice -n 10 python benchmarks/qk_clip_cost.py                  # 15 rounds, 1 thread
    python benchmarks/qk_clip_cost.py --rounds 5 --out /tmp

A language model of 4 ``nn.TransformerEncoderLayer`` (d=256, 4 heads, feed-forward 1024,
batch first), vocabulary 512, batches of 8 sequences of 128 tokens; one training step is the
forward pass, the cross-entropy, the backward pass and ``ClippedOptimizer.step()`` over AdamW
(foreach).  The methods, each on its own copy of the model (same weights):

* ``clip``           ``max_norm=1.0`` (the baseline of the ratios);
* ``qk_clip``        ``max_norm=1.0, qk_clip=QKClip(model)``: every window measured and capped;
* ``qk_clip every=4`` ``max_norm=1.0, qk_clip=QKClip(model, every=4)``: 1 window in 4 measured.

The threshold is the default (100): nothing is capped in this short run, but the cap's
multiplications run every measured window all the same (no host read decides them).  Rounds run the
methods interleaved (A B C, then B C A, ...), each round timing ``--steps`` steps per method after one
warm-up step; ``paired`` is the median over rounds of each round's own ratio to ``clip`` (robust to
a shared machine's load drifting between rounds).  Writes ``qk_clip_cost.md`` and ``.json`` into
``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import cpu_name, paired_ratio, rotated  # noqa: E402

from clipopt import ClippedOptimizer, QKClip  # noqa: E402

V, D, HEADS, FF, LAYERS, BATCH, SEQ = 512, 256, 4, 1024, 4, 8, 128

#: name -> (setting, the QKClip keywords; None: off)
METHODS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "clip": ("max_norm=1.0", None),
    "qk_clip": ("max_norm=1.0, qk_clip=QKClip(model)", {}),
    "qk_clip every=4": ("max_norm=1.0, qk_clip=QKClip(model, every=4)", {"every": 4}),
}


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.out = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder(self.emb(x)))


def make_steps(base: LM) -> dict[str, Callable[[torch.Tensor], None]]:
    """One training step per method, each on its own copy of ``base``."""
    steps = {}
    for name, (_, qk) in METHODS.items():
        model = copy.deepcopy(base)
        part = None if qk is None else QKClip(model, **qk)
        opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), max_norm=1.0, qk_clip=part)

        def step(x: torch.Tensor, model: LM = model, opt: ClippedOptimizer = opt) -> None:
            logits = model(x[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()

        steps[name] = step
    return steps


def measure(rounds: int, per_round: int) -> dict[str, Any]:
    torch.manual_seed(0)
    steps = make_steps(LM())
    x = torch.randint(0, V, (BATCH, SEQ + 1))
    for step in steps.values():
        step(x)  # warm-up: AdamW's state, the allocator
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in rotated(list(steps), r):
            t0 = time.perf_counter()
            for _ in range(per_round):
                steps[name](x)
            times[name].append((time.perf_counter() - t0) / per_round)
    return {
        name: {
            "setting": METHODS[name][0],
            "ms": 1e3 * statistics.median(t),
            "paired": paired_ratio(t, times["clip"]),
        }
        for name, t in times.items()
    }


def render(rows: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"{meta['model']}, AdamW (foreach), torch {meta['torch']}, {meta['cpu']}, "
        f"{meta['threads']} thread(s), {meta['rounds']} interleaved rounds of {meta['steps']} steps "
        "(rotating).",
        "",
        "| method | setting | ms / step (median) | vs clip (paired) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | `{r['setting']}` | {r['ms']:.1f} | {r['paired']:.3f} |" for n, r in rows.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=3, help="steps per method and round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = measure(args.rounds, args.steps)
    params = sum(p.numel() for p in LM().parameters())
    meta = {
        "model": f"{params / 1e6:.1f}M-parameter LM ({LAYERS} layers, d={D}, {HEADS} heads, "
        f"{BATCH}x{SEQ} tokens)",
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "threads": args.threads,
        "rounds": args.rounds,
        "steps": args.steps,
    }
    text = render(rows, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qk_clip_cost.md").write_text(text)
    (args.out / "qk_clip_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
