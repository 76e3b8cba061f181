"""Per-layer statistics, parameter names and the CSV logger."""

from __future__ import annotations

import copy
import csv
import math
import re
import threading
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import clipopt
import clipopt._diagnostics.layers as clipopt_layers
from clipopt import LAYER_FIELDS, ClippedOptimizer, CSVLogger, StepStats
from clipopt import functional as F

from ..helpers import TwoHeads, inputs, mlp, reads_per_step, task_run, train
from ..hostreads import count_host_reads

_model = partial(mlp, (4, 6, 2))  # Linear(4, 6), Tanh, Linear(6, 2), global seed 0
_batches = partial(inputs, shape=(5, 4), seed=1, scale=3)  # bad ones hold a NaN


# ------------------------------------------------------------------------------ names


def test_names_from_named_parameters() -> None:
    """param_names=model.named_parameters() names every parameter in group order."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), param_names=model.named_parameters())
    assert opt.layer_names() == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_names_from_inner_optimizer_built_with_named_parameters() -> None:
    """Without param_names, the inner optimizer's own param_names (from named_parameters()) are used."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.AdamW(model.named_parameters(), lr=0.1))
    assert opt.layer_names() == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_names_fallback_and_list_and_dict() -> None:
    """Unnamed parameters get group<g>.<i>; a list of names or a dict also works."""
    model = _model()
    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.01}]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.1))
    assert opt.layer_names() == ["group0.0", "group0.1", "group1.0", "group1.1"]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.1), param_names=["a", "b", "c", "d"])
    assert opt.layer_names() == ["a", "b", "c", "d"]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.1), param_names={"last": params[3]})
    assert opt.layer_names() == ["group0.0", "group0.1", "group1.0", "last"]


@pytest.mark.parametrize(
    ("param_names", "error", "message"),
    [
        ("weights", TypeError, "param_names must be model.named_parameters()"),
        ([1, 2], TypeError, "param_names must be model.named_parameters()"),
        (["a"], ValueError, "param_names lists 1 names but the optimizer has 4 parameters"),
    ],
)
def test_bad_param_names(param_names: Any, error: type[Exception], message: str) -> None:
    """Bad param_names raise an error naming the argument and the fix."""
    model = _model()
    with pytest.raises(error, match=re.escape(message)):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), param_names=param_names)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"layer_stats": 0}, ValueError, "layer_stats must be True, False or an int >= 1, got 0"),
        ({"layer_stats": "10"}, TypeError, "layer_stats must be True, False or an int >= 1, got '10'"),
        ({"loggers": CSVLogger("x.csv")}, TypeError, "loggers must be a list of loggers, got CSVLogger"),
        ({"loggers": [print]}, TypeError, "loggers must hold objects with log(stats, optimizer) and close()"),
        ({"snapshot_dir": 3}, TypeError, "snapshot_dir must be a path or None, got int"),
        ({"max_snapshots": 0}, ValueError, "max_snapshots must be an int >= 1, got 0"),
    ],
)
def test_bad_diagnostics_arguments(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    """Each bad diagnostics argument raises the documented error."""
    model = _model()
    with pytest.raises(error, match=re.escape(message)):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


# ------------------------------------------------------------------------------ layer statistics


def _reference_layer_stats(grads: list[torch.Tensor], params: list[torch.Tensor]) -> list[list[float]]:
    rows = []
    for g, p in zip(grads, params, strict=True):
        a = np.abs(g.double().numpy()).ravel()
        finite = np.isfinite(a)
        rows.append(
            [
                float(np.sqrt(np.sum(a**2))),
                float(a.max()),
                float(a.min()),
                float((~finite).sum()),
                float(np.sqrt(np.sum(p.detach().double().numpy() ** 2))),
            ]
        )
    return rows


@pytest.mark.parametrize("accumulation", [1, 3])
def test_layer_stats_match_numpy(accumulation: int) -> None:
    """Per-layer statistics equal NumPy's on the combined (mean), pre-clip gradient and the parameters."""
    model = _model()
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        max_norm=1e-3,
        accumulation_steps=accumulation,
        layer_stats=True,
        param_names=model.named_parameters(),
    )
    batches = _batches(accumulation)
    for x in batches:
        ref(x).pow(2).mean().backward()
    grads = [p.grad / accumulation for p in ref.parameters() if p.grad is not None]
    expected = _reference_layer_stats(grads, list(ref.parameters()))
    train(model, opt, batches)
    assert opt.last_stats is not None and opt.last_stats.layers is not None
    got = opt.last_stats.layers
    assert got.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    np.testing.assert_allclose(np.array(got.rows()), np.array(expected), rtol=1e-5, atol=1e-7)
    assert got["2.bias"]["grad_norm"] == pytest.approx(expected[3][0], rel=1e-5)
    assert set(got.as_dict()["0.weight"]) == set(LAYER_FIELDS)


def test_layer_stats_every_k_windows() -> None:
    """layer_stats=3 computes statistics on windows 3, 6, ... only; False never."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), layer_stats=3)
    train(model, opt, _batches(7))
    assert [s.step for s in opt.stats if s.layers is not None] == [3, 6]
    opt2 = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    train(model, opt2, _batches(3))
    assert all(s.layers is None for s in opt2.stats)


def test_layer_stats_count_nonfinite_elements() -> None:
    """A NaN window's statistics count the non-finite elements per parameter exactly."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), layer_stats=True)
    x = torch.randn(5, 4)
    x[1, 2] = float("nan")
    model(x).pow(2).mean().backward()
    expected = [int((~torch.isfinite(p.grad)).sum()) for p in model.parameters() if p.grad is not None]
    opt.step()
    assert opt.last_stats is not None and opt.last_stats.layers is not None
    counts = [row[LAYER_FIELDS.index("nonfinite")] for row in opt.last_stats.layers.rows()]
    assert counts == expected
    assert counts[0] > 0


def test_layer_stats_without_gradient_are_nan() -> None:
    """A parameter without a gradient has nan gradient statistics, 0 non-finite, and its parameter norm."""
    model = _model()
    frozen = list(model.parameters())[1]
    frozen.requires_grad_(False)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), layer_stats=True)
    train(model, opt, _batches(1))
    assert opt.last_stats is not None and opt.last_stats.layers is not None
    row = opt.last_stats.layers.rows()[1]
    assert all(math.isnan(v) for v in row[:3])
    assert row[3] == 0.0
    assert row[4] == pytest.approx(frozen.norm().item())


