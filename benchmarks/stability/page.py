"""docs/which-tool.md, written from the results file alone (every number on it is one of the file's)."""

from __future__ import annotations

from typing import Any

from .report import fault_table_markdown
from .treatments import BY_NAME

CITATION = (
    'Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities", '
    "[arXiv 2309.14322](https://arxiv.org/abs/2309.14322)"
)


def _f(value: float | None, fmt: str = ".3f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _lrs(values: list[float]) -> str:
    return ", ".join(f"{v:g}" for v in values) if values else "none"


def _status(results: dict[str, Any]) -> str:
    summary = results["summary"]
    reproduced = summary["reproduced"]
    if reproduced is None:
        return (
            "**Incomplete.** The positive controls (qk-layernorm, z-loss) and the plain baseline are not "
            "measured on every seed yet, so whether the proxy reproduces the instability is not known, "
            "and no treatment is said to help or not. The numbers below are the cells measured so far."
        )
    if not reproduced:
        rows = summary["treatments"]
        verdicts = {name: rows[name]["verdict"] for name in ("qk-layernorm", "z-loss")}
        each = "; ".join(
            f"{name} {'lowered' if v['lower_on_every_seed'] else 'did not lower'} it "
            f"({_f(v['mean_difference'], '+.3f')} ± {_f(v['spread'])})"
            for name, v in verdicts.items()
        )
        return (
            "**The proxy did not reproduce the instability.** qk-layernorm (against attention-logit growth) "
            "and z-loss (against output-logit divergence), which lower the LR sensitivity of the plain "
            f"baseline in the paper, did not both lower it here on every seed: {each}. So this run "
            "cannot tell which clipping tool fixes such an instability: the treatments' numbers are "
            "measurements, not verdicts."
        )
    return (
        "**The proxy reproduced the instability:** qk-layernorm and z-loss both lowered the plain "
        "baseline's LR sensitivity on every seed, so the treatments' verdicts below mean something."
    )


def _fixed(
    name: str, entry: dict[str, Any], seeds: int, reproduced: bool | None, base: dict[str, float]
) -> str:
    """What the tool fixed: its helps-test against ``none`` (``base``: none's sensitivity per seed)."""
    if name == "none":
        return "the plain baseline: each tool's sensitivity is compared with this one's, seed by seed"
    v = entry.get("verdict")
    if entry["cells"] < entry["cells_planned"] or v is None or v["seeds"] < seeds:
        so_far = [
            f"seed {seed}: LR sensitivity {_f(value)} against `none`'s {_f(base[seed])}"
            for seed, value in entry["sensitivity"].items()
            if seed in base
        ]
        partial = f"; so far, {', '.join(so_far)}" if so_far else ""
        return f"not yet measured ({entry['cells']} of {entry['cells_planned']} runs){partial}"
    diff = f"{_f(v['mean_difference'], '+.3f')} ± {_f(v['spread'])}"
    if v["lower_on_every_seed"]:
        said = f"lowered LR sensitivity on every seed ({diff})"
        said += ", best-lr loss no worse" if v["best_no_worse"] else " but its best-lr loss is worse"
    else:
        said = f"did not lower LR sensitivity on every seed ({diff})"
    if name in ("qk-layernorm", "z-loss"):
        return said + " (a positive control)"
    if not reproduced:
        return said + " (no verdict: the controls have not shown the instability)"
    return said + (": **helps**" if v["helps"] else ": does not help")


def _not_fixed(name: str, entry: dict[str, Any], faults: dict[str, Any]) -> str:
    parts = []
    if entry["diverged"]:
        parts.append(f"{entry['diverged']} diverged runs (lr {_lrs(entry['diverged_lrs'])})")
    row = faults.get(name, {})
    worse = [
        f"{f} {_f(v['vs_clean'], '+.3f')}"
        for f, v in row.items()
        if f != "clean" and v["vs_clean"] is not None
    ]
    if worse:
        parts.append("bad data vs its clean run: " + ", ".join(worse))
    return "; ".join(parts) if parts else "nothing measured against it here"


def render_page(results: dict[str, Any], image: str, logits: str | None = None) -> str:
    s, summary = results["settings"], results["summary"]
    rows = summary["treatments"]
    sessions = results["sessions"]
    machines = sorted({f"{x['processor']} ({x['cpus']} CPUs), torch `{x['torch']}`" for x in sessions})
    seeds = len(s["seeds"])
    cal = results.get("calibration") or {}
    base = rows["none"]["sensitivity"] if "none" in rows else {}
    lines = [
        "# Which tool when: evidence from a small-scale proxy",
        "",
        "This page is written by `python -m benchmarks.stability` from its results file",
        "(`benchmarks/results/stability.json`); every number on it is one of that file's.",
        f"It follows {CITATION}: a pre-LayerNorm GPT without biases ({s['layers']} layers, width "
        f"{s['width']}, {s['heads']} heads, sequence {s['seq_len']}, batch {s['batch']}, byte-level "
        f"Python sources), AdamW (0.9, 0.95), {s['warmup']} warm-up updates then cosine decay, "
        f"{s['updates']} updates per run, learning rates {_lrs(s['lrs'])}, seeds {_lrs(s['seeds'])}.",
        "",
        "**LR sensitivity** (the paper's §2): the mean over the learning rates of min(final loss, loss at "
        "init) minus the best final loss over them; lower is a flatter loss-against-lr curve. A tool "
        f"**helps** when its sensitivity is lower than the plain baseline's (`none`) on each of the {seeds} "
        f"seeds and its best-lr loss (mean over seeds) is no worse (at most "
        f"{summary['best_loss_tolerance']:g} nats above the baseline's).",
        "",
        f"Measured: {summary['cells_measured']} of {summary['cells_planned']} runs, "
        f"{results['wall_seconds']:.0f} s of wall time on {'; '.join(machines)}.",
        "",
        _status(results),
        "",
        f"![Final held-out loss against the learning rate, per treatment]({image})",
        "",
        "| tool | LR sensitivity | vs none | best-lr loss | diverged | max attention logit | clipped "
        "| skipped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, e in rows.items():
        if not e["cells"]:
            lines.append(f"| `{name}` | not yet measured |  |  |  |  |  |  |")
            continue
        v = e.get("verdict")
        vs = "" if v is None else f"{_f(v['mean_difference'], '+.3f')} ± {_f(v['spread'])}"
        lines.append(
            f"| `{name}` | {_f(e['mean_sensitivity'])} | {vs} | {_f(e['mean_best_loss'])} "
            f"| {e['diverged']} | {_f(e['max_logit'], '.1f')} | {e['clipped'] + e['update_clipped']} "
            f"| {e['skipped']} |"
        )
    lines += [
        "",
        "LR sensitivity and best-lr loss are means over the seeds whose every learning rate is measured; "
        "`vs none` is the mean paired difference in sensitivity and its standard deviation over seeds; "
        "diverged counts runs whose final loss is not below the loss at init; clipped counts windows "
        "whose gradient or update was scaled down. Time is not compared here: the runs were spread over "
        "several sessions of a machine shared with other work, whose load differed several-fold between "
        "them; each tool's cost is measured on its own in `benchmarks/` (e.g. `small.py`, "
        "`update_cost.py`, `qk_clip_cost.py`, `rerun_cost.py`).",
        "",
        *(
            [
                f"![The largest attention logit in training against the learning rate]({logits})",
                "",
                "The largest attention logit seen in training, per learning rate (the largest over the seeds "
                "measured): the attention-logit growth that qk-layernorm prevents in the paper.",
                "",
            ]
            if logits
            else []
        ),
        "Final held-out loss per learning rate (mean over the seeds measured; nats per byte):",
        "",
        "| tool | " + " | ".join(f"{lr:g}" for lr in s["lrs"]) + " |",
        "|---|" + "---|" * len(s["lrs"]),
        *(
            f"| `{name}` | " + " | ".join(_f(e["loss_by_lr"].get(f"{lr:g}")) for lr in s["lrs"]) + " |"
            for name, e in rows.items()
            if e["cells"]
        ),
        "",
        "**UpdateClip's fixed bounds** scale with the learning rate: `max_rms = c * lr` and "
        "`max_norm = c * lr`, with `c` the 95th percentile, over a healthy run (the plain baseline at "
        f"lr {s['lrs'][0]:g}, seed 0, after its warm-up), of the update's largest per-tensor RMS "
        f"divided by that update's lr ({_f(cal.get('rms_per_lr'))}) and of its norm divided by the lr "
        f"({_f(cal.get('norm_per_lr'), '.1f')}): a bound a healthy run exceeds about one update in twenty.",
        "",
        "**What these runs cannot show.** Each run is short (the paper trains for far longer), so the "
        "tools that wait for a history act late or not at all: SpikeGuard with `window=128` scores nothing "
        "before `warmup=64` updates (with `window=32`, `warmup=20`), `UpdateClip(z=3.0)` bounds nothing "
        "before its history holds `window // 2 = 64` norms, and AdaGC clips globally at `lambda_abs=1.0` "
        "for its first `warmup=100`. They are measured at their defaults, as a user would first meet "
        "them; SpikeGuard at its former default (`window=128`) and its current one (`window=32`).",
        "",
        "## Per tool",
        "",
    ]
    for name, e in rows.items():
        t = BY_NAME.get(name)
        if not e["cells"]:
            lines += [f"### `{name}`: `{t.description if t else name}`", "", "Not yet measured.", ""]
            continue
        lines += [
            f"### `{name}`: `{t.description if t else name}`",
            "",
            f"- **Fixed here:** {_fixed(name, e, seeds, summary['reproduced'], base)}.",
            f"- **Cost:** {e['skipped']} windows skipped, {e['undone']} updates undone, of {e['windows']} "
            "(time: see above).",
            f"- **Did not fix:** {_not_fixed(name, e, summary['faults'])}.",
            "",
        ]
    lines += [
        "## Bad data",
        "",
        f"A healthy run (lr {s['fault_lr']:g}, seeds {_lrs(s['fault_seeds'])}) with "
        f"{summary['fault_length']} bad batches in a row from update {summary['fault_start']}: "
        "random bytes (`random`), one batch repeated (`repeat`), real text with shuffled targets "
        "(`shuffled`). Final held-out loss, and in brackets its difference from the same treatment's "
        "clean run:",
        "",
    ]
    lines.append(fault_table_markdown(results))
    return "\n".join(lines)
