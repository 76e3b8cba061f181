"""``clipopt report --plot``: the norms, the loss and the per-layer heatmap of a log (needs matplotlib)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from ._report_read import GradLog
from ._text import fmt_num as _num

__all__ = ["plot_log"]

_INSTALL = (
    "drawing the plot needs matplotlib, which is not installed; install it with: pip install 'clipopt[plot]'"
)
#: At most this many layer names are written along the heatmap (every k-th otherwise).
_MAX_LABELS = 30


def plot_log(log: GradLog, report: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw the total norm, the loss (when logged) and the per-layer heatmap (when logged); save to ``path``.

    Panel 1: the pre-clip total norm per step on a log scale, the ``max_norm``
    used, the suggested ``max_norm``, clipped updates (dots), spikes (circles),
    skipped or non-finite updates (red crosses along the top) and the onset of
    an explosion (a vertical line).  Panel 2, with a loss: the loss per step
    (log scale when it is positive), non-finite losses as red crosses.  Panel 3,
    with per-layer rows: ``log10(grad_norm)`` per layer and per-layer row, each
    cell spanning the steps since the previous per-layer row, non-finite cells
    crossed out, its colour bar beside it.  Uses ``matplotlib.figure.Figure``
    with the Agg canvas: pyplot and the process's backend are left alone.

    Raises :class:`ImportError` with an install hint when matplotlib is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc

    names = list(log.layers)
    heat = bool(len(log.layer_rows) and names)
    has_loss = report["summary"]["losses"] > 0
    ratios = [4.0] + ([2.2] if has_loss else []) + ([min(1.2 + 0.22 * len(names), 8.0)] if heat else [])
    fig = Figure(figsize=(12.0, 1.0 + sum(ratios)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ratios), 1, sharex=True, height_ratios=ratios, squeeze=False)[:, 0]
    ax = axes[0]
    _norm_panel(ax, log, report)
    ax.set_title(f"{os.path.basename(log.path.rstrip(os.sep))}: verdict: {report['verdict']}")
    if has_loss:
        _loss_panel(axes[1], log)
    if heat:
        _heatmap(axes[-1], log, names)
    axes[-1].set_xlabel("update (step)")
    for a in axes:
        a.tick_params(labelsize=9)
    fig.savefig(os.fspath(path), dpi=110)


def _legend(ax: Any) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0.0)


def _norm_panel(ax: Any, log: GradLog, report: Mapping[str, Any]) -> None:
    from matplotlib.transforms import blended_transform_factory

    steps, norm = log.steps, log.total_norm
    good = [i for i, x in enumerate(norm) if math.isfinite(x) and x > 0]
    ax.plot(
        [steps[i] for i in good],
        [norm[i] for i in good],
        lw=0.9,
        color="tab:blue",
        label="total norm (pre-clip)",
    )
    clipped = [i for i in good if log.clipped[i]]
    if clipped:
        ax.scatter(
            [steps[i] for i in clipped],
            [norm[i] for i in clipped],
            s=8,
            color="tab:orange",
            alpha=0.7,
            lw=0,
            zorder=3,
            label=f"clipped ({len(clipped)})",
        )
    spike = next((f for f in report["findings"] if f["kind"] == "spikes"), None)
    if spike is not None:
        rows = [r for r in spike["values"]["rows"] if math.isfinite(norm[r])]
        ax.scatter(
            [steps[r] for r in rows],
            [norm[r] for r in rows],
            s=60,
            facecolors="none",
            edgecolors="tab:purple",
            lw=1.5,
            zorder=4,
            label=f"spike ({spike['values']['count']})",
        )
    bounds = [(steps[i], b) for i, b in enumerate(log.max_norm) if math.isfinite(b)]
    if bounds:
        bx, by = zip(*bounds, strict=True)
        ax.step(bx, by, where="post", color="black", ls="--", lw=1.0, label="max_norm used")
    suggested = report["suggested_max_norm"]
    if suggested is not None and suggested > 0:
        ax.axhline(
            suggested, color="tab:green", ls=":", lw=1.4, label=f"suggested max_norm {_num(suggested)}"
        )
    onset = next((f for f in report["findings"] if f["kind"] in ("blowup", "growth")), None)
    if onset is not None:
        ax.axvline(
            onset["step"], color="tab:red", lw=1.0, alpha=0.6, label=f"explosion (step {onset['step']})"
        )
    bad = [steps[i] for i in range(len(log)) if log.skipped[i] or not math.isfinite(norm[i])]
    if bad:
        top = blended_transform_factory(ax.transData, ax.transAxes)
        ax.scatter(
            bad,
            [0.97] * len(bad),
            transform=top,
            marker="x",
            s=30,
            color="tab:red",
            zorder=5,
            clip_on=False,
            label=f"skipped / non-finite ({len(bad)})",
        )
    if good or bounds:
        ax.set_yscale("log")
    ax.set_ylabel("gradient norm")
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax)


def _loss_panel(ax: Any, log: GradLog) -> None:
    from matplotlib.transforms import blended_transform_factory

    steps, loss = log.steps, log.loss
    good = [i for i, x in enumerate(loss) if math.isfinite(x)]
    ys = [loss[i] for i in good]
    ax.plot([steps[i] for i in good], ys, lw=0.9, color="tab:brown", label="loss")
    bad = [steps[i] for i, x in enumerate(loss) if math.isinf(x)]
    if bad:
        top = blended_transform_factory(ax.transData, ax.transAxes)
        ax.scatter(
            bad,
            [0.95] * len(bad),
            transform=top,
            marker="x",
            s=30,
            color="tab:red",
            clip_on=False,
            label=f"non-finite loss ({len(bad)})",
        )
    if ys and min(ys) > 0 and max(ys) / min(ys) > 20:
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax)


def _heatmap(ax: Any, log: GradLog, names: list[str]) -> None:
    steps = [log.steps[r] for r in log.layer_rows]
    # cell j spans the steps since the previous per-layer row; the first one starts with the log
    edges = [min(log.steps[0], steps[0]) - 0.5, *(s + 0.5 for s in steps)]
    for j in range(1, len(edges)):  # steps out of order (a resumed log): keep the edges increasing
        edges[j] = max(edges[j], edges[j - 1] + 1e-3)
    grid: list[list[float]] = []
    bad_x: list[float] = []
    bad_y: list[int] = []
    for y, name in enumerate(names):
        cols = log.layers[name]
        line = []
        for x, g in enumerate(cols["grad_norm"]):
            count = cols["nonfinite"][x]
            line.append(math.log10(g) if math.isfinite(g) and g > 0 else math.nan)
            if (
                (math.isfinite(count) and count > 0)
                or math.isinf(g)
                or (math.isnan(g) and not math.isnan(count))
            ):
                bad_x.append(steps[x])
                bad_y.append(y)
        grid.append(line)
    mesh = ax.pcolormesh(
        edges, [y - 0.5 for y in range(len(names) + 1)], grid, cmap="viridis", shading="flat"
    )
    ax.set_facecolor("white")
    if bad_x:
        ax.scatter(bad_x, bad_y, marker="x", s=22, color="tab:red", lw=1.5)
    every = max(1, math.ceil(len(names) / _MAX_LABELS))
    ticks = list(range(0, len(names), every))
    ax.set_yticks(ticks, [_short(names[i]) for i in ticks], fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    crosses = "; red x: non-finite" if bad_x else ""
    ax.set_title(f"per-layer gradient norm (log10; white: not recorded{crosses})", fontsize="medium")
    cax = ax.inset_axes((1.01, 0.0, 0.012, 1.0))  # beside the heatmap, outside it: the x axes stay aligned
    fig = ax.get_figure()
    fig.colorbar(mesh, cax=cax, label="log10 grad_norm")


def _short(name: str, width: int = 28) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3) :]
