"""The vanishing rule: layers whose gradients are negligible against the others' and their weights'."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..read import GradLog
from ..text import fmt_num as _num
from .common import VANISH_RELATIVE, VANISH_TO_PARAM, as_tensor, median_of


def vanishing_findings(log: GradLog, notes: list[str]) -> list[dict[str, Any]]:
    """One ``vanishing`` finding per layer whose gradients are far below the others' or its weights', but
    for the parameters whose gradient is zero by construction (:func:`_zero_by_construction`): a note."""
    medians, ratios = _layer_medians(log)
    if not medians:
        return []
    reference = median_of(torch.tensor(list(medians.values()), dtype=torch.float64))
    findings, by_construction = [], []
    for name, med in medians.items():
        found = _vanishing_finding(log, name, med, ratios[name], reference)
        if found is None:
            continue
        sibling = _zero_by_construction(name, medians)
        if sibling is None:
            findings.append(found)
        else:
            by_construction.append(f"{name} (median {_num(med)}; {sibling} {_num(medians[sibling])})")
    if by_construction:
        listed = ", ".join(by_construction[:10]) + (", ..." if len(by_construction) > 10 else "")
        notes.append(
            f"{len(by_construction)} parameter(s) with a gradient far below that of another parameter of "
            f"the same module: {listed}; the gradient reaches that module, so this is not vanishing but a "
            "gradient that is zero by construction (e.g. a bias followed by a normalisation, which "
            "removes the mean)"
        )
    return findings


def _weight_of(name: str) -> str | None:
    """The weight a bias is added to: ``0.bias`` -> ``0.weight``, ``rnn.bias_ih_l0`` ->
    ``rnn.weight_ih_l0``, ``attn.in_proj_bias`` -> ``attn.in_proj_weight``; None for a name whose last
    part is not a bias."""
    module, dot, leaf = name.rpartition(".")
    return module + dot + leaf.replace("bias", "weight") if "bias" in leaf else None


def _zero_by_construction(name: str, medians: dict[str, float]) -> str | None:
    """The weight of the bias ``name`` (:func:`_weight_of`) when ``name``'s median gradient norm is below
    VANISH_RELATIVE times that weight's, else None.

    Why: gradients vanish layer by layer, so a module's weight and bias shrink
    together (the deep-sigmoid run of the corpus: within 6x of each other,
    both 1e-12); a bias whose gradient is 1e-7 of its own module's weight's is
    cancelled by what follows it -- a BatchNorm subtracts the batch mean, so a
    convolution's bias before it gets no gradient at all -- and the layers
    around it learn.  Only a bias against its own weight: the other parameters
    of a module may be other layers (``nn.ParameterList`` weights ``ws.0`` ...
    ``ws.14``, a stacked RNN's ``weight_ih_l0`` ... ``weight_ih_l11``), whose
    gradients vanish one after the other."""
    weight = _weight_of(name)
    if weight is None or weight not in medians:
        return None
    return weight if medians[name] < VANISH_RELATIVE * medians[weight] else None


def _layer_medians(log: GradLog) -> tuple[dict[str, float], dict[str, Tensor]]:
    """Per layer with a finite gradient norm: its median, and its ``grad_norm / param_norm`` per row (nan:
    not both finite and positive)."""
    medians: dict[str, float] = {}
    ratios: dict[str, Tensor] = {}
    for name, cols in log.layers.items():
        g, p = as_tensor(cols["grad_norm"]), as_tensor(cols["param_norm"])
        ok = torch.isfinite(g)
        if not ok.any():
            continue
        medians[name] = median_of(g[ok])
        both = ok & torch.isfinite(p) & (p > 0)
        ratios[name] = torch.where(both, g / p.clamp(min=1e-300), math.nan)
    return medians, ratios


def _vanishing_finding(
    log: GradLog, name: str, med: float, r: Tensor, reference: float
) -> dict[str, Any] | None:
    """Layer ``name``'s ``vanishing`` finding (None: not vanishing), against the median over layers."""
    r_ok = r[~torch.isnan(r)]
    ratio = median_of(r_ok) if r_ok.numel() else None
    relative = med < VANISH_RELATIVE * reference
    to_param = ratio is not None and ratio < VANISH_TO_PARAM
    if not (relative or to_param):
        return None
    g = as_tensor(log.layers[name]["grad_norm"])
    below = (g < VANISH_RELATIVE * reference) if relative else (r < VANISH_TO_PARAM)
    first = int(below.nonzero().flatten()[0]) if below.any() else 0
    step = log.steps[log.layer_rows[first]]
    parts = []
    if relative:
        rel = _num(med / reference) if reference > 0 else "0"
        parts.append(
            f"median gradient norm {_num(med)} is {rel}x the median over layers ({_num(reference)}; "
            f"vanishing below {VANISH_RELATIVE:g}x)"
        )
    if ratio is not None:
        tail = f"; vanishing below {VANISH_TO_PARAM:g}" if to_param else ""
        parts.append(f"median grad_norm/param_norm {_num(ratio)}{tail}")
    return {
        "kind": "vanishing",
        "verdict": "vanishing",
        "step": step,
        "layer": name,
        "evidence": f"{name}: " + "; ".join(parts) + f" (first below at step {step})",
        "values": {
            "median_grad_norm": med,
            "reference": reference,
            "median_grad_to_param": ratio,
            "relative": relative,
            "to_param": to_param,
        },
    }
