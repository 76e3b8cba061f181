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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from .. import functional as F
from .._checks import check_float_between
from .._distributed.collectives import reduce_norm_over

__all__ = [
    "ParamKey",
    "PolicyWindow",
    "Slots",
    "bias_correction",
    "check_decay",
    "check_dense",
    "check_keys_held",
    "checked_state",
    "param_keys",
    "policy_window",
    "put",
    "ready",
    "scaled_grads",
    "slots",
    "take",
]

#: A parameter as a per-tensor policy keys its statistics: ``(k, i)``, the index ``k`` of its inner
#: optimizer in the wrapper (0 for a wrapper over one) and its index ``i`` in that optimizer's own
#: state dict (its position in that optimizer's ``param_groups``, in order).  Neither moves when a
#: group is added to any inner optimizer (torch appends it), nor when a checkpoint is loaded into a
#: fresh model; a position in the wrapper's flat list of parameters moves (#32).
ParamKey = tuple[int, int]


def param_keys(optimizers: Sequence[Any]) -> list[ParamKey]:
    """The :data:`ParamKey` of every parameter of ``optimizers`` (the wrapper's inner optimizers, in
    order), in the order of the wrapper's ``param_groups`` (theirs, one after the other)."""
    return [
        (k, i)
        for k, o in enumerate(optimizers)
        for i, _ in enumerate(p for group in o.param_groups for p in group["params"])
    ]