def test_layer_stats_windows_read_one_flag_others_none() -> None:
    """With fused AdamW, windows without statistics read nothing; windows with statistics read one flag."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), max_norm=0.1, layer_stats=2)
    reads = reads_per_step(model, opt, _batches(6))
    assert reads[2] == 0 and reads[4] == 0  # windows 3 and 5
    assert reads[3] == 1 and reads[5] == 1  # windows 4 and 6


# ------------------------------------------------------------------------------ compute_layer_stats kernels


def _float64_reference(params: list[torch.Tensor], scale: float, count_nonfinite: bool) -> np.ndarray:
    """Independent [P, 5] reference: NumPy float64 on every element, no chunking."""
    rows = []
    for p in params:
        param_norm = float(np.linalg.norm(p.detach().double().numpy().ravel()))
        g = p.grad
        if g is None:
            rows.append([math.nan, math.nan, math.nan, 0.0, param_norm])
            continue
        v = (g.coalesce().values() if g.is_sparse else g).double().numpy().ravel()
        if v.size == 0:
            rows.append([0.0, 0.0, 0.0, 0.0, param_norm])
            continue
        a = np.abs(v)
        bad = float((~np.isfinite(v)).sum()) if count_nonfinite else 0.0
        norm = float(np.sqrt(np.sum(a * a)))
        rows.append([scale * norm, scale * a.max(), scale * a.min(), bad, param_norm])
    return np.array(rows, dtype=np.float64)


def _stats(params: list[torch.Tensor], scale: float, count_nonfinite: bool, cpu_kernels: bool) -> np.ndarray:
    names = [f"p{i}" for i in range(len(params))]
    if cpu_kernels:
        stats = clipopt_layers.compute_layer_stats(params, names, scale, count_nonfinite)
        return np.array(stats.rows(), dtype=np.float64)
    values = clipopt_layers._layer_stats(params, scale, count_nonfinite, cpu_kernels=False)
    return values.double().numpy()


def _param(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.3).to(dtype))
    p.grad = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    return p


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Shrink the CPU kernels' sizes so chunk boundaries are reached with small tensors."""
    monkeypatch.setattr(clipopt_layers, "CHUNK_NUMEL", 64)
    monkeypatch.setattr(clipopt_layers, "DOT_NUMEL", 24)  # not a divisor: uneven last piece per chunk
    monkeypatch.setattr(clipopt_layers, "BATCH_MAX_NUMEL", 16)
    monkeypatch.setattr(clipopt_layers, "PARAM_DOT_MIN_NUMEL", 16)
    return 64


def _boundary_sizes(chunk: int, batch_max: int) -> list[tuple[int, ...]]:
    return [
        (1,),
        (batch_max - 1,),
        (batch_max,),
        (chunk - 1,),
        (chunk,),
        (chunk + 1,),
        (3, chunk),  # exactly three chunks
        (3 * chunk + 7,),
        (2, 2 * chunk + 3),
        (),  # a 0-dim parameter
    ]


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_kernels_match_float64_around_chunk_boundaries(small_chunks: int, cpu_kernels: bool) -> None:
    """Sizes c-1, c, c+1 and several chunks (c shrunk to 64) match a float64 NumPy reference, in order."""
    shapes = _boundary_sizes(small_chunks, clipopt_layers.BATCH_MAX_NUMEL)
    params = [_param(s, seed=i) for i, s in enumerate(shapes)]
    got = _stats(params, 1.0, True, cpu_kernels)
    np.testing.assert_allclose(got, _float64_reference(params, 1.0, True), rtol=1e-5, atol=0)
    # max |g| and min |g| are exact: float32 values compared with float32 values
    assert np.array_equal(got[:, 1:3], _float64_reference(params, 1.0, True)[:, 1:3])


def test_kernels_match_float64_at_real_chunk_size() -> None:
    """Shipped sizes: gradients and parameters around CHUNK_NUMEL and BATCH_MAX_NUMEL match float64."""
    c, b = clipopt_layers.CHUNK_NUMEL, clipopt_layers.BATCH_MAX_NUMEL
    sizes = [c - 1, c, c + 1, b - 1, b, 768]
    params = [_param((n,), seed=i) for i, n in enumerate(sizes)]
    for count_nonfinite in (False, True):
        got = _stats(params, 1.0, count_nonfinite, True)
        np.testing.assert_allclose(got, _float64_reference(params, 1.0, count_nonfinite), rtol=1e-5, atol=0)


def test_kernels_are_accurate_on_long_tensors() -> None:
    """A 16M-element float32 gradient and parameter stay within 1e-5 of float64 (one long dot: ~2e-4)."""
    p = _param((1 << 24,), seed=3)
    got = _stats([p], 1.0, False, True)
    np.testing.assert_allclose(got, _float64_reference([p], 1.0, False), rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_kernels_half_precision_accumulate_in_float32(
    small_chunks: int, dtype: torch.dtype, cpu_kernels: bool
) -> None:
    """bfloat16/float16 gradients and parameters: float32 accumulation, extremes exact, vs float64."""
    shapes = _boundary_sizes(small_chunks, clipopt_layers.BATCH_MAX_NUMEL)
    params = [_param(s, dtype, seed=i) for i, s in enumerate(shapes)]
    got = _stats(params, 1.0, True, cpu_kernels)
    expected = _float64_reference(params, 1.0, True)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=0)
    assert np.array_equal(got[:, 1:3], expected[:, 1:3])


def test_kernels_half_precision_long_tensor() -> None:
    """A bfloat16 gradient and parameter of several real chunks are summed in float32 (1e-5 of float64)."""
    p = _param((3 * clipopt_layers.CHUNK_NUMEL + 11,), torch.bfloat16)
    np.testing.assert_allclose(_stats([p], 1.0, False, True), _float64_reference([p], 1.0, False), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("count_nonfinite", [True, False])
def test_kernels_extremes_of_signed_zeros_subnormals_and_the_largest_floats(
    small_chunks: int, dtype: torch.dtype, count_nonfinite: bool
) -> None:
    """max |g| and min |g| of -0.0, subnormals and the dtype's largest values, taken on the float's
    bits in the chunked path, equal NumPy's on the same values (and a gradient of -0.0 only has 0, 0)."""
    info = torch.finfo(dtype)
    special = [-0.0, 0.0, info.tiny / 4, -info.tiny / 4, -info.max, info.max / 2, -1.0, 3.0]
    params = []
    for i, values in enumerate([special, [-0.0] * 5, [-info.max] + [-info.tiny / 8] * 4, [-2.0, -0.5, -7.0]]):
        p = _param((2 * small_chunks + 3,), dtype, seed=i)
        assert p.grad is not None
        p.grad[: len(values)] = torch.tensor(values, dtype=torch.float64).to(dtype)
        if i == 1:
            p.grad.fill_(-0.0)
        if i == 3:
            p.grad.abs_().neg_()  # every element negative
        params.append(p)
    got = _stats(params, 1.0, count_nonfinite, True)
    expected = _float64_reference(params, 1.0, count_nonfinite)
    assert np.array_equal(got[:, 1:3], expected[:, 1:3])
    assert list(got[1, :3]) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_kernels_missing_empty_sparse_and_float64(small_chunks: int, cpu_kernels: bool) -> None:
    """No gradient (nan fields), zero-element tensors (zeros), sparse and float64 gradients, in one call."""
    params = [_param((200,), seed=1), _param((5,), seed=2), _param((0,)), _param((0, 3))]
    params.append(_param((130,), seed=4))
    params[1].grad = None
    emb = torch.nn.Embedding(300, 4, sparse=True)
    emb(torch.tensor([3, 7, 3, 299, 150, 7])).pow(2).sum().backward()  # repeated rows: coalesce sums them
    params.insert(2, emb.weight)
    params.append(_param((70,), torch.float64, seed=5))
    params.append(_param((3, 3), torch.float64, seed=6))
    params[-1].grad = None
    for scale in (1.0, 0.25):
        got = _stats(params, scale, True, cpu_kernels)
        np.testing.assert_allclose(got, _float64_reference(params, scale, True), rtol=1e-5, atol=0)
    assert np.isnan(got[1, :3]).all() and got[1, 3] == 0.0
    assert (got[3, :4] == 0).all() and (got[4, :4] == 0).all()


@pytest.mark.parametrize("count_nonfinite", [True, False])
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_kernels_nonfinite_elements(small_chunks: int, count_nonfinite: bool, cpu_kernels: bool) -> None:
    """nan/inf in first, middle, last partial chunks and small tensors: counted exactly, or 0 if not asked."""
    c = small_chunks
    params = [_param((n,), seed=i) for i, n in enumerate([3 * c + 5, 2 * c, c + 1, 10, 40, c - 1])]
    assert params[0].grad is not None
    params[0].grad[0] = math.inf
    params[0].grad[-1] = -math.inf  # in the last, partial chunk
    params[0].grad[c + 3] = math.nan
    params[1].grad[c] = -math.inf  # only infs: max |g| is inf, min |g| finite
    params[1].grad[1] = math.inf
    params[3].grad[4] = math.nan  # batched (small) path
    params[4].grad[:] = math.inf
    got = _stats(params, 0.5, count_nonfinite, cpu_kernels)
    expected = _float64_reference(params, 0.5, count_nonfinite)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=0)
    assert list(got[:, 3]) == ([3, 2, 0, 1, 40, 0] if count_nonfinite else [0] * 6)
    assert np.isinf(got[1, 1]) and np.isfinite(got[1, 2])


