"""``clipopt inspect FILE``: what an anomaly snapshot says about the update that went bad.

:func:`summarize` turns a snapshot (see :func:`clipopt.load_snapshot`) into plain
Python data: the window's step, reason, norm and provenance, every parameter with
its statistics -- ranked so that the parameters that went bad come first -- and a
description of what was :meth:`~clipopt.ClippedOptimizer.attach`-ed.
:func:`format_text` renders that for a terminal, :func:`format_json` as JSON.

In the JSON output every float that is not finite is written as a string,
``"nan"``, ``"inf"`` or ``"-inf"`` (JSON has no such numbers, and ``null`` would
hide the difference between them); everything else is a plain JSON value.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .._diagnostics.layers import LAYER_FIELDS
from .._diagnostics.snapshot import load_snapshot
from .._inner import flat_state_dict
from .._report.text import fmt_num, fmt_scale, json_safe

__all__ = ["InspectError", "format_json", "format_text", "inspect_file", "rank_parameters", "summarize"]

#: Columns of the parameter table, in order.
PARAM_COLUMNS = ("name", "shape", "nonfinite", *(f for f in LAYER_FIELDS if f != "nonfinite"))


class InspectError(Exception):
    """A file that cannot be inspected; the message is one line meant for the user."""


def inspect_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load the snapshot at ``path`` and :func:`summarize` it.

    Raises :class:`InspectError` with a one-line message when the file is
    missing, unreadable, not a clipopt snapshot, or damaged.
    """
    name = os.fspath(path)
    if not os.path.exists(name):
        raise InspectError(f"{name}: no such file")
    if os.path.isdir(name):
        raise InspectError(f"{name} is a directory; pass one snapshot file (anomaly-step*.pt) inside it")
    try:
        with warnings.catch_warnings():  # torch.load's warnings about foreign files would add lines
            warnings.simplefilter("ignore")
            snap = load_snapshot(name)
    except ValueError as exc:  # load_snapshot's own checks (already one line, torch's part of it cut short)
        raise InspectError(str(exc)) from None
    except OSError as exc:
        raise InspectError(f"{name}: cannot read it ({_one_line(exc)})") from None
    except Exception as exc:  # torch.load: not a torch file, or one weights_only refuses
        raise InspectError(
            f"{name} is not a clipopt snapshot (torch.load failed: {_one_line(exc)}); "
            "pass a file that ClippedOptimizer(snapshot_dir=...) wrote"
        ) from None
    try:
        return summarize(snap, name)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as exc:
        raise InspectError(f"{name} is a damaged clipopt snapshot ({_one_line(exc)})") from None


def summarize(snap: Mapping[str, Any], path: str | None = None) -> dict[str, Any]:
    """Plain-data summary of a loaded snapshot (floats may be nan/inf).

    Keys: ``file``, ``format``, ``step``, ``reason``, ``total_norm``,
    ``micro_batches``, ``time``, ``versions``, ``parameters`` (a list of
    :data:`PARAM_COLUMNS` dicts plus ``has_grad``, ranked by
    :func:`rank_parameters`), ``nonfinite_parameters`` (their names),
    ``optimizer`` (number of parameter groups, their learning rates, and how
    many parameters have inner state), ``attached`` (name -> description,
    see :func:`describe`) and ``scale`` (the GradScaler's loss scale of the
    window, None without a scaler or in snapshots older than it).
    """
    ranked = rank_parameters(_parameter_rows(snap))
    # read before the other keys: a damaged snapshot's error names the first missing one
    optimizer = snap["optimizer"]
    return {
        "file": path,
        "format": snap.get("format"),
        "step": int(snap["step"]),
        "reason": snap["reason"],
        "total_norm": float(snap["total_norm"]),
        "micro_batches": int(snap["micro_batches"]),
        "rank": snap.get("rank"),
        "time": snap["time"],
        "versions": dict(snap["versions"]),
        "parameters": ranked,
        "nonfinite_parameters": [r["name"] for r in ranked if r["nonfinite"] > 0],
        "optimizer": _optimizer_summary(flat_state_dict(optimizer)),
        "attached": {str(k): describe(v) for k, v in snap["attached"].items()},
        "scale": None if snap.get("scale") is None else float(snap["scale"]),
    }


