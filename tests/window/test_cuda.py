"""The CUDA paths: sync-free fused updates, fused CUDA kernels, float16/bfloat16, AutoClip's nanquantile.

Every test here needs a CUDA device and is skipped without one (they are marked ``cuda``; run them
with ``python -m pytest -m cuda``). On CPU the same claims are tested through intercepted host reads
(tests/window/test_sync.py); here ``torch.cuda.set_sync_debug_mode("error")`` makes any synchronising call
(a device-to-host read, a blocking host-to-device copy, a stream synchronisation) raise.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import pytest
import torch

import clipopt
from clipopt import AutoClip, ClippedOptimizer, ZClip

from ..helpers import mlp
from ..markers import needs_cuda
from ..optim_db import get

pytestmark = needs_cuda

DEVICE = "cuda"
#: the fused optim_db entries run here, and the constructor arguments they replace
FUSED: dict[str, dict[str, Any]] = {
    "AdamW-fused": {"lr": 1e-2, "weight_decay": 0.01},  # AdamW's default weight decay
    "Adam-fused": {"lr": 1e-2},
    "SGD-momentum-fused": {"lr": 1e-2},
}
POLICIES: dict[str, Callable[[], float | clipopt.ClipPolicy]] = {
    "float": lambda: 0.5,
    "AutoClip": lambda: AutoClip(percentile=50, history=16),
    "ZClip": lambda: ZClip(warmup_steps=2),
}


@pytest.fixture(autouse=True)
def _sync_debug_off() -> Iterator[None]:
    """Whatever a test does, the sync debug mode is off after it."""
    yield
    torch.cuda.set_sync_debug_mode(0)


def _fused(name: str, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The fused optimizer ``name`` (a key of FUSED) over ``params``."""
    return get(name).make(params, **FUSED[name])


_model = partial(mlp, (16, 64, 4), device=DEVICE)  # Linear(16, 64), Tanh, Linear(64, 4), global seed 0


def _backward(model: torch.nn.Module, seed: int, bad: bool = False) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(32, 16, device=DEVICE, generator=gen, dtype=next(model.parameters()).dtype)
    loss = 100.0 * model(x).float().pow(2).mean()  # large enough that max_norm clips
    if bad:
        loss = loss * math.nan
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


# ----------------------------------------------------------------------------- no host sync


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", list(FUSED))
def test_clipped_fused_update_does_not_sync(name: str, policy: str) -> None:
    """Clipped fused updates (accumulation 2, one skipped window) run under sync debug mode "error"."""
    model = _model()
    opt = ClippedOptimizer(
        _fused(name, model.parameters()), max_norm=POLICIES[policy](), accumulation_steps=2
    )
    for i in range(4):  # two windows first: the first update reads the host once (no optimizer state yet)
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for i in range(6):  # three windows; the second holds a non-finite micro-batch
        loss = _backward(model, 10 + i, bad=i == 2)
        opt.step(loss=loss)
        opt.zero_grad()
    torch.cuda.set_sync_debug_mode(0)
    assert (opt.num_updates, opt.num_skipped) == (4, 1)
    assert [s.skipped for s in list(opt.stats)[-3:]] == [False, True, False]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", list(FUSED))
def test_unclipped_accumulated_fused_update_does_not_sync(name: str) -> None:
    """max_norm=None with mean accumulation (a Python grad_scale of 1/2 for the kernel) under sync
    debug mode "error": the scale is made on the device, not copied from the host."""
    model = _model()
    opt = ClippedOptimizer(_fused(name, model.parameters()), max_norm=None, accumulation_steps=2)
    for i in range(4):
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for i in range(4):
        _backward(model, 10 + i)
        opt.step()
        opt.zero_grad()
    torch.cuda.set_sync_debug_mode(0)
    assert (opt.num_updates, opt.num_skipped) == (4, 0)


def test_fused_update_with_grad_scaler_does_not_sync() -> None:
    """With a GradScaler and float16 autocast, a fused update under sync debug mode "error" does not sync."""
    model = _model()
    scaler = torch.amp.GradScaler(DEVICE)
    opt = ClippedOptimizer(_fused("AdamW-fused", model.parameters()), max_norm=1.0, scaler=scaler)

    def window(seed: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss = model(torch.randn(32, 16, device=DEVICE, generator=gen)).float().pow(2).mean()
        scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()

    for i in range(2):
        window(i)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for i in range(3):
        window(10 + i)
    torch.cuda.set_sync_debug_mode(0)
    assert opt.num_updates + opt.num_skipped == 5


# ----------------------------------------------------------------------------- fused kernels


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_cuda_update_equals_clip_grad_norm_then_step(name: str) -> None:
    """clipopt with a fused CUDA optimizer applies what clip_grad_norm_ followed by the same step applies."""
    model = _model()
    twin = copy.deepcopy(model)
    opt = ClippedOptimizer(_fused(name, model.parameters()), max_norm=0.5)
    ref = _fused(name, twin.parameters())
    for i in range(5):
        _backward(model, i)
        opt.step()
        opt.zero_grad()
        _backward(twin, i)
        norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
        ref.step()
        ref.zero_grad()
        assert opt.last_stats is not None
        assert opt.last_stats.clipped
        assert opt.last_stats.total_norm == pytest.approx(float(norm), rel=1e-5)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(FUSED))
