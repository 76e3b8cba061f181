"""The window plan (clipopt/_window/plan.py) is made again whenever a setting changes mid-run.

Each test runs a window (the plan is made), changes one setting the way a user does, and checks
that the next window obeys it.  The inner optimizer is SGD with ``lr=1`` and no momentum, so a
window's update is exactly the gradient it applied; the reference is torch's own
``clip_grad_value_`` / ``clip_grad_norm_`` on a copy of the same gradients.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from clipopt import ClippedOptimizer


def _params(n: int = 3) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 5)) for _ in range(n)]


def _grads(params: list[torch.nn.Parameter], seed: int) -> list[torch.Tensor]:
    """Gradients with a total 2-norm of about 9 (well above every bound used here)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) * 2.0 for p in params]


def _window(
    opt: ClippedOptimizer, params: list[torch.nn.Parameter], grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    """One window of one micro-batch with ``grads``: the update it applied (SGD, lr=1)."""
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    return [b - p.detach() for b, p in zip(before, params, strict=True)]


def _torch_clipped(
    grads: list[torch.Tensor], max_norm: float | None, norm_type: float = 2.0, clip_value: float | None = None
) -> list[torch.Tensor]:
    """The reference: torch's value clip, then norm clip, of copies of ``grads``."""
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads, strict=True):
        p.grad = g.clone()
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(ps, clip_value)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type=norm_type)
    return [p.grad for p in ps if p.grad is not None]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _wrapped(**kwargs: object) -> tuple[ClippedOptimizer, list[torch.nn.Parameter]]:
    params = _params()
    return ClippedOptimizer(torch.optim.SGD(params, lr=1.0), **kwargs), params  # type: ignore[arg-type]


def test_max_norm_setter_takes_effect_at_the_next_window() -> None:
    """``opt.max_norm = 0.5`` after a window clipped at 1.0: the next window is clipped at 0.5, then None
    turns norm clipping off."""
    opt, params = _wrapped(max_norm=1.0)
    _close(_window(opt, params, _grads(params, 1)), _torch_clipped(_grads(params, 1), 1.0))
    opt.max_norm = 0.5
    _close(_window(opt, params, _grads(params, 2)), _torch_clipped(_grads(params, 2), 0.5))
    assert opt.last_stats is not None and opt.last_stats.max_norm == 0.5
    opt.max_norm = None
    _close(_window(opt, params, _grads(params, 3)), _grads(params, 3))


def test_clip_value_set_mid_run_clamps_the_next_window() -> None:
    """``opt.clip_value = 0.1`` after a window without it: the next window is clamped, then clipped by
    norm (torch's clip_grad_value_ then clip_grad_norm_)."""
    opt, params = _wrapped(max_norm=1.0)
    _window(opt, params, _grads(params, 1))
    opt.clip_value = 0.1
    _close(_window(opt, params, _grads(params, 2)), _torch_clipped(_grads(params, 2), 1.0, clip_value=0.1))


def test_norm_type_set_mid_run_measures_the_next_window_with_it() -> None:
    """``opt.norm_type = inf`` after a 2-norm window: the next window's norm is the largest element."""
    opt, params = _wrapped(max_norm=1.0)
    _window(opt, params, _grads(params, 1))
    opt.norm_type = math.inf
    grads = _grads(params, 2)
    _close(_window(opt, params, grads), _torch_clipped(grads, 1.0, norm_type=math.inf))
    assert opt.last_stats is not None
    assert opt.last_stats.total_norm == pytest.approx(max(g.abs().max().item() for g in grads))


def test_reduction_and_skip_nonfinite_set_mid_run() -> None:
    """``opt.reduction = "sum"`` makes the next window of two micro-batches apply their sum (no
    division); ``opt.skip_nonfinite = False`` makes a non-finite window reach the inner step."""
    params = _params()
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=1.0), max_norm=None, accumulation_steps=2)
    for reduction, factor in (("mean", 0.5), ("sum", 1.0)):
        opt.reduction = reduction
        before = [p.detach().clone() for p in params]
        grads = _grads(params, 5)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()  # the second micro-batch adds nothing: the window's sum is ``grads``
        opt.step()
        _close([b - p.detach() for b, p in zip(before, params, strict=True)], [g * factor for g in grads])
    opt.accumulation_steps = 1
    opt.skip_nonfinite = False
    bad = _grads(params, 6)
    bad[0][0, 0] = math.nan
    _window(opt, params, bad)
    assert not opt.step_was_skipped and torch.isnan(params[0].detach()).any()


