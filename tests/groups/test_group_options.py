"""Reading and checking the per-group clipping options (clipopt._window.groups)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from clipopt import AGC, AutoClip, ZClip
from clipopt._window.groups import (
    GroupPlan,
    check_group,
    check_groups,
    check_policy_with_groups,
    group_keys,
    plan_groups,
)

_KEYS = ("max_norm", "clip_value")


def test_no_torch_optimizer_has_the_keys_among_its_defaults() -> None:
    """Every torch.optim optimizer leaves max_norm and clip_value to clipopt (neither is in its defaults), so
    a group holding the key is the user's own choice."""
    w = torch.nn.Parameter(torch.randn(2, 2))
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
        "LBFGS",
        "Adafactor",
        "SparseAdam",
    ):
        inner = getattr(torch.optim, name)([w], lr=0.1)
        assert group_keys(inner.defaults) == _KEYS, name


def test_an_optimizer_that_uses_a_key_itself_keeps_it() -> None:
    """A third-party optimizer with max_norm among its defaults keeps it as its own hyper-parameter."""
    assert group_keys({"lr": 0.1, "max_norm": 1.0}) == ("clip_value",)
    groups = [{"params": [], "max_norm": 5.0}]
    assert plan_groups(groups, ("clip_value",), None) is None


def test_plan_of_groups_without_keys_is_none() -> None:
    """Groups without clipping keys give no plan: the wrapper's single bound applies unchanged."""
    assert plan_groups([{"params": [], "lr": 0.1}, {"params": []}], _KEYS, 0.5) is None


def test_plan_reads_own_and_inherited_options() -> None:
    """A group with the key has its own bound (None: out of clipping); one without shares the wrapper's
    max_norm and inherits its clip_value."""
    groups = [
        {"params": []},
        {"params": [], "max_norm": 2},
        {"params": [], "max_norm": None, "clip_value": None},
    ]
    plan = plan_groups(groups, _KEYS, 0.5)
    assert plan == GroupPlan(
        shared=(True, False, False), bounds=(None, 2.0, None), clip_values=(0.5, 0.5, None)
    )
    assert plan.any_shared and plan.any_value_clipping
    only_value = plan_groups([{"params": [], "clip_value": 0.1}], _KEYS, None)
    assert only_value == GroupPlan(shared=(True,), bounds=(None,), clip_values=(0.1,))


@pytest.mark.parametrize(
    ("key", "value", "error", "message"),
    [
        (
            "max_norm",
            "1.0",
            TypeError,
            "parameter group 1: 'max_norm' must be a float or None, got '1.0' (str); set e.g. "
            "'max_norm': 1.0 in the group, or 'max_norm': None to leave the group out of norm clipping",
        ),
        (
            "max_norm",
            True,
            TypeError,
            "parameter group 1: 'max_norm' must be a float or None, got True (bool); set e.g. "
            "'max_norm': 1.0 in the group, or 'max_norm': None to leave the group out of norm clipping",
        ),
        (
            "max_norm",
            -1.0,
            ValueError,
            "parameter group 1: 'max_norm' must be a positive finite number or None, got -1.0; set e.g. "
            "'max_norm': 1.0 in the group, or 'max_norm': None to leave the group out of norm clipping",
        ),
        (
            "max_norm",
            math.inf,
            ValueError,
            "parameter group 1: 'max_norm' must be a positive finite number or None, got inf; set e.g. "
            "'max_norm': 1.0 in the group, or 'max_norm': None to leave the group out of norm clipping",
        ),
        (
            "clip_value",
            0,
            ValueError,
            "parameter group 1: 'clip_value' must be a positive finite number or None, got 0; set e.g. "
            "'clip_value': 0.5 in the group, or 'clip_value': None to leave the group out of value clipping",
        ),
        (
            "clip_value",
            [0.5],
            TypeError,
            "parameter group 1: 'clip_value' must be a float or None, got [0.5] (list); set e.g. "
            "'clip_value': 0.5 in the group, or 'clip_value': None to leave the group out of value clipping",
        ),
        (
            "max_norm",
            AutoClip(),
            TypeError,
            "parameter group 1: 'max_norm' cannot be a ClipPolicy (AutoClip(percentile=10, history=10000)); "
            "a policy bounds the groups without their own 'max_norm': pass it as ClippedOptimizer(..., "
            "max_norm=AutoClip(percentile=10, history=10000)), and set e.g. 'max_norm': 1.0 in the group, "
            "or 'max_norm': None to leave the group out of norm clipping",
        ),
    ],
)
def test_bad_options_name_group_key_value_and_fix(key: str, value: object, error: type, message: str) -> None:
    """A bad option raises the exact error naming the group's index, the key, the value and the fix, both
    when checked alone (add_param_group) and when the plan is read (every window)."""
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        check_group({"params": [], key: value}, 1, _KEYS)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        plan_groups([{"params": []}, {"params": [], key: value}], _KEYS, None)


