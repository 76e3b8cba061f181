"""A norm that cannot overflow (#35, SPEC §11): the total norm of finite gradients is finite.

torch's float32 norms sum the p-th powers in float32 (on the CPU too: ten elements of 1e20 have
an ``inf`` 2-norm), so a window of finite gradients whose norm exceeds about 1.8e19 used to be
skipped (reason ``"norm_overflow"``).  Now such a norm is taken again, max-scaled in float64
(``functional.finite_total``), and the window is clipped and applied on every path: the plain
fused and host closes, the general close, per-group clipping; the update's norm alike.  Where
torch's norm is finite it is kept bit for bit.  References are computed here in Python floats
(float64), independently of clipopt's kernels.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from clipopt import AGC, AdaGC, AutoClip, ClippedOptimizer, CSVLogger, StableSPAM, UpdateClip, ZClip
from clipopt import functional as F

from ..helpers import spawn_job
from ..hostreads import count_host_reads
from ..markers import needs_gloo

NORM_TYPES = (1.0, 2.0, 3.0, math.inf)

#: Several tensors of finite elements around 1e20: each tensor's float32 2-norm (and 3-norm) is inf.
SHAPES = [(10,), (3, 4), (5,)]


def _reference(grads: list[torch.Tensor], p: float) -> float:
    """The p-norm of ``grads`` in Python floats (float64): the largest element exactly for p = inf,
    else the sum of ``(|x| / m) ** p`` times ``m`` (``m``: the largest element; no overflow)."""
    values = [abs(float(x)) for g in grads for x in g.reshape(-1).tolist()]
    m = max(values)
    if p == math.inf or m == 0.0:
        return m
    return m * math.fsum((v / m) ** p for v in values) ** (1.0 / p)


def _bound(grads: list[torch.Tensor]) -> float:
    """The relative error allowed against :func:`_reference`: clipopt's float64 norm rounds at most
    once per element and a few times more (``2**-53`` each, as the reference does), then once to
    float32 (``2**-24``); a factor 2 for the reference's own rounding."""
    n = sum(g.numel() for g in grads)
    return 2**-24 + 2 * (n + 8) * 2**-53


def _huge(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * 1e20 for shape in SHAPES]


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]


# ---------------------------------------------------------------- the kernel: bit for bit, or finite


@given(
    p=st.sampled_from(NORM_TYPES),
    exponent=st.integers(min_value=-20, max_value=11),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_a_norm_that_does_not_overflow_is_torchs_bit_for_bit(p: float, exponent: int, seed: int) -> None:
    """On ordinary gradients (elements up to ~1e12: no 3-norm overflows) the total norm, and the
    per-group form's total, are ``torch.nn.utils.get_total_norm``'s (what ``clip_grad_norm_``
    returns), bit for bit, for p = 1, 2, 3, inf."""
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=gen) * 10.0**exponent for shape in SHAPES]
    want = torch.nn.utils.get_total_norm(grads, p)
    assert torch.isfinite(want)
    assert torch.equal(F.get_total_norm(grads, p), want)
    _, total, _ = F.finite_group_norms(F.get_norms(grads, p), [1, 2], grads, p)
    assert torch.equal(total, want)


