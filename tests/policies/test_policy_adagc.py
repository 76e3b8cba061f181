"""AdaGC (per-tensor adaptive clipping): what is its own -- other settings against
``pytorch_optimizer.AdaGC``, the checks of its state and arguments, its settings key, LBFGS, a
group added later.  What every per-tensor policy promises is in ``test_per_tensor_policies.py``."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import pytest
import torch
from pytorch_optimizer import AdaGC as ReferenceAdaGC

from clipopt import AdaGC, ClippedOptimizer
from clipopt._distributed.rank_check import settings_key

from ..policy_runs import (
    largest_difference,
    layers,
    spiked_model,
    train_spiked,
    trajectory,
)

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def _reference(warmup: int = 20, **kw: Any) -> Any:
    return lambda m: ReferenceAdaGC(m.parameters(), warmup_steps=warmup, **ADAM, **kw)


def _ours(warmup: int = 20, accumulation: int = 1, foreach: bool = False, **kw: Any) -> Any:
    return lambda m: ClippedOptimizer(
        torch.optim.AdamW(m.parameters(), foreach=foreach, **ADAM),
        max_norm=AdaGC(warmup=warmup, **kw),
        accumulation_steps=accumulation,
    )


# ------------------------------------------------------------------------------ trajectories


def test_adagc_non_default_settings_reproduce_the_reference() -> None:
    """Other hyper-parameters (beta 0.9, lambda_rel 1.2, lambda_abs 0.5, warm-up 5) give the
    reference's trajectory as well (tolerance 0)."""
    kw = {"beta": 0.9, "lambda_rel": 1.2, "lambda_abs": 0.5}
    want = trajectory(_reference(warmup=5, **kw), mean_grads=True)
    got = trajectory(_ours(warmup=5, **kw))
    assert largest_difference(got, want) == 0.0


# ------------------------------------------------------------------------------ state


def test_adagc_state_is_checked_before_loading() -> None:
    """A corrupt AdaGC state raises ValueError naming it, and the policy keeps its state."""
    model = spiked_model()
    opt = _ours()(model)
    train_spiked(model, opt, range(3))
    sd = copy.deepcopy(opt.state_dict())
    sd["clipopt"]["policy"]["gamma"] = torch.zeros(2, 2)
    before = copy.deepcopy(opt.max_norm.state_dict())  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=re.escape("invalid AdaGC state: 'gamma' must be 1-d")):
        opt.load_state_dict(sd)
    after = opt.max_norm.state_dict()  # type: ignore[union-attr]
    assert torch.equal(after["gamma"], before["gamma"]) and torch.equal(after["count"], before["count"])


_NOT_FINITE = "invalid AdaGC state: 'gamma' holds a value that is not finite and >= 0 (or nan: not seen yet)"
_NOT_WHOLE = "invalid AdaGC state: 'count' must be one whole number >= 0"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("gamma", -1.0, _NOT_FINITE),  # every gradient clipped to ~1e-8: training stops, silently
        ("gamma", math.inf, _NOT_FINITE),  # no tensor ever clipped again
        ("count", math.inf, _NOT_WHOLE),
        ("count", math.nan, _NOT_WHOLE),
        ("count", 2.5, _NOT_WHOLE),
    ],
)
def test_adagc_state_values_are_checked_before_loading(key: str, value: float, message: str) -> None:
    """An AdaGC state whose EMA holds a negative or infinite norm, or whose count is not a whole
    number >= 0, raises ValueError naming the entry, and the policy keeps its state; a nan in
    ``gamma`` (a tensor not seen yet) is accepted."""
    model = spiked_model()
    opt = _ours()(model)
    train_spiked(model, opt, range(3))
    unseen = copy.deepcopy(opt.state_dict())
    unseen["clipopt"]["policy"]["gamma"][0] = math.nan
    opt.load_state_dict(unseen)  # a tensor not seen yet: its gamma is nan
    sd = copy.deepcopy(opt.state_dict())
    entry = sd["clipopt"]["policy"][key]
    entry[0 if entry.dim() else ()] = value
    before = copy.deepcopy(opt.max_norm.state_dict())  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=re.escape(f"{message}; pass the state a AdaGC saved")):
        opt.load_state_dict(sd)
    after = opt.max_norm.state_dict()  # type: ignore[union-attr]
    assert torch.equal(after["gamma"].nan_to_num(-7.0), before["gamma"].nan_to_num(-7.0))
    assert torch.equal(after["count"], before["count"]) and bool(after["gamma"][0].isnan())


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "start",
            torch.tensor([-1.0, 0.0, 0.0, 0.0], dtype=torch.float64),
            "'start' holds a value that is not",
        ),
        ("keys", torch.tensor([[0, 0], [0, 1], [0, 1], [0, 3]]), "'keys' must hold distinct rows"),
        ("keys", torch.zeros(4, 2), "'keys' must be an integer tensor of shape (4, 2)"),
        ("keys", torch.tensor([[0, 0], [0, 1], [0, 2]]), "'keys' must be an integer tensor of shape (4, 2)"),
    ],
)
def test_adagc_start_and_keys_are_checked_before_loading(key: str, value: torch.Tensor, message: str) -> None:
    """#32: the warm-up starts (>= 0, or inf: not seen yet) and the keys (one distinct
    (optimizer, index) row per tensor) are checked as the statistics are: ValueError naming the
    entry, the policy unchanged."""
    model = spiked_model()
    opt = _ours()(model)
    train_spiked(model, opt, range(3))
    sd = copy.deepcopy(opt.state_dict())
    sd["clipopt"]["policy"][key] = value
    before = copy.deepcopy(opt.max_norm.state_dict())  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(sd)
    after = opt.max_norm.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(after[k].nan_to_num(-7.0), before[k].nan_to_num(-7.0)) for k in before)


