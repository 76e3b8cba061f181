"""Per-group clipping, defects found in the review of issue 16.

Windows in which no gradient shares the wrapper's bound: when every group with a gradient has its
own ``max_norm`` (or is left out), the wrapper's bound --
a float or a policy's threshold -- bounds nothing: a policy must not record the shared groups'
norm of 0 as a sample, the shared coefficient stays 1 (a 0 there used to reach a fused kernel's
``grad_scale`` as ``1/0``) and the recorded ``max_norm`` is None.  References are torch's own
``clip_grad_norm_`` on a copy of the gradients.  And a checkpoint with per-group keys loaded into a
wrapper with ``norm_group``, refused at the load as at construction.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from clipopt import AutoClip, ClippedOptimizer, ZClip


def _model() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(3, 3), nn.Linear(3, 3)


def _own_group_only_window(opt: ClippedOptimizer, own: nn.Linear, seed: int) -> list[torch.Tensor]:
    """Backward through the group with its own bound only; return torch's reference clipped gradient."""
    gen = torch.Generator().manual_seed(seed)
    own(torch.randn(4, 3, generator=gen)).pow(2).sum().backward()
    ref = [p.grad.detach().clone().requires_grad_() for p in own.parameters()]  # type: ignore[union-attr]
    for r, p in zip(ref, own.parameters(), strict=True):
        r.grad = p.grad.detach().clone()  # type: ignore[union-attr]
    torch.nn.utils.clip_grad_norm_(ref, 0.5)
    return [r.grad for r in ref]  # type: ignore[misc]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("policy", ["autoclip", "zclip", "float"])
def test_window_without_shared_gradients_applies_the_own_bound(fused: bool, policy: str) -> None:
    """Windows where only the own-bound group has gradients: SGD (lr=1) applies exactly torch's
    clip_grad_norm_(own grads, 0.5), finite, with the shared coefficient 1 and max_norm None; before
    the fix AutoClip recorded a norm of 0, its threshold 0 gave a coefficient of 0, and the fused
    kernel turned the update into nan."""
    shared, own = _model()
    bound = {"autoclip": AutoClip(), "zclip": ZClip(warmup_steps=1), "float": 1.0}[policy]
    groups = [{"params": shared.parameters()}, {"params": own.parameters(), "max_norm": 0.5}]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=1.0, fused=fused), max_norm=bound)
    for seed in range(3):
        before = [p.detach().clone() for p in own.parameters()]
        expected = _own_group_only_window(opt, own, seed)
        opt.step()
        opt.zero_grad()
        for b, p, e in zip(before, own.parameters(), expected, strict=True):
            torch.testing.assert_close(b - p.detach(), e, rtol=1e-5, atol=1e-7)
        stats = opt.last_stats
        assert stats is not None and not stats.skipped
        assert stats.group_coefs[0] == 1.0
        assert stats.max_norm is None  # the wrapper's bound bounded nothing this window


def test_autoclip_history_skips_windows_without_shared_gradients() -> None:
    """AutoClip records the shared groups' norm only in windows where they have gradients: after two
    windows with and two without, its history holds exactly the two shared norms (torch's
    get_total_norm), not zeros that would drag its percentile threshold down."""
    shared, own = _model()
    policy = AutoClip(percentile=50, history=8)
    groups = [{"params": shared.parameters()}, {"params": own.parameters(), "max_norm": 0.5}]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), max_norm=policy)
    norms = []
    for k in range(4):
        x = torch.randn(4, 3) * 5
        own(x).pow(2).sum().backward()
        if k < 2:
            shared(x).pow(2).sum().backward()
            grads = [p.grad for p in shared.parameters()]
            norms.append(float(torch.nn.utils.get_total_norm(grads)))  # type: ignore[arg-type]
        opt.step()
        opt.zero_grad()
    state = policy.state_dict()
    assert int(state["index"]) == 2
    torch.testing.assert_close(state["buffer"][:2], torch.tensor(norms), rtol=1e-5, atol=0.0)
    assert torch.isnan(state["buffer"][2:]).all()


def test_every_group_with_its_own_bound_records_no_max_norm() -> None:
    """With every group bounded by its own max_norm, the wrapper's max_norm=1.0 is used by none:
    StepStats.max_norm is None and clip_coef 1.0, so a log (and clipopt report) does not claim that
    max_norm 1.0 clipped the updates; the groups' own coefficients are torch's."""
    a, b = _model()
    groups = [{"params": a.parameters(), "max_norm": 0.5}, {"params": b.parameters(), "max_norm": 0.2}]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), max_norm=1.0)
    x = torch.randn(4, 3) * 5
    (a(x).pow(2).sum() + b(x).pow(2).sum()).backward()
    na = float(torch.nn.utils.get_total_norm([p.grad for p in a.parameters()]))  # type: ignore[arg-type]
    opt.step()
    stats = opt.last_stats
    assert stats is not None
    assert stats.max_norm is None
    assert stats.clip_coef == 1.0
    assert stats.clipped
    assert stats.group_coefs[0] == pytest.approx(0.5 / (na + 1e-6), rel=1e-5)


def test_load_refuses_group_keys_with_norm_group(tmp_path: Path) -> None:
    """A wrapper with norm_group (pipeline stages) refuses, at load_state_dict and before anything
    loads, a checkpoint whose groups carry per-group keys -- as its constructor would; before the fix
    the load succeeded and every later window raised."""
    import torch.distributed as dist

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        a, b = _model()
        saved = ClippedOptimizer(
            torch.optim.SGD([{"params": a.parameters()}, {"params": b.parameters(), "max_norm": 0.5}], lr=0.1)
        ).state_dict()
        inner = torch.optim.SGD([{"params": a.parameters()}, {"params": b.parameters()}], lr=0.2)
        opt = ClippedOptimizer(inner, norm_group=dist.group.WORLD)
        message = (
            "invalid state_dict: per-group 'max_norm'/'clip_value' (parameter group 1) cannot be combined "
            "with norm_group yet: the stages would have to agree on every group; pass norm_group=None, "
            "or remove the keys"
        )
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            opt.load_state_dict(saved)
        assert "max_norm" not in opt.param_groups[1] and opt.param_groups[1]["lr"] == 0.2  # nothing loaded
    finally:
        if mine:
            dist.destroy_process_group()
