"""The three kinds of clipping policy, and what an in-place policy is given each window.

A :class:`~clipopt.ClipPolicy` passed as ``max_norm`` is one of:

* **global** (:class:`~clipopt.AutoClip`, :class:`~clipopt.ZClip`): ``threshold(total_norm)``
  returns the window's norm bound; the wrapper clips by it like a float ``max_norm``
  (``StepStats.max_norm`` records it).  Optionally a spike rule (``spike``, ``is_spike``).
* **unit-wise** (:class:`~clipopt.AGC`, ``unitwise = True``): clips the gradients in place,
  unit by unit, from the parameters (``clip_(params, scale)``).
* **per-tensor** (:class:`~clipopt._policies.builtin.TensorPolicy`: :class:`~clipopt.AdaGC`,
  :class:`~clipopt.StableSPAM`):
  clips the gradients in place, tensor by tensor, from statistics of its own
  (``clip_window_(window)``), which it updates only for a healthy window.

Unit-wise and per-tensor policies both *clip in place* (``unitwise = True``: the wrapper
has no global bound; ``StepStats.max_norm`` is None and ``clip_coef`` 1.0, ``clipped``
says whether the policy changed anything).  The wrapper calls
``policy.clip_window_(window)`` with a :class:`PolicyWindow`; the default forwards to
``clip_(window.params, window.scale)``.  A new per-tensor policy subclasses
:class:`~clipopt._policies.builtin.TensorPolicy` in a file of its own (docs/choosing-max-norm.md,
'Per-tensor policies'; ARCHITECTURE.md, 'Extension points').
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from numbers import Real
from typing import Any

import torch
from torch import Tensor

from .._distributed.collectives import reduce_norm_over

__all__ = [
    "PolicyWindow",
    "bias_correction",
    "check_decay",
    "check_dense",
    "scaled_grads",
    "checked_state",
    "policy_window",
    "positions",
    "put",
    "ready",
    "take",
]


@dataclass(frozen=True)
class PolicyWindow:
    """What an in-place policy sees of one window's close (stage 4, clip).

    Attributes:
        params: the parameters to clip the gradients of (every one, in group order; some may
            have no gradient).  For DTensors (FSDP2) the DTensor parameters.
        grads: the window's summed gradients, one per parameter of ``params`` that has one, in
            order; local shards for DTensors (clipping them in place clips the gradients).
        index: for each of ``grads``, its position in ``params`` (a policy's per-tensor state
            is kept by that position).
        scale: the factor the gradients still need (``1 / micro-batches`` with
            ``reduction="mean"``); the policy applies it.
        norms: ``norms(grads, p)``: each of ``grads``' ``p``-norm over all ranks holding shards
            of it (a collective for DTensors; ``p = inf`` gives each tensor's largest ``|g|``),
            a 1-d tensor on the device.
        total: ``total(norms)``: the 2-norm of all the gradients from their per-tensor 2-norms
            (over a pipeline's ``norm_group`` as well).
        healthy: a 0-d bool on the device: the window is finite and the replicas agree; a
            policy updates its statistics only where it is true (a skipped window is as if it
            never happened).
        update: False for a closure's re-evaluation (LBFGS): clip with the current
            statistics, change none.
    """

    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    index: Sequence[int]
    scale: float
    norms: Callable[[Sequence[Tensor], float], Tensor]
    total: Callable[[Tensor], Tensor]
    healthy: Tensor
    update: bool = True

    def restricted(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> PolicyWindow:
        """The same window over a subset (the parameter groups that share the wrapper's bound)."""
        have = [p for p in params if p.grad is not None]
        if len(have) != len(grads):
            raise ValueError(f"{len(have)} parameters with a gradient but {len(grads)} gradients")
        return replace(
            self, params=params, grads=grads, index=[i for i, p in enumerate(params) if p.grad is not None]
        )


def policy_window(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    divisor: float,
    norms: Callable[[Sequence[Tensor], float], Tensor],
    norm_group: Any,
    flags: Sequence[Tensor | None],
    update: bool,
) -> PolicyWindow:
    """The :class:`PolicyWindow` of a window's close: healthy when none of ``flags`` (the
    non-finite flag, the replicas' divergence; 0/1 on the device) is set."""
    set_flags = [f for f in flags if f is not None]
    healthy = (
        torch.stack([f.reshape(()).float() for f in set_flags]).amax() == 0
        if set_flags
        else torch.ones((), dtype=torch.bool)
    )

    def total(per_tensor: Tensor) -> Tensor:
        local = torch.linalg.vector_norm(per_tensor)
        return local if norm_group is None else reduce_norm_over(local, 2.0, norm_group)

    return PolicyWindow(
        params=params,
        grads=grads,
        index=[i for i, p in enumerate(params) if p.grad is not None],
        scale=1.0 / divisor,
        norms=norms,
        total=total,
        healthy=healthy,
        update=update,
    )


def check_decay(name: str, value: Any, example: str) -> float:
    """A decay rate of an exponential moving average: a float in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            f"{name} must be a float in [0, 1), got {value!r} ({type(value).__name__}); "
            f"pass e.g. {name}={example}"
        )
    v = float(value)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}; pass e.g. {name}={example}")
    return v


def check_dense(name: str, grads: Sequence[Tensor]) -> None:
    """Refuse sparse gradients before any gradient changes."""
    if any(g.is_sparse for g in grads):
        raise TypeError(f"{name} does not support sparse gradients; use a float max_norm or None")


def scaled_grads(name: str, window: PolicyWindow) -> list[Tensor]:
    """The window's gradients, checked dense (``name``: the policy, for the error) and multiplied in
    place by ``window.scale``: what a per-tensor policy measures and clips (empty: no gradient)."""
    check_dense(name, window.grads)
    grads = list(window.grads)
    if grads and window.scale != 1.0:
        torch._foreach_mul_(grads, window.scale)
    return grads


def positions(window: PolicyWindow, device: torch.device) -> Tensor | None:
    """The positions of the window's gradients in its parameters, on ``device``; None when every
    parameter has one (the common case: no gather or scatter needed)."""
    if len(window.index) == len(window.params):
        return None
    return torch.tensor(list(window.index), dtype=torch.int64, device=device)


def ready(state: Tensor, size: int, fill: float, like: Tensor) -> Tensor:
    """A per-tensor statistic of ``size`` values on ``like``'s device, in at least float32:
    ``state`` (loaded or kept), then ``fill`` for the tensors it has not seen (all of them the
    first time; those of a parameter group added since, which come last)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    have = state.numel()
    if have > size:
        raise ValueError(
            f"the policy holds statistics of {have} tensors, but is asked to clip {size}: its state "
            "belongs to another set of parameters; use a fresh policy, or load the state saved with these"
        )
    state = state.to(like.device, dtype)
    if have < size:
        state = torch.cat([state, torch.full((size - have,), fill, dtype=dtype, device=like.device)])
    return state


def take(state: Tensor, where: Tensor | None) -> Tensor:
    """The statistics of the window's gradients (``where``: their positions, None: all)."""
    return state if where is None else state[where]


def put(state: Tensor, where: Tensor | None, values: Tensor) -> Tensor:
    """A new statistic with ``values`` at ``where`` (None: everywhere), the rest as it was."""
    return values if where is None else state.index_put((where,), values)


def bias_correction(decay: float, count: Tensor, dtype: torch.dtype) -> Tensor:
    """``1 - decay ** count`` computed in float64 (the reference implementations compute it in
    Python), then rounded to ``dtype``: on the device, no host read."""
    base = torch.full((), decay, dtype=torch.float64, device=count.device)
    return (1.0 - torch.pow(base, count.to(torch.float64))).to(dtype)


def checked_state(
    name: str, state: dict[str, Any], keys: Sequence[str], unseen: Sequence[str] = ()
) -> dict[str, Tensor]:
    """A per-tensor policy's saved state: 1-d real statistics of one length, each finite and >= 0
    (nan too for the keys in ``unseen``: a tensor not seen yet), and a 0-d ``count`` (the last of
    ``keys``), a whole number >= 0; else ``ValueError`` naming the policy (touching nothing).
    A nan, infinite or negative statistic would turn the clipping off, or make every gradient nan
    after the window's finiteness check.  Reads the values (a load, not a step)."""
    fix = f"pass the state a {name} saved"
    out: dict[str, Tensor] = {}
    for key in keys:
        value = state.get(key) if isinstance(state, dict) else None
        if not isinstance(value, Tensor) or value.is_complex() or not value.is_floating_point():
            raise ValueError(f"invalid {name} state: {key!r} must be a float tensor; {fix}")
        if key == "count" and (value.numel() != 1 or not _whole(value.reshape(()))):
            raise ValueError(f"invalid {name} state: 'count' must be one whole number >= 0; {fix}")
        if key != "count" and value.dim() != 1:
            raise ValueError(f"invalid {name} state: {key!r} must be 1-d; {fix}")
        ok = torch.isfinite(value) & (value >= 0)
        if key in unseen:
            ok |= torch.isnan(value)
        if not bool(ok.all()):
            also = " (or nan: not seen yet)" if key in unseen else ""
            raise ValueError(
                f"invalid {name} state: {key!r} holds a value that is not finite and >= 0{also}; {fix}"
            )
        out[key] = value.detach()
    sizes = sorted({v.numel() for k, v in out.items() if k != "count"})
    if len(sizes) > 1:
        raise ValueError(f"invalid {name} state: statistics of different lengths {sizes}; {fix}")
    return out


def _whole(count: Tensor) -> bool:
    """Whether ``count`` (0-d) is a finite whole number >= 0."""
    return bool(torch.isfinite(count) & (count >= 0) & (count == count.round()))
