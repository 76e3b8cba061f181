"""Per-group clipping through ClippedOptimizer (docs/per-group-clipping.md).

The reference is torch's own functions applied group by group on copies of the combined gradient:
``clip_grad_value_`` per group with its bound, then ``clip_grad_norm_`` once over all the groups
without their own ``max_norm`` (with the wrapper's bound) and once per group with its own float bound.
Inner SGD with lr=1 and no momentum turns the clipped gradient into the parameter change exactly
(parameters start at 0: after one window they hold ``-clipped gradient``).
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clipopt import AGC, AutoClip, ClippedOptimizer, CSVLogger, ZClip
from clipopt._report.report import read_log

from ..helpers import mlp
from ..hostreads import count_host_reads
from ..strategies import clip_values, max_norms, norm_types

_SHAPES = hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=5)
_ELEMENTS = st.floats(min_value=-100, max_value=100, allow_nan=False, width=32)

#: relative tolerance of the applied update against the float64 reference
_RTOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2}


@dataclass
class Case:
    """Groups of parameter shapes, each group's options, and the micro-batch gradients."""

    shapes: list[list[tuple[int, ...]]]
    options: list[dict[str, Any]]  # the keys each group carries
    micro: list[list[list[np.ndarray]]]  # micro-batch -> group -> tensor


@st.composite
def cases(draw: st.DrawFn, max_k: int = 3) -> Case:
    """2-3 groups: each without keys, with its own float or None max_norm, maybe its own clip_value."""
    k = draw(st.integers(1, max_k))
    n_groups = draw(st.integers(2, 3))
    shapes = [[draw(_SHAPES) for _ in range(draw(st.integers(1, 2)))] for _ in range(n_groups)]
    options = []
    for _ in range(n_groups):
        opt: dict[str, Any] = {}
        kind = draw(st.sampled_from(["shared", "own", "none"]))
        if kind == "own":
            opt["max_norm"] = draw(max_norms)
        elif kind == "none":
            opt["max_norm"] = None
        if draw(st.booleans()):
            opt["clip_value"] = draw(st.one_of(st.none(), clip_values))
        options.append(opt)
    micro = [
        [[draw(hnp.arrays(np.float32, s, elements=_ELEMENTS)) for s in group] for group in shapes]
        for _ in range(k)
    ]
    return Case(shapes, options, micro)


def _build(case: Case, dtype: torch.dtype, fused: bool, **kwargs: Any) -> tuple[list[list[Any]], Any]:
    params = [[torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in group] for group in case.shapes]
    groups = [{"params": ps, **opt} for ps, opt in zip(params, case.options, strict=True)]
    inner = torch.optim.SGD(groups, lr=1.0, fused=fused or None)
    return params, ClippedOptimizer(inner, accumulation_steps=len(case.micro), **kwargs)


def _backward(params: list[list[Any]], grads: list[list[np.ndarray]]) -> None:
    """One micro-batch whose gradient is ``grads`` (accumulated by autograd like a real backward)."""
    loss = sum(
        (p * torch.tensor(g, dtype=p.dtype)).sum()
        for ps, gs in zip(params, grads, strict=True)
        for p, g in zip(ps, gs, strict=True)
    )
    loss.backward()  # type: ignore[union-attr]


