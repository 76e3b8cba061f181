"""``clipopt report --plot``: the norms, the loss and the per-layer heatmap of a log (needs matplotlib)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from .read import GradLog
from .text import fmt_num as _num

__all__ = ["plot_log", "short_names"]

_INSTALL = (
    "drawing the plot needs matplotlib, which is not installed; install it with: pip install 'clipopt[plot]'"
)
#: At most this many layer names are written along the heatmap (every k-th otherwise).
_MAX_LABELS = 30
#: The heatmap's row labels are at most this many characters (:func:`short_names`).
_LABEL_WIDTH = 28


def plot_log(log: GradLog, report: Mapping[str, Any], path: str | os.PathLike[str]) -> Any:
    """Draw the total norm, the loss (when logged) and the per-layer heatmap (when logged); save to ``path``.

    Panel 1: the pre-clip total norm per step on a log scale, the ``max_norm``
    used, the suggested ``max_norm``, clipped updates (dots), spikes (circles),
    updates skipped with a finite norm (red crosses on the line), updates with a
    non-finite norm (crosses along the top inside the panel: red where the log
    says they were skipped, black for the others -- "applied" in clipopt's logs,
    which record every skip, plain "non-finite" in logs that record none) and
    the onset of an explosion (a vertical line).  With the update norm
    (``update_stats=True``, ``update_clip=``), a panel below it: the update norm
    of the applied updates on a log scale, the update spikes of the
    ``update_spikes`` finding (circles) and the suggested
    ``UpdateClip(max_norm=...)``.  Then, with a loss: the loss per step (log
    scale when it is positive), non-finite losses as red crosses along the top.
    Last, with per-layer rows:
    ``log10(grad_norm)`` per layer and per-layer row, each cell spanning the
    steps since the previous per-layer row, non-finite cells crossed out, its
    colour bar beside it; the rows are named by the parameters' names, shortened
    (:func:`short_names`) so that the parts that tell them apart stay.  The
    x axis spans every logged step, the non-finite ones too.  Uses
    ``matplotlib.figure.Figure`` with the Agg canvas: pyplot and the process's
    backend are left alone.

    Returns the ``Figure`` (drawn and saved).  Raises :class:`ImportError`
    with an install hint when matplotlib is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc

    heat = bool(len(log.layer_rows) and log.layers)
    has_loss = report["summary"]["losses"] > 0
    update = report.get("update") is not None
    ratios = [4.0] + ([2.6] if update else []) + ([2.2] if has_loss else [])
    ratios += [min(1.2 + 0.22 * len(log.layers), 8.0)] if heat else []
    fig = Figure(figsize=(12.0, 1.0 + sum(ratios)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(len(ratios), 1, sharex=True, height_ratios=ratios, squeeze=False)[:, 0])
    _norm_panel(axes[0], log, report)
    axes[0].set_title(f"{os.path.basename(log.path.rstrip(os.sep))}: verdict: {report['verdict']}")
    _lower_panels(axes[1:], log, report, (update, has_loss, heat))
    axes[-1].set_xlabel("update (step)")
    axes[0].set_xlim(*_step_range(log))  # the panels share it
    for a in axes:
        a.tick_params(labelsize=9)
    fig.savefig(os.fspath(path), dpi=110)
    return fig


def _lower_panels(
    axes: list[Any], log: GradLog, report: Mapping[str, Any], which: tuple[bool, bool, bool]
) -> None:
    """The panels below the gradient norm's, in order, those of ``which`` that are on: the update
    norm, the loss, the per-layer heatmap."""
    update, has_loss, heat = which
    if update:
        _update_panel(axes[0], log, report)
    if has_loss:
        _loss_panel(axes[int(update)], log)
    if heat:
        _heatmap(axes[-1], log, list(log.layers))


def _legend(ax: Any) -> None:
    """The legend outside the panel, on its right."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0.0)


def _norm_panel(ax: Any, log: GradLog, report: Mapping[str, Any]) -> None:
    """Panel 1: the total norm on a log scale, with every marker the docstring of :func:`plot_log` lists."""
    good = [i for i, x in enumerate(log.total_norm) if math.isfinite(x) and x > 0]
    ax.plot(
        [log.steps[i] for i in good],
        [log.total_norm[i] for i in good],
        lw=0.9,
        color="tab:blue",
        label="total norm (pre-clip)",
    )
    _clipped_dots(ax, log, good)
    _spike_circles(ax, log, report)
    bounds = _max_norm_line(ax, log)
    _suggested_line(ax, report)
    _onset_line(ax, report)
    _skip_marks(ax, log)
    if good or bounds:
        ax.set_yscale("log")
    ax.set_ylabel("gradient norm")
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax)


def _step_range(log: GradLog) -> tuple[float, float]:
    """The x limits: every logged step, with a margin of 1 % of the span (at least half a step)."""
    lo, hi = min(log.steps), max(log.steps)
    pad = max(0.5, 0.01 * (hi - lo))
    return lo - pad, hi + pad


def _skip_marks(ax: Any, log: GradLog) -> None:
    """Skipped updates with a finite norm: red crosses on the line.  Non-finite norms: crosses along the
    top, red for those the log marks skipped, black for the others (applied, or not recorded)."""
    finite = [math.isfinite(x) and x > 0 for x in log.total_norm]
    skipped = [i for i in range(len(log)) if log.skipped[i] and finite[i]]
    if skipped:
        ax.scatter(
            [log.steps[i] for i in skipped],
            [log.total_norm[i] for i in skipped],
            marker="x",
            s=30,
            color="tab:red",
            zorder=5,
            label=f"skipped ({len(skipped)})",
        )
    bad = [i for i, x in enumerate(log.total_norm) if not math.isfinite(x)]
    bad_skipped = [log.steps[i] for i in bad if log.skipped[i]]
    bad_kept = [log.steps[i] for i in bad if not log.skipped[i]]
    if bad_skipped:
        _top_crosses(ax, bad_skipped, 0.96, f"non-finite, skipped ({len(bad_skipped)})", zorder=5)
    if bad_kept:  # clipopt's logs record every skip: the others were applied; other logs record none
        label = (
            f"non-finite, applied ({len(bad_kept)})" if log.has_clipping else f"non-finite ({len(bad_kept)})"
        )
        _top_crosses(ax, bad_kept, 0.92, label, zorder=5, color="black")


def _clipped_dots(ax: Any, log: GradLog, good: list[int]) -> None:
    """Dots on the clipped updates among the rows ``good`` (finite, positive norms)."""
    clipped = [i for i in good if log.clipped[i]]
    if clipped:
        ax.scatter(
            [log.steps[i] for i in clipped],
            [log.total_norm[i] for i in clipped],
            s=8,
            color="tab:orange",
            alpha=0.7,
            lw=0,
            zorder=3,
            label=f"clipped ({len(clipped)})",
        )


def _spike_circles(ax: Any, log: GradLog, report: Mapping[str, Any]) -> None:
    """Circles around the norm spikes of the report's ``spikes`` finding (when it has one)."""
    spike = next((f for f in report["findings"] if f["kind"] == "spikes"), None)
    if spike is None:
        return
    rows = [r for r in spike["values"]["rows"] if math.isfinite(log.total_norm[r])]
    _circles(ax, log, rows, log.total_norm, f"spike ({spike['values']['count']})")


def _circles(ax: Any, log: GradLog, rows: list[int], values: Any, label: str) -> None:
    """Open purple circles around ``values`` at the spike ``rows`` of ``log``."""
    ax.scatter(
        [log.steps[r] for r in rows],
        [values[r] for r in rows],
        s=60,
        facecolors="none",
        edgecolors="tab:purple",
        lw=1.5,
        zorder=4,
        label=label,
    )


def _max_norm_line(ax: Any, log: GradLog) -> bool:
    """The ``max_norm`` used, as a step line over its finite values; False when it has none."""
    bounds = [(log.steps[i], b) for i, b in enumerate(log.max_norm) if math.isfinite(b)]
    if bounds:
        bx, by = zip(*bounds, strict=True)
        ax.step(bx, by, where="post", color="black", ls="--", lw=1.0, label="max_norm used")
    return bool(bounds)


def _suggested_line(ax: Any, report: Mapping[str, Any]) -> None:
    """A horizontal line at the suggested ``max_norm`` (when positive)."""
    suggested = report["suggested_max_norm"]
    if suggested is not None and suggested > 0:
        ax.axhline(
            suggested, color="tab:green", ls=":", lw=1.4, label=f"suggested max_norm {_num(suggested)}"
        )


def _onset_line(ax: Any, report: Mapping[str, Any]) -> None:
    """A vertical line at the step of the first explosion finding (blow-up or growth), when there is one."""
    onset = next((f for f in report["findings"] if f["kind"] in ("blowup", "growth")), None)
    if onset is not None:
        ax.axvline(
            onset["step"], color="tab:red", lw=1.0, alpha=0.6, label=f"explosion (step {onset['step']})"
        )


def _top_crosses(ax: Any, steps: list[int], height: float, label: str, **kwargs: Any) -> None:
    """Crosses (red unless ``color`` says otherwise) at ``steps``, at ``height`` in axes coordinates
    (0: bottom, 1: top), inside the panel: updates whose value cannot be drawn."""
    from matplotlib.transforms import blended_transform_factory

    top = blended_transform_factory(ax.transData, ax.transAxes)
    ax.scatter(
        steps,
        [height] * len(steps),
        transform=top,
        marker="x",
        s=30,
        **{"color": "tab:red", **kwargs},
        label=label,
    )


def _update_panel(ax: Any, log: GradLog, report: Mapping[str, Any]) -> None:
    """The update norm of the applied updates (log scale), the update spikes found, the suggested bound."""
    good = [i for i, x in enumerate(log.update_norm) if math.isfinite(x) and x > 0 and not log.skipped[i]]
    xs, ys = [log.steps[i] for i in good], [log.update_norm[i] for i in good]
    ax.plot(xs, ys, lw=0.9, color="tab:olive", label="update norm (before update_clip)")
    found = next((f for f in report["findings"] if f["kind"] == "update_spikes"), None)
    if found is not None:
        label = f"update spike, no gradient spike ({found['values']['count']})"
        _circles(ax, log, found["values"]["rows"], log.update_norm, label)
    suggested = report["update"]["suggested"]
    if suggested is not None and suggested["max_norm"] > 0:
        bound = suggested["max_norm"]
        ax.axhline(
            bound, color="tab:green", ls=":", lw=1.4, label=f"suggested UpdateClip(max_norm={_num(bound)})"
        )
    if good:
        ax.set_yscale("log")
    ax.set_ylabel("update norm")
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax)


