"""Gradient accumulation: micro-batch windows against one large batch in plain torch."""

from __future__ import annotations

import copy
import math
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import nn

from clipopt import ClippedOptimizer

from ..helpers import mlp, mse
from ..optim_db import params, pick
from ..strategies import clip_values, max_norms, norm_types

# Plain SGD, SGD with nesterov momentum, and Adam (for-loop implementations).
OPTIMIZERS = pick("SGD-forloop", "SGD-nesterov-forloop", "Adam-forloop")


# make_model(seed): Linear(4, 8), Tanh, Linear(8, 2) in float64
make_model = partial(mlp, (4, 8, 2), dtype=torch.float64)


def make_batch(n: int, gen: torch.Generator, dtype: torch.dtype = torch.float64):
    x = torch.randn(n, 4, generator=gen, dtype=dtype)
    y = torch.randn(n, 2, generator=gen, dtype=dtype)
    return x, y


def assert_params_close(a: nn.Module, b: nn.Module, **tol) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, msg=lambda m, n=name: f"{n}: {m}", **tol)


class RecordingSGD(torch.optim.SGD):
    """A third-party-style optimizer that records the gradients its step() sees."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _reference_update(ref: nn.Module, ref_opt: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor:
    """Plain torch's update from the gradients in ``ref``: clip_grad_norm_ (or only the norm when
    ``max_norm`` is None), step, zero; returns the total norm before clipping."""
    if max_norm is not None:
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    else:
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    ref_opt.step()
    ref_opt.zero_grad()
    return ref_norm


# ---------------------------------------------------------------- mean == one large batch


@pytest.mark.parametrize("info", params(OPTIMIZERS))
@settings(deadline=None)
@given(
    k=st.integers(1, 4),
    batch=st.integers(1, 5),
    windows=st.integers(1, 3),
    max_norm=st.sampled_from([None, 1e-3, 0.05, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_mean_accumulation_equals_large_batch(info, k, batch, windows, max_norm, seed):
    """k equal micro-batches with reduction='mean' give the same parameters as one concatenated batch."""
    model = make_model(seed % 7)
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(info.make(model.parameters()), max_norm=max_norm, accumulation_steps=k)
    ref_opt = info.make(ref.parameters())
    gen = torch.Generator().manual_seed(seed)
    for _ in range(windows):
        micro = [make_batch(batch, gen) for _ in range(k)]
        for x, y in micro:
            mse(model, (x, y)).backward()
            opt.step()
            opt.zero_grad()
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        mse(ref, (x, y)).backward()
        ref_norm = _reference_update(ref, ref_opt, max_norm)
        assert opt.last_stats.micro_batches == k
        assert opt.last_stats.total_norm == pytest.approx(ref_norm.item(), rel=1e-10)
        assert_params_close(model, ref, rtol=1e-9, atol=1e-12)
    assert opt.num_updates == windows


@pytest.mark.parametrize("info", params(OPTIMIZERS))
@settings(deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    max_norm=st.sampled_from([None, 0.02, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_sum_reduction_keeps_sum_of_gradients(info, sizes, max_norm, seed):
    """reduction='sum' equals backward of the sum of the micro-batch losses (micro-batches of any size)."""
    k = len(sizes)
    model = make_model(seed % 5)
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(
        info.make(model.parameters()), max_norm=max_norm, accumulation_steps=k, reduction="sum"
    )
    ref_opt = info.make(ref.parameters())
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        micro = [make_batch(n, gen) for n in sizes]
        for x, y in micro:
            mse(model, (x, y)).backward()
            opt.step()
        opt.zero_grad()
        total = sum(mse(ref, (x, y)) for x, y in micro)
        total.backward()
        ref_norm = _reference_update(ref, ref_opt, max_norm)
        assert opt.last_stats.total_norm == pytest.approx(ref_norm.item(), rel=1e-10)
        assert_params_close(model, ref, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- flush


def test_flush_divides_by_real_count():
    """flush() after 2 of 4 micro-batches applies the mean over those 2 and records micro_batches=2."""
    model = make_model(1)
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), max_norm=None, accumulation_steps=4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(3)
    micro = [make_batch(3, gen) for _ in range(2)]
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in micro:
        mse(model, (x, y)).backward()
        opt.step()
        assert not opt.update_applied
    assert opt.micro_batches == 2
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    opt.flush()
    assert opt.update_applied
    assert opt.micro_batches == 0
    assert opt.last_stats.micro_batches == 2
    assert opt.last_stats.step == 1
    mse(ref, (torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro]))).backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    ref_opt.step()
    assert_params_close(model, ref, rtol=1e-12, atol=1e-14)
    assert opt.last_stats.total_norm == pytest.approx(ref_norm.item(), rel=1e-12)


def test_flush_with_nothing_pending_is_noop():
    """flush() with no pending micro-batch changes neither parameters, state, counters nor stats."""
    model = make_model(2)
    opt = ClippedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), max_norm=1.0, accumulation_steps=2)
    opt.flush()  # before anything happened
    assert opt.num_windows == 0
    assert opt.last_stats is None
    assert len(opt.state) == 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        mse(model, make_batch(4, gen)).backward()
        opt.step()
    opt.zero_grad()
    stats = opt.last_stats
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.optimizer.state_dict())
    opt.flush()
    assert opt.last_stats is stats
    assert opt.num_windows == 1
    assert opt.num_updates == 1
    assert len(opt.stats) == 1
    for p, b in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, b)
    after = opt.optimizer.state_dict()["state"]
    for idx, s in state["state"].items():
        for key, v in s.items():
            assert torch.equal(after[idx][key], v), key


# ---------------------------------------------------------------- zero_grad


@pytest.mark.parametrize("order", ["zero_grad_after_step", "zero_grad_before_backward"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_every_micro_batch_keeps_accumulation(order, set_to_none):
    """Calling zero_grad() on every micro-batch, in either loop order, still accumulates the whole window."""
    k = 3
    model = make_model(4)
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), max_norm=0.1, accumulation_steps=k
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        micro = [make_batch(2, gen) for _ in range(k)]
        for x, y in micro:
            if order == "zero_grad_before_backward":
                opt.zero_grad(set_to_none=set_to_none)
            mse(model, (x, y)).backward()
            opt.step()
            if order == "zero_grad_after_step":
                opt.zero_grad(set_to_none=set_to_none)
        mse(ref, (torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro]))).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        ref_opt.zero_grad()
        assert_params_close(model, ref, rtol=1e-10, atol=1e-13)


def test_zero_grad_clears_only_once_window_closed():
    """zero_grad() mid-window keeps the accumulated gradient; after the boundary it clears it."""
    model = make_model(5)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=None, accumulation_steps=2)
    gen = torch.Generator().manual_seed(1)
    mse(model, make_batch(3, gen)).backward()
    opt.step()
    kept = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    for p, g in zip(model.parameters(), kept, strict=True):
        assert p.grad is not None
        assert torch.equal(p.grad, g)
    mse(model, make_batch(3, gen)).backward()
    opt.step()
    assert opt.update_applied
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    mse(model, make_batch(3, gen)).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # mid-window again: no-op
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# ---------------------------------------------------------------- value clipping


@st.composite
def micro_batch_grads(draw, dtype=np.float32):
    """k lists of gradient arrays sharing the same shapes (one list per micro-batch)."""
    k = draw(st.integers(1, 4))
    shapes = draw(
        st.lists(hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=5), min_size=1, max_size=3)
    )
    elements = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_subnormal=False, width=32)
    return [[draw(hnp.arrays(dtype, s, elements=elements)) for s in shapes] for _ in range(k)]


def _run_value_clip_case(grads_per_mb, clip_value, max_norm, norm_type, dtype, rtol, atol_rel):
    k = len(grads_per_mb)
    params = [torch.zeros(a.shape, dtype=dtype, requires_grad=True) for a in grads_per_mb[0]]
    inner = RecordingSGD(params, lr=1.0)
    opt = ClippedOptimizer(
        inner, max_norm=max_norm, norm_type=norm_type, clip_value=clip_value, accumulation_steps=k
    )
    for mb in grads_per_mb:
        for p, a in zip(params, mb, strict=True):
            g = torch.tensor(a, dtype=dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)  # what autograd does on the next backward
        opt.step()
    assert opt.update_applied
    # plain-torch reference on the MEAN gradient
    ref = [torch.zeros(a.shape, dtype=dtype, requires_grad=True) for a in grads_per_mb[0]]
    for r, i in zip(ref, range(len(ref)), strict=True):
        r.grad = sum(torch.tensor(mb[i], dtype=dtype) for mb in grads_per_mb) / k
    unclipped = [torch.zeros_like(r, requires_grad=True) for r in ref]
    for u, r in zip(unclipped, ref, strict=True):
        u.grad = r.grad.clone()
    ref_total = torch.nn.utils.clip_grad_norm_(unclipped, max_norm, norm_type=norm_type)
    torch.nn.utils.clip_grad_value_(ref, clip_value)
    torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    seen = inner.seen[-1]
    for got, r in zip(seen, ref, strict=True):
        scale = max(float(r.grad.abs().max()), 1e-30)
        torch.testing.assert_close(got, r.grad, rtol=rtol, atol=atol_rel * scale)
    assert opt.last_stats.total_norm == pytest.approx(float(ref_total), rel=rtol * 10, abs=1e-30)


@settings(deadline=None)
@given(grads=micro_batch_grads(), clip_value=clip_values, max_norm=max_norms, norm_type=norm_types)
def test_value_then_norm_clipping_on_mean_float32(grads, clip_value, max_norm, norm_type):
    """float32: clip_value then max_norm on the accumulated mean equals clip_grad_value_ + clip_grad_norm_."""
    _run_value_clip_case(grads, clip_value, max_norm, norm_type, torch.float32, rtol=1e-6, atol_rel=1e-6)


@settings(deadline=None)
@given(grads=micro_batch_grads(), clip_value=clip_values, max_norm=max_norms, norm_type=norm_types)
def test_value_then_norm_clipping_on_mean_float64(grads, clip_value, max_norm, norm_type):
    """float64: clip_value then max_norm on the accumulated mean matches plain torch to ~1e-12."""
    _run_value_clip_case(grads, clip_value, max_norm, norm_type, torch.float64, rtol=1e-12, atol_rel=1e-13)


def test_value_clipping_clipped_flag_and_norm_after_value_clip():
    """The norm bound uses the norm after value clipping; the recorded norm is the one before it."""
    p = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    inner = RecordingSGD([p], lr=1.0)
    opt = ClippedOptimizer(inner, max_norm=3.0, clip_value=2.0, accumulation_steps=2)
    p.grad = torch.tensor([10.0, -10.0, 1.0, 0.0], dtype=torch.float64)
    opt.step()
    p.grad.add_(torch.tensor([10.0, -10.0, 1.0, 0.0], dtype=torch.float64))
    opt.step()
    # mean = [10, -10, 1, 0]; value clip -> [2, -2, 1, 0] (norm 3); coef = 3 / (3 + 1e-6)
    coef = min(1.0, 3.0 / (3.0 + 1e-6))
    expected = torch.tensor([2.0, -2.0, 1.0, 0.0], dtype=torch.float64) * coef
    torch.testing.assert_close(inner.seen[-1][0], expected, rtol=1e-14, atol=0)
    assert opt.last_stats.total_norm == pytest.approx(math.sqrt(201.0), rel=1e-14)
    assert opt.last_stats.clip_coef == pytest.approx(coef, rel=1e-14)
    assert opt.last_stats.clipped is True


# ---------------------------------------------------------------- signals and statistics


def test_update_applied_and_micro_batches_counter():
    """update_applied is False on micro-batch calls and True on the boundary; micro_batches counts."""
    model = make_model(6)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)
    gen = torch.Generator().manual_seed(2)
    assert opt.micro_batches == 0
    assert not opt.update_applied
    seen = []
    for _ in range(7):
        before = [p.detach().clone() for p in model.parameters()]
        mse(model, make_batch(2, gen)).backward()
        opt.step()
        changed = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert changed == opt.update_applied
        seen.append((opt.update_applied, opt.micro_batches))
        opt.zero_grad()
    assert seen == [(False, 1), (False, 2), (True, 0), (False, 1), (False, 2), (True, 0), (False, 1)]
    assert opt.num_updates == 2
    assert opt.num_windows == 2
    assert not opt.step_was_skipped


def test_last_stats_fields_against_plain_torch():
    """step, micro_batches, total_norm, clip_coef (plain Python formula) and clipped match plain torch."""
    k = 2
    model = make_model(8)
    ref = copy.deepcopy(model)
    max_norms_seq = [1e-3, 1e3, 0.05, 1e3]
    gen = torch.Generator().manual_seed(9)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1e-3, accumulation_steps=k)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for window, max_norm in enumerate(max_norms_seq, start=1):
        opt.max_norm = max_norm
        micro = [make_batch(3, gen) for _ in range(k)]
        for x, y in micro:
            mse(model, (x, y)).backward()
            opt.step()
            opt.zero_grad()
        mse(ref, (torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro]))).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item()
        ref_opt.step()
        ref_opt.zero_grad()
        s = opt.last_stats
        coef = min(1.0, max_norm / (norm + 1e-6))
        assert s.step == window
        assert s.micro_batches == k
        assert s.total_norm == pytest.approx(norm, rel=1e-10)
        assert isinstance(s.total_norm, float)
        assert s.clip_coef == pytest.approx(coef, rel=1e-10)
        assert s.clipped is (coef < 1.0)
        assert s.skipped is False
        assert s.reason is None
        assert_params_close(model, ref, rtol=1e-10, atol=1e-13)
    assert [s.step for s in opt.stats] == [1, 2, 3, 4]
    assert [s.clipped for s in opt.stats] == [True, False, True, False]


def test_clip_coef_is_one_when_norm_clipping_off():
    """With max_norm=None the recorded clip_coef is 1.0 and clipped is False."""
    model = make_model(3)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=None)
    mse(model, make_batch(4, torch.Generator().manual_seed(0))).backward()
    opt.step()
    assert opt.last_stats.clip_coef == 1.0
    assert opt.last_stats.clipped is False


def test_stats_history_is_bounded():
    """opt.stats keeps only the latest stats_history windows, last one being last_stats."""
    model = make_model(10)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), accumulation_steps=2, stats_history=3
    )
    gen = torch.Generator().manual_seed(4)
    for _ in range(11):  # 5 full windows + 1 pending micro-batch
        mse(model, make_batch(2, gen)).backward()
        opt.step()
        opt.zero_grad()
    assert len(opt.stats) == 3
    assert [s.step for s in opt.stats] == [3, 4, 5]
    assert opt.stats[-1] is opt.last_stats
    assert opt.micro_batches == 1
