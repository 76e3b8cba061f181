"""The cost of going beyond the gradient: UpdateClip, AdaGC and StableSPAM against the plain clipped update,
and UpdateClip against the recipe a careful user would write.

    python benchmarks/update_cost.py                    # 25M model, fused AdamW, 1 thread, 15 rounds
    python benchmarks/update_cost.py --optimizer AdamW-foreach --rounds 5
    python benchmarks/update_cost.py --methods clip,recipe-norm,update-norm   # a subset

On the 25M-parameter transformer-shaped parameter set of ``benchmarks/diagnostics.py`` (3 layers of
d=768 and one of d=512, synthetic gradients of norm well above 1), one update (``step()`` with
``accumulation_steps=1``) of:

* ``clip``          ``max_norm=1.0`` (the baseline of the ratios);
* ``update_stats``  ``max_norm=1.0, update_stats=True`` (the update norm recorded, nothing bounded);
* ``update-rms``    ``max_norm=1.0, update_clip=UpdateClip(max_rms=1e-5)``;
* ``update-norm``   ``max_norm=1.0, update_clip=UpdateClip(max_norm=1e-3)``;
* ``update-z``      ``max_norm=1.0, update_clip=UpdateClip(z=3.0, window=4)`` (its history full);
* ``adagc``         ``max_norm=AdaGC(warmup=0)`` (past its warm-up);
* ``stablespam``    ``max_norm=StableSPAM()``;
* ``update-norm-restore`` ``UpdateClip(max_norm=1e-3, restore_state=True)`` (the inner state copied too);
* ``recipe-norm``   what a careful user writes around ``ClippedOptimizer(max_norm=1.0)`` for a global
  bound: copy the parameters into a kept buffer (``_foreach_copy_``), ``step()``, subtract into a kept
  update buffer, per-tensor norms (``torch.linalg.vector_norm``), one ``_foreach_lerp_`` by
  ``1 - coef`` (no put-back of a non-finite update: it is the floor, not a replacement);
* ``recipe-rms``    the same with one coefficient per tensor (``max_rms``);
* ``recipe-stats``  the same without the bound: copy, subtract, norm (``update_stats``' recipe);
* ``bare``          the inner optimizer's ``step()`` alone, for scale.

``vs recipe (paired)``: each UpdateClip mode against its recipe (``update-rms`` against
``recipe-rms``, ``update-norm``/``-z``/``-restore`` against ``recipe-norm``, ``update_stats`` against
``recipe-stats``), the median of the rounds' own ratios.

The bounds are small enough that every update is scaled (lr 1e-4: AdamW's update RMS is about 1e-4).
Methods run interleaved with the order rotating every round (A B C ..., then B C ... A), medians over
rounds; ``paired`` is the median of each round's own ratio to ``clip`` (robust to the load of a shared
machine drifting between rounds). Memory: the largest sum of tensors allocated and alive during one
update (``bench._AllocTracker``, a ``TorchDispatchMode``), and what it adds to ``clip``'s, in units of
the parameters' bytes. Host reads per update (tests/hostreads.py). Writes
``update_cost_<optimizer>.md`` and ``.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import (  # noqa: E402
    OPTIMIZERS,
    ParamModel,
    _AllocTracker,
    cpu_name,
    paired_ratio,
    rotated,
    transformer_shapes,
)

from clipopt import AdaGC, ClippedOptimizer, StableSPAM, UpdateClip  # noqa: E402
from tests.hostreads import count_host_reads  # noqa: E402

#: name -> (setting, ClippedOptimizer keywords besides the inner optimizer); None: the bare inner step
METHODS: dict[str, tuple[str, Callable[[], dict[str, Any]] | None]] = {
    "clip": ("max_norm=1.0", lambda: {"max_norm": 1.0}),
    "update_stats": ("max_norm=1.0, update_stats=True", lambda: {"max_norm": 1.0, "update_stats": True}),
    "update-rms": (
        "max_norm=1.0, update_clip=UpdateClip(max_rms=1e-5)",
        lambda: {"max_norm": 1.0, "update_clip": UpdateClip(max_rms=1e-5)},
    ),
    "update-norm": (
        "max_norm=1.0, update_clip=UpdateClip(max_norm=1e-3)",
        lambda: {"max_norm": 1.0, "update_clip": UpdateClip(max_norm=1e-3)},
    ),
    "update-z": (
        "max_norm=1.0, update_clip=UpdateClip(z=3.0, window=4)",
        lambda: {"max_norm": 1.0, "update_clip": UpdateClip(z=3.0, window=4)},
    ),
    "update-norm-restore": (
        "max_norm=1.0, update_clip=UpdateClip(max_norm=1e-3, restore_state=True)",
        lambda: {"max_norm": 1.0, "update_clip": UpdateClip(max_norm=1e-3, restore_state=True)},
    ),
    "recipe-norm": ("max_norm=1.0, by hand: copy, step, subtract, norms, lerp (global)", None),
    "recipe-rms": ("max_norm=1.0, by hand: copy, step, subtract, norms, lerp (per tensor)", None),
    "recipe-stats": ("max_norm=1.0, by hand: copy, step, subtract, norms", None),
    "adagc": ("max_norm=AdaGC(warmup=0)", lambda: {"max_norm": AdaGC(warmup=0)}),
    "stablespam": ("max_norm=StableSPAM()", lambda: {"max_norm": StableSPAM()}),
    "bare": ("inner.step()", None),
}


#: The methods also run with the baseline package (``--baseline``).
UPDATE_METHODS = ("update_stats", "update-rms", "update-norm", "update-z")

#: Each UpdateClip method's recipe (``vs recipe``).
RECIPE_OF = {
    "update_stats": "recipe-stats",
    "update-rms": "recipe-rms",
    "update-norm": "recipe-norm",
    "update-z": "recipe-norm",
    "update-norm-restore": "recipe-norm",
}


class Recipe:
    """The update bounded by hand around ``ClippedOptimizer(inner, max_norm=1.0)``, with two kept
    buffers (the copy and the update): ``bound`` ``"norm"`` (global, 1e-3), ``"rms"`` (per tensor,
    1e-5) or None (measured only)."""

    def __init__(self, opt: ClippedOptimizer, params: list[torch.nn.Parameter], bound: str | None) -> None:
        self.opt, self.bound = opt, bound
        self.params = [p.detach() for p in params]
        self.copy = [p.clone() for p in self.params]
        self.update = [torch.empty_like(p) for p in self.params]
        self.roots = [float(p.numel()) ** 0.5 for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_(self.copy, self.params)
        self.opt.step()
        for u, p, b in zip(self.update, self.params, self.copy, strict=True):
            torch.sub(p, b, out=u)
        norms = torch.stack([torch.linalg.vector_norm(u) for u in self.update])
        if self.bound == "norm":
            coef = torch.clamp(torch.linalg.vector_norm(norms) / 1e-3, min=1.0).reciprocal()
            torch._foreach_lerp_(self.params, self.copy, [1.0 - coef] * len(self.params))
        elif self.bound == "rms":
            rms = norms / torch.tensor(self.roots)
            shrink = 1.0 - torch.clamp(rms / 1e-5, min=1.0).reciprocal()
            torch._foreach_lerp_(self.params, self.copy, list(shrink.unbind()))


def make_methods(
    params: list[torch.nn.Parameter], inner: str, base: Any = None, only: list[str] | None = None
) -> dict[str, Callable[[], None]]:
    new = OPTIMIZERS[inner]
    out: dict[str, Callable[[], None]] = {}
    for name, (_, kwargs) in METHODS.items():
        if only is not None and name not in only:
            continue
        opt = new(params)
        if name.startswith("recipe-"):
            bound = {"recipe-norm": "norm", "recipe-rms": "rms"}.get(name)
            out[name] = Recipe(ClippedOptimizer(opt, max_norm=1.0), params, bound).step
            continue
        out[name] = opt.step if kwargs is None else ClippedOptimizer(opt, **kwargs()).step
    if base is not None:  # the same settings, the baseline package's classes
        for name in UPDATE_METHODS:
            kw = METHODS[name][1]()  # type: ignore[misc]
            if "update_clip" in kw:
                kw["update_clip"] = base.UpdateClip(
                    **{
                        kw["update_clip"].mode: kw["update_clip"].limit,
                        **({"window": kw["update_clip"].window} if kw["update_clip"].mode == "z" else {}),
                    }
                )
            out[f"{name}@base"] = base.ClippedOptimizer(new(params), **kw).step
    return out


class _OpCount(TorchDispatchMode):
    """ATen operators dispatched (what runs on the device, whatever the machine's load)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _held(update: Callable[[], None]) -> int:
    """The bytes held between updates for the update: the wrapper's copy before the inner step
    (``UpdateCopy.held_bytes``, in what the parts share: ``Parts.shared``), or a recipe's two buffers."""
    owner = getattr(update, "__self__", None)
    if isinstance(owner, Recipe):
        return sum(t.numel() * t.element_size() for t in [*owner.copy, *owner.update])
    shared = getattr(getattr(getattr(owner, "_run", None), "parts", None), "shared", {})
    return sum(int(getattr(getattr(work, "copy", None), "held_bytes", 0)) for work in shared.values())


def measure(model: ParamModel, methods: dict[str, Callable[[], None]], rounds: int) -> dict[str, Any]:
    """Median time, paired ratio, transient memory and host reads of one update per method."""
    grads = [p.grad for p in model.parameters()]
    saved = [g.clone() for g in grads if g is not None]

    def restore() -> None:
        torch._foreach_copy_(grads, saved)  # type: ignore[arg-type]

    for update in methods.values():  # warm-up: optimizer state, first-update paths, a full z history
        for _ in range(4):
            restore()
            update()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(rounds):
        for name in rotated(names, r):
            restore()
            gc.disable()
            t0 = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - t0)
            gc.enable()
    out: dict[str, Any] = {}
    for name, update in methods.items():
        restore()
        with count_host_reads() as reads:
            update()
        restore()
        tracker = _AllocTracker()
        with tracker:
            update()
        restore()
        with _OpCount() as ops:
            update()
        out[name] = {
            "update_s": statistics.median(times[name]),
            "paired_vs_clip": paired_ratio(times[name], times["clip"]),
            "host_reads": len(reads),
            "transient_bytes": tracker.peak,
            "held_bytes": _held(update),
            "aten_ops": ops.count,
        }
    for name, row in out.items():
        row["vs_clip"] = row["update_s"] / out["clip"]["update_s"]
        recipe = RECIPE_OF.get(name)
        if recipe in times:
            row["vs_recipe"] = paired_ratio(times[name], times[recipe])
    return out