def test_kernels_scale_multiplies_gradient_fields_only(small_chunks: int) -> None:
    """scale multiplies grad_norm, grad_max and grad_min; nonfinite and param_norm are unscaled."""
    params = [_param((n,), seed=n) for n in (5, 100, 200)]
    one = _stats(params, 1.0, True, True)
    third = _stats(params, 1 / 3, True, True)
    np.testing.assert_allclose(third[:, :3], one[:, :3] / 3, rtol=1e-6)
    assert np.array_equal(third[:, 3:], one[:, 3:])


def test_kernels_make_no_host_reads(small_chunks: int) -> None:
    """compute_layer_stats on every path (chunked, batched, per-tensor, sparse, none, empty) reads nothing."""
    params = [_param((n,), seed=n) for n in (3, 30, 200, 0)]
    params.append(_param((50,), torch.float64))
    params.append(_param((70,), torch.bfloat16))
    params.append(_param((4,)))
    params[-1].grad = None
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2, 1])).sum().backward()
    params.append(emb.weight)
    names = [str(i) for i in range(len(params))]
    for count_nonfinite in (False, True):
        with count_host_reads() as r:
            stats = clipopt_layers.compute_layer_stats(params, names, 0.5, count_nonfinite)
            generic = clipopt_layers._layer_stats(params, 0.5, count_nonfinite, cpu_kernels=False)
        assert len(r) == 0, r.ours
        assert stats._values is not None and stats._values.shape == (len(params), 5)
        assert generic.shape == (len(params), 5)


def test_kernels_threads_do_not_share_scratch(small_chunks: int) -> None:
    """Statistics computed concurrently in several threads equal the single-threaded result."""
    params = [_param((n,), seed=n) for n in (300, 1000, 77)]
    expected = _stats(params, 1.0, False, True)
    results: list[np.ndarray] = []

    def work() -> None:
        for _ in range(20):
            results.append(_stats(params, 1.0, False, True))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80
    for got in results:
        assert np.array_equal(got, expected)


# ------------------------------------------------------------------------------ CSV logger


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_csv_rows_match_stats(tmp_path: Path) -> None:
    """One CSV row per window with the documented columns, equal to opt.stats (round trip)."""
    path = tmp_path / "logs" / "grads.csv"
    model = _model()
    logger = CSVLogger(path, flush_every=4)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.named_parameters(), lr=0.05),
        max_norm=0.5,
        layer_stats=2,
        loggers=[logger],
    )
    train(model, opt, _batches(7, bad={4}))
    opt.close()
    rows = _read_csv(path)
    assert list(rows[0])[:10] == list(clipopt._diagnostics.loggers.BASE_COLUMNS)
    assert list(rows[0])[10:15] == [f"0.weight.{f}" for f in LAYER_FIELDS]
    assert len(rows) == 7
    for row, s in zip(rows, opt.stats, strict=True):
        assert int(row["step"]) == s.step
        assert int(row["micro_batches"]) == 1
        if s.skipped:
            assert row["total_norm"] == "nan" and row["reason"] == "nonfinite" and row["skipped"] == "1"
        else:
            assert float(row["total_norm"]) == s.total_norm
            assert float(row["clip_coef"]) == s.clip_coef
            assert row["reason"] == "" and row["skipped"] == "0"
        assert row["clipped"] == ("1" if s.clipped else "0")
        assert float(row["max_norm"]) == 0.5
        assert float(row["lr"]) == 0.05
        if s.layers is None and not s.skipped:
            assert row["0.weight.grad_norm"] == ""
        elif s.layers is not None:
            assert float(row["2.bias.grad_norm"]) == s.layers["2.bias"]["grad_norm"]
    # every 2nd window, and the non-finite window 5 with its own row (whatever the period)
    assert [r["step"] for r in rows if r["0.weight.grad_norm"]] == ["2", "4", "5", "6"]


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
@pytest.mark.parametrize("fused", [False, True])
def test_bad_window_row_names_the_nonfinite_parameter(tmp_path: Path, norm_type: float, fused: bool) -> None:
    """A non-finite window between two periodic statistics rows gets its own row from the norm pass:
    nonfinite = 1 exactly for the parameters whose gradient went non-finite, and (for the 2-norm)
    each other parameter's gradient norm of the combined window, equal to torch's vector_norm."""
    path = tmp_path / "grads.csv"
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.named_parameters(), lr=0.01, fused=fused),
        max_norm=1.0,
        norm_type=norm_type,
        accumulation_steps=2,
        layer_stats=10,
        loggers=[CSVLogger(path)],
    )
    expected: dict[str, float] = {}
    for i, x in enumerate(_batches(12)):
        model(x).pow(2).mean().backward()
        if i == 7:  # the second micro-batch of window 4
            weight = model[2].weight
            assert weight.grad is not None
            weight.grad[1, 3] = math.inf
            expected = {n: float(p.grad.double().norm() / 2) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    opt.close()
    rows = {r["step"]: r for r in _read_csv(path)}
    assert [s for s, r in rows.items() if r["0.weight.nonfinite"]] == ["4"]
    row = rows["4"]
    assert row["reason"] == "nonfinite"
    nonfinite = {n: float(row[f"{n}.nonfinite"]) for n in expected}
    assert nonfinite == {"0.weight": 0.0, "0.bias": 0.0, "2.weight": 1.0, "2.bias": 0.0}
    for name, value in expected.items():
        if norm_type != 2.0:
            assert math.isnan(float(row[f"{name}.grad_norm"]))  # only the 2-norm is a grad_norm
        elif name == "2.weight":
            assert float(row[f"{name}.grad_norm"]) == math.inf
        else:
            assert float(row[f"{name}.grad_norm"]) == pytest.approx(value, rel=1e-5)


def test_csv_is_buffered(tmp_path: Path) -> None:
    """Nothing is written before flush_every windows; close() writes the rest."""
    path = tmp_path / "grads.csv"
    model = _model()
    logger = CSVLogger(path, flush_every=3)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), loggers=[logger])
    train(model, opt, _batches(2))
    assert not path.exists()
    train(model, opt, _batches(1))
    assert len(_read_csv(path)) == 3
    train(model, opt, _batches(2))
    assert len(_read_csv(path)) == 3
    logger.close()
    assert [int(r["step"]) for r in _read_csv(path)] == [1, 2, 3, 4, 5]