@dataclass(frozen=True)
class PolicyWindow:
    """What an in-place policy sees of one window's close (stage 4, clip).

    Attributes:
        params: the parameters to clip the gradients of (every one, in group order; some may
            have no gradient).  For DTensors (FSDP2) the DTensor parameters.
        grads: the window's summed gradients, one per parameter of ``params`` that has one, in
            order; local shards for DTensors (clipping them in place clips the gradients).
        keys: for each of ``params``, its :data:`ParamKey` (inner optimizer, index in it): a
            policy's per-tensor statistics are kept by it (:attr:`grad_keys`: those of ``grads``).
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
    keys: Sequence[ParamKey]
    scale: float
    norms: Callable[[Sequence[Tensor], float], Tensor]
    total: Callable[[Tensor], Tensor]
    healthy: Tensor
    update: bool = True

    @cached_property
    def grad_keys(self) -> tuple[ParamKey, ...]:
        """The :data:`ParamKey` of each of ``grads``: those of the parameters that have a gradient."""
        return tuple(k for p, k in zip(self.params, self.keys, strict=True) if p.grad is not None)

    def restricted(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> PolicyWindow:
        """The same window over a subset (the parameter groups that share the wrapper's bound)."""
        have = [p for p in params if p.grad is not None]
        if len(have) != len(grads):
            raise ValueError(f"{len(have)} parameters with a gradient but {len(grads)} gradients")
        key_of = {id(p): k for p, k in zip(self.params, self.keys, strict=True)}
        return replace(self, params=params, grads=grads, keys=[key_of[id(p)] for p in params])


def policy_window(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    keys: Sequence[ParamKey],
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
        # sqrt(sum(n_i**2)) by these three kernels, as pytorch_optimizer's get_global_gradient_norm
        # computes it: the same kernels in the same order, so AdaGC's warm-up bound is the
        # reference's bit for bit on any CPU (linalg.vector_norm of the same values rounds
        # differently, by the vector width: #33)
        local = per_tensor.square().sum().sqrt()
        if F.overflowed(local):  # finite norms whose float32 squares overflowed: the norm's rule (#35)
            local = F.narrowed(F.finite_norm_of(per_tensor.double(), 2.0), local)
        return local if norm_group is None else reduce_norm_over(local, 2.0, norm_group)

    if len(keys) != len(params):
        raise ValueError(f"{len(keys)} parameter keys for {len(params)} parameters")
    return PolicyWindow(
        params=params,
        grads=grads,
        keys=keys,
        scale=1.0 / divisor,
        norms=norms,
        total=total,
        healthy=healthy,
        update=update,
    )


def check_decay(name: str, value: Any, example: str) -> float:
    """A decay rate of an exponential moving average: a float in [0, 1)."""
    return check_float_between(name, value, 0.0, 1.0, example, open_high=True)


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


@dataclass(frozen=True)
class Slots:
    """Which parameter each entry of a per-tensor policy's statistics belongs to: entry ``j`` of
    every statistic tensor is the parameter ``keys[j]`` (a :data:`ParamKey`), in the order the
    policy first saw them.  Replaced, never changed (``UndoPoint`` puts the old one back)."""

    keys: tuple[ParamKey, ...] = ()

    @cached_property
    def entry(self) -> dict[ParamKey, int]:
        """The entry of each key."""
        return {k: j for j, k in enumerate(self.keys)}

    def place(self, keys: tuple[ParamKey, ...]) -> tuple[Slots, list[int] | None]:
        """The slots after a window whose gradients are those of ``keys`` (new keys appended, in
        order) and the entry of each of ``keys``; None when they are all the entries, in order
        (the common case: no gather or scatter)."""
        if keys == self.keys:
            return self, None
        new = [k for k in dict.fromkeys(keys) if k not in self.entry]
        after = Slots((*self.keys, *new)) if new else self
        where = [after.entry[k] for k in keys]
        return after, None if where == list(range(len(after.keys))) else where

    def tensor(self) -> Tensor:
        """The keys as the state dict holds them: an int64 tensor of shape ``(entries, 2)``."""
        return torch.tensor(self.keys, dtype=torch.int64).reshape(-1, 2)


def slots(current: Slots, window: PolicyWindow, device: torch.device) -> tuple[Slots, Tensor | None]:
    """:meth:`Slots.place` for the window's gradients, the entries as an index tensor on ``device``."""
    after, where = current.place(window.grad_keys)
    return after, None if where is None else torch.tensor(where, dtype=torch.int64, device=device)


def ready(state: Tensor, size: int, fill: float, like: Tensor) -> Tensor:
    """A per-tensor statistic of ``size`` entries on ``like``'s device, in at least float32:
    ``state`` (loaded or kept), then ``fill`` for the tensors it has not seen (new entries of
    :class:`Slots`, which come last)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    have = state.numel()
    state = state.to(like.device, dtype)
    if have < size:
        state = torch.cat([state, torch.full((size - have,), fill, dtype=dtype, device=like.device)])
    return state


def take(state: Tensor, where: Tensor | None) -> Tensor:
    """The statistics of the window's gradients (``where``: their entries, None: all)."""
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
    name: str, state: dict[str, Any], names: Sequence[str], unseen: Mapping[str, float] | None = None
) -> tuple[dict[str, Tensor], Slots]:
    """A per-tensor policy's saved state: 1-d real statistics ``names`` of one length, each finite
    and >= 0 (or, for a name in ``unseen``, the value it maps to: a tensor not seen yet), a 0-d ``count`` (the
    last of ``names``), a whole number >= 0, and ``keys``: whose statistics each entry is (an
    integer tensor of one distinct ``(optimizer, index)`` row >= 0 per entry, :class:`Slots`);
    else ``ValueError`` naming the policy (touching nothing).  A nan, infinite or negative
    statistic would turn the clipping off, or make every gradient nan after the window's
    finiteness check.  Reads the values (a load, not a step)."""
    fix = f"pass the state a {name} saved"
    out: dict[str, Tensor] = {}
    for key in names:
        value = state.get(key) if isinstance(state, dict) else None
        if not isinstance(value, Tensor) or value.is_complex() or not value.is_floating_point():
            raise ValueError(f"invalid {name} state: {key!r} must be a float tensor; {fix}")
        if key == "count" and (value.numel() != 1 or not _whole(value.reshape(()))):
            raise ValueError(f"invalid {name} state: 'count' must be one whole number >= 0; {fix}")
        if key != "count" and value.dim() != 1:
            raise ValueError(f"invalid {name} state: {key!r} must be 1-d; {fix}")
        ok = torch.isfinite(value) & (value >= 0)
        mark = (unseen or {}).get(key)
        if mark is not None:
            ok |= torch.isnan(value) if math.isnan(mark) else value == mark
        if not bool(ok.all()):
            also = f" (or {mark}: not seen yet)" if mark is not None else ""
            raise ValueError(
                f"invalid {name} state: {key!r} holds a value that is not finite and >= 0{also}; {fix}"
            )
        out[key] = value.detach()
    sizes = sorted({v.numel() for k, v in out.items() if k != "count"})
    if len(sizes) > 1:
        raise ValueError(f"invalid {name} state: statistics of different lengths {sizes}; {fix}")
    return out, _checked_keys(name, state.get("keys"), sizes[0] if sizes else 0, fix)


def _checked_keys(name: str, keys: Any, entries: int, fix: str) -> Slots:
    """The saved ``keys`` as :class:`Slots`: an integer tensor of ``entries`` distinct rows
    ``(optimizer, index)`` >= 0, else ``ValueError``."""
    what = f"'keys' must be an integer tensor of shape ({entries}, 2), one (optimizer, index) row per entry"
    if (
        not isinstance(keys, Tensor)
        or keys.is_floating_point()
        or keys.is_complex()
        or keys.dtype == torch.bool
        or tuple(keys.shape) != (entries, 2)
    ):
        raise ValueError(f"invalid {name} state: {what}; {fix}")
    rows: list[ParamKey] = [(int(k), int(i)) for k, i in keys.tolist()]
    if any(k < 0 or i < 0 for k, i in rows) or len(set(rows)) != len(rows):
        raise ValueError(f"invalid {name} state: 'keys' must hold distinct rows of indices >= 0; {fix}")
    return Slots(tuple(rows))


def check_keys_held(name: str, slots: Slots, sizes: Sequence[int]) -> None:
    """``ValueError`` when ``slots`` name a parameter the wrapper does not have (``sizes``: the
    parameters of each inner optimizer): a state saved for other parameters, refused at load
    rather than at the next window's close, after its gradients were used (#32)."""
    for k, i in slots.keys:
        if k >= len(sizes) or i >= sizes[k]:
            held = ", ".join(f"optimizer {j}: {n}" for j, n in enumerate(sizes))
            raise ValueError(
                f"invalid {name} state: it holds statistics of {len(slots.keys)} tensors, among them "
                f"parameter {i} of optimizer {k}, but the wrapper's optimizers hold {held} parameters; "
                f"the state belongs to other parameters: load the state saved with these, or use a "
                f"fresh {name}"
            )


def _whole(count: Tensor) -> bool:
    """Whether ``count`` (0-d) is a finite whole number >= 0."""
    return bool(torch.isfinite(count) & (count >= 0) & (count == count.round()))