def _reference(
    case: Case, dtype: torch.dtype, max_norm: float | None, clip_value: float | None, p: float, mean: bool
) -> tuple[list[list[torch.Tensor]], float, list[float], list[float]]:
    """The clipped combined gradient by torch's functions, its pre-clip total norm and group norms, and
    each group's coefficient (norm after value clipping against its bound)."""
    k = len(case.micro)
    refs = [[torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in group] for group in case.shapes]
    for g_index, group in enumerate(refs):
        for t_index, ref in enumerate(group):
            acc = torch.tensor(case.micro[0][g_index][t_index]).to(dtype)
            for m in case.micro[1:]:  # autograd accumulates in the gradient's dtype
                acc = acc + torch.tensor(m[g_index][t_index]).to(dtype)
            ref.grad = acc.double() / (k if mean else 1)
    every = [r.grad for group in refs for r in group]
    total = float(torch.nn.utils.get_total_norm(every, p))  # type: ignore[arg-type]
    norms = [float(torch.nn.utils.get_total_norm([r.grad for r in g], p)) for g in refs]  # type: ignore[misc]
    for group, opt in zip(refs, case.options, strict=True):
        value = opt.get("clip_value", clip_value)
        if value is not None:
            torch.nn.utils.clip_grad_value_(group, value)
    after = [float(torch.nn.utils.get_total_norm([r.grad for r in g], p)) for g in refs]  # type: ignore[misc]
    shared = [
        r for group, opt in zip(refs, case.options, strict=True) if "max_norm" not in opt for r in group
    ]
    shared_after = float(torch.nn.utils.get_total_norm([r.grad for r in shared], p)) if shared else 0.0  # type: ignore[misc]
    coefs = []
    for opt, norm in zip(case.options, after, strict=True):
        bound, own = (opt["max_norm"], True) if "max_norm" in opt else (max_norm, False)
        coefs.append(1.0 if bound is None else min(1.0, bound / ((norm if own else shared_after) + 1e-6)))
    if shared and max_norm is not None:
        torch.nn.utils.clip_grad_norm_(shared, max_norm, norm_type=p)
    for group, opt in zip(refs, case.options, strict=True):
        if opt.get("max_norm") is not None:
            torch.nn.utils.clip_grad_norm_(group, opt["max_norm"], norm_type=p)
    return [[r.grad for r in g] for g in refs], total, norms, coefs  # type: ignore[misc]


@given(
    cases(),
    st.one_of(st.none(), max_norms),
    st.one_of(st.none(), clip_values),
    norm_types,
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    st.booleans(),
    st.sampled_from(["mean", "sum"]),
)
def test_window_equals_torch_group_by_group(
    case: Case,
    max_norm: float | None,
    clip_value: float | None,
    p: float,
    dtype: torch.dtype,
    fused: bool,
    reduction: str,
) -> None:
    """One accumulated window with per-group options applies exactly torch's group-by-group clipping
    (value then norm, shared groups together), fused or not; the recorded total_norm, group_norms and
    group_coefs are the reference's pre-clip norms and coefficients."""
    fused = fused and dtype != torch.bfloat16  # torch's fused CPU SGD leaves bf16 parameters unchanged
    params, opt = _build(
        case, dtype, fused, max_norm=max_norm, clip_value=clip_value, norm_type=p, reduction=reduction
    )
    for grads in case.micro:
        _backward(params, grads)
        opt.step()
    expected, total, norms, coefs = _reference(case, dtype, max_norm, clip_value, p, reduction == "mean")
    rtol = max(_RTOL[dtype], 2e-7 if fused else 0.0)  # the fused kernel's grad_scale is float32
    for group, ref in zip(params, expected, strict=True):
        for param, r in zip(group, ref, strict=True):
            atol = rtol * float(r.abs().max()) + torch.finfo(dtype).tiny
            torch.testing.assert_close(-param.detach().double(), r, rtol=rtol, atol=atol)
    stats = opt.last_stats
    assert stats is not None and not stats.skipped
    assert stats.total_norm == pytest.approx(total, rel=1e-4, abs=1e-6)
    if not any(case.options):  # no group has a key: the single-bound path, nothing per group
        assert stats.group_norms == () and stats.group_coefs == ()
        return
    assert list(stats.group_norms) == pytest.approx(norms, rel=1e-4, abs=1e-6)
    # bf16 gradients hold a clamped value rounded (64.25 -> 64): the coefficient follows the gradient
    assert list(stats.group_coefs) == pytest.approx(coefs, rel=max(1e-3, _RTOL[dtype]), abs=1e-6)


def _two_groups(
    dtype: torch.dtype = torch.float32, **head: Any
) -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    """``mlp((4, 8, 3))`` in ``dtype`` and its two layers as two groups, the second with ``head``'s keys."""
    model = mlp((4, 8, 3), dtype=dtype)
    return model, [{"params": model[0].parameters()}, {"params": model[2].parameters(), **head}]


def _train(opt: ClippedOptimizer, model: torch.nn.Module, windows: int, seed: int = 1, k: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(windows * k):
        x = torch.randn(6, 4, generator=gen) * 5
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()


def test_stats_are_empty_without_group_keys() -> None:
    """Without any per-group key the single-bound path is unchanged: group_norms and group_coefs are ()."""
    model, groups = _two_groups()
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.1), max_norm=1.0)
    _train(opt, model, 1)
    assert opt.last_stats is not None
    assert opt.last_stats.group_norms == () and opt.last_stats.group_coefs == ()