@pytest.mark.parametrize("p", NORM_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_finite_huge_gradients_have_a_finite_norm(p: float, seed: int) -> None:
    """Elements ~1e20 in several tensors: torch's float32 norm is inf for p = 2 and 3 (every tensor's
    own norm overflows), clipopt's is finite and equals the float64 reference within the derived
    bound, through the total-norm kernel and the per-group one (each group's norm too).  For p = 1
    and inf nothing overflows: torch's norm, bit for bit."""
    grads = _huge(seed)
    parts = (grads[:1], grads[1:])
    norms, total, groups = F.finite_group_norms(F.get_norms(grads, p), [1, 2], grads, p)
    got = F.get_total_norm(grads, p)
    assert got.dtype == torch.float32 and torch.isfinite(norms).all()
    if p in (1.0, math.inf):
        want = torch.nn.utils.get_total_norm(grads, p)
        assert torch.equal(got, want) and torch.equal(total, want)
        assert groups.tolist() == [torch.nn.utils.get_total_norm(g, p).item() for g in parts]
        return
    assert torch.nn.utils.get_total_norm(grads, p) == math.inf
    assert all(torch.linalg.vector_norm(g, p) == math.inf for g in grads)
    assert float(got) == pytest.approx(_reference(grads, p), rel=_bound(grads), abs=0)
    assert float(total) == pytest.approx(_reference(grads, p), rel=_bound(grads), abs=0)
    for group, want_group in zip(groups.tolist(), parts, strict=True):
        assert group == pytest.approx(_reference(want_group, p), rel=_bound(want_group), abs=0)


@pytest.mark.parametrize("p", [2.0, 3.0])
def test_each_gradients_norm_is_torchs_or_finite(p: float) -> None:
    """``get_norms`` (per-tensor norms: per-group clipping, per-tensor policies, sharded shards):
    an ordinary gradient's norm is torch's bit for bit beside a huge one, whose own norm (inf in
    float32) is finite and the float64 reference's."""
    grads = [*_huge(2)[:2], torch.randn(7)]
    got = F.get_norms(grads, p)
    assert torch.equal(got[2], torch.linalg.vector_norm(grads[2], p))
    for n, g in zip(got[:2].tolist(), grads[:2], strict=True):
        assert torch.linalg.vector_norm(g, p) == math.inf
        assert n == pytest.approx(_reference([g], p), rel=_bound([g]), abs=0)


def test_norms_of_norms_that_overflow_only_together_are_finite() -> None:
    """Each tensor's norm is finite (1.5e19 < 1.8e19) but their float32 combination overflows:
    the group functions take it max-scaled (``functional.group_norms``, ``shared_norm``)."""
    grads = [torch.full((1,), 1.5e19) for _ in range(4)]
    norms = F.get_norms(grads)
    assert torch.isfinite(norms).all() and torch.linalg.vector_norm(norms) == math.inf
    assert float(F.group_norms(norms, [4], 2.0)[0]) == pytest.approx(3e19, rel=_bound(grads))
    assert float(F.shared_norm(norms, [True] * 4, 2.0)) == pytest.approx(3e19, rel=_bound(grads))
    assert float(F.get_total_norm(grads)) == pytest.approx(3e19, rel=_bound(grads))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_element_keeps_a_nonfinite_norm(bad: float) -> None:
    """Beside huge finite elements, a nan or an inf element leaves the norm as torch gives it."""
    grads = _huge(0)
    grads[1][0, 2] = bad
    want = torch.nn.utils.get_total_norm(grads)
    got = F.get_total_norm(grads)
    assert not math.isfinite(float(got))
    assert math.isnan(float(got)) == math.isnan(float(want))


def test_a_norm_beyond_float32s_range_stays_inf() -> None:
    """Finite elements whose norm (4.2e38) no float32 holds: inf, as torch's (reason "norm_overflow")."""
    grads = [torch.tensor([3e38, -3e38, 1.0])]
    assert F.get_total_norm(grads) == math.inf == torch.nn.utils.get_total_norm(grads)


def _float64_grads(kind: str) -> list[torch.Tensor]:
    """Gradients of float64 elements ~1e160 whose own float64 2-norm overflows (squares ~1e320):
    dense, sparse COO (coalesced: its values are the gradient's own) or complex128 (its
    ``view_as_real`` is the gradient's own)."""
    gen = torch.Generator().manual_seed(4)
    dense = [torch.randn(shape, generator=gen, dtype=torch.float64) * 1e160 for shape in SHAPES]
    if kind == "sparse":
        return [g.to_sparse().coalesce() for g in dense]
    if kind == "complex":
        return [torch.complex(g, g.flip(0)) for g in dense]
    return dense


@pytest.mark.parametrize("kind", ["dense", "sparse", "complex"])
def test_a_float64_norm_taken_again_leaves_the_gradients_as_they_are(kind: str) -> None:
    """A float64 norm that overflows is taken again from a copy: the gradients (float64, whose
    ``double()`` is themselves) keep their elements, and the norm is the reference's.  Before: each
    was divided in place by its largest element (#35 review)."""
    grads = _float64_grads(kind)
    before = [g.clone() for g in grads]
    flat = [torch.view_as_real(g) if g.is_complex() else g for g in grads]
    flat = [g.coalesce().values() if g.is_sparse else g for g in flat]
    assert all(torch.linalg.vector_norm(g) == math.inf for g in flat)  # torch's own norm overflows
    got = F.get_total_norm(grads)
    F.get_norms(grads)
    assert float(got) == pytest.approx(_reference(flat, 2.0), rel=_bound(flat), abs=0)
    for g, b in zip(grads, before, strict=True):
        same = torch.equal(g.to_dense(), b.to_dense()) if g.is_sparse else torch.equal(g, b)
        assert same


# ---------------------------------------------------------------- the window: clipped and applied


def _sgd(**kw: Any) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    return lambda ps: torch.optim.SGD(ps, lr=1.0, **kw)


#: Each path of a window's close, as (inner optimizer, wrapper options): the plain fused close, the
#: plain host close (foreach and for-loop), the general close with a logger (fused and host steps),
#: per-layer rows (the candidate bad row's norm pass).
PATHS: dict[str, tuple[Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], dict[str, Any]]] = {
    "plain-fused": (_sgd(fused=True), {}),
    "plain-host": (_sgd(), {}),
    "plain-for-loop": (_sgd(foreach=False), {}),
    "general-fused": (_sgd(fused=True), {"csv": True}),
    "general-host": (_sgd(), {"csv": True}),
    "rows-fused": (_sgd(fused=True), {"layer_stats": 1}),
    "mean-accumulation": (_sgd(fused=True), {"accumulation_steps": 2, "reduction": "mean"}),
}


def _wrapper(path: str, params: list[torch.nn.Parameter], tmp_path: Path) -> ClippedOptimizer:
    make, options = PATHS[path]
    options = dict(options)
    if options.pop("csv", False):
        options["loggers"] = [CSVLogger(tmp_path / "log.csv")]
    if "layer_stats" in options:
        options["param_names"] = [(f"p{i}", p) for i, p in enumerate(params)]
    return ClippedOptimizer(make(params), max_norm=1.0, **options)


