"""Per-group clipping functions (clipopt.functional) against torch's clip_grad_value_/clip_grad_norm_."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from clipopt import functional as F

from ..hostreads import count_host_reads
from ..strategies import clip_values, grad_arrays, max_norms, norm_types, reference_norm, to_tensors

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

#: relative tolerance of a clipped gradient in each dtype against a float64 reference
_RTOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@dataclass
class Groups:
    """A drawn configuration: gradients per group and each group's options."""

    arrays: list[list[np.ndarray]]
    shared: list[bool]
    bounds: list[float | None]
    values: list[float | None]


@st.composite
def groups(draw: st.DrawFn, min_groups: int = 1, max_groups: int = 4) -> Groups:
    """Several groups of finite gradients; each shared or with its own float/None bound and clip value."""
    k = draw(st.integers(min_groups, max_groups))
    arrays = [draw(grad_arrays(max_size=3)) for _ in range(k)]
    shared = [draw(st.booleans()) for _ in range(k)]
    bounds = [None if s else draw(st.one_of(st.none(), max_norms)) for s in shared]
    values = [draw(st.one_of(st.none(), clip_values)) for _ in range(k)]
    return Groups(arrays, shared, bounds, values)


def _reference(
    cfg: Groups, max_norm: float | None, p: float
) -> tuple[list[list[torch.Tensor]], float, list[float]]:
    """torch's own functions group by group on float64 copies: clip_grad_value_ per group, then
    clip_grad_norm_ over all shared groups together (max_norm) and over each own-bound group alone."""
    params = [
        [torch.nn.Parameter(torch.zeros(a.shape, dtype=torch.float64)) for a in group] for group in cfg.arrays
    ]
    for group, arrays in zip(params, cfg.arrays, strict=True):
        for param, a in zip(group, arrays, strict=True):
            param.grad = torch.tensor(a.astype(np.float64))
    every = [p_ for group in params for p_ in group]
    total = float(torch.nn.utils.get_total_norm([q.grad for q in every], p))  # type: ignore[misc]
    norms = [float(torch.nn.utils.get_total_norm([q.grad for q in g], p)) for g in params]  # type: ignore[misc]
    for group, value in zip(params, cfg.values, strict=True):
        if value is not None:
            torch.nn.utils.clip_grad_value_(group, value)
    shared = [q for group, s in zip(params, cfg.shared, strict=True) if s for q in group]
    if shared and max_norm is not None:
        torch.nn.utils.clip_grad_norm_(shared, max_norm, norm_type=p)
    for group, s, bound in zip(params, cfg.shared, cfg.bounds, strict=True):
        if not s and bound is not None:
            torch.nn.utils.clip_grad_norm_(group, bound, norm_type=p)
    return [[q.grad for q in g] for g in params], total, norms  # type: ignore[misc]


def _decimal(cfg: Groups, dtype: torch.dtype) -> Groups:
    """The configuration with its gradients rounded to ``dtype`` (so the reference sees the same values)."""
    rounded = [[torch.tensor(a).to(dtype).double().numpy() for a in group] for group in cfg.arrays]
    return Groups(rounded, cfg.shared, cfg.bounds, cfg.values)


@given(groups(), st.one_of(st.none(), max_norms), norm_types, st.sampled_from(_DTYPES))
def test_clip_grad_groups_matches_torch_group_by_group(
    cfg: Groups, max_norm: float | None, p: float, dtype: torch.dtype
) -> None:
    """clip_grad_groups_ equals clip_grad_value_ then clip_grad_norm_ applied group by group (shared groups
    together), and returns the pre-clip total norm and group norms torch's get_total_norm gives."""
    cfg = _decimal(cfg, dtype)
    expected, total, norms = _reference(cfg, max_norm, p)
    ours = [[torch.tensor(a, dtype=dtype) for a in group] for group in cfg.arrays]
    got_total, got_norms, coefs = F.clip_grad_groups_(
        ours, max_norm, p, bounds=cfg.bounds, shared=cfg.shared, clip_values=cfg.values
    )
    assert got_total.item() == pytest.approx(total, rel=1e-5, abs=1e-6)
    assert got_norms.tolist() == pytest.approx(norms, rel=1e-5, abs=1e-6)
    assert coefs.shape == (len(cfg.arrays),)
    rtol = _RTOL[dtype]
    for group, ref in zip(ours, expected, strict=True):
        for g, r in zip(group, ref, strict=True):
            scale = float(r.abs().max()) if r.numel() else 0.0
            atol = rtol * scale + torch.finfo(dtype).tiny  # below tiny: subnormal steps, not relative
            torch.testing.assert_close(g.double(), r, rtol=rtol, atol=atol)


