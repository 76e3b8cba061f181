"""Configuration of a :class:`~clipopt.ClippedOptimizer`: every constructor argument, validated in one place.

:func:`configure` checks the arguments in signature order, before any state
exists, and returns them as a :class:`WrapperConfig`; :func:`check_max_norm`
is also what the ``max_norm`` setter runs.  The argument-level checks
(``check_positive_int`` ...) are in :mod:`clipopt._checks`, shared with the
policies and the loggers.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from numbers import Real
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from ._caller import user_stacklevel
from ._checks import (
    check_choice,
    check_flag,
    check_norm_type,
    check_optional_positive_float,
    check_optional_positive_int,
    check_positive_int,
)
from ._diagnostics.layers import resolve_param_names
from ._diagnostics.loggers import Loggers
from ._diagnostics.snapshot import DTENSOR_DIAGNOSTICS, Snapshots, check_snapshot_dir
from ._distributed.collectives import has_dtensor
from ._distributed.replicas import check_norm_group, check_replica_group
from ._inner import InnerOptimizers
from ._part import Part
from ._policies.builtin import ClipPolicy
from ._recovery.qk_clip import QKClip
from ._recovery.rerun import Rerun
from ._recovery.rewind import RewindPart
from ._recovery.spike_guard import GuardPart
from ._window.diagnose import LayerStatistics
from ._window.groups import check_groups
from ._window.update_apply import UpdateStats
from ._window.update_clip import UpdateClip

__all__ = [
    "KEYWORDS",
    "REGISTRY",
    "ASSIGNABLE",
    "ASSIGNED_WITH",
    "WrapperConfig",
    "check_assignment",
    "check_closure",
    "check_max_norm",
    "configure",
    "describe",
]


@dataclass(frozen=True)
class WrapperConfig:
    """The validated constructor arguments (see :class:`~clipopt.ClippedOptimizer` for each)."""

    policy: ClipPolicy | None  #: ``max_norm`` when it is a policy
    bound: float | None  #: ``max_norm`` when it is a float (None: off, or a policy)
    norm_type: float
    clip_value: float | None
    accumulation_steps: int
    reduction: str
    skip_nonfinite: bool
    max_consecutive_nonfinite: int | None
    stats_history: int
    max_snapshots: int
    norm_group: Any
    replica_group: Any  #: ``"auto"``, a process group, or None
    backward_passes_per_step: int
    names: dict[Tensor, str]  #: parameter -> name (see ``param_names``)
    inner: Optimizer  #: the optimizer, or an ``InnerOptimizers`` over a list of several

    def settings(self) -> dict[str, Any]:
        """The wrapper's settings attributes by name (``_policy``/``_bound`` for ``max_norm``)."""
        own = ("replica_group", "names", "inner", "policy", "bound")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in own}
        return {**out, "_policy": self.policy, "_bound": self.bound}


def check_closure(closure: Any, scaler: Any) -> None:
    """``step(closure)``: a callable or None, and not together with a GradScaler."""
    if closure is not None and not callable(closure):
        raise TypeError(
            f"closure must be a callable or None, got {type(closure).__name__}; pass a function that "
            "computes the loss and calls backward(), e.g. opt.step(closure), or call opt.step()"
        )
    if closure is not None and scaler is not None:
        raise TypeError(
            "step(closure) cannot be used with scaler=...: GradScaler does not support "
            "closures; call loss.backward() yourself and then opt.step()"
        )


def check_max_norm(value: Any) -> tuple[ClipPolicy | None, float | None]:
    """``max_norm``: a policy, a positive float or None -> ``(policy, bound)``."""
    if isinstance(value, ClipPolicy):
        return value, None
    if value is not None and (isinstance(value, bool) or not isinstance(value, Real)):
        raise TypeError(
            "max_norm must be a float, a ClipPolicy (AutoClip, ZClip, AGC, AdaGC, StableSPAM) or None, "
            f"got {value!r} ({type(value).__name__}); pass e.g. max_norm=1.0 or max_norm=AutoClip()"
        )
    return None, check_optional_positive_float("max_norm", value, "1.0")


def check_optimizer(optimizer: Any, wrapper_type: type, name: str = "optimizer") -> None:
    """The inner optimizer: a ``torch.optim.Optimizer``, not already wrapped."""
    if isinstance(optimizer, wrapper_type):
        raise TypeError(
            f"{name} is already a ClippedOptimizer; wrap its inner optimizer "
            "(opt.optimizer) once, with all the options you need"
        )
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"{name} must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
            "pass e.g. torch.optim.AdamW(model.parameters())"
            + (", or a list of optimizers over disjoint parameters" if name == "optimizer" else "")
        )


