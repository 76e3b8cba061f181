"""StableSPAM (AdaClip and AdaGN per tensor): what is its own -- other settings against
``pytorch_optimizer.StableSPAM``, the checks of its state and arguments, its settings key, a group
value bound.  What every per-tensor policy promises is in ``test_per_tensor_policies.py``, which
also says how the reference is run (its momentum reset and ``gamma1`` schedule off).
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import pytest
import torch
from pytorch_optimizer import StableSPAM as ReferenceStableSPAM

from clipopt import ClippedOptimizer, StableSPAM
from clipopt._distributed.rank_check import settings_key

from ..policy_runs import (
    largest_difference,
    spiked_model,
    train_spiked,
    trajectory,
)

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
NO_RESET = 10**9  # update_proj_gap: the reference resets its moments every that many updates


def _reference(**kw: Any) -> Any:
    return lambda m: ReferenceStableSPAM(m.parameters(), update_proj_gap=NO_RESET, **ADAM, **kw)


def _ours(accumulation: int = 1, foreach: bool = False, **kw: Any) -> Any:
    return lambda m: ClippedOptimizer(
        torch.optim.AdamW(m.parameters(), foreach=foreach, **ADAM),
        max_norm=StableSPAM(**kw),
        accumulation_steps=accumulation,
    )


# ------------------------------------------------------------------------------ trajectories


def test_stable_spam_non_default_settings_reproduce_the_reference() -> None:
    """Other hyper-parameters (gamma1 0.85, gamma2 0.99, theta 0.9, eps 1e-6) give the reference's
    trajectory as well (tolerance 0)."""
    kw = {"gamma1": 0.85, "gamma2": 0.99, "theta": 0.9}
    want = trajectory(
        lambda m: ReferenceStableSPAM(
            m.parameters(), update_proj_gap=NO_RESET, **{**ADAM, "eps": 1e-6}, **kw
        ),
        mean_grads=True,
    )
    got = trajectory(
        lambda m: ClippedOptimizer(
            torch.optim.AdamW(m.parameters(), foreach=False, **{**ADAM, "eps": 1e-6}),
            max_norm=StableSPAM(eps=1e-6, **kw),
        )
    )
    assert largest_difference(got, want) == 0.0


# ------------------------------------------------------------------------------ state


def test_stable_spam_state_is_checked_before_loading() -> None:
    """A corrupt StableSPAM state raises ValueError naming it, and the policy keeps its state."""
    model = spiked_model()
    opt = _ours()(model)
    train_spiked(model, opt, range(3))
    sd = copy.deepcopy(opt.state_dict())
    sd["clipopt"]["policy"]["v_norm"] = torch.zeros(3)  # the others hold 4 tensors' statistics
    before = copy.deepcopy(opt.max_norm.state_dict())  # type: ignore[union-attr]
    with pytest.raises(
        ValueError, match=re.escape("invalid StableSPAM state: statistics of different lengths [3, 4]")
    ):
        opt.load_state_dict(sd)
    after = opt.max_norm.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("v_norm", -100.0, "'v_norm' holds a value that is not finite and >= 0"),  # sqrt: nan gradients
        ("m_max", math.nan, "'m_max' holds a value that is not finite and >= 0"),  # AdaClip off for good
        ("m_norm", math.inf, "'m_norm' holds a value that is not finite and >= 0"),
        ("count", -1.0, "'count' must be one whole number >= 0"),
        ("count", math.inf, "'count' must be one whole number >= 0"),
    ],
)
def test_stable_spam_state_values_are_checked_before_loading(key: str, value: float, message: str) -> None:
    """A StableSPAM state with a negative, nan or infinite statistic (a negative ``v_norm`` made
    the next window's gradients nan after the window's finiteness check: nan parameters, nothing
    skipped), or a count that is not a whole number >= 0, raises ValueError naming the entry, and
    the policy keeps its state."""
    model = spiked_model()
    opt = _ours()(model)
    train_spiked(model, opt, range(3))
    sd = copy.deepcopy(opt.state_dict())
    entry = sd["clipopt"]["policy"][key]
    entry[0 if entry.dim() else ()] = value
    before = copy.deepcopy(opt.max_norm.state_dict())  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=re.escape(f"invalid StableSPAM state: {message}; pass the state")):
        opt.load_state_dict(sd)
    after = opt.max_norm.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(after[k], before[k]) for k in before)


# ------------------------------------------------------------------------------ arguments, settings


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"gamma1": -1.0}, ValueError, "gamma1 must be in [0, 1), got -1.0; pass e.g. gamma1=0.7"),
        ({"gamma2": 1}, ValueError, "gamma2 must be in [0, 1), got 1; pass e.g. gamma2=0.9"),
        (
            {"theta": None},
            TypeError,
            "theta must be a float in [0, 1), got None (NoneType); pass e.g. theta=0.999",
        ),
        (
            {"eps": 0.0},
            ValueError,
            "eps must be a positive finite number, got 0.0; pass e.g. eps=1e-8",
        ),
    ],
)
def test_stable_spam_bad_arguments(kw: dict[str, Any], error: type[Exception], message: str) -> None:
    """Bad StableSPAM arguments raise errors naming the argument, the value and the fix
    (gamma1=-1, the reference's 'use beta1', is refused: the policy does not see the optimizer's betas)."""
    with pytest.raises(error, match=re.escape(message)):
        StableSPAM(**kw)


def test_stable_spam_defaults_and_settings_key() -> None:
    """The defaults are the reference's; the ranks' settings check tells two StableSPAMs with
    different settings apart (their repr shows every setting)."""
    assert repr(StableSPAM()) == "StableSPAM(gamma1=0.7, gamma2=0.9, theta=0.999, eps=1e-08)"
    assert settings_key([], StableSPAM()) == settings_key([], StableSPAM())
    assert settings_key([], StableSPAM()) != settings_key([], StableSPAM(theta=0.99))
    assert settings_key([], StableSPAM()) != settings_key([], StableSPAM(eps=1e-7))


# ------------------------------------------------------------------------------ sync, groups


def test_stable_spam_with_a_group_value_bound_clips_values_first() -> None:
    """A group's own clip_value combines with StableSPAM: the values are clamped first, then the
    policy sees the clamped gradient (equal to clamping the reference's gradients by hand, tolerance 0)."""

    def ours(m: torch.nn.Module) -> Any:
        groups = [{"params": m.parameters(), "clip_value": 0.05}]
        return ClippedOptimizer(torch.optim.AdamW(groups, foreach=False, **ADAM), max_norm=StableSPAM())

    class Clamped(torch.optim.Optimizer):
        def __init__(self, m: torch.nn.Module) -> None:
            self.inner = ReferenceStableSPAM(m.parameters(), update_proj_gap=NO_RESET, **ADAM)
            super().__init__(list(m.parameters()), {})

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.clamp_(-0.05, 0.05)
            self.inner.step()

    want = trajectory(Clamped, mean_grads=True)
    got = trajectory(ours)
    assert largest_difference(got, want) == 0.0


def test_stable_spam_refuses_a_group_with_its_own_bound() -> None:
    """A group's own float max_norm cannot combine with StableSPAM: a ValueError saying why and the fix."""
    model = spiked_model()
    groups = [{"params": model.parameters(), "max_norm": 0.5}]
    message = (
        "parameter group 0 has its own 'max_norm': 0.5, which cannot combine with max_norm=StableSPAM("
        "gamma1=0.7, gamma2=0.9, theta=0.999, eps=1e-08): a per-tensor policy sets each tensor's norm from "
        "its own statistics and has no norm bound for a group to replace"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        ClippedOptimizer(torch.optim.AdamW(groups), max_norm=StableSPAM())
