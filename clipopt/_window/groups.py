"""Per-group clipping options: ``max_norm`` and ``clip_value`` in the inner optimizer's parameter groups.

A parameter group *has its own bound* when its dict holds the key.  torch's
``Optimizer.add_param_group`` fills a group's missing keys from the
optimizer's ``defaults``; no torch optimizer has ``max_norm`` or
``clip_value`` among its defaults, so the key's presence is the user's
choice.  A third-party optimizer whose ``defaults`` do hold one of these keys
uses it as its own hyper-parameter (every group gets it): for such an
optimizer that key is not read as a clipping option at all (:func:`group_keys`).

The options travel with the inner optimizer's state dict (torch saves every
group key but ``params`` and restores the saved groups on load), so they are
read again from ``param_groups`` at every window and checked there, before
anything is touched.  The host-side result of reading them is a
:class:`GroupPlan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._checks import check_positive_finite
from .._policies.builtin import ClipPolicy

__all__ = [
    "GROUP_KEYS",
    "GroupPlan",
    "check_group",
    "check_groups",
    "check_policy_with_groups",
    "group_keys",
    "kept_options",
    "plan_groups",
]

#: The clipping options a parameter group may carry.
GROUP_KEYS = ("max_norm", "clip_value")

_OFF = {
    "max_norm": "'max_norm': None to leave the group out of norm clipping",
    "clip_value": "'clip_value': None to leave the group out of value clipping",
}
_EXAMPLE = {"max_norm": "1.0", "clip_value": "0.5"}


@dataclass(frozen=True)
class GroupPlan:
    """How one window clips each parameter group (host values only, one entry per group, in order).

    Attributes:
        shared: True for a group without a ``max_norm`` of its own: it is clipped
            together with the other shared groups, by their common norm and the
            wrapper's bound (a float, a policy's threshold, or none).
        bounds: a group's own ``max_norm`` (None: left out of norm clipping);
            None for shared groups.
        clip_values: the element-wise bound in force for the group: its own
            ``clip_value`` where it has the key (None: off), else the wrapper's.
    """

    shared: tuple[bool, ...]
    bounds: tuple[float | None, ...]
    clip_values: tuple[float | None, ...]

    @property
    def any_shared(self) -> bool:
        """Whether some group is clipped by the wrapper's bound."""
        return any(self.shared)

    @property
    def any_value_clipping(self) -> bool:
        """Whether some group is value-clipped."""
        return any(v is not None for v in self.clip_values)


def group_keys(defaults: dict[str, Any]) -> tuple[str, ...]:
    """The keys of :data:`GROUP_KEYS` that are clipping options for an optimizer with these ``defaults``."""
    return tuple(key for key in GROUP_KEYS if key not in defaults)


def _check_option(index: int, key: str, value: Any) -> float | None:
    """A group's ``max_norm``/``clip_value``: None or a finite float > 0, else an error naming both."""
    if value is None:
        return None
    fix = f"set e.g. '{key}': {_EXAMPLE[key]} in the group, or {_OFF[key]}"
    if isinstance(value, ClipPolicy):
        raise TypeError(
            f"parameter group {index}: '{key}' cannot be a ClipPolicy ({value!r}); a policy bounds the "
            f"groups without their own 'max_norm': pass it as ClippedOptimizer(..., max_norm={value!r}), "
            f"and {fix}"
        )
    return check_positive_finite(f"parameter group {index}: '{key}'", value, fix, or_none=True)


def check_group(group: Any, index: int, keys: Sequence[str]) -> None:
    """Check the clipping options of one parameter group (a dict), e.g. before ``add_param_group``."""
    if not isinstance(group, dict):
        return  # the inner optimizer's add_param_group reports that itself
    for key in keys:
        if key in group:
            _check_option(index, key, group[key])


def plan_groups(
    groups: Sequence[dict[str, Any]], keys: Sequence[str], clip_value: float | None
) -> GroupPlan | None:
    """Read and check every group's options; None when no group has one (the single-bound path)."""
    if not any(key in group for group in groups for key in keys):
        return None
    shared: list[bool] = []
    bounds: list[float | None] = []
    values: list[float | None] = []
    own_norm, own_value = "max_norm" in keys, "clip_value" in keys
    for index, group in enumerate(groups):
        has_bound = own_norm and "max_norm" in group
        shared.append(not has_bound)
        bounds.append(_check_option(index, "max_norm", group["max_norm"]) if has_bound else None)
        if own_value and "clip_value" in group:
            values.append(_check_option(index, "clip_value", group["clip_value"]))
        else:
            values.append(clip_value)
    return GroupPlan(tuple(shared), tuple(bounds), tuple(values))


def check_policy_with_groups(policy: ClipPolicy | None, plan: GroupPlan | None) -> None:
    """Refuse the combinations of a policy and per-group bounds that have no meaning.

    Supported: a global-norm policy (:class:`AutoClip`, :class:`ZClip`) bounds
    the shared groups, by their common norm, while the other groups keep their
    own bounds; a unit-wise policy (:class:`AGC`) clips the shared groups, and
    groups with ``'max_norm': None`` are left out of it.  Refused: a unit-wise
    policy with a group's own float bound (AGC has no norm bound for it to
    replace), and a global-norm policy when every group has its own bound (it
    would bound nothing).
    """
    if policy is None or plan is None:
        return
    if policy.unitwise:
        for index, bound in enumerate(plan.bounds):
            if bound is not None:
                raise ValueError(
                    f"parameter group {index} has its own 'max_norm': {bound!r}, which cannot combine "
                    f"with max_norm={policy!r}: {policy.in_place_rule} "
                    "and has no norm bound for a group to replace; set 'max_norm': None in the group "
                    "to leave it out of the policy, or remove the key"
                )
    elif not plan.any_shared:
        raise ValueError(
            f"max_norm={policy!r} bounds the parameter groups without their own 'max_norm', but every "
            "group has one, so it would bound nothing; remove 'max_norm' from the groups the policy "
            "should bound, or pass max_norm=None"
        )


def check_groups(
    groups: Sequence[dict[str, Any]],
    defaults: dict[str, Any],
    *,
    policy: ClipPolicy | None,
    norm_group: Any,
    clip_value: float | None,
) -> GroupPlan | None:
    """The plan of a wrapper's groups, every option and combination checked (construction,
    ``add_param_group`` with the new group appended, and every window before anything changes)."""
    keys = group_keys(defaults)
    plan = plan_groups(groups, keys, clip_value)
    if plan is None:  # no group has an option: nothing to combine
        return None
    check_policy_with_groups(policy, plan)
    if norm_group is not None:
        index = next(i for i, g in enumerate(groups) if any(k in g for k in keys))
        raise ValueError(
            f"per-group 'max_norm'/'clip_value' (parameter group {index}) cannot be combined with "
            "norm_group yet: the stages would have to agree on every group; pass norm_group=None, "
            "or remove the keys"
        )
    return plan


def kept_options(
    saved: Sequence[dict[str, Any]], current: Sequence[dict[str, Any]], keys: Sequence[str]
) -> list[dict[str, Any]]:
    """Per group, the clipping options set now that a saved group lacks (kept across a load).

    torch restores every group option from the saved dict; a checkpoint saved before a group got
    its ``max_norm``/``clip_value`` (a run that adds per-group clipping when it resumes) would
    otherwise drop them.  A saved key wins, as for every other option.
    """
    return [
        {k: now[k] for k in keys if k in now and k not in then}
        for then, now in zip(saved, current, strict=False)
    ]
