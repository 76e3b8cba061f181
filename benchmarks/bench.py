"""Time, memory and host reads of one optimizer update: clipopt against the alternatives.

    python benchmarks/bench.py              # every model, optimizer and accumulation
    python benchmarks/bench.py --quick      # tiny + medium, fewer rounds

Methods, measured in one process and interleaved (A B C ... per round, the
median over rounds; machines here are shared and noisy, so only ratios from
the same run are compared):

* ``bare``            the inner optimizer's ``step()`` alone;
* ``bare+read``       one read of every gradient (``g.sum()``) then ``step()``: the floor of any
                      clipping that measures the gradients (``x bare+read`` in the table);
* ``clip_grad_norm_`` ``torch.nn.utils.clip_grad_norm_(params, 1.0)`` then ``step()``;
* ``clipopt``         ``ClippedOptimizer(inner, max_norm=1.0, accumulation_steps=k)``,
                      the k ``step()`` calls of one window;
* ``clipopt+update_clip`` the same with ``update_clip=UpdateClip(max_rms=1.0)``: the copy of
                      the parameters and inner state, the update's norms and bound;
* ``zclip``           ``zclip.ZClip(max_grad_norm=None).step(model)`` then ``step()`` (extra ``bench``);
* ``autoclip``        ``autoclip.torch.QuantileClip(params, 0.9, 1000, global_threshold=True).step()``
                      then ``step()`` (extra ``bench``).

Gradients are synthetic (restored before every timed call, outside the timing),
so the numbers are the optimizer side of a training step only.  Peak memory is
the largest sum of live tensors allocated during one update (parameters,
gradients and optimizer state excluded), added to the resident
parameters + gradients + state; host reads are counted with tests/hostreads.py.
Writes a markdown table and a JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clipopt import ClippedOptimizer, UpdateClip  # noqa: E402
from tests.hostreads import count_host_reads  # noqa: E402

# ----------------------------------------------------------------------------- models


class ParamModel(torch.nn.Module):
    """Just parameters, with the shapes of a real model (no forward is needed)."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes)


def tiny_shapes() -> list[tuple[int, ...]]:
    """~100 tensors, ~50k parameters: 50 Linear(31, 32)."""
    return [s for _ in range(50) for s in ((32, 31), (32,))]


def transformer_shapes(d: int, layers: int) -> list[tuple[int, ...]]:
    """Per layer: qkv, out-proj, two MLP matrices, their biases, two LayerNorms."""
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
        shapes += [(d,), (d,), (d,), (d,)]
    return shapes


MODELS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "tiny": tiny_shapes,
    "medium": lambda: transformer_shapes(512, 3),  # ~9.5M
    "24m": lambda: transformer_shapes(768, 3) + transformer_shapes(512, 1),  # ~24.4M, diagnostics.py's
    "large": lambda: transformer_shapes(1024, 8),  # ~101M
}

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "AdamW-fused": lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
    "AdamW-foreach": lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
}

# ----------------------------------------------------------------------------- methods


@dataclass
class Method:
    name: str
    update: Callable[[], None]  #: one whole update (a window of k calls for clipopt)
    optimizers: list[torch.optim.Optimizer]  #: whose state counts as resident memory


def make_methods(model: ParamModel, opt_name: str, accumulation: int, peers: bool) -> list[Method]:
    params = list(model.parameters())
    new = OPTIMIZERS[opt_name]
    methods: list[Method] = []

    bare = new(params)
    methods.append(Method("bare", lambda: bare.step(), [bare]))

    floor = new(params)

    def read_then_step() -> None:
        for p in params:
            if p.grad is not None:
                p.grad.sum()  # one read of each gradient: what measuring a norm costs at least
        floor.step()

    methods.append(Method("bare+read", read_then_step, [floor]))

    ref = new(params)

    def clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        ref.step()

    methods.append(Method("clip_grad_norm_", clip_then_step, [ref]))

    wrapped = ClippedOptimizer(new(params), max_norm=1.0, accumulation_steps=accumulation)

    def clipopt_window() -> None:
        for _ in range(accumulation):
            wrapped.step()

    methods.append(Method("clipopt", clipopt_window, [wrapped.optimizer]))

    bounded = ClippedOptimizer(
        new(params), max_norm=1.0, accumulation_steps=accumulation, update_clip=UpdateClip(max_rms=1.0)
    )

    def update_clip_window() -> None:
        for _ in range(accumulation):
            bounded.step()

    methods.append(Method("clipopt+update_clip", update_clip_window, [bounded.optimizer]))

    if peers:
        try:
            import zclip

            zc = zclip.ZClip(max_grad_norm=None)
            zopt = new(params)

            def zclip_step() -> None:
                zc.step(model)
                zopt.step()

            methods.append(Method("zclip", zclip_step, [zopt]))
        except ImportError:
            pass
        try:
            from autoclip.torch import QuantileClip

            qc = QuantileClip(iter(params), quantile=0.9, history_length=1000, global_threshold=True)
            qopt = new(params)

            def autoclip_step() -> None:
                qc.step()
                qopt.step()

            methods.append(Method("autoclip", autoclip_step, [qopt]))
        except ImportError:
            pass
    return methods


# ----------------------------------------------------------------------------- measuring


class _AllocTracker(TorchDispatchMode):
    """Peak bytes of tensors allocated (and still alive) inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, nbytes)
        return out


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's processor string: what a result file records."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rotated(names: list[str], r: int) -> list[str]:
    """``names`` in round ``r``'s order: rotated by one every round, so that none always runs first."""
    k = r % len(names)
    return names[k:] + names[:k]


