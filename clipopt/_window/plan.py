"""The window plan: what a window of a :class:`~clipopt.ClippedOptimizer` does, decided once per settings.

A window closes with the wrapper's :class:`~clipopt._config.WindowSettings` and its groups'
own ``max_norm``/``clip_value`` (a :class:`~clipopt._window.groups.GroupPlan`).  Both change
rarely (a setter, ``add_param_group``, a loaded checkpoint, an option set in a group like a
learning rate), so :class:`WindowPlan` decides them once and keeps them until a change:

* assigning one of :data:`PLANNED` on the wrapper calls :meth:`WindowPlan.reset`
  (``InnerOptimizerView.__setattr__``); ``add_param_group`` and ``load_state_dict`` call it too;
* a group's options are changed in place (``opt.param_groups[1]["max_norm"] = 0.5``): each window
  compares the identities of the groups' option values with the plan's (a few host operations per
  group, nothing per parameter or per feature), and decides again, checking them, when one differs.

Nothing here touches a tensor: the plan is host-side Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.optim import Optimizer

from .._policies.builtin import ClipPolicy
from .groups import GroupPlan, check_groups
from .settings import WindowSettings

__all__ = ["PLANNED", "WindowPlan"]

#: The wrapper's attributes read into a window's settings: assigning one makes the plan again.
#: (``max_norm``'s setter assigns ``_policy`` and ``_bound``.)
PLANNED = frozenset(
    {
        "norm_type",
        "clip_value",
        "reduction",
        "foreach",
        "_policy",
        "_bound",
        "skip_nonfinite",
        "scaler",
        "norm_group",
    }
)

#: What ``dict.get`` returns for an option a group does not have.
_ABSENT = object()

#: The group keys whose value the plan follows: the clipping options, and ``fused``
#: (it decides whether the fused, host-read-free path may run).
_FOLLOWED = ("max_norm", "clip_value", "fused")


class WindowPlan:
    """The settings of a window of ``n`` micro-batches, made when first needed after a change.

    :meth:`settings` is the one call a window's close makes; :meth:`check_groups` checks the
    groups a new one would make (``add_param_group``, before it adds anything).
    """

    __slots__ = ("_by_n", "_values", "config", "groups")

    def __init__(self) -> None:
        #: The wrapper's settings by name, as they are now (:meth:`reset` hands them over).
        self.config: Mapping[str, Any] = {}
        self._by_n: dict[int, WindowSettings] = {}  #: the settings per window size, since the last change
        #: What the plan was made from (compared by identity; kept alive so no identity is reused):
        #: the groups, which clipping options the defaults have, and each group's values of
        #: ``_FOLLOWED``; ``()``: decide again.
        self._values: tuple[Any, ...] = ()
        self.groups: GroupPlan | None = None  #: the groups' own options (None: no group has one)

    def reset(self, config: Mapping[str, Any] | None = None) -> None:
        """A setting changed (``config``: the wrapper's settings by name, when they changed): the next
        window decides its settings and checks the groups again."""
        if config is not None:
            self.config = config
        self._by_n.clear()
        self._values = ()

    def settings(self, n: int, inner: Optimizer) -> WindowSettings:
        """The settings of a window of ``n`` micro-batches over the ``inner`` optimizer(s); the groups'
        options are checked again (before anything changes) when one was set since the last window."""
        groups, defaults = inner.param_groups, inner.defaults  # (over several inner optimizers a new dict)
        if self._changed(groups, defaults):
            values = (
                groups,
                "max_norm" in defaults,  # which of GROUP_KEYS are clipping options (group_keys)
                "clip_value" in defaults,
                *[g.get(k, _ABSENT) for g in groups for k in _FOLLOWED],
            )
            self.groups = self.check_groups(groups, defaults)  # raises before the plan changes
            self._by_n.clear()
            self._values = values
        s = self._by_n.get(n)
        if s is None:
            s = self._by_n[n] = WindowSettings.read(self.config, n, self.groups, inner)
        return s

    def _changed(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> bool:
        """Whether what the plan was made from changed (compared by identity, one by one: this runs
        at every window)."""
        v = self._values
        if (
            not v
            or groups is not v[0]
            or ("max_norm" in defaults) is not v[1]
            or ("clip_value" in defaults) is not v[2]
        ):
            return True
        i = 3
        for g in groups:
            for k in _FOLLOWED:
                if g.get(k, _ABSENT) is not v[i]:
                    return True
                i += 1
        return i != len(v)

    def check_groups(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> GroupPlan | None:
        """The per-group options of ``groups`` under the wrapper's settings, all checked; None when no
        group has one (they may change like a learning rate)."""
        c = self.config
        policy = c["max_norm"] if isinstance(c["max_norm"], ClipPolicy) else None
        return check_groups(
            groups, defaults, policy=policy, norm_group=c["norm_group"], clip_value=c["clip_value"]
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}  # identities mean nothing in a copy: it decides again

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.config = state.get("config", {})