def _close(opt: ClippedOptimizer, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    """One window: each micro-batch's gradients are ``grads`` (summed, divided with "mean")."""
    for _ in range(opt.accumulation_steps):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone() if p.grad is None else p.grad + g
        opt.step()


@pytest.mark.parametrize("path", list(PATHS))
def test_a_window_whose_float32_norm_overflows_is_clipped_and_applied(path: str, tmp_path: Path) -> None:
    """Finite gradients ~1e20 (torch's norm: inf): the window is not skipped, its recorded norm is
    finite and equals the float64 reference, and SGD (lr 1) moves each parameter by
    ``-g / norm``: the clipped step.  Bound: the reference's, and at most four float32 roundings of
    the coefficient and the step (``2**-24`` each), twice."""
    grads = _huge(3)
    params = _params()
    opt = _wrapper(path, params, tmp_path)
    _close(opt, params, grads)
    stats = opt.last_stats
    want = _reference(grads, 2.0)
    assert stats is not None and not stats.skipped and stats.reason is None
    assert stats.total_norm == pytest.approx(want, rel=_bound(grads), abs=0)
    assert stats.clipped and stats.clip_coef == pytest.approx(1.0 / want, rel=4 * _bound(grads))
    for p, g in zip(params, grads, strict=True):
        expected = torch.tensor([-float(x) / want for x in g.reshape(-1).tolist()], dtype=torch.float64)
        torch.testing.assert_close(
            p.detach().reshape(-1).double(), expected, rtol=8 * 2**-24 + _bound(grads), atol=0
        )
    assert opt.num_skipped == 0
    opt.close()


#: The closes that scale the gradients themselves (a fused kernel's ``grad_scale`` is float32: a
#: float64 norm above 3.4e38 makes it inf, a separate limit).
HOST_PATHS = ["plain-host", "plain-for-loop", "general-host"]


@pytest.mark.parametrize("path", HOST_PATHS)
def test_a_float64_window_whose_norm_overflows_takes_a_step_of_norm_max_norm(
    path: str, tmp_path: Path
) -> None:
    """Float64 parameters, gradients ~1e160 (float64 norm: inf), ``max_norm=1``: the window is
    clipped and applied, SGD (lr 1) moves the parameters by ``-g / norm`` (a step of norm 1), and
    the gradients handed in are the ones the step took.  Before: the norm's second pass divided
    ``p.grad`` in place by its largest element, so the step had norm ~1e-160 (#35 review)."""
    grads = _float64_grads("dense")
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64)) for shape in SHAPES]
    opt = _wrapper(path, params, tmp_path)
    _close(opt, params, grads)
    stats = opt.last_stats
    want = _reference(grads, 2.0)
    assert stats is not None and not stats.skipped
    assert stats.total_norm == pytest.approx(want, rel=1e-12, abs=0)
    step = math.sqrt(math.fsum(float(x) ** 2 for p in params for x in p.detach().reshape(-1).tolist()))
    assert step == pytest.approx(1.0, rel=1e-12)
    for p, g in zip(params, grads, strict=True):
        expected = torch.tensor([-float(x) / want for x in g.reshape(-1).tolist()], dtype=torch.float64)
        torch.testing.assert_close(p.detach().reshape(-1), expected, rtol=1e-12, atol=0)
    opt.close()


def test_fused_adamw_takes_the_clipped_gradient() -> None:
    """Fused AdamW (the plain fused close): its first moment after the window is ``(1 - beta1)``
    times the clipped gradient ``g / norm``, not times the raw one (and not skipped)."""
    grads = _huge(4)
    params = _params()
    opt = ClippedOptimizer(torch.optim.AdamW(params, lr=1e-3, fused=True), max_norm=1.0)
    _close(opt, params, grads)
    want = _reference(grads, 2.0)
    assert opt.last_stats is not None and not opt.last_stats.skipped
    for p, g in zip(params, grads, strict=True):
        m = opt.optimizer.state[p]["exp_avg"]
        torch.testing.assert_close(m, 0.1 * g / want, rtol=16 * 2**-24, atol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_per_group_clipping_takes_finite_group_norms(fused: bool) -> None:
    """Per-group clipping, one group with its own bound (0.5) and two sharing the wrapper's (1.0):
    each is clipped by its own finite norm, as the float64 reference says."""
    grads = _huge(5)
    params = _params()
    groups = [{"params": params[:1], "max_norm": 0.5}, {"params": params[1:]}]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=1.0, fused=fused), max_norm=1.0)
    _close(opt, params, grads)
    stats = opt.last_stats
    assert stats is not None and not stats.skipped
    assert stats.total_norm == pytest.approx(_reference(grads, 2.0), rel=_bound(grads), abs=0)
    for members, bound in ((slice(0, 1), 0.5), (slice(1, 3), 1.0)):
        norm = _reference(grads[members], 2.0)
        for p, g in zip(params[members], grads[members], strict=True):
            torch.testing.assert_close(p.detach(), -bound * g / norm, rtol=16 * 2**-24, atol=0)


