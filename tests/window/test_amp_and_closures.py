"""GradScaler, low-precision gradients and step(closure) through ClippedOptimizer."""

from __future__ import annotations

import copy
import math
from functools import partial

import pytest
import torch
from torch import nn

from clipopt import ClippedOptimizer

from ..helpers import TwoHeads, mlp, mse, pairs
from ..optim_db import params, pick

INIT_SCALE = 2.0**8


make_model = partial(mlp, (5, 16, 3), act=nn.ReLU)  # make_model(seed)


def make_batch(i: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return pairs(1, (n, 5), (n, 3), seed=1000 + i, scale=3)[0]


INNER = pick("Adam-forloop", "AdamW-fused")  # a for-loop and a fused inner optimizer


def scaler(**kw) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, **kw)


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, msg=lambda m, n=name: f"{n}: {m}")


def assert_same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for idx in sa:
        for key in sa[idx]:
            torch.testing.assert_close(sa[idx][key], sb[idx][key], msg=lambda m, k=key: f"{k}: {m}")


def poison(model: nn.Module) -> None:
    """Inject an inf into one (scaled) gradient, as an fp16 overflow would."""
    next(model.parameters()).grad[0, 0] = float("inf")


# ---------------------------------------------------------------- GradScaler


@pytest.mark.parametrize("inner", params(INNER))
def test_scaler_matches_manual_amp_loop(inner):
    """scaler= equals the manual scale/backward/unscale_/clip_grad_norm_/scaler.step/update loop."""
    max_norm = 0.5
    model = make_model()
    ref = copy.deepcopy(model)
    sc, ref_sc = scaler(), scaler()
    opt = ClippedOptimizer(inner.make(model.parameters()), max_norm=max_norm, scaler=sc)
    ref_opt = inner.make(ref.parameters())
    overflow_at = 3
    for i in range(7):
        x, y = make_batch(i)
        sc.scale(mse(model, (x, y))).backward()
        if i == overflow_at:
            poison(model)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()

        ref_sc.scale(mse(ref, (x, y))).backward()
        if i == overflow_at:
            poison(ref)
        ref_sc.unscale_(ref_opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_sc.step(ref_opt)
        ref_sc.update()
        ref_opt.zero_grad()

        assert sc.get_scale() == ref_sc.get_scale()
        assert_same_params(model, ref)
        s = opt.last_stats
        if i == overflow_at:
            assert s.skipped is True
            assert s.reason == "overflow"
            assert opt.step_was_skipped
            assert not opt.update_applied
            assert not math.isfinite(s.total_norm)
            assert sc.get_scale() == INIT_SCALE / 2
            for p, b in zip(model.parameters(), before, strict=True):
                assert torch.equal(p, b)
        else:
            assert s.skipped is False
            assert s.reason is None
            assert opt.update_applied
            assert s.total_norm == pytest.approx(ref_norm.item(), rel=1e-5)
    assert_same_state(opt.optimizer, ref_opt)
    assert opt.num_skipped == 1
    assert opt.num_updates == 6


@pytest.mark.parametrize("inner", params(INNER))
def test_scaler_overflow_from_huge_loss(inner):
    """A loss that overflows once scaled is skipped with reason 'overflow' and the scale backs off."""
    model = make_model(2)
    sc = scaler()
    opt = ClippedOptimizer(inner.make(model.parameters()), max_norm=1.0, scaler=sc)
    x, y = make_batch(0)
    sc.scale(mse(model, (x, y))).backward()
    opt.step()
    opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.optimizer.state_dict()["state"])
    sc.scale(mse(model, (x, y)) * 3e38).backward()
    opt.step()
    opt.zero_grad()
    assert opt.last_stats.skipped and opt.last_stats.reason == "overflow"
    assert sc.get_scale() == INIT_SCALE / 2
    for p, b in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, b)
    after = opt.optimizer.state_dict()["state"]
    for idx, st in state.items():
        for key, v in st.items():
            assert torch.equal(after[idx][key], v), key
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("inner", params(INNER))
def test_scaler_with_accumulation_updates_only_at_boundaries(inner):
    """With accumulation_steps=2 the scaler unscales/steps/updates once per window, like a one-batch loop."""
    model = make_model(3)
    ref = copy.deepcopy(model)
    sc, ref_sc = scaler(growth_interval=1), scaler(growth_interval=1)  # scale doubles at every update()
    opt = ClippedOptimizer(inner.make(model.parameters()), max_norm=0.5, accumulation_steps=2, scaler=sc)
    ref_opt = inner.make(ref.parameters())
    for w in range(3):
        xs, ys = zip(*(make_batch(10 * w + j, n=4) for j in range(2)), strict=True)
        for j in range(2):
            sc.scale(mse(model, (xs[j], ys[j]))).backward()
            opt.step()
            opt.zero_grad()
            if j == 0:
                assert sc.get_scale() == INIT_SCALE * 2**w, "scaler updated mid-window"
                assert not opt.update_applied
        ref_sc.scale(mse(ref, (torch.cat(xs), torch.cat(ys)))).backward()
        ref_sc.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_sc.step(ref_opt)
        ref_sc.update()
        ref_opt.zero_grad()
        assert opt.update_applied
        assert sc.get_scale() == ref_sc.get_scale() == INIT_SCALE * 2 ** (w + 1)
        assert_same_params(model, ref)
    assert opt.num_updates == 3


