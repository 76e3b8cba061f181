"""Checkpoint state of a :class:`~clipopt.ClippedOptimizer`: the ``"clipopt"`` entry of its state dict.

:func:`wrapper_entry` builds the entry (counters, the open window's gradients
and loss sum, scaler, policy, the pending-unsynced marker); :func:`read_checkpoint`
checks a whole state dict -- the entry, the inner state, the policy's and the
scaler's state (each loaded into a copy first) -- before anything changes, and
returns what the optimizer then takes over.  The format is ``_state.FORMAT_VERSION``.

The entry is stored twice, as one object: at the top level and under the same key in the first
parameter group (:func:`with_entry`).  Savers that keep only ``state`` and ``param_groups`` of an
optimizer's state dict (torch's ``get_optimizer_state_dict``, Composer, torchtitan's
``OptimizersContainer``) keep the group's copy; :func:`entry_at_top` finds it again.  The flattening
savers (torchtitan, ``flatten_optimizer_state_dict=True``) restore only the group keys that the live
optimizer has: :func:`add_entry_slot` gives its first group the key, holding None.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from ._distributed.collectives import Unsynced
from ._inner import InnerOptimizers, inner_optimizers, inner_state_dicts
from ._part import Parts
from ._policies.builtin import ClipPolicy, checked_policy_state
from ._state import (
    StateDictError,
    WrapperState,
    check_loaded_state,
    check_scaler_matches,
    has_own_layout,
    held_state,
    keep_group_keys,
    read_wrapper_state,
    restore_on_failure,
    validate_inner_state,
)
from ._window.groups import check_groups, group_keys, kept_options
from ._window.loss import LossSum

__all__ = [
    "ENTRY",
    "Checkpoint",
    "add_entry_slot",
    "entry_at_top",
    "read_checkpoint",
    "with_entry",
    "wrapper_entry",
]

OptimizerT = TypeVar("OptimizerT", bound=Optimizer)

#: The key of the wrapper's entry, at the top level of its state dict and in its first parameter group.
ENTRY = "clipopt"


def add_entry_slot(inner: OptimizerT) -> OptimizerT:
    """``inner``, the first group of which -- for a single inner optimizer whose state dict is torch's
    (it keeps ``Optimizer.state_dict`` or is torch's own) -- now has the key that carries the entry,
    holding None: a flattening saver restores a group key only where the live group has it."""
    if isinstance(inner, InnerOptimizers) or not inner.param_groups:
        return inner
    kind = type(inner)
    torch_class = kind.__module__ == "torch" or kind.__module__.startswith("torch.")
    if torch_class or kind.state_dict is Optimizer.state_dict:
        inner.param_groups[0].setdefault(ENTRY, None)
    return inner


def with_entry(state_dict: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (the inner optimizer's) with ``entry`` at the top level and, where its first
    group has the slot (:func:`add_entry_slot`), in that group too (the same object)."""
    sd = dict(state_dict)
    sd[ENTRY] = entry
    groups = sd.get("param_groups")
    if isinstance(groups, list) and groups and isinstance(groups[0], dict) and ENTRY in groups[0]:
        sd["param_groups"] = [{**groups[0], ENTRY: entry}, *groups[1:]]
    return sd


def entry_at_top(state_dict: Any, inner: Optimizer) -> Any:
    """``state_dict`` with the entry at the top level -- taken from its first group where a saver
    dropped the top level's (the top level's wins) -- and that group's key set as ``inner``'s first
    group has it: None where it has the slot, absent where not.  The caller's dict is not changed."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not (isinstance(groups, list) and groups and isinstance(groups[0], dict)):
        return state_dict
    first = dict(groups[0])
    sd = dict(state_dict)
    carried = first.pop(ENTRY, None)
    if sd.get(ENTRY) is None and carried is not None:
        sd[ENTRY] = carried
    if not isinstance(inner, InnerOptimizers) and inner.param_groups and ENTRY in inner.param_groups[0]:
        first[ENTRY] = None
    sd["param_groups"] = [first, *groups[1:]]
    return sd


def wrapper_entry(
    counters: WrapperState,
    params: list[Tensor],
    *,
    scaler: torch.amp.GradScaler | None,
    loss_sum: LossSum,
    policy: ClipPolicy | None,
    unsynced: Unsynced | None,
    parts: Parts | None = None,
) -> dict[str, Any]:
    """The ``"clipopt"`` entry; mid-window it holds a copy of the gradients accumulated so far.
    ``parts``: each active part's entry under its keyword (``_part.Part.state_dict``)."""
    pending = None
    if counters.micro_batches > 0:
        pending = [None if p.grad is None else p.grad.detach().clone() for p in params]
    scaler_state = scaler.state_dict() if scaler is not None else None
    entry = counters.to_dict(pending_grads=pending, scaler=scaler_state)
    entry.update(loss_sum.to_dict())  # the open window's loss sum
    entry["policy"] = policy.state_dict() if policy is not None else None
    # DDP: the saved gradients are this rank's, not yet averaged
    entry["unsynced"] = None if unsynced is None else unsynced.to_dict()
    if parts is not None:
        entry.update(parts.state_dict())
    return entry


class Checkpoint(NamedTuple):
    """A state dict checked by :func:`read_checkpoint`, ready to be taken over."""

    #: The inner optimizer's state dict (without the ``"clipopt"`` entry).
    inner: dict[str, Any]
    #: The counters, or None for a plain optimizer's state dict (fresh counters).
    counters: WrapperState | None
    #: The open window's gradients (one per parameter), or None.
    pending_grads: list[Tensor | None] | None
    scaler_state: dict[str, Any] | None
    policy_state: dict[str, Any] | None
    loss_sum: LossSum
    unsynced: Unsynced | None
    #: Per inner optimizer, per group, the clipping options set now that the saved group lacks (put
    #: back after loading).
    kept_options: list[list[dict[str, Any]]]
    #: Per inner optimizer, whether its entry is in its own layout (``_state.has_own_layout``): its
    #: groups are checked once loaded (its ``kept_options`` is empty then), with this ``norm_group``.
    own_layout: tuple[bool, ...] = ()
    norm_group: Any = None
    #: Whether the wrapper loading it is mid-window (:meth:`with_open_window`): its window's
    #: gradients go unless the state dict has some (:func:`_take_grads`).
    open_window: bool = False
    #: The parts' checked entries, by keyword (``Parts.check_state``).
    parts: dict[str, Any] = {}  # noqa: RUF012 (a NamedTuple default, never written to)

    def with_open_window(self, open_window: bool) -> Checkpoint:
        """This checkpoint, to be loaded into a wrapper that is mid-window (``open_window``) or not."""
        return self._replace(open_window=open_window)

    def take_over(
        self,
        inner: Optimizer,
        params: list[Tensor],
        c: Mapping[str, Any],
        *,
        parts: Parts | None = None,
    ) -> WrapperState:
        """Load the checked state: the inner optimizer's (the groups' current clipping options
        kept; a failure leaves it as it was), the open window's gradients into ``params`` (or none:
        :func:`_take_grads`), the scaler's, the policy's and the parts'; return the counters to
        take over."""
        scaler, policy = c["scaler"], c["max_norm"] if isinstance(c["max_norm"], ClipPolicy) else None
        optimizers = inner_optimizers(inner)
        own = self.own_layout or (False,) * len(optimizers)
        with ExitStack() as stack:  # several inner optimizers: all as they were if one fails
            for o, reload in zip(optimizers, own, strict=True):  # outermost: undone after any check
                stack.enter_context(restore_on_failure(o, reload=reload))
            for o in optimizers:
                stack.enter_context(keep_group_keys(o))
            kept: list[dict[str, Any]] = []
            inners = inner_state_dicts(self.inner, inner)
            for (part, o), mine, options in zip(inners, own, self.kept_options, strict=True):
                if mine:
                    kept += _load_own_layout(o, part, policy, self.norm_group)
                else:
                    o.load_state_dict(part)
                    kept += options
            for group, extra in zip(inner.param_groups, kept, strict=False):
                group.update(extra)  # per-group clipping set now, absent from the checkpoint
        counters = self.counters if self.counters is not None else WrapperState()
        _take_grads(params, self.pending_grads, self.open_window)
        if self.scaler_state is not None and scaler is not None:  # (None for a plain optimizer's)
            scaler.load_state_dict(self.scaler_state)
        if self.policy_state is not None and policy is not None:
            policy.load_state_dict(self.policy_state)
        if parts is not None:  # (empty for a plain optimizer's state dict)
            parts.load_state(self.parts)
        return counters


def _take_grads(params: list[Tensor], pending: list[Tensor | None] | None, open_window: bool) -> None:
    """The saved open window's gradients into ``params``; without one, a window open now (``open_window``)
    drops its gradients (``grad`` None), as a fresh wrapper has none: they would be added to the next."""
    if pending is not None:
        for p, g in zip(params, pending, strict=True):
            p.grad = None if g is None else g.detach().to(p.device, p.dtype, copy=True)
    elif open_window:
        for p in params:
            p.grad = None


def read_checkpoint(
    state_dict: dict[str, Any],
    params: list[Tensor],
    c: Mapping[str, Any],
    *,
    inner: Optimizer,
    parts: Parts | None = None,
) -> Checkpoint:
    """Validate ``state_dict`` completely (``ValueError``, touching nothing) and return its parts;
    ``c``: the wrapper's settings by name (``accumulation_steps``, ``max_norm``, ``scaler``,
    ``norm_group``).

    An inner entry in the inner optimizer's own layout (pytorch_optimizer's ``Lookahead``) is left to
    the inner optimizer's own ``load_state_dict``, which :meth:`Checkpoint.take_over` undoes when it,
    or the check of the groups it loaded, fails; so is each such part of ``state_dict["optimizers"]``."""
    scaler, norm_group = c["scaler"], c["norm_group"]
    policy = c["max_norm"] if isinstance(c["max_norm"], ClipPolicy) else None
    inners = inner_state_dicts(state_dict, inner) if isinstance(state_dict, dict) else []
    own = tuple(isinstance(part, dict) and has_own_layout(part, o) for part, o in inners)
    torch_parts = [None if mine else part for (part, _), mine in zip(inners, own, strict=True)]
    wrapper = read_wrapper_state(state_dict, params, c["accumulation_steps"], torch_parts)
    kept = _check_parts(inners, own, policy, norm_group)
    ext = state_dict.get("clipopt")
    policy_state = _checked_policy(ext, policy, inner)
    check_scaler_matches(wrapper[2] if wrapper is not None else None, scaler)
    unsynced = Unsynced.from_dict(
        ext.get("unsynced") if isinstance(ext, dict) else None, wrapper[0].micro_batches if wrapper else 0
    )
    loss_sum, checked_parts = LossSum(), {}
    if wrapper is not None and isinstance(ext, dict):  # older state dicts have no loss: an empty sum
        loss_sum = LossSum.from_dict(ext, wrapper[0].micro_batches)
        copied = _copied_wrapper_check(policy, scaler)  # (inside a Rewind's copies)
        checked_parts = parts.check_state(ext, inner, copied) if parts else {}
    inner_sd = {k: v for k, v in state_dict.items() if k != "clipopt"}
    counters, pending, scaler_state = wrapper if wrapper is not None else (None, None, None)
    entries = (policy_state, loss_sum, unsynced, kept, own, norm_group)
    return Checkpoint(inner_sd, counters, pending, scaler_state, *entries, parts=checked_parts)


def _checked_policy(ext: Any, policy: ClipPolicy | None, inner: Optimizer) -> dict[str, Any] | None:
    """The policy's entry of ``ext`` (the ``"clipopt"`` entry), checked; a per-tensor policy's
    statistics against the parameters each inner optimizer holds (#32)."""
    held = [sum(len(g["params"]) for g in o.param_groups) for o in inner_optimizers(inner)]
    return checked_policy_state(ext.get("policy") if isinstance(ext, dict) else None, policy, held)


def _check_parts(
    parts: list[tuple[Any, Optimizer]], own: tuple[bool, ...], policy: ClipPolicy | None, norm_group: Any
) -> list[list[dict[str, Any]]]:
    """Each inner optimizer's part in torch's layout checked against it (one optimizer: the state dict
    itself); per optimizer, the clipping options to keep (none yet for a part in its own layout,
    whose groups are checked once loaded)."""
    kept: list[list[dict[str, Any]]] = []
    for (part, o), mine in zip(parts, own, strict=True):
        if mine:
            kept.append([])
            continue
        validate_inner_state(part, o)
        saved = [g for g in part["param_groups"] if isinstance(g, dict)]
        kept.append(_checked_kept_options(saved, o.param_groups, o.defaults, policy, norm_group))
    return kept


def _load_own_layout(
    inner: Optimizer, entry: dict[str, Any], policy: ClipPolicy | None, norm_group: Any
) -> list[dict[str, Any]]:
    """Load an entry in the inner optimizer's own layout (checked by its ``load_state_dict``), then
    check what has become visible as a torch-layout entry is checked before loading: the state and
    the groups' hyper-parameters of ``inner`` and of the optimizer it wraps (``_state.optimizer_chain``),
    the groups' clipping options; returns the kept options."""
    before = held_state(inner)
    inner.load_state_dict(entry)
    check_loaded_state(inner, before)
    return _checked_kept_options(inner.param_groups, before[0][0], inner.defaults, policy, norm_group)


def _checked_kept_options(
    saved: list[dict[str, Any]],
    current: list[dict[str, Any]],
    defaults: dict[str, Any],
    policy: ClipPolicy | None,
    norm_group: Any,
) -> list[dict[str, Any]]:
    """The groups' ``max_norm``/``clip_value`` after loading -- torch restores every group option from
    the ``saved`` groups; options set now (``current``) that a saved group lacks are kept (returned)
    -- checked as the constructor checks them (``StateDictError``, a ``ValueError``)."""
    kept = kept_options(saved, current, group_keys(defaults))
    try:
        merged = [{**extra, **group} for group, extra in zip(saved, kept, strict=False)]
        check_groups(merged, defaults, policy=policy, norm_group=norm_group, clip_value=None)
    except (TypeError, ValueError) as exc:
        raise StateDictError(f"invalid state_dict: {exc}") from None
    return kept


def _copied_wrapper_check(policy: ClipPolicy | None, scaler: torch.amp.GradScaler | None) -> Any:
    """A check of the policy's and the scaler's state inside a Rewind copy (loaded at a rewind, after
    the parameters are restored: it must be loadable before anything changes); the held parts' own
    state in it is checked by ``Parts.check_state``."""

    def check(extra: Any) -> None:
        if not isinstance(extra, dict):
            return
        checked_policy_state(extra.get("policy"), policy)
        check_scaler_matches(extra.get("scaler"), scaler)

    return check