def test_fused_cuda_skip_leaves_everything_bit_identical(name: str) -> None:
    """A non-finite window under a fused CUDA optimizer changes no parameter and no state tensor."""
    model = _model()
    opt = ClippedOptimizer(_fused(name, model.parameters()), max_norm=0.5)
    for i in range(3):
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in opt.optimizer.state[p].items()} for p in model.parameters()}
    _backward(model, 99, bad=True)
    opt.step()
    opt.zero_grad()
    assert opt.step_was_skipped and opt.last_stats is not None and opt.last_stats.reason == "nonfinite"
    for p, before in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, before)
        for k, v in opt.optimizer.state[p].items():
            assert torch.equal(v, state[id(p)][k]), k


# ----------------------------------------------------------------------------- float16 / bfloat16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gradient_norm_is_float32_accumulated(dtype: torch.dtype) -> None:
    """Half-precision gradients whose norm exceeds float16's range (elements finite) are clipped, not skipped.

    The norm is accumulated in float32: torch's own clip_grad_norm_ would give inf for float16 here.
    """
    p = torch.nn.Parameter(torch.zeros(1024, device=DEVICE, dtype=dtype))
    opt = ClippedOptimizer(torch.optim.SGD([p], lr=1.0), max_norm=1.0)
    p.grad = torch.full_like(p, 60000.0)  # finite in float16 (max 65504); the norm is 60000 * 32
    opt.step()
    stats = opt.last_stats
    assert stats is not None and not stats.skipped and stats.clipped
    expected = float(torch.full((1024,), 60000.0, dtype=dtype).double().norm())
    assert stats.total_norm == pytest.approx(expected, rel=1e-5)
    step = -p.detach().double()  # what SGD applied: the clipped gradient
    assert float(step.norm()) == pytest.approx(1.0, rel=1e-2)  # half-precision rounding of the result


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["AdamW-fused", "Adam-fused"])
def test_fused_half_parameters_train(dtype: torch.dtype, name: str) -> None:
    """A half-precision model with a fused CUDA optimizer: updates are applied, clipped, and stay finite."""
    model = _model(dtype=dtype)
    opt = ClippedOptimizer(_fused(name, model.parameters()), max_norm=0.5)
    start = [p.detach().clone() for p in model.parameters()]
    for i in range(5):
        _backward(model, i)
        opt.step()
        opt.zero_grad()
    assert opt.num_updates == 5 and all(s.clipped for s in opt.stats)
    assert all(math.isfinite(s.total_norm) for s in opt.stats)
    for p, before in zip(model.parameters(), start, strict=True):
        assert p.dtype == dtype and torch.isfinite(p).all() and not torch.equal(p, before)


def test_grad_scaler_overflow_is_skipped_on_cuda() -> None:
    """A float16 overflow (a huge loss scale) is a skip with reason "overflow"; the scaler backs off."""
    model = _model()
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**100)
    opt = ClippedOptimizer(_fused("AdamW-fused", model.parameters()), max_norm=1.0, scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast(DEVICE, dtype=torch.float16):
        loss = model(torch.randn(32, 16, device=DEVICE)).float().pow(2).mean()
    scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad()
    assert opt.last_stats is not None and opt.last_stats.reason == "overflow"
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert scaler.get_scale() == 2.0**99


def test_bfloat16_autocast_without_scaler() -> None:
    """bfloat16 autocast needs no scaler: every window applies a clipped update."""
    model = _model()
    opt = ClippedOptimizer(_fused("AdamW-fused", model.parameters()), max_norm=0.5)
    for i in range(4):
        gen = torch.Generator(device=DEVICE).manual_seed(i)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = 100.0 * model(torch.randn(32, 16, device=DEVICE, generator=gen)).float().pow(2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step(loss=loss)
        opt.zero_grad()
    assert (opt.num_updates, opt.num_skipped) == (4, 0)
    assert all(s.clipped and math.isfinite(s.loss) for s in opt.stats)


# ----------------------------------------------------------------------------- AutoClip


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), written out."""
    xs = sorted(values)
    pos = q / 100.0 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def test_autoclip_nanquantile_on_cuda() -> None:
    """AutoClip's threshold on CUDA is the percentile of the finite norms so far (nan slots and skipped
    windows ignored, the ring buffer keeping the latest ``history``), as a hand-written percentile gives."""
    p = torch.nn.Parameter(torch.zeros(4, device=DEVICE))
    policy = AutoClip(percentile=30, history=5)
    opt = ClippedOptimizer(torch.optim.SGD([p], lr=0.0), max_norm=policy)
    norms = [3.0, 1.0, math.nan, 4.0, 1.5, math.inf, 9.0, 2.0, 6.0, 5.0, 3.5]
    history: list[float] = []
    for norm in norms:
        p.grad = torch.tensor([norm, 0.0, 0.0, 0.0], device=DEVICE)
        opt.step()
        stats = opt.last_stats
        assert stats is not None
        if math.isfinite(norm):
            history = [*history, norm][-5:]
            assert not stats.skipped
            assert stats.max_norm == pytest.approx(_percentile(history, 30), rel=1e-6), norm
        else:
            assert stats.skipped and stats.reason == "nonfinite"
    assert policy.state_dict()["buffer"].device.type == "cuda"
