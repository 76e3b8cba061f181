"""Adaptive thresholds: AutoClip, ZClip and AGC against plain-Python references."""

from __future__ import annotations

import copy
import math
import re
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

import clipopt
from clipopt import AGC, AutoClip, ClippedOptimizer, ZClip

from ..helpers import TwoHeads, inputs, mlp, reads_per_step, square_sum, train

_model = partial(mlp, (4, 5, 2))  # Linear(4, 5), Tanh, Linear(5, 2), global seed 0
_batches = partial(inputs, shape=(6, 4), seed=3)  # scale={i: factor}; bad ones hold a NaN


# ------------------------------------------------------------------------------ AutoClip


def test_autoclip_threshold_is_the_percentile_of_the_history() -> None:
    """Each bound is numpy's 10th percentile of the finite pre-clip norms so far, the current one included."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), max_norm=AutoClip(percentile=10))
    train(model, opt, _batches(12, scale={3: 50.0}, bad={6}), square_sum)
    history: list[float] = []
    for s in opt.stats:
        if not math.isfinite(s.total_norm):
            assert s.skipped and s.reason == "nonfinite"
            continue
        history.append(s.total_norm)
        expected = float(np.percentile(np.array(history), 10))
        assert s.max_norm == pytest.approx(expected, rel=1e-6)
        assert s.clip_coef == pytest.approx(min(1.0, expected / (s.total_norm + 1e-6)), rel=1e-6)


def test_autoclip_history_is_bounded() -> None:
    """With history=3 the percentile covers only the latest three finite norms."""
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), max_norm=AutoClip(percentile=50, history=3)
    )
    train(model, opt, _batches(8), square_sum)
    norms = [s.total_norm for s in opt.stats]
    for i, s in enumerate(opt.stats):
        window = norms[max(0, i - 2) : i + 1]
        assert s.max_norm == pytest.approx(float(np.percentile(window, 50)), rel=1e-6)


def test_policies_read_nothing_on_the_fused_path() -> None:
    """AutoClip and ZClip keep a fused AdamW update free of host reads."""
    for policy in (AutoClip(), ZClip(warmup_steps=2, skip_spikes=True)):
        model = _model()
        opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), max_norm=policy)
        reads = reads_per_step(model, opt, _batches(6), square_sum)
        assert reads[1:] == [0] * 5, policy


# ------------------------------------------------------------------------------ ZClip


def _zclip_reference(norms: list[float], **kw: Any) -> tuple[list[float], list[bool]]:
    """ZClip (Kumar et al. 2025) in plain Python: the bound and the spike flag of each norm."""
    alpha, z_thresh, warmup = kw.get("alpha", 0.97), kw.get("z_thresh", 2.5), kw.get("warmup_steps", 25)
    eps, max_grad_norm = kw.get("eps", 1e-6), kw.get("max_grad_norm")
    buffer: list[float] = []
    mean = var = 0.0
    bounds, spikes = [], []
    for g in norms:
        if not math.isfinite(g):
            bounds.append(math.inf if max_grad_norm is None else max_grad_norm)
            spikes.append(False)
            continue
        if len(buffer) < warmup:
            buffer.append(g)
            if len(buffer) == warmup:
                mean = sum(buffer) / warmup
                var = sum((x - mean) ** 2 for x in buffer) / warmup
            bound = math.inf
            spike = False
        else:
            std = math.sqrt(var)
            z = (g - mean) / (std + eps)
            spike = z > z_thresh
            bound = mean + z_thresh * std / (z / z_thresh) if spike else math.inf
            clipped = min(g, bound)  # as the zclip package: its own bound, not max_grad_norm
            mean = alpha * mean + (1 - alpha) * clipped
            var = alpha * var + (1 - alpha) * (clipped - mean) ** 2
        if max_grad_norm is not None:
            bound = min(bound, max_grad_norm)
        bounds.append(bound)
        spikes.append(spike)
    return bounds, spikes


@pytest.mark.parametrize("max_grad_norm", [None, 30.0, 0.5])
def test_zclip_matches_reference(max_grad_norm: float | None) -> None:
    """ZClip's bounds (warm-up, EMA, adaptive scaling on spikes) equal a plain-Python implementation."""
    model = _model()
    policy = ZClip(warmup_steps=5, max_grad_norm=max_grad_norm)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), max_norm=policy)
    train(model, opt, _batches(20, scale={9: 30.0, 15: 20.0}, bad={12}), square_sum)
    norms = [s.total_norm for s in opt.stats]
    bounds, spikes = _zclip_reference(norms, warmup_steps=5, max_grad_norm=max_grad_norm)
    assert any(spikes)
    for s, bound in zip(opt.stats, bounds, strict=True):
        if not math.isfinite(s.total_norm):
            assert s.skipped and s.reason == "nonfinite"
        elif math.isinf(bound):
            assert math.isinf(s.max_norm) and s.clip_coef == 1.0  # type: ignore[arg-type]
        else:
            assert s.max_norm == pytest.approx(bound, rel=1e-5)


