"""Wrapping, never copying: an ``Optimizer`` whose ``param_groups``, ``state`` and ``defaults``
are the inner optimizer's own objects (docs/concepts.md, 'The wrapper and its arguments').

:class:`InnerOptimizerView` is the base of :class:`~clipopt.ClippedOptimizer`:
it owns the delegation and torch's hook dictionaries (kept off pickles, as
torch does); the subclass owns everything clipopt adds.
"""

from __future__ import annotations

import collections
import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer

from ._inner import inner_optimizers

__all__ = ["HOOK_DICTS", "NOT_PICKLED", "STORED", "InnerOptimizerView"]

#: What a subclass's ``_assigning`` returns for a setting it stored itself (nothing more to store).
STORED = object()

#: torch's per-optimizer hook dictionaries, created here since ``Optimizer.__init__`` is not called.
HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)

#: Instance attributes that never travel with a pickle or a deep copy: torch's hook dictionaries
#: (new empty ones are made), an LR scheduler's wrapper around ``step`` (it marks and calls the
#: *original* optimizer through a weak reference, and cannot be pickled: a copy would close its
#: windows on the original) and the ``_opt_called`` flag that wrapper sets.  A ``step`` on the
#: instance is always such a wrapper (the method is the class's); the copy has the plain method.
NOT_PICKLED = (*HOOK_DICTS, "step", "_opt_called")


def forwardable(owner: type, name: str) -> bool:
    """Whether ``name`` is read from the inner optimizer: public, and not defined by the wrapper's class.

    Private names never are (GradScaler would see the inner ``_step_supports_amp_scaling``),
    and the wrapper's own attributes (its class's, its instance's) are found before
    ``__getattr__`` is asked.
    """
    return not name.startswith("_") and not hasattr(owner, name)


def _defined(obj: object, name: str) -> bool:
    """Whether ``obj`` has ``name`` without running it (its class's or its instance's own)."""
    missing = object()
    return inspect.getattr_static(obj, name, missing) is not missing


def _no_attribute(view: object, name: str, inner: list[Optimizer] | None) -> AttributeError:
    where = ""
    if inner:
        kinds = ", ".join(type(o).__name__ for o in inner)
        where = f" (nor has its inner {kinds})" if len(inner) == 1 else f" (nor has any of its inner {kinds})"
    return AttributeError(f"'{type(view).__name__}' object has no attribute '{name}'{where}")


def _read_inner(view: object, optimizers: list[Optimizer], name: str) -> Any:
    """``name`` of the inner optimizer; over several, of the one that has it, and a method that
    more have is one calling each of theirs in order (``opt.train()`` of schedule-free ones)."""
    values = []
    for o in optimizers:
        try:
            values.append(getattr(o, name))
        except AttributeError:
            if _defined(o, name):  # the inner attribute exists; something it reads does not
                raise
    if not values:
        raise _no_attribute(view, name, optimizers)
    if len(values) == 1:
        return values[0]
    if not all(callable(v) for v in values):
        raise AttributeError(
            f"'{name}' is an attribute of {len(values)} of the inner optimizers; "
            f"read it from one of them: opt.optimizers[i].{name}"
        )

    def each(*args: Any, **kwargs: Any) -> Any:
        results = [v(*args, **kwargs) for v in values]
        return None if all(r is None for r in results) else results

    return each