@pytest.mark.parametrize("policy", ["AutoClip", "AdaGC", "AGC"])
def test_a_policy_clips_a_window_whose_float32_norm_overflows(policy: str) -> None:
    """A global policy (AutoClip: its threshold from the finite norm), a per-tensor one
    (AdaGC: its warm-up bound from the norm of the per-tensor norms) and the unit-wise AGC (each
    unit's norm) clip a window of gradients ~1e20 after two ordinary ones: applied, every parameter
    moved by a finite step of at most a few units (before: skipped, or each gradient zeroed by a
    coefficient of 0 from an inf norm)."""
    made = {"AutoClip": AutoClip, "AdaGC": AdaGC, "AGC": AGC}
    params = [torch.nn.Parameter(torch.ones(shape)) for shape in SHAPES]
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=1.0), max_norm=made[policy]())
    gen = torch.Generator().manual_seed(0)
    for window in range(3):
        before = [p.detach().clone() for p in params]
        grads = [torch.randn(shape, generator=gen) for shape in SHAPES]
        _close(opt, params, [g * 1e20 for g in grads] if window == 2 else grads)
    stats = opt.last_stats
    assert stats is not None and not stats.skipped and stats.reason is None
    assert stats.total_norm == pytest.approx(_reference([g * 1e20 for g in grads], 2.0), rel=1e-6)
    steps = [p.detach() - b for p, b in zip(params, before, strict=True)]
    assert all(torch.isfinite(s).all() for s in steps)
    assert all(s.abs().amax() > 0 for s in steps)
    assert max(float(s.abs().amax()) for s in steps) < 10.0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_nonfinite_gradient_is_still_skipped(path: str, bad: float, tmp_path: Path) -> None:
    """A nan or inf element beside the huge finite ones: skipped as before, reason "nonfinite"."""
    grads = _huge(6)
    grads[2][1] = bad
    params = _params()
    opt = _wrapper(path, params, tmp_path)
    _close(opt, params, grads)
    stats = opt.last_stats
    assert stats is not None and stats.skipped and stats.reason == "nonfinite"
    assert all(torch.equal(p, torch.zeros_like(p)) for p in params)
    opt.close()


@pytest.mark.parametrize("path", ["plain-fused", "plain-host", "general-fused", "general-host"])
def test_the_overflow_check_adds_no_host_read(path: str, tmp_path: Path) -> None:
    """Counted by tests/hostreads.py: a healthy window and an overflowing one make the reads they
    made before (none of clipopt's on the fused path, one on the host path); the check reads the
    CPU norm through ``_tensors.cpu_value`` (no device to wait for, counted apart)."""
    params = _params()
    opt = _wrapper(path, params, tmp_path)
    counts = []
    for grads in (_huge(7), [g * 1e-20 for g in _huge(8)], _huge(9)):
        with count_host_reads() as reads:
            _close(opt, params, grads)
        counts.append((len(reads), len(reads.cpu)))
        opt.zero_grad()
    ours = 0 if "fused" in path else 1
    assert [c[0] for c in counts] == [ours] * 3
    assert all(c[1] >= 1 for c in counts)
    assert opt.num_skipped == 0
    opt.close()


# ---------------------------------------------------------------- a window that no bound clips


#: The closes a window of real AdamW takes: the plain fused and host closes, the general close
#: (a logger) with the fused and the host step.
ADAMW_PATHS = {
    "plain-fused": (True, False),
    "plain-host": (False, False),
    "general-fused": (True, True),
    "general-host": (False, True),
}

#: Bounds that leave a window of norm ~4e20 beyond float32's range (1.8e19): none, ZClip in its
#: warm-up (it bounds nothing before its 25th window), a bound larger than the norm, and AutoClip
#: after one ordinary window (its 10th percentile of [~3, 4e20] is ~4e19).
UNCLIPPED: dict[str, Callable[[], Any]] = {
    "none": lambda: None,
    "zclip-warmup": ZClip,
    "bound-1e30": lambda: 1e30,
    "autoclip": AutoClip,
}


def _adamw_window(
    path: str, max_norm: Any, tmp_path: Path
) -> tuple[ClippedOptimizer, list[torch.nn.Parameter], dict[str, Any]]:
    """Real AdamW on the close ``path``, one ordinary window applied, then a window of finite
    gradients of 1e20 per element (float32 norm: inf); returns the wrapper, the parameters and a
    copy of the parameters, AdamW's state and the policy's state from before that window."""
    fused, logged = ADAMW_PATHS[path]
    gen = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]
    loggers = [CSVLogger(tmp_path / "log.csv")] if logged else []
    inner = torch.optim.AdamW(params, lr=1e-3, fused=fused)
    opt = ClippedOptimizer(inner, max_norm=max_norm, loggers=loggers)
    _close(opt, params, [torch.randn(shape, generator=gen) for shape in SHAPES])
    opt.zero_grad()
    policy = max_norm if isinstance(max_norm, (ZClip, AutoClip)) else None
    before = {
        "params": [p.detach().clone() for p in params],
        "state": copy.deepcopy(opt.optimizer.state_dict()["state"]),
        "policy": None if policy is None else copy.deepcopy(policy.state_dict()),
    }
    _close(opt, params, [torch.full(shape, 1e20) for shape in SHAPES])
    return opt, params, before