def paired_ratio(times: list[float], base: list[float]) -> float:
    """The median over rounds of each round's time over the same round's ``base`` time: steadier than
    a ratio of medians when the machine's load drifts between rounds."""
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def resident_bytes(model: ParamModel, opts: list[torch.optim.Optimizer]) -> int:
    total = sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # params + grads
    for opt in opts:
        for st in opt.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return total


def measure(
    model: ParamModel, methods: list[Method], saved: list[torch.Tensor], rounds: int
) -> dict[str, dict[str, float]]:
    grads = [p.grad for p in model.parameters()]

    def restore() -> None:
        torch._foreach_copy_(grads, saved)  # type: ignore[arg-type]

    for m in methods:  # warm-up: creates optimizer state, first-update paths
        for _ in range(2):
            restore()
            m.update()
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    for _ in range(rounds):
        for m in methods:
            restore()
            gc.disable()
            t0 = time.perf_counter()
            m.update()
            times[m.name].append(time.perf_counter() - t0)
            gc.enable()
    out: dict[str, dict[str, float]] = {}
    for m in methods:
        restore()
        with count_host_reads() as reads:
            m.update()
        restore()
        tracker = _AllocTracker()
        with tracker:
            m.update()
        out[m.name] = {
            "update_s": statistics.median(times[m.name]),
            "host_reads": float(len(reads)),
            "transient_bytes": float(tracker.peak),
            "peak_bytes": float(resident_bytes(model, m.optimizers) + tracker.peak),
        }
    return out


def micro_call_time(model: ParamModel, opt_name: str, calls: int = 2000) -> float:
    """Median over 5 batches of the time of one micro-batch step() call (a window that never closes).

    Every parameter has a gradient, as after a backward pass (without any, each call would look
    for a parameter to watch again: a case no training loop has)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    wrapped = ClippedOptimizer(OPTIMIZERS[opt_name](list(model.parameters())), accumulation_steps=10_000)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            wrapped.step()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny and medium models, 5 rounds")
    ap.add_argument("--models", default=None, help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--optimizers", default=None, help="comma-separated subset of " + ",".join(OPTIMIZERS))
    ap.add_argument("--accumulation", default="1,4", help="accumulation steps to measure (default 1,4)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 9, quick 5)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--no-peers", action="store_true", help="leave out zclip and autoclip")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for results.md/.json")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = args.models.split(",") if args.models else (["tiny", "medium"] if args.quick else list(MODELS))
    opt_names = args.optimizers.split(",") if args.optimizers else list(OPTIMIZERS)
    accs = [int(a) for a in args.accumulation.split(",")]
    rounds = args.rounds or (5 if args.quick else 9)

    rows: list[dict[str, Any]] = []
    for model_name in models:
        model = ParamModel(MODELS[model_name]())
        n_params = sum(p.numel() for p in model.parameters())
        n_tensors = len(list(model.parameters()))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 0.05  # total norm well above 1: clipping is active
        saved = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        for opt_name in opt_names:
            for acc in accs:
                methods = make_methods(model, opt_name, acc, peers=not args.no_peers)
                res = measure(model, methods, saved, rounds)
                base, floor = res["bare"]["update_s"], res["bare+read"]["update_s"]
                ref = res["clip_grad_norm_"]["update_s"]
                for name, r in res.items():
                    rows.append(
                        {
                            "model": model_name,
                            "params": n_params,
                            "tensors": n_tensors,
                            "optimizer": opt_name,
                            "accumulation": acc,
                            "method": name,
                            **r,
                            "vs_bare": r["update_s"] / base,
                            "vs_floor": r["update_s"] / floor,
                            "vs_clip_grad_norm_": r["update_s"] / ref,
                            "peak_vs_clip_grad_norm_": r["peak_bytes"] / res["clip_grad_norm_"]["peak_bytes"],
                        }
                    )
                del methods
                gc.collect()
                line = ", ".join(f"{k} {v['update_s'] * 1e3:.2f} ms" for k, v in res.items())
                print(f"{model_name} {opt_name} k={acc}: {line}", flush=True)
        micro = micro_call_time(model, "AdamW-fused")
        rows.append({"model": model_name, "params": n_params, "tensors": n_tensors, "micro_call_s": micro})
        print(f"{model_name}: micro-batch step() call {micro * 1e6:.2f} us", flush=True)
        del model, saved
        gc.collect()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": args.threads,
        "rounds": rounds,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = render(rows, meta)
    (out / "results.md").write_text(table)
    print()
    print(table)
    return 0


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"torch {meta['torch']}, {meta['threads']} CPU threads, "
        f"median of {meta['rounds']} interleaved rounds.",
        "",
        "| model | optimizer | k | method | update ms | x bare | x bare+read | x clip_grad_norm_ "
        "| host reads | peak x cgn |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "method" not in r:
            continue
        lines.append(
            f"| {r['model']} ({r['params'] / 1e6:.2f}M) | {r['optimizer']} | {r['accumulation']} "
            f"| {r['method']} "
            f"| {r['update_s'] * 1e3:.2f} | {r['vs_bare']:.2f} | {r['vs_floor']:.2f} "
            f"| {r['vs_clip_grad_norm_']:.2f} "
            f"| {r['host_reads']:.0f} | {r['peak_vs_clip_grad_norm_']:.3f} |"
        )
    lines += ["", "| model | micro-batch step() call |", "|---|---|"]
    for r in rows:
        if "method" not in r:
            lines.append(f"| {r['model']} | {r['micro_call_s'] * 1e6:.2f} µs |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