class InnerOptimizerView(Optimizer):
    """Delegates ``param_groups``, ``state``, ``defaults`` and ``add_param_group`` to the inner optimizer,
    and reads every other public attribute the wrapper does not define from it (``train()``/``eval()``
    of schedule-free optimizers, ``consolidate_state_dict()`` of ``ZeroRedundancyOptimizer``).

    ``_inner`` is the optimizer, or an ``_inner.InnerOptimizers`` over several: then
    ``param_groups`` is every inner optimizer's group dicts in order, ``state`` a view
    of their ``state`` and ``defaults`` a new dict merging theirs.
    """

    #: The inner optimizer (an ``InnerOptimizers`` over several).
    _inner: Optimizer

    #: Set at the end of the constructor: from then on, assigning a name read from the inner
    #: optimizer raises instead of hiding it (see ``__setattr__``).
    _forwarding = False

    #: Attributes whose assignment calls :meth:`_settings_changed` (the subclass's window plan).
    _planned: frozenset[str] = frozenset()

    if not TYPE_CHECKING:  # hidden from mypy, which would otherwise type every misspelt attribute Any

        def __getattr__(self, name: str) -> Any:
            """The inner optimizer's public attribute ``name`` (only asked when the wrapper has none).

            Reads ``__dict__`` directly: while unpickling, before it is filled, no lookup recurses.
            A property of the wrapper that raised ``AttributeError`` (``opt.optimizer`` over
            several) raises its own error again.
            """
            if hasattr(type(self), name):  # the wrapper's own property raised AttributeError inside
                return object.__getattribute__(self, name)  # run it again: its own error, not ours
            inner = self.__dict__.get("_inner")
            if inner is None or not forwardable(type(self), name):
                raise _no_attribute(self, name, None)
            return _read_inner(self, inner_optimizers(inner), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._assignable and self._forwarding:  # a setting: checked before anything changes
            value = self._assigning(name, value)
            if value is STORED:  # the subclass stored it itself (a part)
                return
        # cheapest test first: the step path only reassigns the wrapper's own instance attributes
        if self._forwarding and name not in self.__dict__ and forwardable(type(self), name):
            inner = self.__dict__.get("_inner")
            optimizers = [] if inner is None else inner_optimizers(inner)
            holders = [k for k, o in enumerate(optimizers) if hasattr(o, name)]
            if holders:
                kind = type(optimizers[holders[0]]).__name__
                where = "opt.optimizer" if len(optimizers) == 1 else f"opt.optimizers[{holders[0]}]"
                raise AttributeError(
                    f"cannot set '{name}' on the {type(self).__name__}: it is the inner {kind}'s "
                    f"attribute, read through the wrapper; set it there: {where}.{name} = ..."
                )
        super().__setattr__(name, value)
        if name in self._planned and self._forwarding:
            self._settings_changed()

    #: Settings whose assignment after the constructor is checked first (:meth:`_assigning`).
    _assignable: frozenset[str] = frozenset()

    def _assigning(self, name: str, value: Any) -> Any:
        """The value to store for the setting ``name`` (one of :attr:`_assignable`), checked as the
        subclass's constructor checks it; raises before anything changes."""
        return value

    def _settings_changed(self) -> None:
        """One of :attr:`_planned` was assigned after the constructor (the subclass forgets what it
        decided from it)."""

    def __dir__(self) -> list[str]:
        """The wrapper's names and the inner optimizers' public ones (what ``__getattr__`` reads)."""
        inner = self.__dict__.get("_inner")
        names = set(super().__dir__())
        for o in [] if inner is None else inner_optimizers(inner):
            names.update(n for n in dir(o) if forwardable(type(self), n))
        return sorted(names)

    def _init_hooks(self) -> None:
        for name in HOOK_DICTS:
            if name not in self.__dict__:
                setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property
    def optimizers(self) -> list[Optimizer]:
        """The inner optimizers, in the order given (a new list)."""
        return inner_optimizers(self._inner)

    @property
    def optimizer(self) -> Optimizer:
        """The inner optimizer; ``AttributeError`` over several (use :attr:`optimizers`)."""
        several = self.optimizers
        if len(several) > 1:
            names = ", ".join(type(o).__name__ for o in several)
            raise AttributeError(
                f"this ClippedOptimizer wraps {len(several)} optimizers ({names}); "
                "opt.optimizer is the inner optimizer of one: use opt.optimizers[i]"
            )
        return self._inner

    def _assign(self, name: str, value: Any) -> None:
        if len(self.optimizers) > 1:
            raise TypeError(
                f"cannot assign {name} of a ClippedOptimizer over several optimizers; "
                f"assign each inner optimizer's (opt.optimizers[i].{name} = ...)"
            )
        setattr(self._inner, name, value)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._assign("param_groups", value)

    @property
    def state(self) -> collections.defaultdict[Tensor, Any]:
        return self._inner.state

    @state.setter
    def state(self, value: collections.defaultdict[Tensor, Any]) -> None:
        self._assign("state", value)

    @property
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._assign("defaults", value)

    def add_param_group(self, param_group: dict[str, Any], optimizer: int | None = None) -> None:
        """Add a parameter group to the inner optimizer (over several: to ``optimizers[optimizer]``)."""
        if len(self.optimizers) > 1:
            self._inner.add_param_group(param_group, optimizer)  # type: ignore[call-arg]
        elif optimizer not in (None, 0):
            raise TypeError(
                f"optimizer={optimizer!r}: this ClippedOptimizer wraps one optimizer; "
                "call opt.add_param_group(group)"
            )
        else:
            self._inner.add_param_group(param_group)

    def _hooked_state_dict(self, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``build()`` with torch's state-dict hooks around it, as ``Optimizer.state_dict`` runs them."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = build()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _hooked_load(self, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
        """``load(state_dict)`` with torch's load hooks around it (as ``Optimizer.load_state_dict``)."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        load(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        """Everything but what torch's ``Optimizer.__getstate__`` leaves out of its own: the hooks,
        and what an LR scheduler puts on the instance (:data:`NOT_PICKLED`), so a copy's ``step``
        is its own plain method (``__setstate__`` patches the class's hooks as torch does)."""
        state = self.__dict__.copy()
        for name in NOT_PICKLED:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_hooks()
