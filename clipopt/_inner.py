"""The inner optimizers of a wrapper over several (torch's ``Muon`` for the matrices, AdamW for the rest).

:class:`InnerOptimizers` steps several optimizers over disjoint parameters as
one ``torch.optim.Optimizer``, so the wrapper decides once for all of them (one
norm over every gradient, one coefficient, one skip): ``param_groups`` is every
inner optimizer's group dicts in order (the same dicts, re-read when an inner
optimizer's list changes), ``state`` a view routing each parameter to its
optimizer's ``state``, ``state_dict()`` each inner optimizer's state dict in a
list (``{"optimizers": [...]}``).  A wrapper over one optimizer holds it
directly: :func:`inner_optimizers` lists the inner optimizers of either.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ._hooks import inner_step
from ._state import StateDictError

__all__ = [
    "InnerOptimizers",
    "flat_state_dict",
    "inner_optimizers",
    "inner_state_dicts",
    "is_fused",
    "reevaluates",
]


#: Inner optimizers whose ``step(closure)`` re-evaluates the closure after changing the parameters.
REEVALUATING = (torch.optim.LBFGS,)


def reevaluates(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step(closure)`` re-evaluates the closure after changing the parameters."""
    return isinstance(optimizer, REEVALUATING)


def inner_optimizers(inner: Optimizer) -> list[Optimizer]:
    """The optimizers ``inner`` steps: its list for :class:`InnerOptimizers`, else ``[inner]``."""
    return list(inner.optimizers) if isinstance(inner, InnerOptimizers) else [inner]


#: torch optimizers whose fused implementation takes ``grad_scale`` and ``found_inf``.
_FUSED_CAPABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def is_fused(inner: Optimizer) -> bool:
    """True when ``inner.step()`` takes ``grad_scale``/``found_inf`` (fused Adam, AdamW, SGD, Adagrad).

    ``_step_supports_amp_scaling`` marks them (and third-party fused optimizers),
    but pickling drops that instance attribute, so the type counts as well.
    Several inner optimizers (:class:`~clipopt._inner.InnerOptimizers`) are fused when all are.
    """
    if isinstance(inner, InnerOptimizers):
        return all(is_fused(o) for o in inner.optimizers)
    if not (getattr(inner, "_step_supports_amp_scaling", False) or isinstance(inner, _FUSED_CAPABLE)):
        return False
    return all(bool(g.get("fused")) for g in inner.param_groups)


def _describe(optimizers: Sequence[Optimizer]) -> str:
    return ", ".join(type(o).__name__ for o in optimizers)


def _param_label(optimizer: Optimizer, p: Tensor) -> str:
    """``p`` as the user knows it: its name (``param_names``), else its group, index and shape."""
    for g, group in enumerate(optimizer.param_groups):
        for i, q in enumerate(group["params"]):
            if q is p:
                names = group.get("param_names")
                if names:
                    return repr(names[i])
                return f"group {g} index {i} (shape {tuple(p.shape)})"
    return f"of shape {tuple(p.shape)}"


#: What a parameter held twice after the wrapper was made says: how it came to be.
_ADDED_HINT = (
    "; a group added to an inner optimizer (opt.optimizers[i].add_param_group(...)) must hold parameters "
    "no other optimizer holds: remove it (opt.optimizers[i].param_groups.pop()) or add new parameters"
)


def _check_disjoint(
    optimizers: Sequence[Optimizer], new: Sequence[Tensor] = (), into: int = 0, hint: str = ""
) -> None:
    """Every parameter in one optimizer only (``new``: parameters to add to ``optimizers[into]``):
    ``ValueError`` naming the first one held twice (and ``hint``)."""
    owner: dict[Tensor, int] = {}
    entries = [(k, p) for k, o in enumerate(optimizers) for g in o.param_groups for p in g["params"]]
    for k, p in [*entries, *((into, p) for p in new)]:
        first = owner.setdefault(p, k)
        if first != k:
            label = _param_label(optimizers[first], p)
            raise ValueError(
                f"optimizer[{first}] ({type(optimizers[first]).__name__}) and optimizer[{k}] "
                f"({type(optimizers[k]).__name__}) both hold parameter {label}; the optimizers "
                f"must hold disjoint parameters: give each parameter to one of them{hint}"
            )


def _skipping(found_inf: Any) -> bool:
    """Whether a fused step was handed the skip (read on the error path only; False if unreadable)."""
    try:
        return isinstance(found_inf, Tensor) and bool(found_inf.item())
    except Exception:  # a device in an error state: say what may have happened
        return False


