"""What clipopt's stability benchmark measured, quoted in ``clipopt report``'s advice (#34).

The figures are a digest of the benchmark's results file, ``evidence.json`` beside this module,
written by ``python -m benchmarks.stability`` from ``benchmarks/results/stability.json``; the page
that shows them all is ``docs/which-tool.md``.  Each advice of the report (lower the learning rate,
SpikeGuard for bad data, clip, UpdateClip, cap the attention logits) gets one sentence: the tools
that fixed that kind of run there, or that none did, with the numbers and the page.  A tool *fixed*:

- a learning rate too large, when it lowered the loss's sensitivity to the learning rate
  (Wortsman et al. 2023, §2) on every seed of the sweep, by more than the benchmark's tolerance
  (``tolerance``, 0.01 nats: a smaller difference is no difference there) on average;
- bad batches, when it cut the held-out loss they cost the plain run (``none``) at least in half
  (:data:`FIXED_SHARE`); bad batches that cost no more than the tolerance needed no fixing.

Nothing here is computed from a user's log: the sentences say what happened in that benchmark, a
2-layer GPT trained for a few hundred updates, not what will happen in the user's run.  Where the
benchmark's positive controls did not both lower the plain run's sensitivity (``reproduced``), the
sentence says that its numbers are measurements, not verdicts, as the page does.  A digest that
does not have the expected shape gives no sentence (the advice is then printed without evidence).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache, wraps
from importlib import resources
from typing import Any

__all__ = ["FIXED_SHARE", "attention", "bad_data", "clipping", "learning_rate", "update_bounds"]

#: A tool fixed a data fault when the loss it cost is at most this share of the plain run's.
FIXED_SHARE = 0.5

#: The data faults' names in words.
_FAULTS = {"random": "random tokens", "repeat": "a repeated batch", "shuffled": "a label-shuffled shard"}

#: UpdateClip's treatments and their mode's argument.
_UPDATE = {"update-rms": "max_rms", "update-norm": "max_norm", "update-z": "z"}


@cache
def load() -> dict[str, Any] | None:
    """The digest, or None when it is missing or unreadable (then the advice has no evidence line)."""
    try:
        text = resources.files(__package__).joinpath("evidence.json").read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("treatments"), dict) else None


def _quoted(sentence: Callable[[dict[str, Any]], str]) -> Callable[[], str]:
    """The sentence from the digest, ``""`` without one or when the digest lacks what it reads."""

    @wraps(sentence)
    def quote() -> str:
        d = load()
        if d is None:
            return ""
        try:
            return sentence(d)
        except (KeyError, TypeError, ValueError, AttributeError):
            return ""

    return quote


def _where(d: dict[str, Any], what: str = "") -> str:
    lrs = d["lrs"]
    shape = what or f"learning rates {min(lrs):g} to {max(lrs):g}, {d['seeds']} seeds"
    run = f"a {d['layers']}-layer GPT, {d['updates']} updates"
    caveat = (
        ""
        if d["reproduced"]
        else "; its controls did not both show the instability: measurements, not verdicts"
    )
    return f"in clipopt's stability benchmark ({run}, {shape}; {d['page']}{caveat})"


def _d(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _listed(names: list[str], t: dict[str, Any]) -> str:
    return ", ".join(f"{n} ({_d(t[n]['vs_none'])})" for n in names)


def _lowered(e: dict[str, Any], tolerance: float) -> bool:
    """Whether a treatment lowered the sensitivity on every seed, and by more than ``tolerance``."""
    return bool(e["lower_on_every_seed"]) and e["vs_none"] is not None and e["vs_none"] < -tolerance


@_quoted
def learning_rate(d: dict[str, Any]) -> str:
    """What fixed runs at too large a learning rate there (the learning-rate advice), or ``""``."""
    t = d["treatments"]
    lowered = [n for n, e in t.items() if _lowered(e, d["tolerance"])]
    tools = [n for n in lowered if n not in d["controls"]]
    models = [n for n in lowered if n in d["controls"]]
    said = (
        f"{_listed(tools, t)} lowered the loss's sensitivity to the learning rate on every seed"
        if tools
        else "no clipopt tool lowered the loss's sensitivity to the learning rate on every seed"
    ) + f" (by more than {d['tolerance']:g} nats)"
    if models:
        said += f"; of the model changes, {_listed(models, t)} did"
    ends = {n: e["loss_at_largest_lr"] for n, e in t.items() if e["loss_at_largest_lr"] is not None}
    best = min(ends, key=lambda n: ends[n]) if ends else None
    if best is not None:
        said += (
            f"; at lr {max(d['lrs']):g} the plain run ended at {_f(ends['none'])} nats, {best} at "
            f"{_f(ends[best])}"
        )
    return f"{_where(d)}, {said}"


@_quoted
def bad_data(d: dict[str, Any]) -> str:
    """What fixed a run fed bad batches there (the SpikeGuard advice), or ``""``."""
    faults = d["faults"]
    plain = faults["none"]
    parts = []
    for fault, cost in plain.items():
        others = {n: row[fault] for n, row in faults.items() if n != "none" and row.get(fault) is not None}
        if cost is None or not others:
            continue
        fixed = [n for n, v in others.items() if v <= FIXED_SHARE * cost]
        best = min(others, key=lambda n: others[n])
        by = f"fixed by {', '.join(fixed)}" if fixed else "fixed by no tool"
        said = f"{_FAULTS.get(fault, fault)} cost the plain run {_d(cost)} nats"
        if cost <= d["tolerance"]:
            parts.append(f"{said}, no more than {d['tolerance']:g}: nothing to fix")
        else:
            parts.append(f"{said}, {by} (best: {best} {_d(others[best])})")
    what = (
        f"{d['fault_length']} bad batches at update {d['fault_start']}, lr {d['fault_lr']:g}, "
        f"{d['fault_seeds']} seeds"
    )
    return f"{_where(d, what)}: " + "; ".join(parts) if parts else ""


def _moved(diff: float, tolerance: float) -> str:
    """``lowered``, ``raised``, or ``left within the tolerance`` by ``diff``."""
    return "lowered" if diff < -tolerance else "raised" if diff > tolerance else "barely changed"


@_quoted
def clipping(d: dict[str, Any]) -> str:
    """What ``max_norm=1.0`` did there (the advice to clip, or to clip otherwise), or ``""``."""
    t = d["treatments"]
    clip, none = t["clip"], t["none"]
    best = _moved(clip["mean_best_loss"] - none["mean_best_loss"], d["tolerance"])
    sens = _moved(clip["vs_none"], d["tolerance"])
    return (
        f"{_where(d)}, max_norm=1.0 {best} the best-lr loss ({_f(none['mean_best_loss'])} -> "
        f"{_f(clip['mean_best_loss'])} nats) and {sens} the loss's sensitivity to the learning rate "
        f"({_d(clip['vs_none'])}); at lr {max(d['lrs']):g} it ended at {_f(clip['loss_at_largest_lr'])} "
        f"against the plain run's {_f(none['loss_at_largest_lr'])}"
    )


@_quoted
def update_bounds(d: dict[str, Any]) -> str:
    """What UpdateClip's modes did there (the UpdateClip suggestion), or ``""``."""
    t = d["treatments"]
    modes = [n for n in _UPDATE if n in t]
    if not modes:
        return ""
    said = "; ".join(
        f"UpdateClip({_UPDATE[n]}=...) bounded {t[n]['update_clipped']} of {t[n]['windows']} updates, "
        f"sensitivity to the learning rate {_d(t[n]['vs_none'])}"
        + (", lower on every seed" if _lowered(t[n], d["tolerance"]) else "")
        for n in modes
    )
    return f"{_where(d)}: {said}"


@_quoted
def attention(d: dict[str, Any]) -> str:
    """What capped the attention logits there (the attention note), or ``""``."""
    t = d["treatments"]
    shown = [n for n in ("qk-clip", "qk-layernorm") if n in t]
    if not shown:
        return ""
    said = "; ".join(
        f"{n}: largest logit {t[n]['max_logit']:.0f}, sensitivity to the learning rate {_d(t[n]['vs_none'])}"
        + (" (lower on every seed)" if _lowered(t[n], d["tolerance"]) else "")
        for n in shown
    )
    plain = f"the plain run's largest attention logit reached {t['none']['max_logit']:.0f}"
    return f"{_where(d)}, {plain}; {said}"