def _same(a: Any, b: Any) -> bool:
    """Identical nested states (tensors element for element, nan equal to nan)."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
        return same and torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("impl", [{"foreach": True}, {"foreach": False}, {"fused": True}])
def test_the_rule_is_conservative_for_adamw(impl: dict[str, bool]) -> None:
    """What docs/design.md states: at the range (1.8e19) every element's square is finite in
    float32, and AdamW's ``exp_avg_sq`` (``(1 - beta2) * g**2``, beta2 0.999) stays finite up to
    ``sqrt(3.4e38 / 0.001)`` = 5.83e20 per element (foreach, for-loop and fused alike), inf above."""
    limit = math.sqrt(F.FLOAT32_MAX / 1e-3)
    assert torch.isfinite(torch.tensor(F.norm_range(2.0) * (1 - 2**-20)) ** 2)
    for element, finite in ((limit * (1 - 1e-3), True), (limit * (1 + 1e-3), False)):
        param = torch.nn.Parameter(torch.ones(8))
        opt = torch.optim.AdamW([param], lr=1e-3, **impl)
        param.grad = torch.full((8,), element)
        opt.step()
        assert bool(torch.isfinite(opt.state[param]["exp_avg_sq"]).all()) == finite


@pytest.mark.parametrize("bound", list(UNCLIPPED))
@pytest.mark.parametrize("path", list(ADAMW_PATHS))
def test_a_window_beyond_float32s_range_that_no_bound_clips_is_skipped(
    path: str, bound: str, tmp_path: Path
) -> None:
    """Finite gradients of 1e20 per element that no bound clips below float32's range of norms
    (no ``max_norm``, ZClip in its warm-up, a bound of 1e30, AutoClip's 4e19).  The rule is
    conservative: below the range every element's square is finite in float32, so no optimizer's
    squared-gradient state overflows from one window (AdamW's ``exp_avg_sq`` itself stays finite up
    to ~5.8e20 per element, ``sqrt(3.4e38 / 0.001)``: these 1e20 would not yet break it).  Skipped
    as before #35, reason "norm_overflow" (not counted as non-finite): the parameters, AdamW's state
    and the policy's statistics bit-identical to before the window."""
    opt, params, before = _adamw_window(path, UNCLIPPED[bound](), tmp_path)
    stats = opt.last_stats
    assert stats is not None and stats.skipped and stats.reason == "norm_overflow"
    assert stats.total_norm == pytest.approx(_reference([torch.full(s, 1e20) for s in SHAPES], 2.0), rel=1e-6)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before["params"], strict=True))
    assert _same(opt.optimizer.state_dict()["state"], before["state"])
    if before["policy"] is not None:  # the very policy object the wrapper holds
        assert opt.max_norm is not None and _same(opt.max_norm.state_dict(), before["policy"])
    assert opt.num_skipped == 1
    opt.close()


@pytest.mark.parametrize("path", list(ADAMW_PATHS))
def test_a_window_beyond_float32s_range_clipped_below_it_leaves_adamw_finite(
    path: str, tmp_path: Path
) -> None:
    """The same window with ``max_norm=1.0``: clipped (coefficient 1 / 4e20) and applied, AdamW's
    moments finite and the parameters moved by a finite step."""
    opt, params, before = _adamw_window(path, 1.0, tmp_path)
    stats = opt.last_stats
    assert stats is not None and not stats.skipped and stats.clipped
    assert all(torch.isfinite(v).all() for state in opt.optimizer.state.values() for v in state.values())
    steps = [p.detach() - b for p, b in zip(params, before["params"], strict=True)]
    assert all(torch.isfinite(s).all() and s.abs().amax() > 0 for s in steps)
    opt.close()


#: Windows at float32's range of norms (``norm_range(2.0)`` = 1.8447e19), as (shape, gradient
#: element, whether it is beyond the range): a 0-d gradient of 3e19 (torch's norm of one element is
#: ``|g|``, finite: nothing overflows), a vector whose float32 norm overflows, a 0-d gradient just
#: below the range.
AT_RANGE: dict[str, tuple[tuple[int, ...], float, bool]] = {
    "0-d-3e19": ((), 3e19, True),
    "vector-1e20": ((10,), 1e20, True),
    "0-d-1.8e19": ((), 1.8e19, False),
}


def _unbounded_window(
    shape: tuple[int, ...], element: float, fused: bool, logged: bool, tmp_path: Path
) -> Any:
    """One window of gradients ``element`` on a float32 parameter of ``shape`` (SGD, lr 1e-20, no
    ``max_norm``), through the plain close or (``logged``) the general one: (skipped, reason, the
    parameter's elements)."""
    param = torch.nn.Parameter(torch.zeros(shape))
    loggers = [CSVLogger(tmp_path / f"log-{fused}.csv")] if logged else []
    opt = ClippedOptimizer(torch.optim.SGD([param], lr=1e-20, fused=fused), max_norm=None, loggers=loggers)
    _close(opt, [param], [torch.full(shape, element)])
    stats = opt.last_stats
    assert stats is not None
    outcome = (stats.skipped, stats.reason, param.detach().reshape(-1).tolist())
    opt.close()
    return outcome


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", list(AT_RANGE))
def test_the_plain_and_general_closes_decide_alike_at_the_range(
    case: str, fused: bool, tmp_path: Path
) -> None:
    """The plain close (no logger) and the general close (a logger) decide a window at float32's
    range of norms from one rule (``functional.beyond``): beyond it (a 0-d gradient of 3e19 whose
    norm torch takes without overflow, or a vector whose float32 norm overflows) both skip,
    reason "norm_overflow", the parameter untouched; just below it both apply ``-1e-20 * g``.
    Before: the plain close looked only for torch's ``inf`` and applied the 0-d window of 3e19
    (a logger changed the outcome; #35 review)."""
    shape, element, beyond = AT_RANGE[case]
    plain = _unbounded_window(shape, element, fused, False, tmp_path)
    general = _unbounded_window(shape, element, fused, True, tmp_path)
    assert plain == general
    n = math.prod(shape)
    if beyond:
        assert plain == (True, "norm_overflow", [0.0] * n)
    else:
        assert plain[:2] == (False, None)
        assert plain[2] == pytest.approx([-1e-20 * element] * n, rel=4 * 2**-24)