def test_zclip_skip_spikes() -> None:
    """skip_spikes=True skips a spike window with reason 'spike', leaving parameters untouched."""
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), max_norm=ZClip(warmup_steps=5, skip_spikes=True)
    )
    batches = _batches(12, scale={8: 40.0}, bad={10})
    train(model, opt, batches[:8], square_sum)
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, batches[8:9], square_sum)
    assert opt.step_was_skipped
    assert opt.last_stats is not None and opt.last_stats.reason == "spike"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    train(model, opt, batches[9:], square_sum)
    reasons = [s.reason for s in opt.stats]
    assert reasons[10] == "nonfinite" and reasons[9] is None and reasons[11] is None


# ------------------------------------------------------------------------------ AGC


def _agc_reference(w: np.ndarray, g: np.ndarray, clip: float, eps: float) -> np.ndarray:
    axes = tuple(range(1, w.ndim)) if w.ndim > 1 else None
    w_norm = np.sqrt(np.sum(w.astype(np.float64) ** 2, axis=axes, keepdims=True))
    g_norm = np.sqrt(np.sum(g.astype(np.float64) ** 2, axis=axes, keepdims=True))
    limit = clip * np.maximum(w_norm, eps)
    return g * np.minimum(1.0, limit / np.maximum(g_norm, 1e-6))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_agc_unitwise_matches_reference(accumulation: int) -> None:
    """AGC clips every row of a weight (and a bias as one unit) like the NFNet formula, after the mean."""
    model = _model()
    ref = copy.deepcopy(model)
    captured: list[list[torch.Tensor]] = []

    class Recording(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            captured.append([p.grad.clone() for p in self.param_groups[0]["params"]])
            return super().step(closure)

    opt = ClippedOptimizer(
        Recording(model.parameters(), lr=0.1), max_norm=AGC(clip_factor=0.01), accumulation_steps=accumulation
    )
    batches = _batches(accumulation, scale={0: 5.0})
    for x in batches:
        ref(x).pow(2).sum().backward()
    train(model, opt, batches, square_sum)
    assert opt.last_stats is not None and opt.last_stats.clipped and opt.last_stats.clip_coef == 1.0
    for got, p in zip(captured[0], ref.parameters(), strict=True):
        assert p.grad is not None
        expected = _agc_reference(p.detach().numpy(), p.grad.numpy() / accumulation, 0.01, 1e-3)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-9)


# ------------------------------------------------------------------------------ checkpoints and arguments


@pytest.mark.parametrize("make", [lambda: AutoClip(percentile=20, history=4), lambda: ZClip(warmup_steps=3)])
def test_policy_state_resumes_bit_identically(make: Any) -> None:
    """The policy's state is in the state dict: a resumed run equals the uninterrupted one."""
    batches = _batches(12, scale={7: 30.0})
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), max_norm=make())
    train(model, opt, batches[:5], square_sum)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["clipopt"]["policy"]
    model2 = copy.deepcopy(model)
    opt2 = ClippedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.01), max_norm=make())
    opt2.load_state_dict(sd)
    train(model, opt, batches[5:], square_sum)
    train(model2, opt2, batches[5:], square_sum)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_corrupt_policy_state_is_rejected_untouched() -> None:
    """A policy state of the wrong shape raises ValueError before anything is loaded."""
    model = _model()
    policy = AutoClip(history=4)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), max_norm=policy)
    train(model, opt, _batches(2), square_sum)
    sd = copy.deepcopy(opt.state_dict())
    sd["clipopt"]["policy"] = {"buffer": torch.zeros(9), "index": 1}
    sd["clipopt"]["windows"] = 2
    before = policy.state_dict()["buffer"].clone()
    windows = opt.num_windows
    with pytest.raises(ValueError, match="invalid AutoClip state"):
        opt.load_state_dict(sd)
    torch.testing.assert_close(policy.state_dict()["buffer"], before, equal_nan=True, rtol=0, atol=0)
    assert opt.num_windows == windows