@pytest.mark.parametrize(
    ("group", "error", "message"),
    [
        (
            {"max_norm": "big"},
            TypeError,
            "parameter group 1: 'max_norm' must be a float or None, got 'big' (str); set e.g. "
            "'max_norm': 1.0 in the group, or 'max_norm': None to leave the group out of norm clipping",
        ),
        (
            {"clip_value": -0.5},
            ValueError,
            "parameter group 1: 'clip_value' must be a positive finite number or None, got -0.5; set e.g. "
            "'clip_value': 0.5 in the group, or 'clip_value': None to leave the group out of value clipping",
        ),
    ],
)
def test_bad_group_options_are_refused_at_construction_and_in_add_param_group(
    group: dict[str, Any], error: type, message: str
) -> None:
    """The constructor and add_param_group refuse a bad option with the exact message naming the group
    index and key; add_param_group adds nothing then."""
    _, groups = _two_groups(**group)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        ClippedOptimizer(torch.optim.SGD(groups, lr=0.1))
    _model, groups = _two_groups()
    opt = ClippedOptimizer(torch.optim.SGD(groups[:1], lr=0.1))
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        opt.add_param_group({**groups[1], **group})
    assert len(opt.param_groups) == 1


def test_add_param_group_with_keys_is_clipped_by_them() -> None:
    """A group added with 'max_norm' is clipped by its own norm from the next window on."""
    model, groups = _two_groups()
    opt = ClippedOptimizer(torch.optim.SGD(groups[:1], lr=0.1), max_norm=100.0)
    opt.add_param_group({**groups[1], "max_norm": 1e-3})
    _train(opt, model, 1)
    stats = opt.last_stats
    assert stats is not None
    assert stats.group_coefs[0] == 1.0
    assert stats.group_coefs[1] == pytest.approx(1e-3 / (stats.group_norms[1] + 1e-6))


def test_option_made_invalid_between_windows_fails_before_anything_changes() -> None:
    """An option set to a bad value between windows makes the next closing step() raise with the exact
    message, with parameters, gradients and counters untouched."""
    model, groups = _two_groups(max_norm=0.5)
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.1))
    _train(opt, model, 1)
    opt.param_groups[1]["max_norm"] = 0.0
    model(torch.ones(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    message = (
        "parameter group 1: 'max_norm' must be a positive finite number or None, got 0.0; set e.g. "
        "'max_norm': 1.0 in the group, or 'max_norm': None to leave the group out of norm clipping"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        opt.step()
    assert opt.num_windows == 1 and opt.micro_batches == 0
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        assert torch.equal(p, b) and torch.equal(p.grad, g)  # type: ignore[arg-type]


def test_policies_that_do_not_combine_are_refused() -> None:
    """AGC with a group's own float bound and a global policy with every group bounded on its own are
    refused at construction (the messages are checked in full in test_group_options)."""
    _, groups = _two_groups(max_norm=0.5)
    with pytest.raises(
        ValueError, match=r"^parameter group 1 has its own 'max_norm': 0\.5, which cannot combine "
    ):
        ClippedOptimizer(torch.optim.SGD(groups, lr=0.1), max_norm=AGC())
    _, groups = _two_groups(max_norm=0.5)
    groups[0]["max_norm"] = None
    with pytest.raises(ValueError, match=r"^max_norm=AutoClip\(percentile=10, history=10000\) bounds the "):
        ClippedOptimizer(torch.optim.SGD(groups, lr=0.1), max_norm=AutoClip())


def test_autoclip_bounds_the_shared_groups_by_their_norm() -> None:
    """With a group of its own, AutoClip's history holds the norm of the shared groups only (torch's
    get_total_norm of their gradients), and the own group keeps its bound."""
    model, groups = _two_groups(max_norm=1e-3)
    policy = AutoClip(percentile=50, history=4)
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.0), max_norm=policy)
    x = torch.randn(6, 4) * 5
    model(x).pow(2).sum().backward()
    shared = float(torch.nn.utils.get_total_norm([p.grad for p in model[0].parameters()]))  # type: ignore[misc]
    opt.step()
    assert policy.state_dict()["buffer"][0].item() == pytest.approx(shared, rel=1e-5)
    stats = opt.last_stats
    assert stats is not None
    assert stats.group_coefs[0] == pytest.approx(shared / (shared + 1e-6))  # median of one norm: itself
    assert stats.group_coefs[1] == pytest.approx(1e-3 / (stats.group_norms[1] + 1e-6))


def test_zclip_combines_with_an_excluded_group() -> None:
    """ZClip next to a group left out of clipping runs and leaves that group's coefficient at 1."""
    model, groups = _two_groups(max_norm=None)
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.01), max_norm=ZClip(warmup_steps=2))
    _train(opt, model, 4)
    assert opt.last_stats is not None and opt.last_stats.group_coefs[1] == 1.0