def test_csv_adds_no_host_read_until_flush(tmp_path: Path) -> None:
    """With fused AdamW, logging reads nothing on windows that are not flushed, and once per flush."""
    model = _model()
    logger = CSVLogger(tmp_path / "g.csv", flush_every=4)
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), loggers=[logger])
    reads = reads_per_step(model, opt, _batches(8))
    assert reads[1:] == [0, 0, 1, 0, 0, 0, 1]


def test_csv_resume_appends_without_second_header(tmp_path: Path) -> None:
    """A resumed run with a new CSVLogger on the same file appends rows and writes no second header."""
    path = tmp_path / "grads.csv"
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), loggers=[CSVLogger(path)])
    train(model, opt, _batches(3))
    opt.close()
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = ClippedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.05), loggers=[CSVLogger(path)])
    opt2.load_state_dict(sd)
    train(model2, opt2, _batches(2))
    opt2.close()
    text = path.read_text()
    assert text.count("step,micro_batches") == 1
    assert [int(r["step"]) for r in _read_csv(path)] == [1, 2, 3, 4, 5]


def test_csv_refuses_other_columns(tmp_path: Path) -> None:
    """Appending to a CSV with other columns (layer_stats toggled) is a ValueError naming the path."""
    path = tmp_path / "grads.csv"
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), loggers=[CSVLogger(path)])
    train(model, opt, _batches(1))
    opt.close()
    opt2 = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), layer_stats=True, loggers=[CSVLogger(path)]
    )
    with pytest.raises(ValueError, match=re.escape(f"{path} already holds a CSV log with other columns")):
        train(model, opt2, _batches(1))