def test_check_group_ignores_keys_of_the_inner_optimizer_and_non_dicts() -> None:
    """Keys the inner optimizer owns are not checked; a non-dict group is left to the inner optimizer."""
    check_group({"params": [], "max_norm": "its own"}, 0, ("clip_value",))
    check_group([torch.zeros(1)], 0, _KEYS)


def test_agc_refuses_an_own_float_bound_and_accepts_none() -> None:
    """AGC with a group's own float max_norm is refused (exact message); 'max_norm': None leaves the group
    out of AGC and is accepted."""
    plan = plan_groups([{"params": []}, {"params": [], "max_norm": 0.5}], _KEYS, None)
    message = (
        "parameter group 1 has its own 'max_norm': 0.5, which cannot combine with max_norm=AGC("
        "clip_factor=0.01, eps=0.001): a unit-wise policy clips every unit against its weight norm and has "
        "no norm bound for a group to replace; set 'max_norm': None in the group to leave it out of the "
        "policy, or remove the key"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_policy_with_groups(AGC(), plan)
    check_policy_with_groups(
        AGC(), plan_groups([{"params": []}, {"params": [], "max_norm": None}], _KEYS, None)
    )


def test_global_policy_needs_a_shared_group() -> None:
    """AutoClip/ZClip bound the shared groups: accepted next to own bounds, refused when every group has
    one."""
    mixed = plan_groups([{"params": []}, {"params": [], "max_norm": 0.5}], _KEYS, None)
    check_policy_with_groups(AutoClip(), mixed)
    check_policy_with_groups(ZClip(), mixed)
    check_policy_with_groups(None, mixed)
    every = plan_groups([{"params": [], "max_norm": None}, {"params": [], "max_norm": 0.5}], _KEYS, None)
    message = (
        "max_norm=ZClip(alpha=0.97, z_thresh=2.5, max_grad_norm=None, warmup_steps=25, "
        "clip_option='adaptive_scaling', skip_spikes=False) bounds the parameter groups without their own "
        "'max_norm', but every group has one, so it would bound nothing; remove 'max_norm' from the groups "
        "the policy should bound, or pass max_norm=None"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_policy_with_groups(ZClip(), every)


def test_norm_group_with_group_keys_is_refused() -> None:
    """Pipeline stages (norm_group) with per-group keys are refused with the exact message naming the
    first group with a key; without keys, or with keys the inner optimizer owns, they pass."""
    groups = [{"params": [], "lr": 0.1}, {"params": [], "clip_value": 0.5}]
    message = (
        "per-group 'max_norm'/'clip_value' (parameter group 1) cannot be combined with norm_group yet: "
        "the stages would have to agree on every group; pass norm_group=None, or remove the keys"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_groups(groups, {"lr": 0.1}, policy=None, norm_group=object(), clip_value=None)
    assert check_groups(groups[:1], {}, policy=None, norm_group=object(), clip_value=None) is None
    owned = check_groups(groups, {"clip_value": 1.0}, policy=None, norm_group=object(), clip_value=None)
    assert owned is None
