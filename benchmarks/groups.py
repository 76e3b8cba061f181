"""The cost of per-group clipping: one parameter group with its own bound, against the shared bound.

    python benchmarks/groups.py                 # large model, fused and foreach AdamW
    python benchmarks/groups.py --model medium --rounds 5

The model (``bench.py``'s shapes) is split into two parameter groups: the
first layer's tensors ("head", ~1/8 of the parameters) and the rest.  Methods,
measured in one process, interleaved (A B C D, then B C D A, ...: the order rotates every
round), medians over rounds:

* ``shared``    both groups without keys: one bound for all (the single-bound path);
* ``own``       the head group has ``'max_norm': 0.5`` (clipped by its own norm);
* ``excluded``  the head group has ``'max_norm': None`` (left out of norm clipping);
* ``bare``      the inner optimizer's ``step()`` alone, for scale.

On a fused optimizer the shared groups' coefficient still goes into the
kernel's ``grad_scale``; the head group takes one extra in-place scaling pass.
Ratios are against ``shared`` from the same run: of the medians, and the median of each round's
own ratio (``paired``: robust to the load of a shared machine drifting between rounds).  Host
reads per update are counted too (tests/hostreads.py): 0 on the fused optimizer for every method.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import MODELS, ParamModel, paired_ratio, rotated  # noqa: E402

from clipopt import ClippedOptimizer  # noqa: E402
from tests.hostreads import count_host_reads  # noqa: E402

INNER: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "AdamW-fused": lambda groups: torch.optim.AdamW(groups, lr=1e-4, fused=True),
    "AdamW-foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-4, foreach=True),
}

#: tensors per transformer layer in bench.transformer_shapes
_PER_LAYER = 12


def _groups(params: list[torch.nn.Parameter], head: Any) -> list[dict[str, Any]]:
    """Two groups: the first layer's tensors (with ``head`` as its options) and the rest."""
    first: dict[str, Any] = {"params": params[:_PER_LAYER], **head}
    return [first, {"params": params[_PER_LAYER:]}]


def make_methods(model: ParamModel, inner: str) -> dict[str, Callable[[], None]]:
    params = list(model.parameters())
    new = INNER[inner]
    bare = new(_groups(params, {}))
    shared = ClippedOptimizer(new(_groups(params, {})), max_norm=1.0)
    own = ClippedOptimizer(new(_groups(params, {"max_norm": 0.5})), max_norm=1.0)
    excluded = ClippedOptimizer(new(_groups(params, {"max_norm": None})), max_norm=1.0)
    return {"shared": shared.step, "own": own.step, "excluded": excluded.step, "bare": bare.step}


def measure(model: ParamModel, methods: dict[str, Callable[[], None]], rounds: int) -> dict[str, Any]:
    grads = [p.grad for p in model.parameters()]
    saved = [g.clone() for g in grads if g is not None]

    def restore() -> None:
        torch._foreach_copy_(grads, saved)  # type: ignore[arg-type]

    for update in methods.values():  # warm-up: optimizer state, first-update paths
        for _ in range(2):
            restore()
            update()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(rounds):
        for name in rotated(names, r):
            update = methods[name]
            restore()
            gc.disable()
            t0 = time.perf_counter()
            update()
            times[name].append(time.perf_counter() - t0)
            gc.enable()
    out: dict[str, Any] = {}
    for name, update in methods.items():
        restore()
        with count_host_reads() as reads:
            update()
        out[name] = {"update_s": statistics.median(times[name]), "host_reads": len(reads)}
    base = out["shared"]["update_s"]
    for name, row in out.items():
        row["vs_shared"] = row["update_s"] / base
        row["paired_vs_shared"] = paired_ratio(times[name], times["shared"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="large", choices=[m for m in MODELS if m != "tiny"])
    names = ",".join(INNER)
    ap.add_argument("--optimizers", default=names, help=f"comma-separated subset of {names}")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "groups.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = ParamModel(MODELS[args.model]())
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 0.05  # norms well above the bounds: clipping is active
    n_params = sum(p.numel() for p in model.parameters())
    head = sum(p.numel() for p in list(model.parameters())[:_PER_LAYER])
    rows: dict[str, Any] = {}
    for inner in args.optimizers.split(","):
        rows[inner] = measure(model, make_methods(model, inner), args.rounds)
        gc.collect()
        line = ", ".join(
            f"{k} {v['update_s'] * 1e3:.1f} ms ({v['vs_shared']:.3f}x; paired {v['paired_vs_shared']:.3f}x; "
            f"{v['host_reads']} reads)"
            for k, v in rows[inner].items()
        )
        print(f"{args.model} {inner}: {line}", flush=True)
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "rounds": args.rounds,
        "model": args.model,
        "params": n_params,
        "head_params": head,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