def _loss_panel(ax: Any, log: GradLog) -> None:
    """The loss panel: the loss per step (log scale when positive over a wide range), non-finite crossed."""
    steps, loss = log.steps, log.loss
    good = [i for i, x in enumerate(loss) if math.isfinite(x)]
    ys = [loss[i] for i in good]
    ax.plot([steps[i] for i in good], ys, lw=0.9, color="tab:brown", label="loss")
    bad = [steps[i] for i, x in enumerate(loss) if math.isinf(x)]
    if bad:
        _top_crosses(ax, bad, 0.95, f"non-finite loss ({len(bad)})")
    if ys and min(ys) > 0 and max(ys) / min(ys) > 20:
        ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax)


def _heatmap(ax: Any, log: GradLog, names: list[str]) -> None:
    """The last panel: log10 of each layer's gradient norm per per-layer row, non-finite cells crossed."""
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
    labels = short_names(names)
    ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    crosses = "; red x: non-finite" if bad_x else ""
    ax.set_title(f"per-layer gradient norm (log10; white: not recorded{crosses})", fontsize="medium")
    cax = ax.inset_axes((1.01, 0.0, 0.012, 1.0))  # beside the heatmap, outside it: the x axes stay aligned
    fig = ax.get_figure()
    fig.colorbar(mesh, cax=cax, label="log10 grad_norm")