def test_agc_leaves_an_excluded_group_alone() -> None:
    """AGC clips the groups without keys unit-wise (the formula written here) and leaves a group with
    'max_norm': None unclipped (only divided by the micro-batch count)."""
    model, groups = _two_groups(max_norm=None)
    opt = ClippedOptimizer(
        torch.optim.SGD(groups, lr=1.0), max_norm=AGC(clip_factor=0.01), accumulation_steps=2
    )
    before = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        model(torch.randn(6, 4, generator=gen) * 5).pow(2).sum().backward()
        if opt.micro_batches == 1:
            combined = [p.grad.detach().clone() / 2 for p in model.parameters()]  # type: ignore[union-attr]
        opt.step()
    delta = [b - p.detach() for p, b in zip(model.parameters(), before, strict=True)]
    for i in (0, 1):  # AGC: per row of the weight, the whole bias
        w, g = before[i], combined[i]
        dims = tuple(range(1, g.ndim)) or None
        w_norm = torch.linalg.vector_norm(w, dim=dims, keepdim=True).clamp_min(1e-3)
        g_norm = torch.linalg.vector_norm(g, dim=dims, keepdim=True).clamp_min(1e-6)
        expected = g * (0.01 * w_norm / g_norm).clamp(max=1.0)
        torch.testing.assert_close(delta[i], expected, rtol=1e-5, atol=1e-7)
    for i in (2, 3):
        torch.testing.assert_close(delta[i], combined[i], rtol=1e-6, atol=1e-7)


def test_nonfinite_in_an_own_group_skips_the_window() -> None:
    """A nan in a group with its own bound makes total_norm non-finite: the window is skipped (reason
    'nonfinite') and the parameters are unchanged, fused or not."""
    for fused in (False, True):
        model, groups = _two_groups(max_norm=0.5)
        opt = ClippedOptimizer(torch.optim.AdamW(groups, lr=0.1, fused=fused or None))
        _train(opt, model, 1)
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.ones(2, 4)).sum().backward()
        model[2].weight.grad[0, 0] = math.nan  # type: ignore[index]
        opt.step()
        stats = opt.last_stats
        assert stats is not None and stats.skipped and stats.reason == "nonfinite"
        assert math.isnan(stats.total_norm) and math.isnan(stats.group_norms[1])
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_fused_window_with_group_bounds_reads_nothing_back() -> None:
    """Per-group clipping on fused AdamW (own bound, excluded group, own clip_value) makes no host read."""
    model, groups = _two_groups(max_norm=0.5, clip_value=0.1)
    groups.append({"params": [torch.nn.Parameter(torch.randn(5))], "max_norm": None})
    opt = ClippedOptimizer(torch.optim.AdamW(groups, lr=0.1, fused=True), max_norm=1.0, accumulation_steps=2)
    extra = groups[2]["params"][0]
    for window in range(3):  # the first window creates the state (taken on the host path)
        for _ in range(2):
            model(torch.randn(3, 4) * 5).sum().backward()
            extra.grad = torch.randn(5) if extra.grad is None else extra.grad + torch.randn(5)
            with count_host_reads() as reads:
                opt.step()
            opt.zero_grad()
        if window > 0:
            assert reads.ours == []
    assert opt.num_windows == 3 and opt.num_updates == 3