def test_a_tensor_marked_unseen_by_gamma_alone_starts_its_warm_up_when_seen() -> None:
    """A loaded state whose gamma is nan (not seen yet) but whose start is a number: the tensor is
    taken as not seen yet (its start read as inf), so its first window clips it globally and
    starts its EMA and warm-up there, with finite gradients; a start of inf beside a finite
    gamma is read as 0 (seen from the first window)."""
    model = spiked_model()
    opt = _ours(warmup=2)(model)
    train_spiked(model, opt, range(3))
    sd = copy.deepcopy(opt.state_dict())
    sd["clipopt"]["policy"]["gamma"][0] = math.nan
    sd["clipopt"]["policy"]["start"][1] = math.inf
    opt.load_state_dict(sd)
    loaded = opt.max_norm.state_dict()  # type: ignore[union-attr]
    assert loaded["start"].tolist() == [math.inf, 0.0, 0.0, 0.0]
    train_spiked(model, opt, range(3, 4))
    after = opt.max_norm.state_dict()  # type: ignore[union-attr]
    assert after["start"].tolist() == [3.0, 0.0, 0.0, 0.0] and bool(torch.isfinite(after["gamma"]).all())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ------------------------------------------------------------------------------ arguments, settings


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"beta": 1.0}, ValueError, "beta must be in [0, 1), got 1.0; pass e.g. beta=0.98"),
        ({"beta": "0.9"}, TypeError, "beta must be a float in [0, 1), got '0.9' (str); pass e.g. beta=0.98"),
        (
            {"lambda_rel": 0},
            ValueError,
            "lambda_rel must be a positive finite number, got 0; pass e.g. lambda_rel=1.05",
        ),
        (
            {"lambda_abs": None},
            TypeError,
            "lambda_abs must be a positive float, got None; pass e.g. lambda_abs=1.0",
        ),
        ({"warmup": -1}, ValueError, "warmup must be an int >= 0, got -1; pass e.g. warmup=100"),
        ({"warmup": 2.5}, TypeError, "warmup must be an int >= 0, got 2.5 (float); pass e.g. warmup=100"),
    ],
)
def test_adagc_bad_arguments(kw: dict[str, Any], error: type[Exception], message: str) -> None:
    """Bad AdaGC arguments raise errors naming the argument, the value and the fix."""
    with pytest.raises(error, match=re.escape(message)):
        AdaGC(**kw)


def test_adagc_defaults_and_settings_key() -> None:
    """The defaults are those of the paper's reference code; the ranks' settings check tells
    two AdaGCs with different settings apart (their repr shows every setting)."""
    assert repr(AdaGC()) == "AdaGC(beta=0.98, lambda_rel=1.05, lambda_abs=1.0, warmup=100)"
    assert settings_key([], AdaGC()) == settings_key([], AdaGC())
    assert settings_key([], AdaGC()) != settings_key([], AdaGC(beta=0.99))
    assert settings_key([], AdaGC()) != settings_key([], AdaGC(warmup=101))


# ------------------------------------------------------------------------------ sync, groups, closures


def test_adagc_refuses_a_group_with_its_own_bound() -> None:
    """A group's own float max_norm cannot combine with AdaGC: a ValueError saying why and the fix."""
    model = spiked_model()
    first, second = layers(model)
    groups = [{"params": first.parameters()}, {"params": second.parameters(), "max_norm": 1.0}]
    message = (
        "parameter group 1 has its own 'max_norm': 1.0, which cannot combine with max_norm=AdaGC(beta=0.98, "
        "lambda_rel=1.05, lambda_abs=1.0, warmup=100): a per-tensor policy sets each tensor's norm from its "
        "own statistics and has no norm bound for a group to replace; set 'max_norm': None in the group"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        ClippedOptimizer(torch.optim.AdamW(groups), max_norm=AdaGC())


def test_adagc_counts_each_window_once_with_lbfgs() -> None:
    """LBFGS re-evaluations are clipped by AdaGC but do not move its statistics: one count per step()."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    policy = AdaGC(warmup=1)
    opt = ClippedOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=5), max_norm=policy)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    opt.step(closure)
    assert float(policy.state_dict()["count"]) == 2


def test_adagc_takes_a_parameter_group_added_later() -> None:
    """add_param_group after some updates: the new tensors start unseen (their first clipped norm
    starts their EMA) and have a warm-up of their own, the others keep theirs.  (That they follow
    their tensors and match the reference: test_per_tensor_policies.py, add_param_group.)"""
    model = spiked_model()
    first, second = layers(model)
    opt = ClippedOptimizer(torch.optim.AdamW(first.parameters(), **ADAM), max_norm=AdaGC(warmup=2))
    train_spiked(model, opt, range(3))
    before = opt.max_norm.state_dict()  # type: ignore[union-attr]
    assert before["gamma"].shape == (2,)
    opt.add_param_group({"params": list(second.parameters())})
    train_spiked(model, opt, range(3, 4))
    after = opt.max_norm.state_dict()  # type: ignore[union-attr]
    assert after["gamma"].shape == (4,) and bool(torch.isfinite(after["gamma"]).all())
    assert after["keys"].tolist() == [[0, 0], [0, 1], [0, 2], [0, 3]]
    assert after["start"].tolist() == [0.0, 0.0, 3.0, 3.0]  # the new tensors' warm-up starts at update 4