def test_closure_with_scaler_raises():
    """step(closure) on a wrapper with scaler= raises TypeError before touching anything."""
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler())
    calls = []

    def closure():
        calls.append(1)
        return mse(model, make_batch(0))

    with pytest.raises(TypeError, match="closure"):
        opt.step(closure)
    assert calls == []
    assert opt.micro_batches == 0


# ---------------------------------------------------------------- low-precision gradients


def test_fp16_grads_with_norm_above_fp16_max_are_finite_and_applied():
    """fp16 gradients whose norm exceeds 65504 give a finite float32 total_norm and are not skipped."""
    p = torch.zeros(100, dtype=torch.float16, requires_grad=True)
    opt = ClippedOptimizer(torch.optim.SGD([p], lr=1.0), max_norm=1.0)
    p.grad = torch.full((100,), 1e4, dtype=torch.float16)
    assert not torch.isfinite(torch.nn.utils.get_total_norm([p.grad]))  # what plain torch gets
    opt.step()
    s = opt.last_stats
    assert not s.skipped
    assert opt.update_applied
    assert s.total_norm == pytest.approx(1e5, rel=1e-6)  # float64: sqrt(100) * 1e4
    assert s.clip_coef == pytest.approx(1e-5, rel=1e-5)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p, torch.full((100,), -0.1, dtype=torch.float16), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_low_precision_norm_computed_in_float32(dtype, norm_type):
    """The recorded norm of fp16/bf16 gradients matches a float64 reference to float32 precision."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(30, 20), (20,), (7, 3)]
    params = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in shapes]
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.1), max_norm=1.0, norm_type=norm_type)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 300).to(dtype)
    ref = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in params]), norm_type)
    opt.step()
    assert not opt.last_stats.skipped
    assert opt.last_stats.total_norm == pytest.approx(ref.item(), rel=2e-6)
    assert all(torch.isfinite(p).all() for p in params)


def test_fp16_accumulated_mean_norm_is_finite():
    """With accumulation, the mean of fp16 micro-batch grads is measured in float32 and applied."""
    p = torch.zeros(64, dtype=torch.float16, requires_grad=True)
    opt = ClippedOptimizer(torch.optim.SGD([p], lr=1.0), max_norm=2.0, accumulation_steps=2)
    p.grad = torch.full((64,), 9000.0, dtype=torch.float16)
    opt.step()
    p.grad.add_(torch.full((64,), 11000.0, dtype=torch.float16))
    opt.step()
    s = opt.last_stats
    assert not s.skipped
    assert s.total_norm == pytest.approx(8 * 10000.0, rel=1e-3)  # fp16 sum is rounded
    torch.testing.assert_close(p, torch.full((64,), -0.25, dtype=torch.float16), rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------- closures


def test_sgd_closure_returns_loss_and_matches_reference():
    """SGD.step(closure) through the wrapper returns the closure's loss and equals closure + clip + step."""
    model = make_model(4)
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), max_norm=0.3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i in range(4):
        x, y = make_batch(i)

        def closure(m=model, x=x, y=y):
            opt.zero_grad()
            loss = mse(m, (x, y))
            loss.backward()
            return loss

        got = opt.step(closure)
        ref_opt.zero_grad()
        ref_loss = mse(ref, (x, y))
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        ref_opt.step()
        assert isinstance(got, torch.Tensor)
        assert got.item() == ref_loss.item()
        assert opt.update_applied
        assert_same_params(model, ref)


