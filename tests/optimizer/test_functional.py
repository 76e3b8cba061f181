"""The functional layer against plain NumPy and torch.nn.utils references."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import clipopt
from clipopt import functional as F

from ..strategies import (
    clip_values,
    grad_arrays,
    max_norms,
    named_norm_types,
    norm_types,
    reference_norm,
    to_tensors,
)


@given(grad_arrays(), norm_types)
def test_total_norm_matches_numpy(arrays: list[np.ndarray], p: float) -> None:
    """get_total_norm equals the p-norm of the concatenated gradients computed in NumPy float64."""
    got = F.get_total_norm(to_tensors(arrays), p)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(reference_norm(arrays, p), rel=1e-4, abs=1e-6)


@given(grad_arrays(), named_norm_types)
def test_total_norm_matches_torch(arrays: list[np.ndarray], p: float) -> None:
    """For float32 gradients the norm equals torch.nn.utils.get_total_norm."""
    grads = to_tensors(arrays)
    expected = torch.nn.utils.get_total_norm(grads, p)
    torch.testing.assert_close(F.get_total_norm(grads, p), expected, rtol=1e-6, atol=0)


@given(grad_arrays(), named_norm_types)
def test_total_norm_foreach_and_loop_agree(arrays: list[np.ndarray], p: float) -> None:
    """The foreach and the per-tensor implementations give the same norm."""
    grads = to_tensors(arrays)
    a = F.get_total_norm(grads, p, foreach=True)
    b = F.get_total_norm(grads, p, foreach=False)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_total_norm_of_fp16_beyond_fp16_range_is_finite() -> None:
    """fp16 gradients whose norm exceeds 65504 but whose elements are finite give a finite float32 norm."""
    grads = [torch.full((10_000,), 1000.0, dtype=torch.float16) for _ in range(2)]
    assert math.isinf(torch.nn.utils.get_total_norm(grads, 2.0).item())  # torch overflows
    got = F.get_total_norm(grads, 2.0)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(1000.0 * math.sqrt(20_000), rel=1e-4)


def test_total_norm_of_bf16_is_float32() -> None:
    """bf16 gradients are accumulated in float32."""
    grads = [torch.full((1000,), 3.0, dtype=torch.bfloat16)]
    got = F.get_total_norm(grads, 2.0)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(3.0 * math.sqrt(1000), rel=1e-6)


def test_total_norm_keeps_float64() -> None:
    """float64 gradients keep float64 precision and match torch exactly."""
    grads = [torch.randn(7, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    got = F.get_total_norm(grads, 2.0)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.nn.utils.get_total_norm(grads, 2.0))


def test_total_norm_of_sparse_gradient_counts_duplicates_once_summed() -> None:
    """A sparse COO gradient with duplicate indices has the norm of its dense form."""
    sparse = torch.sparse_coo_tensor([[0, 0, 2]], [1.0, 2.0, 4.0], (4,), check_invariants=True)
    dense = sparse.to_dense()
    assert F.get_total_norm([sparse], 2.0).item() == pytest.approx(dense.norm().item())


def test_total_norm_empty_is_zero() -> None:
    """No gradients give a norm of 0."""
    assert F.get_total_norm([], 2.0).item() == 0.0


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
def test_nonfinite_flag(value: float, p: float) -> None:
    """One non-finite element makes the norm non-finite and the flag exactly 1.0."""
    grads = [torch.ones(3), torch.tensor([1.0, value])]
    flag = F.nonfinite_flag(F.get_total_norm(grads, p))
    assert flag.dtype == torch.float32
    assert flag.item() == 1.0
    assert F.nonfinite_flag(F.get_total_norm([torch.ones(3)], p)).item() == 0.0


@given(st.floats(0, 1e6, allow_nan=False), max_norms)
def test_clip_coef_formula(norm: float, max_norm: float) -> None:
    """clip_coef is min(1, max_norm / (norm + 1e-6)) as written in plain Python."""
    got = F.clip_coef(torch.tensor(norm, dtype=torch.float64), max_norm).item()
    assert got == pytest.approx(min(1.0, max_norm / (norm + 1e-6)), rel=1e-12)


@given(grad_arrays(), max_norms, norm_types)
def test_norm_clipping_bounds_the_norm(arrays: list[np.ndarray], max_norm: float, p: float) -> None:
    """After scaling by clip_coef the norm is <= max_norm (up to rounding) and direction is kept."""
    grads = to_tensors(arrays)
    before = [g.clone() for g in grads]
    norm = F.get_total_norm(grads, p)
    F.scale_grads_(grads, F.clip_coef(norm, max_norm))
    after = reference_norm([g.numpy() for g in grads], p)
    assert after <= max_norm * (1 + 1e-5) + 1e-6
    if norm.item() <= max_norm:  # nothing to clip: unchanged up to 1 ulp and the 1e-6 of the coefficient
        for a, b in zip(grads, before, strict=True):  # (max_norm / (norm + 1e-6) < 1 for norm = max_norm)
            torch.testing.assert_close(a, b, rtol=2e-6 + 1e-6 / max_norm, atol=0)


@given(grad_arrays(), max_norms, named_norm_types)
def test_clipping_twice_equals_once(arrays: list[np.ndarray], max_norm: float, p: float) -> None:
    """Norm clipping is idempotent up to the 1e-6 in the denominator (relative change <= 1e-6/max_norm)."""
    grads = to_tensors(arrays)
    F.scale_grads_(grads, F.clip_coef(F.get_total_norm(grads, p), max_norm))
    once = [g.clone() for g in grads]
    F.scale_grads_(grads, F.clip_coef(F.get_total_norm(grads, p), max_norm))
    for a, b in zip(grads, once, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6 / max_norm + 1e-5, atol=0)


@given(grad_arrays(), max_norms, named_norm_types)
def test_norm_clipping_matches_clip_grad_norm(arrays: list[np.ndarray], max_norm: float, p: float) -> None:
    """get_total_norm + clip_coef + scale_grads_ equals torch.nn.utils.clip_grad_norm_ bit for bit."""
    ours = to_tensors(arrays)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ours]
    for param, g in zip(params, to_tensors(arrays), strict=True):
        param.grad = g
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=p)
    norm = F.get_total_norm(ours, p)
    F.scale_grads_(ours, F.clip_coef(norm, max_norm))
    assert torch.equal(norm, expected_norm)
    for g, param in zip(ours, params, strict=True):
        assert param.grad is not None
        assert torch.equal(g, param.grad)


@given(grad_arrays(), clip_values)
def test_value_clipping_bounds_and_matches_torch(arrays: list[np.ndarray], clip_value: float) -> None:
    """clip_grads_value_ bounds every element by clip_value and equals torch's clip_grad_value_."""
    grads = to_tensors(arrays)
    F.clip_grads_value_(grads, clip_value)
    for g, a in zip(grads, arrays, strict=True):
        assert g.abs().max().item() <= np.float32(clip_value)
        np.testing.assert_array_equal(g.numpy(), np.clip(a, -np.float32(clip_value), np.float32(clip_value)))
    params = [torch.nn.Parameter(torch.zeros(a.shape)) for a in arrays]
    for param, g in zip(params, to_tensors(arrays), strict=True):
        param.grad = g
    torch.nn.utils.clip_grad_value_(params, clip_value)
    for g, param in zip(grads, params, strict=True):
        assert param.grad is not None
        assert torch.equal(g, param.grad)


