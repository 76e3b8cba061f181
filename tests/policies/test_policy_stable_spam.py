"""StableSPAM (AdaClip and AdaGN per tensor) against ``pytorch_optimizer.StableSPAM``, and as a policy.

The reference runs with its momentum reset off (``update_proj_gap`` beyond the run) and without
its cosine schedule of ``gamma1`` (``t_max=None``, its default): what is left of its optimizer is
Adam with decoupled weight decay, which ``torch.optim.AdamW`` computes the same way.
"""

from __future__ import annotations

import copy
import functools
import io
import math
import re
from typing import Any

import pytest
import torch
from pytorch_optimizer import StableSPAM as ReferenceStableSPAM

from clipopt import ClippedOptimizer, SpikeGuard, StableSPAM
from clipopt._distributed.rank_check import settings_key

from ..helpers import reads_per_step, square_mean
from ..policy_runs import (
    SPIKES,
    UPDATES,
    assert_same_run,
    largest_difference,
    layers,
    spiked_model,
    train_spiked,
    trajectory,
    with_and_without,
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


@functools.cache
def _reference_trajectory() -> list[torch.Tensor]:
    """pytorch_optimizer.StableSPAM's trajectory with the default settings: computed once, then only read."""
    return trajectory(_reference(), mean_grads=True)


@functools.cache
def _plain_trajectory() -> list[torch.Tensor]:
    """The same run under plain AdamW (no policy): computed once, then only read."""
    return trajectory(lambda m: torch.optim.AdamW(m.parameters(), foreach=False, **ADAM))


@pytest.mark.parametrize("foreach", [False, True])
def test_stable_spam_reproduces_the_reference_trajectory(foreach: bool) -> None:
    """300 updates with gradient spikes (x1e3 on four updates, one element +1e6 on another) give
    parameters identical, update by update, to pytorch_optimizer.StableSPAM's (momentum reset off)
    with the same settings (tolerance 0: measured 0.0 with torch.optim.AdamW foreach=False and
    foreach=True); the run without the policy differs by more than 0.1, so the spikes matter."""
    want = _reference_trajectory()
    got = trajectory(_ours(foreach=foreach))
    assert largest_difference(got, want) == 0.0
    plain = _plain_trajectory()
    assert largest_difference(plain, want) > 0.1


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


def test_stable_spam_with_accumulation_reproduces_the_reference_on_the_mean_gradient() -> None:
    """accumulation_steps=3 (reduction 'mean'): each update equals the reference stepping on the
    mean of the three micro-batches' gradients (tolerance 0)."""
    want = trajectory(_reference(), accumulation=3, mean_grads=True)
    got = trajectory(_ours(accumulation=3), accumulation=3)
    assert largest_difference(got, want) == 0.0


def test_stable_spam_records_the_spikes_as_clipped() -> None:
    """StepStats: no global bound (max_norm None, clip_coef 1.0); a spike update is clipped."""
    model = spiked_model()
    opt = _ours()(model)
    train_spiked(model, opt, range(60))
    assert all(s.max_norm is None and s.clip_coef == 1.0 for s in opt.stats)
    assert all(opt.stats[i].clipped for i in SPIKES if i < 60)


# ------------------------------------------------------------------------------ state


def test_stable_spam_state_dict_resumes_identically() -> None:
    """Saved after 150 updates, loaded into a fresh wrapper with a fresh StableSPAM (through
    torch.save / torch.load), the run continues exactly as the uninterrupted one."""
    model = spiked_model()
    opt = _ours()(model)
    train_spiked(model, opt, range(150))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    model2 = copy.deepcopy(model)
    opt2 = _ours()(model2)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    train_spiked(model, opt, range(150, UPDATES))
    train_spiked(model2, opt2, range(150, UPDATES))
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


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


def test_a_skipped_window_leaves_stable_spam_as_if_it_never_happened() -> None:
    """A window with a NaN gradient is skipped, and StableSPAM's statistics (the EMAs of max |g|,
    of the norm and its square, the count) and the parameters are those of the run that never saw it."""
    bad = (torch.randn(8, 6), torch.randn(8, 3))
    bad[0][0, 0] = math.nan
    with_bad, without = with_and_without(_ours(), bad)
    assert with_bad[1].stats[10].skipped and with_bad[1].stats[10].reason == "nonfinite"  # type: ignore[attr-defined]
    assert float(with_bad[1].max_norm.state_dict()["count"]) == 30  # type: ignore[attr-defined]
    assert_same_run(with_bad, without, ("m_max", "m_norm", "v_norm", "count"))


def test_a_spike_skipped_by_spike_guard_leaves_stable_spam_as_if_it_never_happened() -> None:
    """A finite window that SpikeGuard skips (reason "spike") after StableSPAM clipped it leaves the
    policy's statistics and the parameters those of the run that never saw it."""
    bad = (torch.randn(8, 6) * 1e4, torch.randn(8, 3))

    def make(m: torch.nn.Module) -> Any:
        guard = SpikeGuard(z_thresh=4.0, window=8, signals=("grad_norm",))
        inner = torch.optim.AdamW(m.parameters(), foreach=False, **ADAM)
        return ClippedOptimizer(inner, max_norm=StableSPAM(), spike_guard=guard)

    with_bad, without = with_and_without(make, bad)
    assert with_bad[1].stats[10].skipped and with_bad[1].stats[10].reason == "spike"  # type: ignore[attr-defined]
    assert_same_run(with_bad, without, ("m_max", "m_norm", "v_norm", "count"))


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
            "eps must be a positive finite number or None, got 0.0; pass e.g. eps=1e-8",
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


@pytest.mark.parametrize("accumulation", [1, 2])
def test_stable_spam_reads_nothing_on_the_fused_path(accumulation: int) -> None:
    """StableSPAM keeps a fused AdamW update free of host reads (after the first window)."""
    model = spiked_model()
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), fused=True),
        max_norm=StableSPAM(),
        accumulation_steps=accumulation,
    )
    reads = reads_per_step(model, opt, [torch.randn(4, 6) for _ in range(8)], square_mean)
    assert reads[accumulation:] == [0] * (8 - accumulation)


def test_stable_spam_with_an_excluded_group_matches_the_reference_on_the_others() -> None:
    """A group with 'max_norm': None is left out of StableSPAM: the other group follows
    pytorch_optimizer.StableSPAM over its parameters alone, the excluded one plain AdamW (tolerance 0)."""

    def ours(m: torch.nn.Module) -> Any:
        first, second = layers(m)
        groups = [{"params": first.parameters()}, {"params": second.parameters(), "max_norm": None}]
        return ClippedOptimizer(torch.optim.AdamW(groups, foreach=False, **ADAM), max_norm=StableSPAM())

    class Both(torch.optim.Optimizer):
        def __init__(self, m: torch.nn.Module) -> None:
            first, second = layers(m)
            self.a = ReferenceStableSPAM(first.parameters(), update_proj_gap=NO_RESET, **ADAM)
            self.b = torch.optim.AdamW(second.parameters(), foreach=False, **ADAM)
            super().__init__(list(m.parameters()), {})

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            self.a.step()
            self.b.step()

    want = trajectory(Both, mean_grads=True)
    got = trajectory(ours)
    assert largest_difference(got, want) == 0.0


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
