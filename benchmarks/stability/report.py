"""What the results file says: the summary (stored in the file), the plots, the bad-data table."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .metrics import BEST_LOSS_TOLERANCE, Verdict, best_loss, clamped, helps, lr_sensitivity
from .treatments import BY_NAME


def sweep_key(treatment: str, lr: float, seed: int) -> str:
    return f"sweep/{treatment}/{lr:g}/{seed}"


def fault_key(treatment: str, fault: str, seed: int) -> str:
    return f"faults/{treatment}/{fault}/{seed}"


def _r(value: float, digits: int = 4) -> float | None:
    """A float for the JSON summary (rounded; None for nan)."""
    return round(value, digits) if math.isfinite(value) else None


def _verdict(v: Verdict) -> dict[str, Any]:
    return {
        "helps": v.helps,
        "lower_on_every_seed": v.lower_on_every_seed,
        "best_no_worse": v.best_no_worse,
        "seeds": v.seeds,
        "mean_difference": _r(v.mean_difference),
        "spread": _r(v.spread),
    }


def _per_seed(
    cells: dict[str, Any], settings: dict[str, Any], name: str
) -> dict[int, tuple[float, float, float]]:
    """Per seed with every lr measured: (sensitivity, best loss, best lr)."""
    out = {}
    for seed in settings["seeds"]:
        runs = [cells.get(sweep_key(name, lr, seed)) for lr in settings["lrs"]]
        if any(r is None for r in runs):
            continue
        init = statistics.fmean(r["init_loss"] for r in runs)  # the same model at every lr
        losses = {r["lr"]: r["heldout"] for r in runs}
        best = best_loss(losses, init)
        best_lr = min(losses, key=lambda lr: clamped(losses[lr], init))
        out[seed] = (lr_sensitivity(losses, init), best, best_lr)
    return out


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The figures of the page, from the cells: per treatment, the controls' test, the fault table."""
    settings, cells = results["settings"], results["cells"]
    lrs, seeds = settings["lrs"], settings["seeds"]
    per_seed = {name: _per_seed(cells, settings, name) for name in settings["treatments"]}
    base = per_seed.get("none", {})
    treatments: dict[str, Any] = {}
    for name in settings["treatments"]:
        mine = [cells[k] for lr in lrs for seed in seeds if (k := sweep_key(name, lr, seed)) in cells]
        ps = per_seed[name]
        common = [seed for seed in seeds if seed in ps and seed in base]
        entry: dict[str, Any] = {
            "description": BY_NAME[name].description if name in BY_NAME else name,
            "cells": len(mine),
            "cells_planned": len(lrs) * len(seeds),
            "sensitivity": {str(seed): _r(v[0]) for seed, v in ps.items()},
            "best_loss": {str(seed): _r(v[1]) for seed, v in ps.items()},
            "best_lr": {str(seed): v[2] for seed, v in ps.items()},
            "mean_sensitivity": _r(statistics.fmean(v[0] for v in ps.values())) if ps else None,
            "mean_best_loss": _r(statistics.fmean(v[1] for v in ps.values())) if ps else None,
            "loss_by_lr": {
                f"{lr:g}": _r(statistics.fmean(c["heldout"] for c in by_lr))
                if (by_lr := [c for c in mine if c["lr"] == lr])
                and all(math.isfinite(c["heldout"]) for c in by_lr)
                else None
                for lr in lrs
            },
            "diverged": sum(bool(c["diverged"]) for c in mine),
            "diverged_lrs": sorted({c["lr"] for c in mine if c["diverged"]}),
            "max_logit": _r(max((c["max_logit"] for c in mine), default=math.nan), 2),
            "skipped": sum(c["skipped"] for c in mine),
            "clipped": sum(c["clipped"] for c in mine),
            "update_clipped": sum(c["update_clipped"] for c in mine),
            "undone": sum(c["undone"] for c in mine),
            "windows": sum(c["windows"] for c in mine),
        }
        if name != "none" and common:
            verdict = helps([ps[s][:2] for s in common], [base[s][:2] for s in common], min_seeds=len(seeds))
            entry["verdict"] = _verdict(verdict)
        treatments[name] = entry
    controls = {n: treatments[n].get("verdict") for n in ("qk-layernorm", "z-loss") if n in treatments}
    if any(v is None or v["seeds"] < len(seeds) for v in controls.values()) or len(controls) < 2:
        reproduced = None  # not every seed of the controls and the baseline measured yet
    else:
        reproduced = all(v["lower_on_every_seed"] for v in controls.values())
    return {
        "treatments": treatments,
        "reproduced": reproduced,
        "faults": _fault_table(results),
        "best_loss_tolerance": BEST_LOSS_TOLERANCE,
        "cells_measured": len(cells),
        "cells_planned": planned_cells(settings),
    }