def test_value_clipping_rejects_sparse() -> None:
    """Value clipping of a sparse gradient raises a TypeError that says how to turn it off."""
    sparse = torch.sparse_coo_tensor([[0]], [5.0], (3,), check_invariants=True)
    msg = "clip_value does not support sparse gradients; pass clip_value=None"
    with pytest.raises(TypeError, match=msg):
        F.clip_grads_value_([sparse], 1.0)


def test_scale_grads_handles_sparse() -> None:
    """scale_grads_ multiplies sparse gradients too."""
    sparse = torch.sparse_coo_tensor([[1]], [4.0], (3,), check_invariants=True)
    F.scale_grads_([sparse], torch.tensor(0.5))
    assert torch.equal(sparse.to_dense(), torch.tensor([0.0, 2.0, 0.0]))


def test_foreach_true_on_unsupported_device_raises() -> None:
    """foreach=True on a device without foreach kernels is an error, like torch's."""
    g = torch.ones(3, device="meta")
    with pytest.raises(RuntimeError, match="foreach=True was passed"):
        F.get_total_norm([g], 2.0, foreach=True)


@pytest.mark.parametrize("p", [2.0, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_direct_cpu_norm_of_large_tensors(p: float, dtype: torch.dtype) -> None:
    """The single-pass CPU kernels for large tensors (dot for p=2, aminmax for inf) match float64 truth.

    They are at least as accurate as torch's own get_total_norm, mixed with small tensors too.
    """
    gen = torch.Generator().manual_seed(0)
    big = F.DOT_MIN_NUMEL if p == 2.0 else F.AMINMAX_MIN_NUMEL
    shapes = [(big,), (3, big), (5,), (7, 3)]
    grads = [(torch.randn(s, generator=gen) * 3).to(dtype) for s in shapes]
    truth = reference_norm([g.double().numpy() for g in grads], p)
    got = F.get_total_norm(grads, p).item()
    torch_err = abs(torch.nn.utils.get_total_norm([g.float() for g in grads], p).item() - truth)
    assert abs(got - truth) <= max(torch_err * 1.01, truth * 1e-6)


@pytest.mark.parametrize("p", [2.0, math.inf])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_direct_cpu_norm_propagates_nonfinite(p: float, value: float) -> None:
    """A single non-finite element in a large tensor makes the norm non-finite on the fast paths."""
    g = torch.ones(F.DOT_MIN_NUMEL)
    g[12345] = value
    assert F.nonfinite_flag(F.get_total_norm([g, torch.ones(3)], p)).item() == 1.0


def test_direct_cpu_norm_handles_non_contiguous() -> None:
    """A transposed (non-contiguous) large gradient has the same norm as its contiguous copy."""
    g = torch.randn(512, 256).t()
    assert not g.is_contiguous()
    torch.testing.assert_close(F.get_total_norm([g], 2.0), F.get_total_norm([g.contiguous()], 2.0))
    assert F.get_total_norm([g], math.inf).item() == g.abs().max().item()


@pytest.mark.parametrize("piece", [None, 1000])
def test_dot_norm_is_accurate_on_long_tensors(piece: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dot path sums over pieces: on 16M float32 elements (where one dot drifts ~1e-4 and
    torch's get_total_norm ~6e-4) the norm is within 5e-6 of float64; also with pieces that do not
    divide the length (shrunk to 1000 elements)."""
    if piece is not None:
        monkeypatch.setattr(F, "DOT_PIECE_NUMEL", piece)
    n = (1 << 24) if piece is None else 3 * piece + 7 + F.DOT_MIN_NUMEL
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    truth = math.sqrt(float(np.dot(g.double().numpy(), g.double().numpy())))
    assert F.get_total_norm([g]).item() == pytest.approx(truth, rel=5e-6)


@given(grad_arrays(), norm_types, st.booleans())
def test_get_norms_match_numpy_per_tensor(arrays: list[np.ndarray], p: float, mixed: bool) -> None:
    """get_norms gives each gradient's p-norm (NumPy float64 reference), in the order given, also
    when the gradients have different dtypes; the p-norm of that vector is get_total_norm's value."""
    grads = to_tensors(arrays)
    if mixed:
        grads = [g.double() if i % 2 else g for i, g in enumerate(grads)]
    got = F.get_norms(grads, p)
    assert got.shape == (len(arrays),)
    assert got.dtype == (torch.float64 if mixed and len(arrays) > 1 else torch.float32)
    for value, a in zip(got.tolist(), arrays, strict=True):
        assert value == pytest.approx(reference_norm([a], p), rel=1e-4, abs=1e-6)
    total = torch.linalg.vector_norm(got, p).item()
    assert total == pytest.approx(F.get_total_norm(grads, p).item(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("p", [2.0, math.inf, 3.0])
def test_get_norms_of_large_sparse_and_nonfinite_tensors(p: float) -> None:
    """get_norms takes the direct CPU kernels for large tensors (per tensor, in order), coalesces
    sparse gradients, and keeps a non-finite gradient's norm non-finite without touching the others."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1 << 18, generator=g)
    small = torch.randn(7, generator=g)
    bad = torch.randn(3000, generator=g)
    bad[5] = math.nan
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 0, 2]]), torch.tensor([1.0, 2.0, -4.0]), (4,))
    got = F.get_norms([small, big, bad, sparse], p).tolist()

    def ref(t: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(t.double(), p))

    assert got[0] == pytest.approx(ref(small), rel=1e-6)
    # p = 3 has no direct kernel: _foreach_norm's float32 sum (as get_total_norm) is good to ~2e-5
    assert got[1] == pytest.approx(ref(big), rel=1e-6 if p in (2.0, math.inf) else 1e-4)
    assert math.isnan(got[2])
    assert got[3] == pytest.approx(ref(sparse.to_dense()), rel=1e-6)
    assert F.get_norms([], p).shape == (0,)


# ----------------------------------------------------------------------------- sparse gradients


def test_foreach_true_with_sparse_gradients_says_so() -> None:
    """foreach=True with sparse gradients is a ValueError that names the cause, not the device."""
    g = torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True)
    msg = "foreach=True does not support sparse gradients; pass foreach=None (the default)"
    with pytest.raises(ValueError, match=re.escape(msg)):
        clipopt.functional.get_total_norm([g], 2.0, foreach=True)
