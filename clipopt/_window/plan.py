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

from typing import Any

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
        "layer_stats",
        "loggers",
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

    __slots__ = ("_by_n", "_values", "groups")

    def __init__(self) -> None:
        self._by_n: dict[int, WindowSettings] = {}  #: the settings per window size, since the last change
        #: What the plan was made from (compared by identity; kept alive so no identity is reused):
        #: the groups, which clipping options the defaults have, whether loggers are on, and each
        #: group's values of ``_FOLLOWED``; ``()``: decide again.
        self._values: tuple[Any, ...] = ()
        self.groups: GroupPlan | None = None  #: the groups' own options (None: no group has one)

    def reset(self) -> None:
        """A setting changed: the next window decides its settings and checks the groups again."""
        self._by_n.clear()
        self._values = ()

    def settings(self, opt: Any, n: int) -> WindowSettings:
        """The settings of a window of ``n`` micro-batches of the wrapper ``opt``; the groups' options
        are checked again (before anything changes) when one was set since the last window."""
        groups, defaults = opt.param_groups, opt.defaults  # (over several inner optimizers a new dict)
        if self._changed(groups, defaults, opt.loggers):
            values = (
                groups,
                "max_norm" in defaults,  # which of GROUP_KEYS are clipping options (group_keys)
                "clip_value" in defaults,
                bool(opt.loggers),
                *[g.get(k, _ABSENT) for g in groups for k in _FOLLOWED],
            )
            self.groups = self.check_groups(opt, groups)  # raises before the plan changes
            self._by_n.clear()
            self._values = values
        s = self._by_n.get(n)
        if s is None:
            s = self._by_n[n] = WindowSettings.read(opt, n, self.groups)
        return s

    def _changed(self, groups: list[dict[str, Any]], defaults: dict[str, Any], loggers: list[Any]) -> bool:
        """Whether what the plan was made from changed (compared by identity, one by one: this runs
        at every window)."""
        v = self._values
        if (
            not v
            or groups is not v[0]
            or ("max_norm" in defaults) is not v[1]
            or ("clip_value" in defaults) is not v[2]
            or bool(loggers) is not v[3]
        ):
            return True
        i = 4
        for g in groups:
            for k in _FOLLOWED:
                if g.get(k, _ABSENT) is not v[i]:
                    return True
                i += 1
        return i != len(v)

    @staticmethod
    def check_groups(opt: Any, groups: list[dict[str, Any]]) -> GroupPlan | None:
        """The per-group options of ``groups`` under ``opt``'s settings, all checked; None when no group
        has one (they may change like a learning rate)."""
        bound = opt.max_norm
        policy = bound if isinstance(bound, ClipPolicy) else None
        return check_groups(
            groups, opt.defaults, policy=policy, norm_group=opt.norm_group, clip_value=opt.clip_value
        )

    def __getstate__(self) -> dict[str, Any]:
        return {}  # identities mean nothing in a copy: it decides again at its first window

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
