"""The treatments: what wraps the same AdamW (or the model change of a positive control).

Every treatment trains the same model from the same initialisation on the same batches per seed;
they differ only in the ``ClippedOptimizer`` keywords (and, for the positive controls, the model or
the loss).  ``UpdateClip``'s fixed bounds come from :class:`Bounds`: read off a healthy run and
scaled by the learning rate (see ``calibrate`` in ``train.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import clipopt


@dataclass(frozen=True)
class Bounds:
    """UpdateClip's fixed bounds per unit of learning rate (the bound at peak lr ``eta`` is
    ``ratio * eta``), read off a healthy run."""

    rms_per_lr: float = math.nan  #: 95th percentile of max-over-tensors rms(update) / lr
    norm_per_lr: float = math.nan  #: 95th percentile of ||update|| / lr


@dataclass(frozen=True)
class RunShape:
    """What a treatment's keywords may depend on besides the model: the peak lr and the run length."""

    lr: float
    updates: int
    bounds: Bounds


#: ClippedOptimizer keywords from (the model, the run).
Keywords = Callable[[torch.nn.Module, RunShape], dict[str, Any]]


@dataclass(frozen=True)
class Treatment:
    name: str
    description: str  #: what it is, in the words of the API
    keywords: Keywords
    qk_layernorm: bool = False
    z_loss: float = 0.0
    muon: bool = False  #: [Muon for the blocks' matrices, AdamW for the rest] instead of AdamW alone
    control: bool = False  #: a positive control (changes the model or the loss, not the optimizer)


def _rewind(model: torch.nn.Module, run: RunShape) -> clipopt.Rewind:
    """Rewind scaled to the run: a copy every 1/8 of it, rewind after 3 spikes within 1/8, then drop
    1/10 of the run's batches (the defaults, every=100 and skip_batches=200, are sized for long runs)."""
    eighth = max(3, run.updates // 8)
    return clipopt.Rewind(
        every=eighth, keep=2, spikes=3, within=eighth, skip_batches=max(1, run.updates // 10), module=model
    )


TREATMENTS: tuple[Treatment, ...] = (
    Treatment(
        "none",
        "max_norm=None (no clipping; non-finite updates still skipped)",
        lambda m, r: {"max_norm": None},
    ),
    Treatment(
        "qk-layernorm",
        "control: LayerNorm on queries and keys, max_norm=None",
        lambda m, r: {"max_norm": None},
        qk_layernorm=True,
        control=True,
    ),
    Treatment(
        "z-loss",
        "control: z-loss 1e-4 * log(Z)^2, max_norm=None",
        lambda m, r: {"max_norm": None},
        z_loss=1e-4,
        control=True,
    ),
    Treatment("clip", "max_norm=1.0", lambda m, r: {"max_norm": 1.0}),
    Treatment("autoclip", "max_norm=AutoClip()", lambda m, r: {"max_norm": clipopt.AutoClip()}),
    Treatment("zclip", "max_norm=ZClip()", lambda m, r: {"max_norm": clipopt.ZClip()}),
    Treatment("adagc", "max_norm=AdaGC()", lambda m, r: {"max_norm": clipopt.AdaGC()}),
    Treatment("stablespam", "max_norm=StableSPAM()", lambda m, r: {"max_norm": clipopt.StableSPAM()}),
    Treatment(
        "update-rms",
        "update_clip=UpdateClip(max_rms=c * lr), c from a healthy run",
        lambda m, r: {
            "max_norm": None,
            "update_clip": clipopt.UpdateClip(max_rms=r.bounds.rms_per_lr * r.lr),
        },
    ),
    Treatment(
        "update-norm",
        "update_clip=UpdateClip(max_norm=c * lr), c from a healthy run",
        lambda m, r: {
            "max_norm": None,
            "update_clip": clipopt.UpdateClip(max_norm=r.bounds.norm_per_lr * r.lr),
        },
    ),
    Treatment(
        "update-z",
        "update_clip=UpdateClip(z=3.0, window=128)",
        lambda m, r: {"max_norm": None, "update_clip": clipopt.UpdateClip(z=3.0, window=128)},
    ),
    Treatment(
        "spikeguard-w128",
        "spike_guard=SpikeGuard(window=128) (SpikeGuard() before #34)",
        lambda m, r: {"max_norm": None, "spike_guard": clipopt.SpikeGuard(window=128)},
    ),
    Treatment(
        "spikeguard+rewind",
        "spike_guard=SpikeGuard(window=128), rewind=Rewind(every=U/8, keep=2, spikes=3, within=U/8, "
        "skip_batches=U/10)",
        lambda m, r: {
            "max_norm": None,
            "spike_guard": clipopt.SpikeGuard(window=128),
            "rewind": _rewind(m, r),
        },
    ),
    Treatment(
        "muon", "[Muon(matrices), AdamW(rest)], max_norm=None", lambda m, r: {"max_norm": None}, muon=True
    ),
    Treatment(
        "qk-clip",
        "qk_clip=QKClip(model, fused='qkv') (threshold 100, alpha 0.5), max_norm=None",
        lambda m, r: {"max_norm": None, "qk_clip": clipopt.QKClip(m, fused="qkv")},
    ),
    Treatment(
        "spikeguard",
        "spike_guard=SpikeGuard(window=32) (SpikeGuard() since #34)",
        lambda m, r: {"max_norm": None, "spike_guard": clipopt.SpikeGuard(window=32)},
    ),
)

BY_NAME = {t.name: t for t in TREATMENTS}


def weight_decay(lr: float) -> float:
    """AdamW's ``weight_decay`` for peak lr ``lr``: a per-update decay of 1e-4 (times the schedule),
    the same at every learning rate, so that only the step size varies across the sweep."""
    return 1e-4 / lr


def inner_optimizers(model: torch.nn.Module, treatment: Treatment, lr: float) -> list[torch.optim.Optimizer]:
    """AdamW (0.9, 0.95), or Muon for the transformer blocks' matrices and AdamW for the rest."""
    wd = weight_decay(lr)
    if not treatment.muon:
        return [torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=wd)]
    blocks = getattr(model, "blocks")  # noqa: B009 -- the GPT of model.py
    matrices = [p for p in blocks.parameters() if p.ndim == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [
        torch.optim.Muon(matrices, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95), weight_decay=wd),
    ]