def _parameter_rows(snap: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One :data:`PARAM_COLUMNS` row (plus ``has_grad``) per parameter, in the snapshot's order: those
    with ``layer_stats`` first, their statistics computed from the tensors for the others."""
    params: Mapping[str, Any] = snap["params"]
    grads: Mapping[str, Any] = snap["grads"]
    layer_stats: Mapping[str, Any] = snap["layer_stats"]
    names = list(layer_stats) + [n for n in params if n not in layer_stats]
    rows = []
    for name in names:
        stats = layer_stats.get(name)
        grad = grads.get(name)
        param = params.get(name)
        if stats is None:
            stats = _tensor_stats(grad, param)
        shape = param.shape if isinstance(param, Tensor) else grad.shape if isinstance(grad, Tensor) else None
        row: dict[str, Any] = {"name": name, "shape": None if shape is None else list(shape)}
        for field in PARAM_COLUMNS[2:]:
            row[field] = int(stats[field]) if field == "nonfinite" else float(stats[field])
        row["has_grad"] = isinstance(grad, Tensor)
        rows.append(row)
    return rows


def _optimizer_summary(optimizer: Any) -> dict[str, Any]:
    """The inner optimizer's state dict in brief: parameter groups, their learning rates, parameters with
    state."""
    groups = optimizer.get("param_groups", []) if isinstance(optimizer, Mapping) else []
    state = optimizer.get("state", {}) if isinstance(optimizer, Mapping) else {}
    return {
        "param_groups": len(groups),
        "lr": [_plain(g.get("lr")) for g in groups],
        "params_with_state": len(state),
    }


def rank_parameters(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parameters that went bad first (most non-finite elements first), then by gradient norm, largest first.

    A non-finite ``grad_norm`` of a parameter without non-finite elements (an
    overflowing float32 norm) ranks above every finite one; parameters without
    a gradient (``grad_norm`` nan) come last.  Ties keep the snapshot's order.
    """

    def key(row: dict[str, Any]) -> tuple[int, int, float]:
        norm = row["grad_norm"]
        no_grad = math.isnan(norm)
        return (-row["nonfinite"], int(no_grad), 0.0 if no_grad else -norm)

    return sorted(rows, key=key)


def describe(value: Any) -> dict[str, Any]:
    """What ``attach`` received: tensors by shape, dtype and non-finite count; other values as they are."""
    if isinstance(value, Tensor):
        return {
            "type": "tensor",
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
            "nonfinite": _count_nonfinite(value),
        }
    if isinstance(value, (list, tuple)):
        return {"type": type(value).__name__, "items": [describe(v) for v in value]}
    if isinstance(value, Mapping):
        return {"type": "dict", "items": {str(k): describe(v) for k, v in value.items()}}
    if value is None:
        return {"type": "None", "value": None}
    return {
        "type": type(value).__name__,
        "value": value if isinstance(value, (bool, int, float, str)) else str(value),
    }


# ---------------------------------------------------------------------------- rendering


def format_json(summary: Mapping[str, Any]) -> str:
    """The summary as JSON; non-finite floats become ``"nan"``, ``"inf"`` or ``"-inf"``."""
    return json.dumps(json_safe(summary), indent=2, allow_nan=False)


def format_text(summary: Mapping[str, Any]) -> str:
    """The summary for a terminal: header, ranked parameter table, attachments."""
    lines = [f"clipopt anomaly snapshot {summary['file'] or ''}".rstrip()]
    lines += _header_lines(summary)
    lines += ["", *_parameter_lines(summary)]
    lines += ["", *_attached_lines(summary["attached"])]
    lines += ["", *_replay_lines(summary)]
    return "\n".join(lines)


def _header_lines(summary: Mapping[str, Any]) -> list[str]:
    """The window: step, reason, total norm, micro-batches, loss scale, rank, time, versions, the inner
    optimizer."""
    versions = summary["versions"]
    opt = summary["optimizer"]
    lrs = ", ".join(fmt_num(lr) if isinstance(lr, float) else str(lr) for lr in opt["lr"])
    scaled = summary["scale"] is not None
    header = [
        ("step", str(summary["step"])),
        ("reason", str(summary["reason"])),
        ("total_norm", fmt_num(summary["total_norm"]) + "  (pre-clip norm of the combined gradient)"),
        ("micro_batches", str(summary["micro_batches"])),
        *([("scale", fmt_scale(summary["scale"]) + "  (the GradScaler's loss scale)")] if scaled else []),
        *([("rank", str(summary["rank"]))] if summary.get("rank") is not None else []),
        ("time", str(summary["time"])),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions.items())),
        (
            "optimizer",
            f"{opt['param_groups']} parameter group(s), lr {lrs or '-'}; "
            f"state for {opt['params_with_state']} parameter(s)",
        ),
    ]
    width = max(len(k) for k, _ in header)
    return [f"  {k.ljust(width)}  {v}" for k, v in header]