def test_csv_writes_at_exit(tmp_path: Path) -> None:
    """Buffered rows are written when the interpreter exits (atexit), without close()."""
    import subprocess
    import sys

    path = tmp_path / "exit.csv"
    code = (
        "import torch, clipopt\n"
        "m = torch.nn.Linear(2, 1)\n"
        f"opt = clipopt.ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), "
        f"loggers=[clipopt.CSVLogger({str(path)!r})])\n"
        "for _ in range(3):\n"
        "    m(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert len(_read_csv(path)) == 3


def test_unpickled_csv_logger_writes_at_exit(tmp_path: Path) -> None:
    """A wrapper pickled with rows still buffered in its CSVLogger (a checkpoint by pickle), then
    unpickled in a new process that trains on and exits without close(): the buffered rows and the
    new ones are written at exit (before, only the original logger was registered for it)."""
    import subprocess
    import sys

    path, saved = tmp_path / "exit.csv", tmp_path / "opt.pkl"
    train_code = (
        "for _ in range({n}):\n    m(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()\n"
    )
    first = (
        "import os, pickle, torch, clipopt\n"
        "m = torch.nn.Linear(2, 1)\n"
        f"opt = clipopt.ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), "
        f"loggers=[clipopt.CSVLogger({str(path)!r})])\n"
        + train_code.format(n=3)
        + f"open({str(saved)!r}, 'wb').write(pickle.dumps((m, opt)))\n"
        "os._exit(0)  # the process ends without its exit handlers: the rows stay in the pickle\n"
    )
    second = (
        f"import pickle, torch\nm, opt = pickle.loads(open({str(saved)!r}, 'rb').read())\n"
        + train_code.format(n=2)
    )
    subprocess.run([sys.executable, "-c", first], check=True, timeout=120)
    assert not path.exists()
    subprocess.run([sys.executable, "-c", second], check=True, timeout=120)
    assert [row["step"] for row in _read_csv(path)] == ["1", "2", "3", "4", "5"]


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "copy"])
def test_logger_copied_in_the_same_process_writes_no_row_twice(tmp_path: Path, how: str) -> None:
    """A copy of the wrapper (or of its CSVLogger) made in the process that keeps training the
    original (an in-memory checkpoint: pickle round trip, copy.deepcopy or copy.copy of the
    logger) does not write the rows buffered when it was made a second time at exit: the
    original writes them (before, the pickled and deep copies' exit flush wrote rows 1-3 again)."""
    import subprocess
    import sys

    path = tmp_path / "exit.csv"
    copy_of = {
        "pickle": "keep = pickle.loads(pickle.dumps(opt))\n",
        "deepcopy": "keep = copy.deepcopy(opt.loggers[0])\n",
        "copy": "keep = copy.copy(opt.loggers[0])\n",
    }[how]
    train_code = (
        "for _ in range({n}):\n    m(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()\n"
    )
    code = (
        "import copy, pickle, torch, clipopt\n"
        "m = torch.nn.Linear(2, 1)\n"
        f"opt = clipopt.ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), "
        f"loggers=[clipopt.CSVLogger({str(path)!r})])\n"
        + train_code.format(n=3)
        + copy_of
        + train_code.format(n=2)
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert [row["step"] for row in _read_csv(path)] == ["1", "2", "3", "4", "5"]


def test_logger_copy_used_in_the_same_process_writes_its_own_rows_at_exit(tmp_path: Path) -> None:
    """A copy made by a pickle round trip in the same process and trained on (a rollback to an
    in-memory checkpoint) writes the rows it logs itself at exit; the original writes the rows
    buffered before the copy (each row once)."""
    import subprocess
    import sys

    path = tmp_path / "exit.csv"
    code = (
        "import pickle, torch, clipopt\n"
        "m = torch.nn.Linear(2, 1)\n"
        f"opt = clipopt.ClippedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), "
        f"loggers=[clipopt.CSVLogger({str(path)!r})])\n"
        "for _ in range(3):\n    m(torch.ones(1, 2)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "m, back = pickle.loads(pickle.dumps((m, opt)))\n"
        "for _ in range(2):\n    m(torch.ones(1, 2)).sum().backward(); back.step(); back.zero_grad()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert sorted(row["step"] for row in _read_csv(path)) == ["1", "2", "3", "4", "5"]


def test_custom_logger_protocol() -> None:
    """Any object with log(stats, optimizer) and close() is a logger; it sees every window in order."""

    class Recorder:
        def __init__(self) -> None:
            self.steps: list[int] = []
            self.closed = 0

        def log(self, stats: StepStats, optimizer: ClippedOptimizer) -> None:
            assert optimizer.last_stats is stats
            self.steps.append(stats.step)

        def close(self) -> None:
            self.closed += 1

    rec = Recorder()
    assert isinstance(rec, clipopt.Logger)
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, loggers=[rec])
    train(model, opt, _batches(6))
    opt.close()
    assert rec.steps == [1, 2, 3]
    assert rec.closed == 1


def test_materialize_reads_once() -> None:
    """clipopt.materialize converts many StepStats, layer statistics included, with a single host read."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), max_norm=0.1, layer_stats=2)
    train(model, opt, _batches(5))
    stats = list(opt.stats)[1:]
    with_layers = [s.layers for s in stats if s.layers is not None]
    expected = [lay._values.tolist() for lay in with_layers if lay._values is not None]
    with count_host_reads() as reads:
        clipopt.materialize(stats)
    assert len(reads) == 1
    with count_host_reads() as reads:
        values = [(s.total_norm, s.clip_coef, s.clipped, s.skipped) for s in stats]
        rows = [s.layers.rows() for s in stats if s.layers is not None]
    assert len(reads) == 0
    assert rows == expected and len(rows) == 2
    assert all(isinstance(v[0], float) and isinstance(v[2], bool) for v in values)


def test_snapshot_dir_without_names_warns(tmp_path: Path) -> None:
    """snapshot_dir with unnamed parameters warns that snapshots will use positional names."""
    model = _model()
    with pytest.warns(UserWarning, match=re.escape("pass param_names=model.named_parameters()")):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=tmp_path)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClippedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            snapshot_dir=tmp_path,
            param_names=model.named_parameters(),
        )


@pytest.mark.parametrize(
    ("factory", "error", "message"),
    [
        (lambda: CSVLogger(3), TypeError, "path must be a str or os.PathLike, got int; pass e.g. 'grads.csv"),
        (lambda: CSVLogger("g.csv", flush_every=0), ValueError, "flush_every must be an int >= 1, got 0"),
        (lambda: CSVLogger("g.csv", flush_every=2.5), TypeError, "flush_every must be an int >= 1, got 2.5"),
    ],
)
def test_bad_csv_logger_arguments(factory: Any, error: type[Exception], message: str) -> None:
    """CSVLogger's bad arguments raise errors naming the argument, the value and the fix."""
    with pytest.raises(error, match=re.escape(message)):
        factory()


def _non_dense_params() -> list[torch.nn.Parameter]:
    """Parameters whose gradients (and some whose weights) are not contiguous: channels_last,
    transposed, expanded, and a strided 1-d view (large enough for the chunked CPU path)."""
    gen = torch.Generator().manual_seed(5)
    conv = torch.nn.Parameter(torch.randn(64, 32, 3, 3, generator=gen).to(memory_format=torch.channels_last))
    conv.grad = torch.randn(64, 32, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    lin = torch.nn.Parameter(torch.randn(300, 200, generator=gen).t())
    lin.grad = torch.randn(300, 200, generator=gen).t()
    wide = torch.nn.Parameter(torch.randn(40_000, generator=gen))
    wide.grad = torch.randn(1, generator=gen).expand(40_000)  # stride 0
    strided = torch.nn.Parameter(torch.randn(2 * 50_000, generator=gen)[::2])
    strided.grad = torch.randn(2 * 50_000, generator=gen)[::2]
    small = torch.nn.Parameter(torch.randn(20, 10, generator=gen).t())
    small.grad = torch.randn(20, 10, generator=gen).t()
    return [conv, lin, wide, strided, small]


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_layer_stats_of_non_contiguous_tensors(cpu_kernels: bool) -> None:
    """channels_last, transposed, expanded and strided gradients and weights give the same statistics
    as NumPy in float64 (element order does not matter to them)."""
    params = _non_dense_params()
    assert not any(p.grad is not None and p.grad.is_contiguous() for p in params)
    got = _stats(params, 1.0, True, cpu_kernels)
    want = _float64_reference(params, 1.0, True)
    if cpu_kernels:  # sums of dot pieces: ~1e-6
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=0)
        return
    # The generic path (the one used off CPU) takes torch's own norm kernel.  Extremes and counts are
    # exact.  On CPU that kernel sums the squares in float32 lane by lane, not pairwise: 40,000 equal
    # values come out 1e-5 to 3e-5 off depending on the value and on how many threads share them.
    # What float32 summation guarantees in any order is Higham's bound for a sum of n non-negative
    # terms, (n - 1) * 2**-24 relative, half of it for the norm (plus the square root's rounding).
    # And the layout must not matter: a non-dense view (expanded: stride 0; a slice with a step) was
    # summed one element after the other within each thread (2.4e-4 off for the expanded gradient
    # with OMP_NUM_THREADS=1): each norm equals torch's norm of the same values made contiguous.
    np.testing.assert_allclose(got[:, 1:4], want[:, 1:4], rtol=1e-7, atol=0)
    for row, p in enumerate(params):
        for col, t in ((0, p.grad), (4, p.detach())):
            assert t is not None
            bound = ((t.numel() - 1) / 2 + 1) * 2.0**-24
            assert got[row, col] == pytest.approx(want[row, col], rel=bound), (row, col)
            dense = float(torch._foreach_norm([t.contiguous()], 2.0)[0])
            assert got[row, col] == pytest.approx(dense, rel=1e-6), (row, col)


def test_flat_views_dense_non_contiguous_memory_without_copying() -> None:
    """A channels_last or transposed tensor is flattened as a view of its own memory (no copy: before,
    every such gradient was copied and all copies were held at once); an expanded one is copied."""
    cl = torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)
    tr = torch.randn(30, 20).t()
    for t in (cl, tr):
        v = F._flat(t)
        assert v.data_ptr() == t.data_ptr() and v.numel() == t.numel()
        assert sorted(v.tolist()) == sorted(t.reshape(-1).tolist())
    ex = torch.randn(1).expand(10)
    assert F._flat(ex).is_contiguous() and F._flat(ex).tolist() == ex.tolist()


def test_total_norm_of_a_strided_gradient_is_accurate() -> None:
    """A strided 1-d gradient of 1M elements: the dot path copies it first (a strided dot accumulates
    sequentially, 8e-5 off before), so the norm is within 5e-6 of float64."""
    g = torch.randn(2 << 20, generator=torch.Generator().manual_seed(0))[::2]
    truth = float(np.linalg.norm(g.double().numpy()))
    assert F.get_total_norm([g]).item() == pytest.approx(truth, rel=5e-6)


def test_layer_stats_ignore_a_non_cpu_default_device() -> None:
    """torch.set_default_device (here meta, standing in for cuda) does not move the CPU kernels'
    buffers away from the CPU gradients (before: 'Attempting to copy from device cpu to device meta')."""
    params = [_param((3, 50_000)), _param((100,), seed=1)]
    want = _float64_reference(params, 1.0, False)
    torch.set_default_device("meta")
    try:
        stats = clipopt_layers.compute_layer_stats(params, ["a", "b"], 1.0, False)
    finally:
        torch.set_default_device(None)
    np.testing.assert_allclose(np.array(stats.rows()), want, rtol=2e-6)