def test_a_windows_range_is_its_narrowest_gradients() -> None:
    """``functional.range_dtype``: float64's range only where every gradient is float64 (or
    complex128); a float32 or narrower gradient beside them gives float32's."""
    f32, f64 = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
    assert F.range_dtype([f64, f64.to(torch.complex128)]) == torch.float64
    for narrow in (f32, f32.half(), f32.bfloat16(), f32.to(torch.complex64)):
        assert F.range_dtype([f64, narrow]) == torch.float32
    # a float64 norm of 1e21 (no overflow in float64) beside a float32 gradient is beyond the range
    assert F.beyond(1e21, 2.0, [f32, f64]) and not F.beyond(1e21, 2.0, [f64])
    assert F.beyond_range(torch.tensor(1e21, dtype=torch.float64), 2.0, grads=[f32, f64])


#: Parameters of float32 and float64 together (the norm float64), gradients of 1e21 on the float32 one.
MIXED_SHAPES = [((10,), torch.float32), ((2,), torch.float64)]


@pytest.mark.parametrize("path", list(ADAMW_PATHS))
def test_a_float32_gradient_beside_a_float64_one_is_held_to_float32s_range(path: str, tmp_path: Path) -> None:
    """AdamW, no ``max_norm``, a float32 parameter with gradients of 1e21 beside a float64 one: the
    norm (3.2e21) is float64, below float64's range but beyond the float32 parameter's, so the window
    is skipped ("norm_overflow"), the parameters and AdamW's state untouched and finite, as for the
    float32 parameter alone.  Before: applied (the range was the norm's dtype's, 1.3e154), the float32
    ``exp_avg_sq`` became inf (#35 review)."""
    fused, logged = ADAMW_PATHS[path]
    params = [torch.nn.Parameter(torch.ones(shape, dtype=dtype)) for shape, dtype in MIXED_SHAPES]
    loggers = [CSVLogger(tmp_path / "log.csv")] if logged else []
    opt = ClippedOptimizer(torch.optim.AdamW(params, lr=1e-3, fused=fused), max_norm=None, loggers=loggers)
    _close(opt, params, [torch.full((10,), 1e21), torch.ones(2, dtype=torch.float64)])
    stats = opt.last_stats
    assert stats is not None and stats.skipped and stats.reason == "norm_overflow"
    assert all(torch.equal(p.detach(), torch.ones_like(p)) for p in params)
    assert all(torch.isfinite(v).all() for state in opt.optimizer.state.values() for v in state.values())
    opt.close()


@pytest.mark.parametrize("fused", [True, False])
def test_a_float32_update_beside_a_float64_one_is_held_to_float32s_range(fused: bool) -> None:
    """SGD (lr 1e21, gradients of 1) on a float32 and a float64 parameter, ``update_stats``: an update
    of -1e21 per element, beyond the float32 parameter's range: put back (reason
    "nonfinite_update"), the gradient norm's rule (``functional.range_dtype``)."""
    params = [torch.nn.Parameter(torch.ones(shape, dtype=dtype)) for shape, dtype in MIXED_SHAPES]
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=1e21, fused=fused), max_norm=None, update_stats=True)
    _close(opt, params, [torch.ones(shape, dtype=dtype) for shape, dtype in MIXED_SHAPES])
    stats = opt.last_stats
    assert stats is not None and stats.skipped and stats.reason == "nonfinite_update"
    assert all(torch.equal(p.detach(), torch.ones_like(p)) for p in params)


@pytest.mark.parametrize("fused", [True, False])
def test_a_float64_update_within_float64s_range_is_kept_as_its_gradient_would_be(fused: bool) -> None:
    """Float64 parameters alone, SGD (lr 1e21, gradients of 1), ``update_stats``: an update of -1e21
    per element (norm 3.2e21, within float64's range) is kept, as a float64 window of gradients of
    1e21 is applied (one rule: ``functional.range_dtype``).  Before: the update's check compared the
    update's norm with float32's range always and put it back."""
    params = [torch.nn.Parameter(torch.ones(shape, dtype=torch.float64)) for shape in SHAPES]
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=1e21, fused=fused), max_norm=None, update_stats=True)
    _close(opt, params, [torch.ones(shape, dtype=torch.float64) for shape in SHAPES])
    stats = opt.last_stats
    assert stats is not None and not stats.skipped and stats.reason is None
    assert all(torch.equal(p.detach(), torch.full_like(p, 1.0 - 1e21)) for p in params)
    # the same as gradients: applied (no max_norm), SGD lr 1
    grads = [torch.full(shape, 1e21, dtype=torch.float64) for shape in SHAPES]
    params = [torch.nn.Parameter(torch.ones(shape, dtype=torch.float64)) for shape in SHAPES]
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=1.0, fused=fused), max_norm=None)
    _close(opt, params, grads)
    assert opt.last_stats is not None and not opt.last_stats.skipped