def check_inner(optimizer: Any, wrapper_type: type) -> Optimizer:
    """``optimizer``: one optimizer, or a non-empty list of them over disjoint parameters (one
    :class:`~clipopt._inner.InnerOptimizers`; a list of one is that optimizer)."""
    if not isinstance(optimizer, (list, tuple)):
        check_optimizer(optimizer, wrapper_type)
        return optimizer  # type: ignore[no-any-return]
    if not optimizer:
        raise ValueError(
            "optimizer is an empty list; pass an optimizer, or a list of optimizers over disjoint "
            "parameters, e.g. [torch.optim.Muon(matrices), torch.optim.AdamW(others)]"
        )
    for k, o in enumerate(optimizer):
        check_optimizer(o, wrapper_type, f"optimizer[{k}]")
    return optimizer[0] if len(optimizer) == 1 else InnerOptimizers(optimizer)


def _check_skipping(skip_nonfinite: Any, max_consecutive_nonfinite: Any) -> tuple[bool, int | None]:
    skip = check_flag("skip_nonfinite", skip_nonfinite)
    limit = check_optional_positive_int("max_consecutive_nonfinite", max_consecutive_nonfinite)
    if limit is not None and not skip:
        raise ValueError(
            f"max_consecutive_nonfinite={max_consecutive_nonfinite!r} counts skipped updates "
            "but skip_nonfinite=False skips none; set skip_nonfinite=True or "
            "max_consecutive_nonfinite=None"
        )
    return skip, limit


def _check_scaler_and_foreach(scaler: Any, foreach: Any) -> None:
    if scaler is not None and not (hasattr(scaler, "unscale_") and hasattr(scaler, "update")):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}; "
            "pass scaler=torch.amp.GradScaler()"
        )
    if foreach is not None:
        check_flag("foreach", foreach)


def _check_names(
    optimizer: Optimizer, param_names: Any, clip_value: float | None, snapshot_dir: Any
) -> dict[Tensor, str]:
    """The parameter names, and what they rule out (complex with clip_value, DTensor with snapshots)."""
    names = resolve_param_names(optimizer, param_names)
    _check_complex(optimizer, clip_value)
    if snapshot_dir is not None and has_dtensor(list(names)):
        raise ValueError(DTENSOR_DIAGNOSTICS)
    if (
        snapshot_dir is not None
        and param_names is None
        and not any(g.get("param_names") for g in optimizer.param_groups)
    ):
        warnings.warn(
            "snapshot_dir is set but the parameters have no names, so snapshots name them "
            "group0.0, group0.1, ... and model.load_state_dict(snap['params'], strict=False) "
            "matches nothing; pass param_names=model.named_parameters()",
            UserWarning,
            stacklevel=user_stacklevel(),  # the user's ClippedOptimizer(...) line
        )
    return names


def configure(optimizer: Any, wrapper_type: type, options: dict[str, Any]) -> WrapperConfig:
    """Validate every constructor argument (``options``: the keyword arguments by name), in order."""
    o = options
    inner = check_inner(optimizer, wrapper_type)
    policy, bound = check_max_norm(o["max_norm"])
    norm_type = check_norm_type(o["norm_type"])
    clip_value = check_optional_positive_float("clip_value", o["clip_value"], "0.5")
    accumulation_steps = check_positive_int("accumulation_steps", o["accumulation_steps"])
    reduction = check_choice("reduction", o["reduction"], ("mean", "sum"))
    skip_nonfinite, max_consecutive = _check_skipping(o["skip_nonfinite"], o["max_consecutive_nonfinite"])
    _check_scaler_and_foreach(o["scaler"], o["foreach"])
    stats_history = check_positive_int("stats_history", o["stats_history"])
    check_snapshot_dir(o["snapshot_dir"])
    max_snapshots = check_positive_int("max_snapshots", o["max_snapshots"])
    norm_group = check_norm_group(o["norm_group"])
    replica_group = check_replica_group(o["replica_group"])
    passes = check_positive_int("backward_passes_per_step", o["backward_passes_per_step"])
    names = _check_names(inner, o["param_names"], clip_value, o["snapshot_dir"])
    groups = inner.param_groups  # per-group 'max_norm'/'clip_value' (docs/per-group-clipping.md)
    check_groups(groups, inner.defaults, policy=policy, norm_group=norm_group, clip_value=clip_value)
    return WrapperConfig(
        policy,
        bound,
        norm_type,
        clip_value,
        accumulation_steps,
        reduction,
        skip_nonfinite,
        max_consecutive,
        stats_history,
        max_snapshots,
        norm_group,
        replica_group,
        passes,
        names,
        inner,
    )


#: Every part (``_part.Part``), in the order a window runs their hooks, whatever order the keywords
#: are passed in.  Adding a feature is one new module (its part) plus one line here.
REGISTRY: tuple[type[Part], ...] = (
    GuardPart,
    RewindPart,
    UpdateClip,  # before UpdateStats: it starts and finishes the update they share
    UpdateStats,
    Loggers,
    LayerStatistics,
    Snapshots,
    Rerun,
    QKClip,
)