def test_layer_stats_after_a_first_call_in_inference_mode() -> None:
    """The per-thread scratch buffer first made under torch.inference_mode() still serves calls made
    outside it (before: 'Inplace update to inference tensor outside InferenceMode')."""
    params = [_param((3, 50_000))]
    want = _float64_reference(params, 1.0, False)
    results: list[np.ndarray] = []

    def worker() -> None:  # a fresh thread: its buffer is created by the first call
        with torch.inference_mode():
            results.append(np.array(clipopt_layers.compute_layer_stats(params, ["a"], 1.0, False).rows()))
        results.append(np.array(clipopt_layers.compute_layer_stats(params, ["a"], 1.0, False).rows()))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert len(results) == 2
    for got in results:
        np.testing.assert_allclose(got, want, rtol=2e-6)


def test_batched_small_gradients_in_several_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small gradients are taken in batches of at most CHUNK_NUMEL elements (|g| is a temporary copy);
    shrunk to 100, twenty gradients of 30-70 elements span several batches and still match NumPy."""
    monkeypatch.setattr(clipopt_layers, "CHUNK_NUMEL", 100)
    params = [_param((30 + 2 * i,), seed=i) for i in range(20)]
    got = np.array(clipopt_layers.compute_layer_stats(params, [str(i) for i in range(20)], 0.5, True).rows())
    np.testing.assert_allclose(got, _float64_reference(params, 0.5, True), rtol=2e-6)


# --------------------------------------- sparse gradients, parameter groups added later, copies


def test_sparse_gradients_with_layer_stats() -> None:
    """SparseAdam with clipping off and per-layer statistics works (sparse gradients are coalesced)."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = ClippedOptimizer(
        torch.optim.SparseAdam(emb.parameters()),
        max_norm=None,
        layer_stats=True,
        param_names=emb.named_parameters(),
    )
    emb(torch.tensor([1, 2, 2])).sum().backward()
    dense = emb.weight.grad.to_dense().clone()  # type: ignore[union-attr]
    opt.step()
    assert opt.last_stats is not None and opt.last_stats.layers is not None
    assert opt.last_stats.layers["weight"]["grad_norm"] == pytest.approx(dense.norm().item(), rel=1e-6)


def test_csv_rows_keep_their_width_after_add_param_group(tmp_path: Path) -> None:
    """A group added mid-run does not shift the per-layer columns of later rows."""
    model = TwoHeads()
    path = tmp_path / "g.csv"
    params = list(model.trunk.parameters()) + list(model.a.parameters())
    opt = ClippedOptimizer(torch.optim.SGD(params, lr=0.1), layer_stats=True, loggers=[CSVLogger(path)])
    task_run(model, opt, [("a", False)])
    opt.add_param_group({"params": list(model.b.parameters()), "lr": 0.2})
    task_run(model, opt, [("b", False)])
    opt.close()
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert len({len(r) for r in rows}) == 1


def test_names_of_groups_added_later() -> None:
    """add_param_group with param_names names those parameters in per-layer output."""
    model = TwoHeads()
    opt = ClippedOptimizer(torch.optim.SGD(model.trunk.named_parameters(), lr=0.1))
    opt.add_param_group({"params": list(model.a.parameters()), "param_names": ["a.weight", "a.bias"]})
    assert opt.layer_names() == ["weight", "bias", "a.weight", "a.bias"]


def test_deepcopy_shares_loggers(tmp_path: Path) -> None:
    """A deep copy of the optimizer logs into the same logger, so buffered rows are not written twice."""
    model = TwoHeads()
    path = tmp_path / "g.csv"
    logger = CSVLogger(path)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loggers=[logger])
    task_run(model, opt, [("a", False)] * 3)
    twin = copy.deepcopy(opt)
    assert twin.loggers[0] is logger
    opt.close()
    twin.close()
    with path.open(newline="") as f:
        steps = [r["step"] for r in csv.DictReader(f)]
    assert steps == ["1", "2", "3"]