@pytest.mark.parametrize("fused", [True, False])
def test_a_group_left_out_of_norm_clipping_leaves_the_window_beyond_range(fused: bool) -> None:
    """Per-group clipping, the first group left out of norm clipping (its own ``max_norm: None``),
    the others clipped by 1.0: the first group's gradients of ~1e20 would be applied unclipped, so
    the window is skipped ("norm_overflow"), the parameters untouched."""
    grads = _huge(5)
    params = _params()
    groups = [{"params": params[:1], "max_norm": None}, {"params": params[1:]}]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=1.0, fused=fused), max_norm=1.0)
    _close(opt, params, grads)
    stats = opt.last_stats
    assert stats is not None and stats.skipped and stats.reason == "norm_overflow"
    assert all(torch.equal(p, torch.zeros_like(p)) for p in params)


def _run(policy: Any, windows: list[list[torch.Tensor]], fused: bool) -> tuple[list[torch.Tensor], Any, Any]:
    """Real AdamW under ``max_norm=policy`` stepped on each window of ``windows``: the parameters,
    AdamW's state and the policy's state after them."""
    params = [torch.nn.Parameter(torch.ones(shape)) for shape in SHAPES]
    opt = ClippedOptimizer(torch.optim.AdamW(params, lr=1e-2, fused=fused), max_norm=policy)
    for grads in windows:
        _close(opt, params, grads)
        opt.zero_grad()
    state = copy.deepcopy(opt.optimizer.state_dict()["state"])
    return [p.detach().clone() for p in params], state, None if policy is None else policy.state_dict()


#: The policies whose statistics would take a window of norm ~4e20 that is skipped: StableSPAM (its
#: float32 EMA of squared norms overflows at any history), ZClip in its warm-up (no bound yet).
POLICIES: dict[str, Callable[[], Any]] = {"stablespam": StableSPAM, "zclip": ZClip}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_window_beyond_range_is_as_if_it_never_happened_for_a_policy(policy: str, fused: bool) -> None:
    """Three ordinary windows, one of gradients of 1e20 per element (its float32 norm overflows),
    three more: the parameters, AdamW's state and the policy's statistics are those of the six
    ordinary windows alone, bit for bit.  Before: StableSPAM's float32 EMA of the squared norm
    overflowed to inf and the window was applied with its gradients zeroed (AdamW's moments decayed
    and its step counted); ZClip's warm-up sums took 4e20 (fixed with the rule above)."""
    gen = torch.Generator().manual_seed(21)
    ordinary = [[torch.randn(shape, generator=gen) for shape in SHAPES] for _ in range(6)]
    huge = [torch.full(shape, 1e20) for shape in SHAPES]
    with_huge = _run(POLICIES[policy](), [*ordinary[:3], huge, *ordinary[3:]], fused)
    without = _run(POLICIES[policy](), ordinary, fused)
    assert _same(list(with_huge), list(without))


# ---------------------------------------------------------------- an accelerator's path


@pytest.fixture
def accelerator_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU takes an accelerator's path: no norm is read to look for an overflow
    (``functional.READ_CPU_NORMS``), as on a device where a read is a sync."""
    monkeypatch.setattr(F, "READ_CPU_NORMS", False)


#: What an accelerator's close records for a window of gradients ~1e20 that it cannot rescue: the
#: fused plain close decides on the device from the norm alone ("nonfinite"); the general host
#: step looks at the elements of a skipped window whose norm is +inf ("norm_overflow").
UNRESCUED = {"plain-fused": "nonfinite", "general-fused": "nonfinite", "general-host": "norm_overflow"}


@pytest.mark.usefixtures("accelerator_path")
@pytest.mark.parametrize("path", list(UNRESCUED))
def test_an_accelerators_fused_and_general_closes_skip_it_without_a_read(path: str, tmp_path: Path) -> None:
    """On an accelerator's path the fused and general closes do not read the norm, so a window whose
    float32 norm overflowed on finite gradients is skipped as before #35 (the parameters untouched);
    a healthy window and that one make the same host reads as before (none on the fused path, one
    on the host step), and none through the CPU reader."""
    params = _params()
    opt = _wrapper(path, params, tmp_path)
    counts = []
    for grads in ([g * 1e-20 for g in _huge(8)], _huge(7)):
        before = [p.detach().clone() for p in params]
        with count_host_reads() as reads:
            _close(opt, params, grads)
        counts.append((len(reads), len(reads.cpu)))
        opt.zero_grad()
    stats = opt.last_stats
    assert stats is not None and stats.skipped and stats.reason == UNRESCUED[path]
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    ours = 0 if "fused" in path else 1
    assert counts == [(ours, 0), (ours, 0)]
    opt.close()


@pytest.mark.usefixtures("accelerator_path")
@pytest.mark.parametrize(("max_norm", "applied"), [(1.0, True), (None, False), (1e30, False)])
def test_an_accelerators_plain_host_step_rescues_after_its_read(
    max_norm: float | None, applied: bool
) -> None:
    """On an accelerator's path the plain host step reads the norm anyway: an inf norm is taken again
    without overflow and read once more (two host reads in that window, one in a healthy one), then
    the rule of the CPU: clipped by 1.0 and applied with the reference's norm; no bound, or a bound of
    1e30, leaves it beyond float32's range: skipped, "norm_overflow", the parameters untouched."""
    grads = _huge(3)
    params = _params()
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=1.0), max_norm=max_norm)
    with count_host_reads() as healthy:
        _close(opt, params, [g * 1e-20 for g in grads])
    opt.zero_grad()
    before = [p.detach().clone() for p in params]
    with count_host_reads() as reads:
        _close(opt, params, grads)
    stats = opt.last_stats
    assert (len(healthy), len(healthy.cpu), len(reads), len(reads.cpu)) == (1, 0, 2, 0)
    assert stats is not None and stats.skipped is not applied
    assert stats.total_norm == pytest.approx(_reference(grads, 2.0), rel=_bound(grads), abs=0)
    if applied:
        assert stats.reason is None and all(torch.isfinite(p).all() for p in params)
    else:
        assert stats.reason == "norm_overflow"
        assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