def _note_partial(exc: BaseException, optimizers: Sequence[Optimizer], failed: int) -> None:
    """Say on ``exc`` (raised by ``optimizers[failed].step()``) which optimizers had already stepped."""
    if failed > 0 and hasattr(exc, "add_note"):
        which = "optimizer[0]" if failed == 1 else f"optimizer[0] to optimizer[{failed - 1}]"
        exc.add_note(
            f"clipopt: optimizer[{failed}] ({type(optimizers[failed]).__name__}) raised in step() after "
            f"{which} ({_describe(optimizers[:failed])}) applied this update: those parameters and "
            "states are updated, the others are not; load a checkpoint before training on"
        )


def _refuse(name: str) -> None:
    raise TypeError(
        f"cannot assign {name} of several optimizers; assign each inner optimizer's "
        f"(opt.optimizers[i].{name} = ...)"
    )


class _StateView(MutableMapping[Tensor, Any]):
    """``state`` of several optimizers: each parameter's entry lives in its own optimizer's ``state``."""

    def __init__(self, owner: InnerOptimizers) -> None:
        self._owner = owner

    def _state_of(self, p: Tensor) -> MutableMapping[Tensor, Any]:
        return self._owner.owner_of(p).state

    def __getitem__(self, p: Tensor) -> Any:
        for o in self._owner.optimizers:
            if p in o.state:
                return o.state[p]
        return self._state_of(p)[p]  # torch's state is a defaultdict: {} for a parameter without state

    def __setitem__(self, p: Tensor, value: Any) -> None:
        self._state_of(p)[p] = value

    def __delitem__(self, p: Tensor) -> None:
        for o in self._owner.optimizers:
            if p in o.state:
                del o.state[p]
                return
        raise KeyError(p)

    def __contains__(self, p: object) -> bool:
        return any(p in o.state for o in self._owner.optimizers)

    def __iter__(self) -> Iterator[Tensor]:
        for o in self._owner.optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._owner.optimizers)

    def get(self, p: Tensor, default: Any = None) -> Any:
        """The entry of ``p``, or ``default``: never adds one (``Mapping.get`` would, via ``[]``)."""
        for o in self._owner.optimizers:
            if p in o.state:
                return o.state[p]
        return default

    def clear(self) -> None:
        for o in self._owner.optimizers:
            o.state.clear()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self)!r})"