def _parameter_lines(summary: Mapping[str, Any]) -> list[str]:
    """Which parameters went non-finite, then the ranked parameter table."""
    params = summary["parameters"]
    bad = summary["nonfinite_parameters"]
    if bad:
        lines = [
            f"{len(bad)} of {len(params)} parameters have non-finite gradients; first: {bad[0]} "
            f"({params[0]['nonfinite']} non-finite elements)"
        ]
    else:
        lines = [f"no parameter has non-finite gradient elements ({len(params)} parameters)"]
    lines.append("Parameters (non-finite first, then by gradient norm; gradients are pre-clip, combined):")
    table = [list(PARAM_COLUMNS)]
    for row in params:
        shape = "-" if row["shape"] is None else str(tuple(row["shape"]))
        grad_cols = [fmt_num(row[f]) for f in ("grad_norm", "grad_max", "grad_min")]
        if not row["has_grad"]:
            grad_cols = ["no grad", "-", "-"]
        table.append([row["name"], shape, str(row["nonfinite"]), *grad_cols, fmt_num(row["param_norm"])])
    return lines + _table(table, right=range(2, len(PARAM_COLUMNS)))


def _attached_lines(attached: Mapping[str, Any]) -> list[str]:
    """What was attached with ``opt.attach()``, or how to attach the batch."""
    if not attached:
        return [
            "Attached: nothing (call opt.attach(inputs=x, targets=y) before opt.step() to save the batch)"
        ]
    lines = ["Attached:"]
    for name, desc in attached.items():
        lines += _describe_lines(name, desc, "  ")
    return lines


def _replay_lines(summary: Mapping[str, Any]) -> list[str]:
    """How to replay the window (``clipopt replay``), or why the positional names prevent it."""
    params = summary["parameters"]
    if params and all(re.fullmatch(r"group\d+\.\d+", row["name"]) for row in params):
        return [
            "Replay: the parameter names are positional (group<g>.<i>), so model.load_state_dict() cannot "
            "use them; pass param_names=model.named_parameters() to ClippedOptimizer to get model names"
        ]
    return [
        f"Replay: clipopt replay {summary['file'] or 'FILE'} --model pkg.mod:factory "
        "--loss pkg.mod:loss_fn names the operation, module and phase that went non-finite "
        "(clipopt.replay in Python)",
        "  by hand: snap = clipopt.load_snapshot(FILE); "
        "model.load_state_dict(snap['params'], strict=False); then run the attached batch",
    ]


def _describe_lines(name: str, desc: Mapping[str, Any], indent: str) -> list[str]:
    """The lines of one attached value (nested lists and dicts indented)."""
    kind = desc["type"]
    if kind == "tensor":
        shape = str(tuple(desc["shape"]))
        bad = f", {desc['nonfinite']} non-finite" if desc["nonfinite"] else ""
        return [f"{indent}{name}: tensor {shape} {desc['dtype']}{bad}"]
    if kind in ("list", "tuple"):
        items = desc["items"]
        out = [f"{indent}{name}: {kind} of {len(items)}"]
        for i, item in enumerate(items):
            out += _describe_lines(f"[{i}]", item, indent + "  ")
        return out
    if kind == "dict":
        items = desc["items"]
        out = [f"{indent}{name}: dict of {len(items)}"]
        for key, item in items.items():
            out += _describe_lines(repr(key), item, indent + "  ")
        return out
    value = desc["value"]
    shown = fmt_num(value) if isinstance(value, float) else repr(value)
    return [f"{indent}{name}: {kind} {shown}"]


def _table(rows: list[list[str]], right: range) -> list[str]:
    """Rows as aligned columns (the ``right`` ones right-aligned), each line indented by two spaces."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out


# ---------------------------------------------------------------------------- helpers


def _plain(value: Any) -> Any:
    """A learning rate (float or 0-d tensor) as a Python number."""
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value.item())
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def _count_nonfinite(t: Tensor) -> int:
    """Non-finite elements of ``t`` (0 for integer tensors)."""
    if t.is_sparse:
        t = t.coalesce().values()
    if not (t.is_floating_point() or t.is_complex()):
        return 0
    return int(t.numel() - int(torch.isfinite(t).sum()))


def _tensor_stats(grad: Any, param: Any) -> dict[str, float]:
    """:data:`LAYER_FIELDS` from the tensors, for a parameter the snapshot's ``layer_stats`` lacks."""
    nan = math.nan
    out = {"grad_norm": nan, "grad_max": nan, "grad_min": nan, "nonfinite": 0.0, "param_norm": nan}
    if isinstance(param, Tensor):
        out["param_norm"] = float(param.detach().float().norm())
    if isinstance(grad, Tensor):
        g = (grad.coalesce().values() if grad.is_sparse else grad).detach().float().reshape(-1)
        out["grad_norm"] = float(g.norm())
        if g.numel():
            out["grad_max"] = float(g.abs().max())
            out["grad_min"] = float(g.abs().min())
        out["nonfinite"] = float(_count_nonfinite(g))
    return out


def _one_line(exc: BaseException) -> str:
    """The first line of the exception's message, at most 300 characters."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= 300 else first[:297] + "..."
