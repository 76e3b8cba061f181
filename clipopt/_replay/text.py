"""``clipopt replay``'s output: a :class:`~clipopt.ReplayResult` as a readable account or as JSON."""

from __future__ import annotations

import json
import math

from .._report.text import fmt_num, fmt_scale, json_safe
from .replay import ReplayResult
from .watch import TensorStats

__all__ = ["explain", "format_json", "format_text"]

#: Growth rows shown for a spike.
GROWTH_ROWS = 5


def format_json(result: ReplayResult) -> str:
    """The result as JSON; non-finite floats become ``"nan"``, ``"inf"`` or ``"-inf"``."""
    return json.dumps(json_safe(result.as_dict()), indent=2, allow_nan=False)


def format_text(result: ReplayResult) -> str:
    """The result for a terminal: what was compared, where it went non-finite, and what that means."""
    r = result
    rank = "" if r.rank is None else f", rank {r.rank}"
    lines = [f"clipopt replay {r.file or ''}".rstrip(), f"  step {r.step}, reason {r.reason}{rank}"]
    agree = "" if r.consistent else "; the replays disagree on where"
    times = "once" if r.repeats == 1 else f"{r.repeats} times"
    lines.append(f"  replayed {times}: reproduced {r.reproduced_runs} of {r.repeats}{agree}")
    if r.scale is not None:
        lines.append(f"  loss scale {fmt_scale(r.scale)} (GradScaler), as in the original backward")
    lines.append(f"  total norm: snapshot {fmt_num(r.snapshot_norm)}, replay {fmt_num(r.replay_norm)}")
    replayed = _names(r.replay_nonfinite_grads)
    if r.replay_nonfinite_grads and r.replay_nonfinite_grads == r.snapshot_nonfinite_grads:
        replayed = "the same"
    lines += [
        f"  replay loss: {'finite' if r.loss_finite else 'non-finite'}",
        f"  non-finite gradients, snapshot: {_names(r.snapshot_nonfinite_grads)}",
        f"  non-finite gradients, replay:   {replayed}",
    ]
    if r.op is not None:
        where = "the model itself" if r.module == "" else r.module
        where = "loss_fn, outside the model's modules" if r.module is None else where
        kind = f" ({r.module_type})" if r.module_type else ""
        node = f", autograd node {r.node}" if r.node else ""
        lines += ["", f"First non-finite value: {r.phase}, in {where}{kind}, operator {r.op}{node}"]
        lines += [f"  input {i}: {_stats(s)}" for i, s in enumerate(r.inputs)]
        if r.output is not None:
            lines.append(f"  output:  {_stats(r.output)}")
    if r.growth:
        lines += ["", "Gradient growth against the optimizer's history (largest first):"]
        for g in r.growth[:GROWTH_ROWS]:
            lines.append(
                f"  {g.name}: norm {fmt_num(g.grad_norm)} vs {fmt_num(g.history_norm)} "
                f"({g.source}): x{fmt_num(g.ratio)}"
            )
    lines += ["", f"Cause: {r.cause} -- {explain(r)}"]
    return "\n".join(lines)


def explain(r: ReplayResult) -> str:
    """One or two sentences on what ``r.cause`` means and what to do."""
    rank_hint = (
        f" Under data parallelism a rank's gradient also holds the other ranks' after the all-reduce: "
        f"this is rank {r.rank}'s batch only; replay the other ranks' files (-rank<r>.pt)."
        if r.rank is not None
        else ""
    )
    texts = {
        "operation": "the model made a non-finite value from finite inputs, every time: a deterministic "
        "fault of the model on this batch; guard that operation (clamp its input, add an epsilon).",
        "fp16-overflow": "a float16/bfloat16 result was too large for its dtype (float16 ends at 65504), "
        "from finite inputs: compute that operation in float32 or scale its inputs down.",
        "loss-scale": f"the backward overflowed only with the loss scale {fmt_scale(r.scale)}; without it "
        "the gradients are finite: GradScaler's normal operation (it lowers the scale and skips).",
        "data": f"the attached {_names(r.attached_nonfinite)} hold non-finite values: the data, not the "
        f"model; {_first_seen(r)}",
        "parameters": f"the snapshot's parameters {_names(r.params_nonfinite)} are already non-finite: "
        "an earlier update went bad (look at earlier snapshots or the log).",
        "spike": "the spike replays exactly: the model and this batch produce it"
        + (f"; the layer that grew most is {r.layer}." if r.layer else f" ({r.growth_missing})."),
        "transient": "no replay showed the anomaly again: not the model and this batch, but something "
        "around them (data loading, hardware, a race)." + rank_hint,
        "averaged": f"rank {r.rank}'s snapshot norm {fmt_num(r.snapshot_norm)} is that of the gradient "
        f"averaged over the ranks (data parallel), which this rank's replay ({fmt_num(r.replay_norm)}) "
        "cannot reproduce alone: replay every rank's file (-rank<r>.pt) and compare their mean"
        + (f"; the layer that grew most is {r.layer}." if r.layer else "."),
        "intermittent": "only some replays showed it: a nondeterministic operation (dropout is seeded the "
        "same in every replay).",
    }
    return texts.get(r.cause, f"the {r.reason} window replays with the same gradient norm.")


def _first_seen(r: ReplayResult) -> str:
    if r.module is None:
        return "no module of the model saw it (it went non-finite in loss_fn)."
    name = "the model itself" if r.module == "" else r.module
    return f"the first module that saw it is {name}."


def _names(names: tuple[str, ...]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def _stats(s: TensorStats) -> str:
    bad = [f"{n} {k}" for n, k in ((s.nan, "nan"), (s.posinf, "+inf"), (s.neginf, "-inf")) if n]
    span = f"finite range [{fmt_num(s.min)}, {fmt_num(s.max)}]"
    span = "no finite value" if s.nonfinite == math.prod(s.shape) else span
    return f"{tuple(s.shape)} {s.dtype}, {', '.join(bad) if bad else 'finite'}, {span}"