@pytest.mark.parametrize(
    ("factory", "error", "message"),
    [
        (lambda: AutoClip(percentile=0), ValueError, "percentile must be a positive finite number"),
        (lambda: AutoClip(percentile=150), ValueError, "percentile must be in (0, 100], got 150"),
        (lambda: AutoClip(history=0), ValueError, "history must be an int >= 1, got 0"),
        (lambda: ZClip(alpha=1.5), ValueError, "alpha must be in (0, 1), got 1.5"),
        (lambda: ZClip(clip_option="median"), ValueError, "clip_option must be 'adaptive_scaling' or 'mean'"),
        (lambda: ZClip(warmup_steps=0), ValueError, "warmup_steps must be an int >= 1, got 0"),
        (lambda: AGC(clip_factor=-1), ValueError, "clip_factor must be a positive finite number"),
        (lambda: AGC(eps=None), TypeError, "eps must be a positive float, got None"),
    ],
)
def test_bad_policy_arguments(factory: Any, error: type[Exception], message: str) -> None:
    """Bad policy arguments raise errors naming the argument, the value and the fix."""
    with pytest.raises(error, match=re.escape(message)):
        factory()


def test_max_norm_can_change_between_windows() -> None:
    """Assigning opt.max_norm (float, policy, None) takes effect from the next window; bad values raise."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), max_norm=1.0)
    train(model, opt, _batches(1), square_sum)
    opt.max_norm = AutoClip()
    train(model, opt, _batches(1), square_sum)
    opt.max_norm = None
    train(model, opt, _batches(1), square_sum)
    assert opt.stats[0].max_norm == 1.0
    assert opt.stats[2].max_norm is None and opt.stats[2].clip_coef == 1.0
    assert opt.stats[1].max_norm == pytest.approx(opt.stats[1].total_norm, rel=1e-6)
    with pytest.raises(ValueError, match="max_norm must be a positive finite number or None, got -1"):
        opt.max_norm = -1


# ------------------------ policies with LBFGS, low caps, spikes, float64 and non-finite windows


def test_policy_sees_each_window_once_with_lbfgs() -> None:
    """LBFGS re-evaluations are clipped with the window's bound; AutoClip records one norm per step()."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    policy = AutoClip(percentile=50, history=16)
    opt = ClippedOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=5), max_norm=policy)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    opt.step(closure)
    recorded = policy.state_dict()["buffer"]
    assert int((~torch.isnan(recorded)).sum()) == 2
    assert math.isfinite(opt.last_stats.max_norm)  # type: ignore[union-attr, arg-type]


def test_zclip_with_a_low_max_grad_norm_does_not_call_everything_a_spike() -> None:
    """max_grad_norm below the usual norm caps the bound but not ZClip's statistics (as the zclip package).

    Before: the EMAs were fed the capped norm, so nearly every later window became a spike.
    """
    policy = clipopt.ZClip(max_grad_norm=1.0, warmup_steps=10, skip_spikes=True)
    gen = torch.Generator().manual_seed(0)
    norms = 10 + 0.5 * torch.randn(200, generator=gen)
    spikes = 0
    for g in norms:
        bound = policy.threshold(g.clone())
        spike = policy.spike()
        assert spike is not None
        spikes += int(spike.item())
        assert bound.item() <= 1.0
    assert spikes < 10


def test_spike_skips_do_not_count_as_nonfinite() -> None:
    """Skipped spikes do not extend max_consecutive_nonfinite's count (finite gradients never raise)."""
    model = TwoHeads()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-4),
        max_norm=clipopt.ZClip(warmup_steps=3, skip_spikes=True),
        max_consecutive_nonfinite=2,
    )
    for i in range(12):
        scale = 1.0 if i < 6 else 100.0  # the norm level jumps: several spikes in a row
        model.loss("a", torch.full((2, 3), scale)).backward()
        opt.step()
        opt.zero_grad()
    assert [s.reason for s in opt.stats].count("spike") >= 2


def test_agc_float64_parameters() -> None:
    """AGC works on float64 models (the norms are not forced to float32)."""
    model = TwoHeads().double()
    agc = clipopt.AGC(clip_factor=1e-3)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=agc)
    model.loss("a", torch.ones(2, 3, dtype=torch.float64) * 10).backward()
    opt.step()
    assert opt.last_stats is not None and opt.last_stats.clipped


def test_autoclip_nonfinite_windows_keep_the_history() -> None:
    """A non-finite window does not push a finite norm out of AutoClip's ring buffer."""
    policy = clipopt.AutoClip(percentile=50, history=3)
    for v in (1.0, 2.0, 3.0):
        policy.threshold(torch.tensor(v))
    policy.threshold(torch.tensor(float("nan")))
    bound = policy.threshold(torch.tensor(float("inf")))
    assert bound.item() == 2.0
    saved = policy.state_dict()
    policy.threshold(torch.tensor(10.0))
    assert sorted(saved["buffer"].tolist()) == [1.0, 2.0, 3.0]  # a copy, not the live buffer