def test_a_group_option_set_in_place_is_checked_and_obeyed_at_the_next_window() -> None:
    """``opt.param_groups[0]["max_norm"] = 0.25`` between windows: the group is clipped by its own norm
    at 0.25; a bad value set the same way is refused at the next step(), before anything changes."""
    params = _params(2)
    opt = ClippedOptimizer(
        torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=1.0), max_norm=100.0
    )
    _window(opt, params, _grads(params, 1))
    opt.param_groups[0]["max_norm"] = 0.25
    grads = _grads(params, 2)
    got = _window(opt, params, grads)
    _close(got[:1], _torch_clipped(grads[:1], 0.25))
    _close(got[1:], grads[1:])  # the other group: its norm (about 9) is under the wrapper's 100
    opt.param_groups[0]["max_norm"] = -1.0
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, _grads(params, 3), strict=True):
        p.grad = g
    with pytest.raises(
        ValueError, match=re.escape("parameter group 0: 'max_norm' must be a positive finite")
    ):
        opt.step()
    _close([p.detach() for p in params], before)


def test_add_param_group_with_its_own_bound_is_obeyed_at_the_next_window() -> None:
    """A group added mid-run with ``"max_norm": 0.5`` is clipped by its own norm at the next window."""
    params = _params(3)
    opt = ClippedOptimizer(torch.optim.SGD(params[:2], lr=1.0), max_norm=100.0)
    _window(opt, params[:2], _grads(params[:2], 1))
    opt.add_param_group({"params": params[2:], "max_norm": 0.5})
    grads = _grads(params, 2)
    got = _window(opt, params, grads)
    _close(got[:2], grads[:2])
    _close(got[2:], _torch_clipped(grads[2:], 0.5))


def test_load_state_dict_brings_back_the_groups_options() -> None:
    """A checkpoint whose group has ``"max_norm": 0.3``, loaded into a wrapper whose plan was made
    without it: the next window clips the group at 0.3; loading one without it ends that again."""
    opt, params = _wrapped(max_norm=100.0)
    _window(opt, params, _grads(params, 1))
    plain = opt.state_dict()
    opt.param_groups[0]["max_norm"] = 0.3
    bounded = opt.state_dict()
    del opt.param_groups[0]["max_norm"]
    _window(opt, params, _grads(params, 2))  # a plan without the group's bound
    opt.load_state_dict(bounded)
    _close(_window(opt, params, _grads(params, 3)), _torch_clipped(_grads(params, 3), 0.3))
    opt.load_state_dict(plain)
    assert "max_norm" in opt.param_groups[0]  # a saved dict without the key keeps the current one
    del opt.param_groups[0]["max_norm"]
    _close(_window(opt, params, _grads(params, 4)), _grads(params, 4))


def test_a_policy_set_mid_run_is_checked_against_the_groups() -> None:
    """``opt.max_norm = AGC()`` while a group has its own float bound: refused by the assignment
    itself (the combination the constructor refuses, #32), with the groups' own message; the window
    that follows closes with the bound as it was."""
    from clipopt import AGC

    params = _params(2)
    opt = ClippedOptimizer(
        torch.optim.SGD([{"params": params[:1], "max_norm": 1.0}, {"params": params[1:]}], lr=1.0),
        max_norm=1.0,
    )
    _window(opt, params, _grads(params, 1))
    with pytest.raises(ValueError, match=re.escape("parameter group 0 has its own 'max_norm': 1.0")):
        opt.max_norm = AGC()
    assert opt.max_norm == 1.0
    _window(opt, params, _grads(params, 2))
    assert opt.num_windows == 2


def test_the_plan_is_made_once_while_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows with unchanged settings check the groups once, with one inner optimizer and over
    several (whose merged ``defaults`` is a new dict at every read); a setting assigned makes the
    plan again, once."""
    import clipopt._window.plan as plan_module

    checks: list[int] = []
    real = plan_module.check_groups

    def counting(*args: object, **kwargs: object) -> object:
        checks.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(plan_module, "check_groups", counting)
    params = _params(2)
    one = ClippedOptimizer(torch.optim.SGD(params, lr=1.0), max_norm=1.0)
    several = ClippedOptimizer(
        [torch.optim.SGD(params[:1], lr=1.0), torch.optim.SGD(params[1:], lr=1.0)], max_norm=1.0
    )
    for opt in (one, several):
        checks.clear()
        for seed in range(4):
            _window(opt, params, _grads(params, seed))
        assert len(checks) == 1
        opt.clip_value = 5.0
        for seed in range(3):
            _window(opt, params, _grads(params, seed))
        assert len(checks) == 2
