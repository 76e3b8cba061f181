"""A third-party Optimizer subclass works like the torch ones."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from clipopt import ClippedOptimizer


class SignMomentum(torch.optim.Optimizer):
    """A small third-party optimizer: momentum on the sign of the gradient, with lazy state."""

    def __init__(self, params: Any, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["k"] = 0
                state["m"].mul_(group["beta"]).add_(p.grad.sign(), alpha=1 - group["beta"])
                state["k"] += 1
                p.add_(state["m"], alpha=-group["lr"])
        return loss


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 3, generator=gen) for _ in range(6)]


def _reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()


def test_third_party_optimizer_clips_and_steps_like_torch() -> None:
    """Wrapping a custom Optimizer subclass equals clip_grad_norm_ + its own step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ref_model = copy.deepcopy(model)
    opt = ClippedOptimizer(SignMomentum(model.parameters()), max_norm=0.5)
    ref = SignMomentum(ref_model.parameters())
    for x in _batches():
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        _reference_step(ref_model, ref, x)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.state is opt.optimizer.state


def test_third_party_optimizer_skip_leaves_state_alone() -> None:
    """A NaN window leaves the custom optimizer's tensors and Python counters untouched."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = ClippedOptimizer(SignMomentum(model.parameters()), max_norm=0.5)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
    before = copy.deepcopy(opt.optimizer.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    model(torch.full((2, 3), float("nan"))).sum().backward()
    opt.step()
    assert opt.step_was_skipped
    after = opt.optimizer.state_dict()
    for key, st in before["state"].items():
        assert torch.equal(st["m"], after["state"][key]["m"])
        assert st["k"] == after["state"][key]["k"] == 1
    for a, b in zip(params, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_third_party_state_dict_round_trip() -> None:
    """The wrapper's state dict of a custom optimizer loads into a fresh wrapper and continues identically."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = ClippedOptimizer(SignMomentum(model.parameters()), max_norm=0.5, accumulation_steps=2)
    batches = _batches()
    for x in batches[:3]:
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = ClippedOptimizer(SignMomentum(model2.parameters()), max_norm=0.5, accumulation_steps=2)
    opt2.load_state_dict(sd)
    for x in batches[3:]:
        for m, o in ((model, opt), (model2, opt2)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