class InnerOptimizers(Optimizer):
    """Several optimizers over disjoint parameters, stepped as one (see the module docstring)."""

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        self.optimizers = list(optimizers)
        for k, o in enumerate(self.optimizers):
            if reevaluates(o):
                raise TypeError(
                    f"optimizer[{k}] is {type(o).__name__}, which re-evaluates its closure inside "
                    "step(); it cannot share one step with other optimizers: wrap it alone, "
                    f"ClippedOptimizer({type(o).__name__.lower()}, ...)"
                )
        for k, o in enumerate(self.optimizers):
            first = next(j for j, q in enumerate(self.optimizers) if q is o)
            if first != k:
                raise ValueError(
                    f"optimizer[{first}] and optimizer[{k}] are the same {type(o).__name__} object; "
                    "list each optimizer once"
                )
        _check_disjoint(self.optimizers)
        self._reset_caches()

    def _reset_caches(self) -> None:
        self._groups: list[dict[str, Any]] = []  # the group dicts themselves (held: no id reused)
        self._owners: tuple[Any, tuple[int, ...], dict[Tensor, Optimizer]] = (None, (), {})

    def owner_of(self, p: Tensor) -> Optimizer:
        """The inner optimizer holding parameter ``p`` (``KeyError`` when none does)."""
        groups = self.param_groups
        sizes = tuple(len(g["params"]) for g in groups)
        if self._owners[0] is not groups or self._owners[1] != sizes:
            owners = {q: o for o in self.optimizers for g in o.param_groups for q in g["params"]}
            self._owners = (groups, sizes, owners)
        return self._owners[2][p]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every inner optimizer's group dicts, in order (the same list until one of them changes).

        When one changed (``opt.optimizers[1].add_param_group(...)``, a loaded state dict), the
        parameters must still be disjoint: ``ValueError`` otherwise, at the first read after the change
        (the next ``step()`` or window), before anything changes; a parameter held twice would be
        stepped twice."""
        groups = [g for o in self.optimizers for g in o.param_groups]
        if len(groups) != len(self._groups) or any(
            a is not b for a, b in zip(groups, self._groups, strict=True)
        ):
            _check_disjoint(self.optimizers, hint=_ADDED_HINT)
            self._groups = groups  # a list of theirs changed (load_state_dict, add_param_group, a new dict)
        return self._groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        _refuse("param_groups")

    @property
    def state(self) -> Any:
        """A view of every inner optimizer's ``state`` (each entry lives in its optimizer's)."""
        return _StateView(self)

    @state.setter
    def state(self, value: Any) -> None:
        _refuse("state")

    @property
    def defaults(self) -> dict[str, Any]:
        """A new dict merging the inner optimizers' ``defaults`` (the first one's value for a shared key)."""
        merged: dict[str, Any] = {}
        for o in reversed(self.optimizers):
            merged.update(o.defaults)
        return merged

    @defaults.setter
    def defaults(self, value: Any) -> None:
        _refuse("defaults")

    def add_param_group(self, param_group: dict[str, Any], optimizer: int | None = None) -> None:
        """Add ``param_group`` to ``self.optimizers[optimizer]`` (its parameters held by no other)."""
        n = len(self.optimizers)
        index = optimizer if isinstance(optimizer, int) and not isinstance(optimizer, bool) else None
        if index is None or not 0 <= index < n:
            raise (TypeError if index is None else ValueError)(
                f"add_param_group over {n} optimizers ({_describe(self.optimizers)}) needs the index "
                f"of the one to add the group to, 0 to {n - 1}, got optimizer={optimizer!r}; pass "
                "e.g. opt.add_param_group(group, optimizer=1) (an index into opt.optimizers)"
            )
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if params is not None and not isinstance(params, (Tensor, list, tuple, set)):
            param_group["params"] = params = list(params)  # a generator: read once, kept (torch does too)
        new = [params] if isinstance(params, Tensor) else list(params or [])
        _check_disjoint(self.optimizers, [p for p in new if isinstance(p, Tensor)], index)
        self.optimizers[index].add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Evaluate ``closure`` once (if given), then step every inner optimizer in order.

        ``grad_scale``/``found_inf`` set on this object (the fused path, all inner
        optimizers fused) are handed to each of them the same way.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fused: dict[str, Any] = {
            k: self.__dict__[k] for k in ("grad_scale", "found_inf") if k in self.__dict__
        }
        for i, o in enumerate(self.optimizers):
            o.__dict__.update(fused)
            try:
                inner_step(o)
            except BaseException as exc:
                if not _skipping(fused.get("found_inf")):
                    _note_partial(exc, self.optimizers, i)
                raise
            finally:
                for k in fused:
                    del o.__dict__[k]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizers": [each inner optimizer's state dict]}``."""
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load each of ``state_dict["optimizers"]`` into its inner optimizer, in order (checked first
        by the wrapper: ``clipopt._checkpoint.read_checkpoint``)."""
        for sd, o in inner_state_dicts(state_dict, self):
            o.load_state_dict(sd)

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizers": self.optimizers}  # the caches are rebuilt when read

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_caches()

    def __repr__(self) -> str:
        body = "\n".join("  " + line for o in self.optimizers for line in repr(o).splitlines())
        return f"InnerOptimizers(\n{body}\n)"


def inner_state_dicts(state_dict: dict[str, Any], inner: Optimizer) -> list[tuple[Any, Optimizer]]:
    """Each inner optimizer's part of ``state_dict``, paired with it (``StateDictError`` when the
    count or layout does not match); ``[(state_dict, inner)]`` for a single optimizer."""
    if not isinstance(inner, InnerOptimizers):
        return [(state_dict, inner)]
    parts, n = state_dict.get("optimizers"), len(inner.optimizers)
    if not isinstance(parts, list) or len(parts) != n:
        got = f"{len(parts)} state dicts" if isinstance(parts, list) else "no 'optimizers' list"
        raise StateDictError(
            f"invalid state_dict: 'optimizers' must hold one state dict per inner optimizer, "
            f"{n} ({_describe(inner.optimizers)}), got {got}; pass the dict returned by "
            "opt.state_dict() of a ClippedOptimizer over the same optimizers, in the same order"
        )
    return list(zip(parts, inner.optimizers, strict=True))


def flat_state_dict(state_dict: Any) -> Any:
    """A state dict of several optimizers (``{"optimizers": [...]}``, e.g. in a snapshot) in one torch
    layout: every group in order, parameter ids renumbered in that order; anything else unchanged."""
    parts = state_dict.get("optimizers") if isinstance(state_dict, Mapping) else None
    if not isinstance(parts, list):
        return state_dict
    groups: list[dict[str, Any]] = []
    state: dict[int, Any] = {}
    count = 0  # parameters numbered so far
    for part in parts:
        part = part if isinstance(part, Mapping) else {}
        renumber: dict[Any, int] = {}
        for group in part.get("param_groups") or []:
            ids = group.get("params") if isinstance(group, Mapping) else None
            ids = ids if isinstance(ids, list) else []
            for old in ids:
                renumber[old], count = count, count + 1
            groups.append({**group, "params": [renumber[old] for old in ids]})
        part_state = part.get("state")
        for old, entry in part_state.items() if isinstance(part_state, Mapping) else ():
            if old in renumber:
                state[renumber[old]] = entry
    return {"state": state, "param_groups": groups}