def test_group_options_round_trip_through_the_state_dict(tmp_path: Path) -> None:
    """The options are part of the inner state dict: saved, loaded with weights_only=True into a fresh
    wrapper whose groups lack them, and resuming mid-window gives the same parameters bit for bit as
    never stopping."""
    model, groups = _two_groups(max_norm=0.05, clip_value=0.5)
    opt = ClippedOptimizer(torch.optim.AdamW(groups, lr=0.1), max_norm=0.2, accumulation_steps=2)
    _train(opt, model, 2, k=2)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()  # half a window
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    _train(opt, model, 2, seed=7, k=2)
    model2, groups2 = _two_groups()
    opt2 = ClippedOptimizer(torch.optim.AdamW(groups2, lr=0.1), max_norm=0.2, accumulation_steps=2)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert opt2.param_groups[1]["max_norm"] == 0.05 and opt2.param_groups[1]["clip_value"] == 0.5
    assert "max_norm" not in opt2.param_groups[0]
    _train(opt2, model2, 2, seed=7, k=2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.last_stats is not None and opt.last_stats is not None
    assert opt2.last_stats.group_coefs == opt.last_stats.group_coefs


def test_loading_bad_group_options_changes_nothing() -> None:
    """A state dict whose group holds a bad option is refused (ValueError naming it) before loading."""
    _model, groups = _two_groups(max_norm=0.5)
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.1))
    sd = opt.state_dict()
    sd["param_groups"][1]["max_norm"] = -2.0
    message = (
        "invalid state_dict: parameter group 1: 'max_norm' must be a positive finite number or None, got "
        "-2.0; set e.g. 'max_norm': 1.0 in the group, or 'max_norm': None to leave the group out of norm "
        "clipping"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        opt.load_state_dict(sd)
    assert opt.param_groups[1]["max_norm"] == 0.5


def test_csv_has_group_columns(tmp_path: Path) -> None:
    """CSVLogger writes group_norm.<g> and group_coef.<g> for every group, equal to the StepStats."""
    model, groups = _two_groups(max_norm=0.01)
    path = tmp_path / "grads.csv"
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.01), max_norm=1.0, loggers=[CSVLogger(path)])
    seen = []
    for _ in range(3):
        _train(opt, model, 1)
        seen.append(opt.last_stats)
    opt.close()
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert [c for c in rows[0] if c.startswith("group_")] == [
        "group_norm.0",
        "group_coef.0",
        "group_norm.1",
        "group_coef.1",
    ]
    for row, stats in zip(rows, seen, strict=True):
        assert stats is not None
        for g in (0, 1):
            assert float(row[f"group_norm.{g}"]) == stats.group_norms[g]
            assert float(row[f"group_coef.{g}"]) == stats.group_coefs[g]
    log = read_log(path)  # what `clipopt report` reads
    assert list(log.groups[1]["coef"]) == [s.group_coefs[1] for s in seen if s is not None]


def test_csv_gains_group_columns_when_a_group_gets_a_key(tmp_path: Path) -> None:
    """A key set on a group mid-run rewrites the CSV once with the group columns (earlier rows empty
    there); removing it later keeps the columns (rows leave them empty)."""
    model, groups = _two_groups()
    path = tmp_path / "grads.csv"
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.01), loggers=[CSVLogger(path, flush_every=1)])
    _train(opt, model, 1)
    opt.param_groups[1]["max_norm"] = 0.01
    _train(opt, model, 1)
    del opt.param_groups[1]["max_norm"]
    _train(opt, model, 1)
    opt.close()
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert [r["group_coef.1"] != "" for r in rows] == [False, True, False]
    assert float(rows[1]["group_coef.1"]) < 1.0


def test_csv_without_group_keys_keeps_its_columns(tmp_path: Path) -> None:
    """Without per-group keys no group column is written (existing logs keep their columns)."""
    model, groups = _two_groups()
    path = tmp_path / "grads.csv"
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.01), loggers=[CSVLogger(path)])
    _train(opt, model, 2)
    opt.close()
    header = path.read_text().splitlines()[0].split(",")
    assert not [c for c in header if c.startswith("group_")]


def test_tensorboard_has_group_scalars(tmp_path: Path) -> None:
    """TensorBoardLogger writes clipopt/group_norm/<g> and clipopt/group_coef/<g> per window."""
    pytest.importorskip(
        "tensorboard", reason="TensorBoardLogger needs the optional extra clipopt[tensorboard]"
    )
    from tensorboard.backend.event_processing import event_accumulator

    from clipopt import TensorBoardLogger

    model, groups = _two_groups(max_norm=0.01)
    logger = TensorBoardLogger(str(tmp_path / "tb"))
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=0.01), loggers=[logger])
    seen = []
    for _ in range(2):
        _train(opt, model, 1)
        seen.append(opt.last_stats)
    opt.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    for g in (0, 1):
        norms = {e.step: e.value for e in acc.Scalars(f"clipopt/group_norm/{g}")}
        coefs = {e.step: e.value for e in acc.Scalars(f"clipopt/group_coef/{g}")}
        for stats in seen:
            assert stats is not None
            assert norms[stats.step] == pytest.approx(stats.group_norms[g], rel=1e-6)
            assert coefs[stats.step] == pytest.approx(stats.group_coefs[g], rel=1e-6)