def planned_cells(settings: dict[str, Any]) -> int:
    sweep = len(settings["treatments"]) * len(settings["lrs"]) * len(settings["seeds"])
    faults = len(settings["fault_treatments"]) * len(settings["faults"]) * len(settings["fault_seeds"])
    return sweep + faults


def _fault_table(results: dict[str, Any]) -> dict[str, Any]:
    """Per treatment and fault: mean held-out loss over the fault seeds, and its difference from the
    same treatment's clean run (paired by seed)."""
    settings, cells = results["settings"], results["cells"]
    table: dict[str, Any] = {}
    for name in settings["fault_treatments"]:
        row: dict[str, Any] = {}
        for fault in settings["faults"]:
            pairs = [
                (cells[k]["heldout"], cells[c]["heldout"])
                for seed in settings["fault_seeds"]
                if (k := fault_key(name, fault, seed)) in cells
                and (c := fault_key(name, "clean", seed)) in cells
            ]
            if pairs:
                row[fault] = {
                    "heldout": _r(statistics.fmean(p[0] for p in pairs)),
                    "vs_clean": _r(statistics.fmean(p[0] - p[1] for p in pairs)),
                    "seeds": len(pairs),
                }
        table[name] = row
    return table


def plot_sweep(results: dict[str, Any], path: Path) -> None:
    """Final held-out loss (clamped at the loss at init, as the metric counts it) against the learning
    rate, one panel per treatment, the plain baseline dashed in each: the paper's Figure-1 style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings, cells = results["settings"], results["cells"]
    summary = results["summary"]["treatments"]
    names = settings["treatments"]
    cols = 4
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols, 2.6 * rows), sharex=True, sharey=True, squeeze=False
    )

    def curve(name: str, seed: int) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for lr in settings["lrs"]:
            c = cells.get(sweep_key(name, lr, seed))
            if c is not None:
                xs.append(lr)
                ys.append(clamped(c["heldout"], c["init_loss"]))
        return xs, ys

    for ax, name in zip(axes.flat, names, strict=False):
        for seed in settings["seeds"]:
            bx, by = curve("none", seed)
            if name != "none" and bx:
                ax.plot(
                    bx, by, "--", color="0.6", lw=1, label="none" if seed == settings["seeds"][0] else None
                )
            xs, ys = curve(name, seed)
            ax.plot(xs, ys, "o-", ms=3, lw=1.2, color=f"C{seed}", label=f"seed {seed}")
        sens = summary.get(name, {}).get("mean_sensitivity")
        ax.set_title(
            f"{name}" + (f" (sens. {sens:.3f})" if sens is not None else " (incomplete)"), fontsize=9
        )
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("final held-out loss")
    for ax in axes[-1, :]:
        ax.set_xlabel("peak learning rate")
    axes.flat[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def fault_table_markdown(results: dict[str, Any]) -> str:
    """The bad-data table: held-out loss per treatment and fault, and its difference from clean."""
    settings, table = results["settings"], results["summary"]["faults"]
    faults = settings["faults"]
    head = "| treatment | " + " | ".join(faults) + " |\n|---|" + "---|" * len(faults) + "\n"
    lines = []
    for name in settings["fault_treatments"]:
        row = table.get(name, {})
        cells = []
        for fault in faults:
            v = row.get(fault)
            if v is None:
                cells.append("not yet measured")
            elif v["heldout"] is None:
                cells.append("non-finite")
            elif fault == "clean" or v["vs_clean"] is None:
                cells.append(f"{v['heldout']:.3f}")
            else:
                cells.append(f"{v['heldout']:.3f} ({v['vs_clean']:+.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def plot_logits(results: dict[str, Any], path: Path) -> None:
    """The largest attention logit seen in training against the learning rate (the largest over the
    seeds measured), per treatment: the instability qk-layernorm is the paper's control for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings, cells = results["settings"], results["cells"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, name in enumerate(settings["treatments"]):
        xs, ys = [], []
        for lr in settings["lrs"]:
            seen = [c["max_logit"] for s in settings["seeds"] if (c := cells.get(sweep_key(name, lr, s)))]
            if seen and all(math.isfinite(v) and v > 0 for v in seen):
                xs.append(lr)
                ys.append(max(seen))
        if xs:
            bold = name in ("none", "qk-layernorm", "z-loss")
            ax.plot(xs, ys, "o-", ms=3, lw=2.0 if bold else 0.8, color=f"C{i % 10}", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("largest attention logit in training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
