"""The fast step() path keeps torch's profiler labels and global hooks."""

from __future__ import annotations

import torch
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