#: The parts' constructor keywords: ``opt.<keyword>`` reads a part's value, assigning it is checked
#: by the part before anything changes.
KEYWORDS = frozenset(c.keyword for c in REGISTRY)

#: The settings that may be assigned on a wrapper after its construction (``opt.clip_value = 0.5``):
#: each is checked by :func:`check_assignment` as the constructor checks it, before anything changes.
#: (``max_norm`` is a property whose setter runs the same check.)
ASSIGNABLE = frozenset(
    {
        "norm_type",
        "clip_value",
        "accumulation_steps",
        "reduction",
        "skip_nonfinite",
        "max_consecutive_nonfinite",
        "scaler",
        "stats_history",
        "foreach",
        "max_snapshots",
        "norm_group",
        "backward_passes_per_step",
    }
)


#: The settings :func:`check_assignment` checks an assignment with (cross-checks: a policy against the
#: groups' options and the Rewind, ``skip_nonfinite`` against ``max_consecutive_nonfinite`` ...).
ASSIGNED_WITH = (
    "max_norm",
    "clip_value",
    "norm_group",
    "skip_nonfinite",
    "max_consecutive_nonfinite",
)


def check_assignment(name: str, value: Any, current: dict[str, Any], inner: Optimizer) -> Any:
    """The value to store when the setting ``name`` (``max_norm`` or one of :data:`ASSIGNABLE`) is
    assigned ``value`` after construction: checked exactly as :func:`configure` checks it, with the
    other settings as they are (``current``: the wrapper's settings by name, ``max_norm`` included)
    and the inner optimizer's groups.  Raises the constructor's error, before anything changes.
    ``max_norm`` returns ``(policy, bound)``."""
    new = {**current, name: value}
    if name in ("max_norm", "clip_value", "norm_group"):
        checked: Any
        if name == "max_norm":
            checked = check_max_norm(value)  # (the parts beside it: ``Parts.check_with``)
        elif name == "clip_value":
            checked = new["clip_value"] = check_optional_positive_float("clip_value", value, "0.5")
            _check_complex(inner, checked)
        else:
            checked = new["norm_group"] = check_norm_group(value)
        policy = new["max_norm"] if isinstance(new["max_norm"], ClipPolicy) else None
        check_groups(
            inner.param_groups,
            inner.defaults,
            policy=policy,
            norm_group=new["norm_group"],
            clip_value=new["clip_value"],
        )
        return checked
    if name in ("skip_nonfinite", "max_consecutive_nonfinite"):
        skip, limit = _check_skipping(new["skip_nonfinite"], new["max_consecutive_nonfinite"])
        return skip if name == "skip_nonfinite" else limit
    return _SIMPLE_CHECKS[name](value)


def _check_complex(optimizer: Optimizer, clip_value: float | None) -> None:
    if clip_value is not None and any(p.is_complex() for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            f"clip_value={clip_value!r} cannot clip complex parameters (a complex number has no order "
            "to clamp by); pass clip_value=None and bound complex gradients with max_norm"
        )


def _check_scaler(value: Any) -> Any:
    _check_scaler_and_foreach(value, None)
    return value


def _check_foreach(value: Any) -> Any:
    _check_scaler_and_foreach(None, value)
    return value


#: The settings whose check needs no other setting: name -> the check, which returns what to store.
_SIMPLE_CHECKS: dict[str, Any] = {
    "norm_type": check_norm_type,
    "accumulation_steps": lambda v: check_positive_int("accumulation_steps", v),
    "reduction": lambda v: check_choice("reduction", v, ("mean", "sum")),
    "scaler": _check_scaler,
    "stats_history": lambda v: check_positive_int("stats_history", v),
    "foreach": _check_foreach,
    "max_snapshots": lambda v: check_positive_int("max_snapshots", v),
    "backward_passes_per_step": lambda v: check_positive_int("backward_passes_per_step", v),
}


def describe(opt: Any, inner: Any, parts: Sequence[str] = ()) -> str:
    """The ``repr`` of a :class:`~clipopt.ClippedOptimizer` ``opt``: its settings (and the parts
    that are on: ``parts``, their texts), then its ``inner`` optimizer(s), indented."""
    opts = (
        f"max_norm={opt.max_norm}, norm_type={opt.norm_type}, clip_value={opt.clip_value}, "
        f"accumulation_steps={opt.accumulation_steps}, reduction={opt.reduction!r}, "
        f"skip_nonfinite={opt.skip_nonfinite}"
    )
    opts += "".join(f", {text}" for text in parts)
    text = "\n".join("  " + line for line in repr(inner).splitlines())
    return f"ClippedOptimizer({opts},\n{text}\n)"