def render(rows: dict[str, Any], meta: dict[str, Any]) -> str:
    pbytes = meta["param_bytes"]
    lines = [
        f"{meta['params'] / 1e6:.1f}M parameters ({pbytes / 2**20:.0f} MB), {meta['optimizer']}, "
        f"torch {meta['torch']}, {meta['cpu']}, {meta['threads']} thread(s), "
        f"{meta['rounds']} interleaved rounds (rotating).",
        "",
        "| method | setting | ms / update (median) | vs clip (medians) | vs clip (paired) "
        "| vs recipe (paired) | memory during the update (MB) | added to clip (x parameters) "
        "| held between updates (x parameters) | host reads | ATen ops |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = rows["clip"]["transient_bytes"]
    for name, r in rows.items():
        added = (r["transient_bytes"] - base) / pbytes
        setting = METHODS[name.removesuffix("@base")][0]
        recipe = f"{r['vs_recipe']:.3f}" if "vs_recipe" in r else ""
        lines.append(
            f"| {name} | `{setting}` | {1e3 * r['update_s']:.1f} | {r['vs_clip']:.3f} "
            f"| {r['paired_vs_clip']:.3f} | {recipe} | {r['transient_bytes'] / 2**20:.0f} | {added:+.2f} "
            f"| {r['held_bytes'] / pbytes:.2f} | {r['host_reads']} | {r['aten_ops']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", default="AdamW-fused", choices=list(OPTIMIZERS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="a 1-layer d=256 model instead (smoke run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--baseline", default=None, help="a folder holding another clipopt as clipopt_base")
    ap.add_argument("--methods", default=None, help="a comma-separated subset of the methods (clip always)")
    args = ap.parse_args(argv)
    base = None
    if args.baseline is not None:
        sys.path.insert(0, args.baseline)
        base = importlib.import_module("clipopt_base")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = (
        transformer_shapes(256, 1) if args.small else transformer_shapes(768, 3) + transformer_shapes(512, 1)
    )
    model = ParamModel(shapes)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 0.05  # norm well above 1: gradient clipping is active
    only = None if args.methods is None else ["clip", *args.methods.split(",")]
    rows = measure(model, make_methods(params, args.optimizer, base, only), args.rounds)
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": args.threads,
        "cpu": cpu_name(),
        "rounds": args.rounds,
        "optimizer": args.optimizer,
        "baseline": args.baseline,
        "params": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
    }
    table = render(rows, meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"update_cost_{args.optimizer}"
    (out / f"{stem}.md").write_text(table)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