def short_names(names: list[str], width: int = _LABEL_WIDTH) -> list[str]:
    """The heatmap's row labels: each name at most ``width`` characters, its distinguishing parts kept.

    A longer name keeps its last part (``weight``) and every part with a digit
    (the indices: ``layers.0`` and ``layers.1`` stay apart), then as many of the
    other parts as fit, nearest the end first; each run of parts left out is
    ``…``.  ``model.layers.10.self_attn.q_proj.weight`` becomes
    ``…10.self_attn.q_proj.weight``.  When even the kept parts do not fit, their
    end is kept.  Names whose labels coincide also keep the parts in which they
    differ (``encoder…0…in_proj_weight`` and ``decoder…0…in_proj_weight``, not
    ``…0.self_attn.in_proj_weight`` twice).  Labels that would still coincide
    are the names' ends."""
    labels = [_short(name, width) for name in names]
    for same in _coinciding(labels):
        split = [names[k].split(".") for k in same]
        for k, parts in zip(same, split, strict=True):
            differ = {i for i, p in enumerate(parts) if any(i >= len(o) or o[i] != p for o in split)}
            labels[k] = _short(names[k], width, differ)
    return [
        label if len(name) <= width or len(same) == 1 else "…" + name[-(width - 1) :]
        for name, label, same in zip(names, labels, _groups(labels), strict=True)
    ]


def _coinciding(labels: list[str]) -> list[list[int]]:
    """The indices of each label that several names share."""
    at: dict[str, list[int]] = {}
    for k, label in enumerate(labels):
        at.setdefault(label, []).append(k)
    return [ks for ks in at.values() if len(ks) > 1]


def _groups(labels: list[str]) -> list[list[int]]:
    """For each label, the indices of the labels equal to it."""
    at: dict[str, list[int]] = {}
    for k, label in enumerate(labels):
        at.setdefault(label, []).append(k)
    return [at[label] for label in labels]


def _short(name: str, width: int, differ: set[int] | None = None) -> str:
    """``name`` within ``width`` characters (see :func:`short_names`), keeping the parts ``differ`` too."""
    if len(name) <= width:
        return name
    parts = name.split(".")
    keep = [
        i == len(parts) - 1 or any(c.isdigit() for c in part) or i in (differ or set())
        for i, part in enumerate(parts)
    ]
    for i in reversed(range(len(parts))):
        if not keep[i]:
            keep[i] = True
            if len(_joined(parts, keep)) > width:
                keep[i] = False
    text = _joined(parts, keep)
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _joined(parts: list[str], keep: list[bool]) -> str:
    """The kept parts joined by dots, each run of parts left out written ``…`` (no dot beside it)."""
    out = ""
    for i, part in enumerate(parts):
        if keep[i]:
            out += ("." if out and not out.endswith("…") else "") + part
        elif not out.endswith("…"):
            out += "…"
    return out