@given(grad_arrays(), grad_arrays(), max_norms, norm_types)
def test_group_norms_compose_to_the_total_norm(
    a: list[np.ndarray], b: list[np.ndarray], max_norm: float, p: float
) -> None:
    """group_norms of get_norms equals each group's NumPy p-norm, and the p-norm of the group norms the
    total (the group and total norms come from the same per-tensor norms)."""
    norms = F.get_norms(to_tensors(a + b), p)
    per_group = F.group_norms(norms, [len(a), len(b)], p)
    assert per_group.tolist() == pytest.approx(
        [reference_norm(a, p), reference_norm(b, p)], rel=1e-4, abs=1e-6
    )
    both = F.shared_norm(per_group, [True, True], p)
    assert both.item() == pytest.approx(reference_norm(a + b, p), rel=1e-4, abs=1e-6)


def test_group_norms_of_empty_group_is_zero_and_nan_stays_in_its_group() -> None:
    """A group without gradients has norm 0 (also for the inf-norm); a nan gradient makes its own group's
    norm nan and leaves the other groups' norms and coefficients finite."""
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([math.nan, 1.0])]
    for p in (2.0, math.inf):
        norms = F.group_norms(F.get_norms(grads, p), [1, 0, 1], p)
        assert norms[1].item() == 0.0
        assert math.isnan(norms[2].item())
    norms = F.group_norms(F.get_norms(grads, 2.0), [1, 0, 1], 2.0)
    coefs = F.group_clip_coefs(norms, [None, None, 1.0], [True, True, False], 1.0, 2.0)
    assert coefs[0].item() == pytest.approx(1.0 / (5.0 + 1e-6))
    assert coefs[1].item() == coefs[0].item()  # shared groups share one coefficient
    assert math.isnan(coefs[2].item())


def test_group_clip_coefs_formula() -> None:
    """Shared groups get min(1, b / (N_S + 1e-6)) with N_S their common norm; an own float bound uses the
    group's norm; an own None and an unbounded shared group get 1."""
    norms = torch.tensor([3.0, 4.0, 10.0, 10.0])
    coefs = F.group_clip_coefs(norms, [None, None, 2.0, None], [True, True, False, False], 1.0, 2.0)
    assert coefs.tolist() == pytest.approx([1.0 / (5.0 + 1e-6), 1.0 / (5.0 + 1e-6), 2.0 / (10.0 + 1e-6), 1.0])
    unbounded = F.group_clip_coefs(norms, [None, None, 20.0, None], [True, True, False, False], None, 2.0)
    assert unbounded.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_group_functions_reject_mismatched_lengths() -> None:
    """Lengths that do not give one entry per group raise ValueError naming the counts."""
    norms = torch.ones(3)
    with pytest.raises(ValueError, match=r"^sizes must add up to the number of norms \(3\), got \[1, 1\]; "):
        F.group_norms(norms, [1, 1], 2.0)
    with pytest.raises(ValueError, match=r"^bounds \(2\), shared \(2\) and norms_of_groups \(3\) must have"):
        F.group_clip_coefs(norms, [None, None], [True, True], 1.0, 2.0)
    with pytest.raises(ValueError, match=r"^coefs must have one entry per group \(1\), got 2$"):
        F.scale_groups_([[torch.ones(2)]], torch.ones(2))
    with pytest.raises(ValueError, match=r"^clip_values must have one entry per group \(2\), got 1$"):
        F.clip_groups_value_([[torch.ones(2)], [torch.ones(2)]], [0.5])


def test_clip_groups_value_checks_every_group_before_clamping() -> None:
    """A sparse gradient in a later value-clipped group raises TypeError before the first group is clamped;
    a group whose clip value is None is not checked (sparse allowed there)."""
    dense = torch.tensor([5.0, -5.0])
    sparse = torch.sparse_coo_tensor([[0]], [9.0], (2,), check_invariants=True)
    with pytest.raises(TypeError, match=r"^clip_value does not support sparse gradients"):
        F.clip_groups_value_([[dense], [sparse]], [1.0, 1.0])
    assert dense.tolist() == [5.0, -5.0]
    F.clip_groups_value_([[dense], [sparse]], [1.0, None])
    assert dense.tolist() == [1.0, -1.0]


def test_clip_grad_groups_reads_nothing_back() -> None:
    """The whole per-group clip (norms, value clipping, coefficients, scaling) makes no host read."""
    grads = [[torch.randn(300, 5), torch.randn(7)], [torch.randn(2000)], [torch.randn(3, 3)]]
    with count_host_reads() as reads:
        F.clip_grad_groups_(
            grads,
            0.5,
            2.0,
            bounds=[None, 0.1, None],
            shared=[True, False, False],
            clip_values=[0.1, None, 1.0],
        )
    assert reads.ours == []