def _least_squares(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(30, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(30, generator=gen, dtype=torch.float64)
    return a, b


class RecordingLBFGS(torch.optim.LBFGS):
    """Records the norm of every flat gradient LBFGS reads (first and re-evaluated ones)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.grad_norms: list[float] = []

    def _gather_flat_grad(self):
        flat = super()._gather_flat_grad()
        self.grad_norms.append(flat.norm().item())
        return flat


def _lbfgs_run(max_norm, calls, **lbfgs_kw):
    a, b = _least_squares()
    x = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    inner = RecordingLBFGS([x], lr=1.0, **lbfgs_kw)
    opt = ClippedOptimizer(inner, max_norm=max_norm)

    def closure():
        opt.zero_grad()
        loss = ((a @ x - b) ** 2).sum()
        loss.backward()
        return loss

    losses = [opt.step(closure) for _ in range(calls)]
    return x.detach(), inner, opt, losses


def test_lbfgs_converges_on_least_squares():
    """LBFGS with a closure through the wrapper reaches the least-squares solution."""
    a, b = _least_squares()
    solution = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1)
    x, _, opt, losses = _lbfgs_run(
        max_norm=1.0,
        calls=5,
        max_iter=20,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
    )
    torch.testing.assert_close(x, solution, rtol=1e-6, atol=1e-8)
    assert all(isinstance(v, torch.Tensor) for v in losses)
    assert losses[-1].item() < losses[0].item()
    assert opt.num_updates == 5


def test_lbfgs_reevaluated_gradients_are_clipped():
    """Every gradient LBFGS reads, re-evaluations included, is clipped; tiny max_norm moves x less."""
    max_norm = 1e-3
    x_clip, inner, opt, _ = _lbfgs_run(max_norm=max_norm, calls=1, max_iter=5)
    x_free, free_inner, _, _ = _lbfgs_run(max_norm=None, calls=1, max_iter=5)
    assert len(inner.grad_norms) > 1, "LBFGS did not re-evaluate the closure"
    assert max(inner.grad_norms) <= max_norm * (1 + 1e-9)
    assert max(free_inner.grad_norms) > 1.0  # the unclipped gradients are much larger
    assert x_clip.norm() < x_free.norm()
    assert opt.last_stats.total_norm == pytest.approx(free_inner.grad_norms[0], rel=1e-12)


# -------------------------------------------------------------------- GradScaler after an error


def test_scaler_recovers_after_an_error_inside_a_window() -> None:
    """An exception between unscale_ and the step still updates the scaler, so the next window works."""
    model = TwoHeads()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    class Failing(torch.optim.SGD):
        fail = True

        def step(self, closure: object = None) -> object:
            if Failing.fail:
                Failing.fail = False
                raise RuntimeError("boom")
            return super().step(closure)  # type: ignore[arg-type]

    opt = ClippedOptimizer(Failing(model.parameters(), lr=0.1), scaler=scaler)
    scaler.scale(model.loss("a", torch.ones(2, 3))).backward()
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    opt.zero_grad()
    scaler.scale(model.loss("a", torch.ones(2, 3))).backward()
    opt.step()
    assert opt.update_applied
