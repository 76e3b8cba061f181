"""The fast step() path keeps torch's profiler labels and global hooks; the inner step passes torch's
wrapper by only when it would do nothing but cost time."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import Optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from clipopt import ClippedOptimizer


def _opt() -> tuple[torch.nn.Module, ClippedOptimizer]:
    model = torch.nn.Linear(3, 2)
    return model, ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)


def test_profiler_sees_the_step() -> None:
    """Under torch.profiler every step() call is labelled Optimizer.step#ClippedOptimizer.step."""
    model, opt = _opt()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#ClippedOptimizer.step") == 2
    assert names.count("Optimizer.step#SGD.step") == 1


def test_global_step_hooks_fire() -> None:
    """Global hooks (register_optimizer_step_pre/post_hook) fire around the wrapper and the inner step."""
    model, opt = _opt()
    seen: list[str] = []
    pre = register_optimizer_step_pre_hook(lambda o, a, k: seen.append(f"pre {type(o).__name__}"))
    post = register_optimizer_step_post_hook(lambda o, a, k: seen.append(f"post {type(o).__name__}"))
    try:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.step()
    finally:
        pre.remove()
        post.remove()
    assert seen == [
        "pre ClippedOptimizer",
        "post ClippedOptimizer",
        "pre ClippedOptimizer",
        "pre SGD",
        "post SGD",
        "post ClippedOptimizer",
    ]


# ------------------------------------------------------------------ the inner step past torch's wrapper


def _step_labels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The record_function labels opened from now on (torch's step wrapper opens one per call)."""
    labels: list[str] = []
    enter = torch.autograd.profiler.record_function.__enter__

    def spy(self: torch.autograd.profiler.record_function) -> Any:
        labels.append(self.name)
        return enter(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", spy)
    return labels


def _inner_steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The optimizers whose ``_optimizer_step_code`` ran (torch's wrapper calls it after each step)."""
    seen: list[str] = []
    monkeypatch.setattr(Optimizer, "_optimizer_step_code", lambda self: seen.append(type(self).__name__))
    return seen


INNER_CASES: dict[str, Callable[[list[torch.nn.Parameter]], dict[str, Any]]] = {
    "plain host": lambda ps: {"optimizer": torch.optim.SGD(ps, lr=0.1), "max_norm": 1.0},
    "plain fused": lambda ps: {"optimizer": torch.optim.AdamW(ps, fused=True), "max_norm": 1.0},
    "general host": lambda ps: {"optimizer": torch.optim.SGD(ps, lr=0.1), "max_norm": 1.0, "clip_value": 0.5},
    "general fused": lambda ps: {
        "optimizer": torch.optim.Adam(ps, fused=True),
        "max_norm": 1.0,
        "layer_stats": 1,
    },
    "two inner": lambda ps: {
        "optimizer": [torch.optim.SGD(ps[:1], lr=0.1), torch.optim.AdamW(ps[1:])],
        "max_norm": 1.0,
    },
}


@pytest.mark.parametrize("case", sorted(INNER_CASES))
def test_an_inner_step_without_hooks_or_profiler_passes_torchs_wrapper_by(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """With no hook and no profiler, the inner step runs without torch's wrapper (no record_function),
    on the plain and the general close, host and fused, over one inner optimizer or two; the
    wrapper's ``_optimizer_step_code`` still runs once per inner step; the update is torch's."""
    model = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    kw = INNER_CASES[case](list(model.parameters()))
    opt = ClippedOptimizer(kw.pop("optimizer"), **kw)
    ref_kw = INNER_CASES[case](list(ref.parameters()))
    ref_opt = ref_kw.pop("optimizer")
    labels, steps = _step_labels(monkeypatch), _inner_steps(monkeypatch)
    inner_names = [type(o).__name__ for o in (ref_opt if isinstance(ref_opt, list) else [ref_opt])]
    for _ in range(2):
        for m in (model, ref):
            m.zero_grad()
            (m(torch.ones(2, 3)) * 10).sum().backward()
        del labels[:], steps[:]
        opt.step()
        assert not [label for label in labels if label.startswith("Optimizer.step#")]
        assert steps == inner_names
        if "clip_value" in ref_kw:
            torch.nn.utils.clip_grad_value_(ref.parameters(), ref_kw["clip_value"])
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        for o in ref_opt if isinstance(ref_opt, list) else [ref_opt]:
            o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)


def test_a_closure_reaches_the_inner_step_past_the_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a closure the inner step gets the wrapper's closure through the unwrapped step: ``step()``
    returns the closure's loss and the update is ``clip_grad_norm_`` + SGD's.  (torch.compile's setup
    wraps LBFGS's ``step`` in its own ``disable``: that one is not torch's wrapper and is called as is.)"""
    model, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    labels = _step_labels(monkeypatch)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).pow(2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert not [label for label in labels if label.startswith("Optimizer.step#")]
    ref_loss = ref(torch.ones(2, 3)).pow(2).sum()
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["pre", "post"])
def test_a_hook_on_the_inner_optimizer_takes_torchs_wrapper(
    monkeypatch: pytest.MonkeyPatch, kind: str, fused: bool
) -> None:
    """A step pre- or post-hook registered on the inner optimizer runs at its step, inside torch's
    wrapper."""
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.AdamW(model.parameters(), fused=fused)
    opt = ClippedOptimizer(inner, max_norm=1.0)
    seen: list[int] = []
    register = inner.register_step_pre_hook if kind == "pre" else inner.register_step_post_hook
    register(lambda o, a, k: seen.append(int(o.state[model.weight]["step"]) if kind == "post" else -1))
    labels = _step_labels(monkeypatch)
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert seen == ([-1, -1] if kind == "pre" else [1, 2])
    assert labels.count("Optimizer.step#AdamW.step") == 2


def test_an_lr_scheduler_on_the_inner_optimizer_sees_its_step() -> None:
    """A scheduler built on the inner optimizer wraps its ``step`` on the instance: that step runs, so
    the scheduler sees it and does not warn that it stepped before the optimizer."""
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = ClippedOptimizer(inner, max_norm=1.0)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()
    assert inner.param_groups[0]["lr"] == 0.05


def test_a_profiler_sees_the_inner_step_of_a_fused_plain_window() -> None:
    """Under torch.profiler the fused plain window's inner step keeps its label."""
    model = torch.nn.Linear(3, 2)
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), max_norm=1.0)
    model(torch.ones(1, 3)).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#AdamW.step") == 1


def test_a_profiler_of_every_thread_started_elsewhere_sees_both_steps() -> None:
    """A profiler recording every thread (``profile_all_threads``), started in another thread than the
    one that trains, keeps the wrapper's and the inner optimizer's ``Optimizer.step#`` labels: that
    thread's own profiler flag is off, the process-wide one is on."""
    from torch._C._profiler import _ExperimentalConfig

    model = torch.nn.Linear(3, 2)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0)
    start, done = threading.Event(), threading.Event()
    own_flag: list[bool] = []

    def train() -> None:
        start.wait()
        own_flag.append(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]
        for _ in range(2):
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        done.set()

    worker = threading.Thread(target=train)
    worker.start()
    config = _ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config
    ) as prof:
        start.set()
        done.wait(timeout=60)
    worker.join()
    names = [e.name for e in prof.events()]
    assert own_flag == [False]
    assert names.count("Optimizer.step#ClippedOptimizer.step") == 2
    assert names.count("Optimizer.step#SGD.step") == 2