def test_csv_logger_widens_when_a_parameter_group_is_added(tmp_path: Path) -> None:
    """Before: CSVLogger fixed its columns at the first row, so a group added later (unfreezing a
    layer) had no lr and no per-layer columns.  Now the file is rewritten once with the columns a new
    logger would use: earlier rows empty there, later rows filled, and a resumed run appends."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    path = tmp_path / "grads.csv"
    opt = ClippedOptimizer(
        torch.optim.SGD(head.parameters(), lr=0.1),
        param_names=[("head.weight", head.weight), ("head.bias", head.bias)],
        layer_stats=True,
        loggers=[CSVLogger(path, flush_every=1)],
    )
    x = torch.randn(6, 3)

    def window() -> None:
        head(torch.tanh(trunk(x))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        trunk.zero_grad()

    window()
    window()
    opt.add_param_group({"params": list(trunk.parameters()), "lr": 0.01})
    trunk_ref, head_ref = copy.deepcopy(trunk), copy.deepcopy(head)
    head_ref(torch.tanh(trunk_ref(x))).pow(2).sum().backward()
    assert trunk_ref.weight.grad is not None
    want = float(trunk_ref.weight.grad.double().norm())
    window()
    opt.close()
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)
    assert header is not None
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert "lr.1" in header and header.index("lr.1") < header.index("head.weight.grad_norm")
    assert [r["lr.1"] for r in rows] == ["", "", "0.01"]
    new_column = "group1.0.grad_norm"  # the trunk's weight (unnamed: it was added later)
    assert [r[new_column] == "" for r in rows] == [True, True, False]
    assert float(rows[2][new_column]) == pytest.approx(want, rel=1e-6)
    assert all(r["head.weight.grad_norm"] != "" for r in rows)

    # a resumed run (a new logger, the same groups) appends without a second header
    opt2 = ClippedOptimizer(
        torch.optim.SGD(head.parameters(), lr=0.1),
        param_names=[("head.weight", head.weight), ("head.bias", head.bias)],
        layer_stats=True,
        loggers=[CSVLogger(path, flush_every=1)],
    )
    opt2.add_param_group({"params": list(trunk.parameters()), "lr": 0.01})
    opt2.load_state_dict(opt.state_dict())
    head(torch.tanh(trunk(x))).pow(2).sum().backward()
    opt2.step()
    opt2.close()
    text = path.read_text()
    assert text.count("step,micro_batches") == 1
    assert text.strip().splitlines()[-1].startswith("4,")


def _unfreeze_run(path: Path, logger: CSVLogger) -> tuple[ClippedOptimizer, torch.nn.Linear, torch.nn.Linear]:
    """Two windows on the head, then the trunk is added as a second group and one more window runs."""
    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    opt = ClippedOptimizer(torch.optim.SGD(head.parameters(), lr=0.1), loggers=[logger])
    x = torch.randn(6, 3)
    for i in range(3):
        if i == 2:
            opt.add_param_group({"params": list(trunk.parameters()), "lr": 0.01})
        head(torch.tanh(trunk(x))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        trunk.zero_grad()
    opt.close()
    return opt, trunk, head


def test_csv_widening_that_fails_warns_and_keeps_a_consistent_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a failed rewrite (disk full) escaped opt.step(), lost the row, left a .tmp file and
    later rows longer than the header.  Now it warns, keeps the old columns, and every row fits."""
    path = tmp_path / "grads.csv"

    def no_space(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("clipopt._diagnostics.loggers.os.replace", no_space)
    with pytest.warns(RuntimeWarning, match="could not rewrite .* No space left on device"):
        _unfreeze_run(path, CSVLogger(path, flush_every=1))
    monkeypatch.undo()
    with path.open(newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0][-2:] == ["lr", "loss"] and len({len(line) for line in lines}) == 1
    assert [line[0] for line in lines[1:]] == ["1", "2", "3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grads.csv"]


def test_csv_resume_from_before_a_group_was_added_appends(tmp_path: Path) -> None:
    """Before: a file widened by add_param_group refused a run resumed from an earlier checkpoint
    (one group: fewer columns).  Now it is appended to in the file's column order, lr.1 empty."""
    path = tmp_path / "grads.csv"
    _unfreeze_run(path, CSVLogger(path, flush_every=1))
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 1)
    opt = ClippedOptimizer(torch.optim.SGD(head.parameters(), lr=0.1), loggers=[CSVLogger(path)])
    head(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.close()
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames is not None and reader.fieldnames[-1] == "lr.1"
    assert [(r["step"], r["lr"], r["lr.1"]) for r in rows] == [
        ("1", "0.1", ""),
        ("2", "0.1", ""),
        ("3", "0.1", "0.01"),
        ("1", "0.1", ""),
    ]


# ----------------------------------------------------------------------------- runs of skipped updates


def _skip_warnings(opt: ClippedOptimizer, model: torch.nn.Module, pattern: str) -> list[Any]:
    """Step ``opt`` once per character of ``pattern`` ('g': a good batch, 'b': a nan input, so the
    update is skipped) and return the RuntimeWarnings about skipped updates, with where they point."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for c in pattern:
            x = torch.randn(4, 6)
            if c == "b":
                x[0, 0] = math.nan
            model(x).pow(2).sum().backward()
            opt.step()  # the line a warning names
            opt.zero_grad()
        opt.close()
    return [w for w in caught if w.category is RuntimeWarning and "in a row were skipped" in str(w.message)]


_STEP_LINE = next(
    i + 1
    for i, line in enumerate(Path(__file__).read_text().splitlines())
    if "# the line a warning names" in line
)


def test_ten_skipped_updates_in_a_row_warn_once_per_run() -> None:
    """Ten skipped updates in a row (max_consecutive_nonfinite unset) give one RuntimeWarning that names
    the user's step() line, the count, the steps, the reason and what to check; nine do not; more
    skips in the same run do not warn again; after an applied update a new run of ten warns again."""
    model = mlp((6, 5, 2))
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), max_norm=1.0)
    caught = _skip_warnings(opt, model, "g" + "b" * 9 + "g" + "b" * 14 + "g" + "b" * 10)
    assert len(caught) == 2
    for w, (first, last) in zip(caught, ((12, 21), (27, 36)), strict=True):
        assert (w.filename, w.lineno) == (__file__, _STEP_LINE)
        assert str(w.message) == (
            f"clipopt: 10 updates in a row were skipped (steps {first}-{last}, reasons: 'nonfinite' x10): "
            f"no update has been applied since step {first - 1}; the gradients are not finite: look for "
            "nan/inf in the loss and the inputs (snapshot_dir= and `clipopt inspect` name the parameter), "
            "or lower the learning rate.  Shown once per run of skipped updates (an applied update starts "
            "a new one)."
        )
    assert opt.num_skipped == 33


def test_skipped_updates_of_a_fused_optimizer_warn_when_their_stats_are_read(tmp_path: Path) -> None:
    """With fused AdamW the skips are decided on the device and nothing is read to count them: the
    run of ten warns when a logger reads the rows (CSVLogger flushing every 5 windows), at the step()
    whose window completed the run; a run whose rows are never read does not warn, and reading no
    more than before: the skipped updates themselves make no host read."""
    model = mlp((6, 5, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    opt = ClippedOptimizer(inner, max_norm=1.0, loggers=[CSVLogger(tmp_path / "log.csv", flush_every=5)])
    caught = _skip_warnings(opt, model, "g" * 3 + "b" * 12)
    assert len(caught) == 1 and (caught[0].filename, caught[0].lineno) == (__file__, _STEP_LINE)
    assert "(steps 4-13, reasons: 'nonfinite' x10)" in str(caught[0].message)
    quiet = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True), max_norm=1.0)
    assert _skip_warnings(quiet, model, "g" * 3) == []
    x = torch.randn(4, 6)
    x[0, 0] = math.nan
    with count_host_reads() as reads:
        for _ in range(12):
            model(x).pow(2).sum().backward()
            quiet.step()
            quiet.zero_grad()
    assert len(reads) == 0


# ----------------------------------------------------------------------------- a float32 norm that overflows


_OVERFLOW_SETUPS = {
    "host": (torch.optim.SGD, {}, {}),
    "host-rows": (torch.optim.SGD, {}, {"layer_stats": 10, "csv": True}),
    "fused-rows": (torch.optim.AdamW, {"fused": True}, {"layer_stats": 10, "csv": True}),
    "fused-snapshot": (torch.optim.AdamW, {"fused": True}, {"snapshot": True}),
}


#: Two finite gradient elements whose norm (4.2e38) exceeds float32's range, and whose sum (0) does not.
HUGE = torch.tensor([3e38, -3e38])


@pytest.mark.parametrize("setup", list(_OVERFLOW_SETUPS))
def test_a_finite_gradient_whose_float32_norm_overflows_is_no_nonfinite_skip(
    setup: str, tmp_path: Path
) -> None:
    """Gradient elements of ±3e38 are finite but their norm exceeds float32's range (4.2e38; #35:
    smaller norms are taken without overflow and clipped): the update is skipped (clip_grad_norm_
    returns inf too, and clipping by it would zero the update) with reason 'norm_overflow', not
    counted as non-finite (max_consecutive_nonfinite=1 does not raise; before: reason 'nonfinite'
    and NonFiniteGradientError); an inf element is 'nonfinite' and raises.  On the host path, and on
    the fused path where per-layer rows or snapshots look at the elements."""
    kind, inner_kwargs, extra = _OVERFLOW_SETUPS[setup]
    model = mlp((6, 5, 2))
    loggers = [CSVLogger(tmp_path / "log.csv")] if extra.get("csv") else []
    opt = ClippedOptimizer(
        kind(model.parameters(), lr=0.01, **inner_kwargs),  # type: ignore[operator]
        max_norm=1.0,
        max_consecutive_nonfinite=1,
        param_names=model.named_parameters(),
        layer_stats=extra.get("layer_stats", False),
        loggers=loggers,
        snapshot_dir=tmp_path / "snaps" if extra.get("snapshot") else None,
    )
    for value in (None, None, HUGE, None, math.inf):
        model(torch.randn(4, 6)).pow(2).sum().backward()
        if value is not None:
            model[0].weight.grad.view(-1)[:2] = value
            reference = [p.grad.clone() for p in model.parameters()]
            want = torch.nn.utils.get_total_norm(reference)
        before = [p.detach().clone() for p in model.parameters()]
        if value is not HUGE and value == math.inf:
            with pytest.raises(clipopt.NonFiniteGradientError):
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
        if value is not None:
            stats = opt.last_stats
            assert stats is not None and stats.skipped and stats.total_norm == float(want) == math.inf
            assert stats.reason == ("norm_overflow" if value is HUGE else "nonfinite")
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.num_skipped == 2
    opt.close()
    if extra.get("csv"):
        rows = list(csv.DictReader((tmp_path / "log.csv").open()))
        assert [r["reason"] for r in rows] == ["", "", "norm_overflow", "", "nonfinite"]
    if extra.get("snapshot"):
        names = sorted(p.name for p in (tmp_path / "snaps").glob("*.pt"))
        assert names == ["anomaly-step00000003-norm_overflow.pt", "anomaly-step00000005-nonfinite.pt"]


def test_norm_overflow_round_trips_through_tensorboard(tmp_path: Path) -> None:
    """TensorBoardLogger tags a norm-overflow skip (a norm above float32's range)
    ``clipopt/norm_overflow`` and the report's reader of the event files (written by TensorBoard's
    own SummaryWriter) gives back that reason, and 'nonfinite' for an inf element (before: both
    read back as 'nonfinite')."""
    pytest.importorskip("tensorboard")
    from clipopt import TensorBoardLogger
    from clipopt._report.read import read_log

    model = mlp((6, 5, 2))
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), max_norm=1.0, loggers=[TensorBoardLogger(tmp_path)]
    )
    for value in (None, HUGE, None, math.inf):
        model(torch.randn(4, 6)).pow(2).sum().backward()
        if value is not None:
            model[0].weight.grad.view(-1)[:2] = value
        opt.step()
        opt.zero_grad()
    opt.close()
    log = read_log(tmp_path)
    assert log.reason == {1: "norm_overflow", 3: "nonfinite"}


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_the_candidate_rows_flags_match_the_exact_element_test(norm_type: float) -> None:
    """``element_flags`` (each gradient's norm and sum) flags the same gradients as
    ``functional.nonfinite_grads`` (its largest ``|g|``): a ``nan``, a ``+inf``, a ``-inf``, ``+inf``
    beside ``-inf``, finite elements of 1e25 and of 1e30 (the norm overflows, not the elements), an
    ordinary gradient, a sparse one holding a ``nan``; and the documented limit: finite elements of
    1e38, whose norm exceeds float32's range and whose sum overflows too, count as non-finite."""
    from clipopt._diagnostics.badrow import element_flags

    grads = [
        torch.tensor([1.0, math.nan, 2.0]),
        torch.tensor([1.0, math.inf]),
        torch.tensor([-math.inf, 3.0]),
        torch.tensor([math.inf, -math.inf]),
        torch.full((8,), 1e25),
        torch.full((8,), -1e30),
        torch.randn(5, 4),
        torch.sparse_coo_tensor([[0, 2]], [math.nan, 1.0], (4,)),
    ]
    norms = F.get_norms(grads, norm_type)
    want = F.nonfinite_grads(grads, norms, norm_type)
    assert want.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert torch.equal(element_flags(grads, norms, norm_type), want)
    huge = [torch.full((20,), 1e38)]  # finite, but the float32 sum is inf as well
    huge_norms = F.get_norms(huge, norm_type)
    assert F.nonfinite_grads(huge, huge_norms, norm_type).tolist() == [0.0]
    # the limit holds where the norm itself is beyond float32's range (p = 1, 2); the 3-norm, 2.7e38,
    # is taken without overflow (#35): a finite norm, no look at the sum
    beyond = norm_type in (1.0, 2.0)
    assert element_flags(huge, huge_norms, norm_type).tolist() == ([1.0] if beyond else [0.0])


def test_the_candidate_rows_sums_taken_piece_by_piece_flag_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With gradients large enough for ``dot`` pieces (the sizes shrunk: pieces of 8 elements from 16
    on), ``norms_and_sums`` gives ``get_norms``'s norms bit for bit and sums equal to each gradient's
    sum (to rounding), and the candidate row flags what the exact element test flags: a ``nan`` or an
    ``inf`` in the first, a middle or the last (partial) piece, ``+inf`` and ``-inf`` in different
    pieces, finite 1e25 elements (the norm overflows), a small and a sparse gradient beside them."""
    from clipopt._diagnostics.badrow import norm_with_row

    monkeypatch.setattr(F, "DOT_MIN_NUMEL", 16)
    monkeypatch.setattr(F, "DOT_PIECE_NUMEL", 8)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(29, generator=gen) for _ in range(6)] + [torch.full((20,), 1e25), torch.randn(5)]
    grads[1][0] = math.nan  # first piece
    grads[2][12] = math.inf  # a middle piece
    grads[3][-1] = -math.inf  # the last, partial piece
    grads[4][2], grads[4][20] = math.inf, -math.inf  # the pieces' sums are +inf and -inf
    grads.append(torch.sparse_coo_tensor([[1, 3]], [math.inf, 1.0], (40,)))
    norms, sums = F.norms_and_sums(grads, 2.0, None)
    torch.testing.assert_close(norms, F.get_norms(grads, 2.0), rtol=0, atol=0, equal_nan=True)  # bit for bit
    for g, s in zip(grads, sums, strict=True):
        dense = g.coalesce().values() if g.is_sparse else g
        torch.testing.assert_close(s, dense.sum(), equal_nan=True)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    _, row = norm_with_row(
        grads, params, [str(i) for i in range(len(grads))], norm_type=2.0, foreach=None, inv=1.0
    )
    assert row is not None
    flags = [r[3] for r in row.rows()]
    assert flags == F.nonfinite_grads(grads, norms, 2.0).tolist() == [0, 1, 1, 1, 1, 0, 0, 0, 1]


def test_layer_stats_after_clipopt_was_imported_under_another_default_device() -> None:
    """clipopt imported inside ``with torch.device("meta")`` (a fresh interpreter) still computes the
    statistics of a large CPU gradient: its constants are made on the CPU, whatever the default."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "with torch.device('meta'):\n"
        "    import clipopt\n"
        "p = torch.nn.Parameter(torch.zeros(1 << 15)); p.grad = torch.full((1 << 15,), -2.0)\n"
        "opt = clipopt.ClippedOptimizer(torch.optim.SGD([p], lr=0.1), layer_stats=True, param_names=['p'])\n"
        "opt.step()\n"
        "row = opt.last_stats.layers['p']\n"
        "print(row['grad_max'], row['grad_min'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "2.0 2.0\n", "")


def test_the_extremes_of_a_chunked_gradient_holding_a_nan_are_the_usual_nan(small_chunks: int) -> None:
    """A nan with any payload (here the largest, 0x7fffffff, in the middle chunk) gives ``grad_max``
    and ``grad_min`` torch's nan (0x7fc00000), not the payload that the bits' maximum would carry."""
    g = torch.randn(3 * small_chunks)
    g.view(torch.int32)[small_chunks + 5] = 0x7FFFFFFF
    p = torch.nn.Parameter(torch.zeros_like(g))
    p.grad = g
    for count_nonfinite in (True, False):
        values = clipopt_layers._layer_stats([p], 1.0, count_nonfinite)
        assert values[0, 1:3].view(torch.int32).tolist() == [0x7FC00000, 0x7FC00000]