# ---------------------------------------------------------------- the update's norm


@pytest.mark.parametrize("fused", [True, False])
def test_an_update_of_minus_1e20_is_bounded_not_rejected(fused: bool) -> None:
    """SGD (lr 1e20) on gradients of 1 without a gradient bound makes an update of -1e20 per element:
    its float32 norm overflows, yet it is finite.  UpdateClip(max_norm=1.0) records its norm (the
    float64 reference's) and bounds it (coefficient 1 / norm), not rejected as "nonfinite_update"
    (before: put back and skipped); the parameters end within the bound of where they were."""
    params = [torch.nn.Parameter(torch.ones(shape)) for shape in SHAPES]
    grads = [torch.full(shape, 1e20) for shape in SHAPES]
    opt = ClippedOptimizer(
        torch.optim.SGD(params, lr=1e20, fused=fused), max_norm=None, update_clip=UpdateClip(max_norm=1.0)
    )
    _close(opt, params, [torch.ones(shape) for shape in SHAPES])
    stats = opt.last_stats
    want = _reference(grads, 2.0)
    assert stats is not None and not stats.skipped and stats.reason is None
    assert stats.update_norm == pytest.approx(want, rel=_bound(grads), abs=0)
    assert stats.update_coef == pytest.approx(1.0 / want, rel=4 * _bound(grads))
    moved = torch.linalg.vector_norm(torch.cat([(p.detach() - 1.0).reshape(-1) for p in params]))
    assert float(moved) <= 1.0 * (1 + 1e-6)


#: Update options that leave an update of -1e20 per element (norm ~4e20) beyond float32's range of
#: norms: update_stats alone (no bound), and a bound of 1e30.
UNBOUNDED_UPDATES: dict[str, dict[str, Any]] = {
    "update_stats": {"update_stats": True},
    "bound-1e30": {"update_clip": UpdateClip(max_norm=1e30)},
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("options", list(UNBOUNDED_UPDATES))
def test_an_update_beyond_range_that_no_bound_brings_back_is_put_back(options: str, fused: bool) -> None:
    """SGD (lr 1e20, gradients of 1): an update of -1e20 per element, its float32 norm overflowed.
    Unbounded (update_stats alone, or UpdateClip(max_norm=1e30)) it is put back as before #35
    (reason "nonfinite_update", the parameters as they were), its norm recorded finite (the float64
    reference's): the gradient norm's rule."""
    params = [torch.nn.Parameter(torch.ones(shape)) for shape in SHAPES]
    grads = [torch.full(shape, 1e20) for shape in SHAPES]
    inner = torch.optim.SGD(params, lr=1e20, fused=fused)
    opt = ClippedOptimizer(inner, max_norm=None, **copy.deepcopy(UNBOUNDED_UPDATES[options]))
    _close(opt, params, [torch.ones(shape) for shape in SHAPES])
    stats = opt.last_stats
    assert stats is not None and stats.skipped and stats.reason == "nonfinite_update"
    assert stats.update_norm == pytest.approx(_reference(grads, 2.0), rel=_bound(grads), abs=0)
    assert all(torch.equal(p.detach(), torch.ones_like(p)) for p in params)


# ---------------------------------------------------------------- 2 gloo ranks


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from .. import norm_overflow_jobs

    return spawn_job(norm_overflow_jobs.norm_overflow_job, "norm_overflow", tmp_path_factory.mktemp("no"), 2)


@needs_gloo
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_clip_a_window_whose_float32_norm_overflows(
    kind: str, gloo: list[dict[str, Any]]
) -> None:
    """2 gloo ranks, DDP and FSDP2 (each rank's shards measured, their norms reduced in float64): the
    second window's loss is scaled by 1e20 (finite gradients, an inf float32 norm).  Every rank
    records the float64 reference's finite norm, applies the window and ends with the reference's
    parameters (SGD on the gradient clipped by hand; rtol 1e-5: the ranks average their float32
    gradients); the ranks alike."""
    from .. import norm_overflow_jobs

    ranks = gloo
    want = norm_overflow_jobs.reference()
    assert want["norms"][1] > 1e19
    for rank in ranks:
        got = rank[kind]
        assert got["skipped"] == [False, False] and got["reasons"] == [None, None]
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)
        for a, b in zip(got["params"], want["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    first, second = (rank[kind] for rank in ranks)
    assert first["norms"] == second["norms"]
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"], strict=True))


@needs_gloo
def test_pipeline_stages_clip_a_window_whose_float32_norm_overflows(gloo: list[dict[str, Any]]) -> None:
    """Pipeline stages (``norm_group``: each rank its own layer, the norm over both reduced in
    float64): a window of gradients ~1e20 is applied on both stages, its norm the float64
    reference's."""
    from ..norm_overflow_jobs import stages_reference

    want = stages_reference()
    for rank in gloo:
        assert not rank["stages"]["skipped"]
        assert rank["stages"]["norm"] == pytest.approx(want, rel=1e-6)
