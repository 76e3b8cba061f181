"""A setting assigned mid-run (SPEC §10) is checked exactly as the constructor checks it, before
anything changes: a refused assignment raises the constructor's error and leaves the setting, the open
window's gradients and micro-batches, and the run that follows as they would have been without it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from clipopt import AGC, ClippedOptimizer, Rewind, ZClip

#: (setting, bad value, other constructor arguments the case needs)
BAD: list[tuple[str, Any, dict[str, Any]]] = [
    ("clip_value", float("nan"), {}),
    ("clip_value", -1.0, {}),
    ("clip_value", "0.5", {}),
    ("norm_type", -1, {}),
    ("norm_type", 0, {}),
    ("norm_type", "2", {}),
    ("accumulation_steps", 0, {}),
    ("accumulation_steps", 1.5, {}),
    ("reduction", "avg", {}),
    ("skip_nonfinite", "yes", {}),
    ("skip_nonfinite", False, {"max_consecutive_nonfinite": 3}),  # with the other setting as it is
    ("max_consecutive_nonfinite", 0, {}),
    ("update_clip", 5, {}),
    ("update_stats", "yes", {}),
    ("max_norm", -1.0, {}),
    ("max_norm", "x", {}),
    ("max_norm", float("inf"), {}),
    ("max_norm", 1.0, {"spike_guard": None, "rewind": "R"}),  # a Rewind needs a policy that skips spikes
    ("loggers", 3, {}),
    ("loggers", [object()], {}),
    ("layer_stats", 0, {}),
    ("layer_stats", -1, {}),
    ("stats_history", 0, {}),
    ("max_snapshots", 0, {}),
    ("snapshot_dir", 5, {}),
    ("backward_passes_per_step", 0, {}),
    ("scaler", object(), {}),
    ("foreach", "x", {}),
    ("norm_group", "x", {}),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _wrapper(model: torch.nn.Module, **kwargs: Any) -> ClippedOptimizer:
    if kwargs.get("rewind") == "R":  # a Rewind, with a policy that skips spikes to drive it
        kwargs["rewind"] = Rewind(every=2, keep=1, spikes=2, within=10)
        kwargs.setdefault("max_norm", ZClip(skip_spikes=True))
    kwargs.setdefault("max_norm", 0.1)
    kwargs.setdefault("accumulation_steps", 2)
    return ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **kwargs)


def _micro_batch(model: torch.nn.Module, opt: ClippedOptimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize(("name", "bad", "others"), BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_bad_setting_assigned_mid_window_is_refused_as_the_constructor_refuses_it(
    name: str, bad: Any, others: dict[str, Any]
) -> None:
    with pytest.raises((TypeError, ValueError)) as by_constructor:
        _wrapper(_model(), **{**others, name: bad})

    model = _model()
    opt = _wrapper(model, **others)
    _micro_batch(model, opt, 0)  # the window is open: one of two micro-batches
    before = getattr(opt, name)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(by_constructor.type) as by_assignment:
        setattr(opt, name, bad)
    assert str(by_assignment.value) == str(by_constructor.value)
    assert getattr(opt, name) is before
    assert opt.micro_batches == 1
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))

    # the run goes on as if the assignment had never been tried
    _micro_batch(model, opt, 1)
    reference = _model()
    ref_opt = _wrapper(reference, **others)
    _micro_batch(reference, ref_opt, 0)
    _micro_batch(reference, ref_opt, 1)
    assert opt.num_windows == ref_opt.num_windows == 1
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_policy_that_a_group_option_rules_out_is_refused_when_assigned() -> None:
    """``max_norm=AGC()`` with a group's own float ``max_norm`` is refused by the constructor; so is the
    assignment, with the same message, before the next window."""
    model = _model()
    groups = [{"params": model[0].parameters(), "max_norm": 0.5}, {"params": model[2].parameters()}]
    with pytest.raises(ValueError) as by_constructor:
        ClippedOptimizer(torch.optim.AdamW(groups), max_norm=AGC())
    groups = [{"params": model[0].parameters(), "max_norm": 0.5}, {"params": model[2].parameters()}]
    opt = ClippedOptimizer(torch.optim.AdamW(groups), max_norm=1.0)
    with pytest.raises(ValueError) as by_assignment:
        opt.max_norm = AGC()
    assert str(by_assignment.value) == str(by_constructor.value)
    assert opt.max_norm == 1.0


def test_good_settings_assigned_mid_run_take_effect() -> None:
    model = _model()
    opt = _wrapper(model)
    opt.clip_value = 0.01
    opt.stats_history = 2
    opt.accumulation_steps = 1
    for seed in range(4):
        _micro_batch(model, opt, seed)
    assert opt.num_windows == 4 and len(opt.stats) == 2 and opt.stats.maxlen == 2
    assert opt.clip_value == 0.01 and bool(opt.last_stats.clipped)