def test_nonfinite_window_with_group_keys_is_snapshotted(tmp_path: Path) -> None:
    """With per-group keys a non-finite window still writes its anomaly snapshot (reason 'nonfinite',
    the pre-clip gradients, the group options in the saved optimizer state)."""
    from clipopt import load_snapshot

    model, groups = _two_groups(max_norm=0.5)
    opt = ClippedOptimizer(
        torch.optim.SGD(groups, lr=0.1), snapshot_dir=tmp_path, param_names=model.named_parameters()
    )
    model(torch.ones(2, 4)).sum().backward()
    model[0].bias.grad[0] = math.inf  # type: ignore[index]
    opt.step()
    assert opt.last_snapshot is not None
    snap = load_snapshot(opt.last_snapshot)
    assert snap["reason"] == "nonfinite"
    assert math.isinf(snap["grads"]["0.bias"][0].item())
    assert snap["optimizer"]["param_groups"][1]["max_norm"] == 0.5


def test_lbfgs_reevaluations_are_clipped_by_the_group_bound() -> None:
    """LBFGS (one parameter group only) re-evaluates the closure; each re-evaluated gradient is clipped
    by the group's own max_norm (not the wrapper's 100), so the step ends with a gradient within it."""
    model, _ = _two_groups()
    group = {"params": model.parameters(), "max_norm": 1e-3}
    opt = ClippedOptimizer(torch.optim.LBFGS([group], lr=0.1, max_iter=3), max_norm=100.0)
    x = torch.randn(6, 4) * 5
    calls = [0]

    def closure() -> torch.Tensor:
        calls[0] += 1
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert calls[0] >= 2  # re-evaluated at least once
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])  # type: ignore[misc]
    assert float(norm) <= 1e-3 * (1 + 1e-5)
    assert opt.last_stats is not None and opt.last_stats.group_coefs[0] < 1e-2


def test_checkpoint_without_group_keys_keeps_the_keys_set_now() -> None:
    """A checkpoint saved before a group had 'max_norm' (per-group clipping added on resume) loads and
    keeps the option set now; a key the checkpoint holds wins, as every other group option does."""
    model, groups = _two_groups()
    old = ClippedOptimizer(torch.optim.SGD(groups, lr=0.1))
    _train(old, model, 1)
    saved = old.state_dict()
    _, groups = _two_groups(max_norm=0.25)
    new = ClippedOptimizer(torch.optim.SGD(groups, lr=0.1))
    new.load_state_dict(saved)
    assert new.param_groups[1]["max_norm"] == 0.25 and "max_norm" not in new.param_groups[0]
    _, groups = _two_groups(max_norm=0.5)
    holder = ClippedOptimizer(torch.optim.SGD(groups, lr=0.1))
    new.load_state_dict(holder.state_dict())
    assert new.param_groups[1]["max_norm"] == 0.5


def test_sparse_embedding_group_out_of_value_clipping() -> None:
    """A sparse-gradient embedding in a group with 'clip_value': None next to a dense group that
    inherits the wrapper's clip_value: the dense gradient is clamped, the sparse one is not (value
    clipping refuses sparse gradients, so without the key the window would raise)."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(10, 3, sparse=True)
    linear = torch.nn.Linear(3, 1)
    groups = [{"params": embed.parameters(), "clip_value": None}, {"params": linear.parameters()}]
    opt = ClippedOptimizer(torch.optim.SGD(groups, lr=1.0), max_norm=None, clip_value=1e-3)
    before = embed.weight.detach().clone(), linear.weight.detach().clone()
    (linear(embed(torch.tensor([1, 2, 2]))) * 100).sum().backward()
    raw = embed.weight.grad.to_dense().clone()  # type: ignore[union-attr]
    opt.step()
    assert torch.allclose(before[0] - embed.weight.detach(), raw)  # not clamped
    assert (before[1] - linear.weight.detach()).abs().max().item() <= 1e-3 * (1 + 1e-6)
    bare = ClippedOptimizer(torch.optim.SGD(embed.parameters(), lr=1.0), max_norm=None, clip_value=1e-3)
    linear(embed(torch.tensor([1]))).sum().backward()
    with pytest.raises(TypeError, match=r"^clip_value does not support sparse gradients"):
        bare.step()
