"""torch.compile: a compiled model under the wrapper, and a compiled opt.step with a fused optimizer."""

from __future__ import annotations

import copy
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn
from torch._dynamo.utils import counters

from clipopt import ClippedOptimizer, SpikeGuard

from ..helpers import mlp, pairs

_model = partial(mlp, (8, 16, 1))  # Linear(8, 16), Tanh, Linear(16, 1), global seed 0


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pairs(1, (16, 8), (16, 1), seed=i)[0]


def _four_updates_with_a_nan(m: nn.Module, opt: ClippedOptimizer, compile_step: bool) -> ClippedOptimizer:
    """Four updates of ``m`` through ``opt`` (the third with a NaN input, so it is skipped); after
    the first, eager one (it creates the state), through ``torch.compile(opt.step)`` if asked."""
    step = torch.compile(opt.step) if compile_step else opt.step
    for i in range(4):
        x, y = _batch(i)
        if i == 2:
            x = x.clone()
            x[0, 0] = float("nan")
        nn.functional.mse_loss(m(x), y).backward()
        (opt.step if i == 0 else step)()
        opt.zero_grad()
    return opt


def _graph_breaks(run) -> dict[str, int]:
    """Graph-break reasons (dynamo's full text) counted while ``run()`` compiles and runs."""
    dynamo.reset()
    counters.clear()
    run()
    return dict(counters["graph_break"])


def test_compiled_model_with_accumulating_wrapper() -> None:
    """torch.compile(model) + ClippedOptimizer(accumulation_steps=2) trains like the eager model, and
    model.zero_grad() inside a window is still caught (the guard's hook sits on the parameter)."""
    eager, compiled_src = _model(), _model()
    compiled = torch.compile(compiled_src)
    results = []
    for model, run in ((eager, eager), (compiled_src, compiled)):
        opt = ClippedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), max_norm=0.5, accumulation_steps=2
        )
        for i in range(4):
            x, y = _batch(i)
            nn.functional.mse_loss(run(x), y).backward()
            opt.step()
            opt.zero_grad()
        results.append(opt)
    for p, q in zip(eager.parameters(), compiled_src.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert results[1].num_updates == 2
    x, y = _batch(9)
    nn.functional.mse_loss(compiled(x), y).backward()
    results[1].step()
    compiled_src.zero_grad()
    nn.functional.mse_loss(compiled(x), y).backward()
    with pytest.raises(RuntimeError, match="cleared or replaced from outside"):
        results[1].step()


def test_compiled_step_fused_no_graph_break_from_clipopt() -> None:
    """torch.compile(opt.step) with fused AdamW: same parameters as the eager wrapper (a clipped update
    and a NaN skip included); the norm, clipping and skip decision compile without a graph break, the
    only break being the inner fused step itself, which torch's own compiled step never traces either."""
    model = _model()
    eager_model = copy.deepcopy(model)

    def train(m: nn.Module, compile_step: bool) -> ClippedOptimizer:
        opt = ClippedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True), max_norm=0.5)
        return _four_updates_with_a_nan(m, opt, compile_step)

    ours = _graph_breaks(lambda: train(model, True))
    eager_opt = train(eager_model, False)
    for p, q in zip(eager_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert eager_opt.num_skipped == 1

    def plain() -> None:
        m = _model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
        step = torch.compile(opt.step)
        for i in range(3):
            x, y = _batch(i)
            nn.functional.mse_loss(m(x), y).backward()
            (opt.step if i == 0 else step)()
            opt.zero_grad()

    torch_own = _graph_breaks(plain)
    # torch never traces its fused kernel: its own compiled step breaks around it ...
    assert any("_fused_adam" in reason and "torch.compiler.disable" in reason for reason in torch_own)
    # ... and clipopt's only break is that same place: the inner fused step, run eagerly
    assert ours and all(
        "_fused_inner_step" in reason and "should not be traced" in reason for reason in ours
    ), f"graph breaks from clipopt's own code: {list(ours)}"


def test_warning_in_compiled_step_names_the_users_line() -> None:
    """A warning raised while ``torch.compile(opt.step)`` runs (the SpikeGuard's, no ``loss=``)
    names the user's ``step()`` line, not torch/_dynamo/eval_frame.py (before: the walk out of
    clipopt stopped at the compiled function's wrapper)."""
    dynamo.reset()
    model = _model()
    guard = SpikeGuard(signals=("loss",))
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), max_norm=0.5, spike_guard=guard)
    step = torch.compile(opt.step, backend="eager")
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        step()
    where = [(w.filename, w.lineno) for w in record if "SpikeGuard watches the loss" in str(w.message)]
    assert where == [(__file__, line)]


def test_compiled_step_with_a_candidate_row_raises_no_dynamo_warning(tmp_path: Path) -> None:
    """torch.compile(opt.step) with per-layer rows logged (layer_stats + a CSV logger) and a
    parameter without a gradient (the candidate bad row's index path): no warning from dynamo
    about a traced ``functools.lru_cache`` (the index cache is left to eager windows), and the
    rows written equal the eager run's."""
    from clipopt import CSVLogger

    rows: list[str] = []
    for compile_step in (False, True):
        dynamo.reset()
        model = _model()
        unused = nn.Parameter(torch.ones(3))  # never gets a gradient
        path = tmp_path / f"compiled-{compile_step}.csv"
        opt = ClippedOptimizer(
            torch.optim.AdamW([*model.parameters(), unused], lr=1e-2, fused=True),
            max_norm=0.5,
            layer_stats=1000,
            loggers=[CSVLogger(path, flush_every=1000)],
        )
        step = torch.compile(opt.step, backend="eager") if compile_step else opt.step
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for i in range(3):
                x, y = _batch(i)
                if i == 2:
                    x = x.clone()
                    x[0, 0] = float("nan")  # a non-finite window: its candidate row is written
                nn.functional.mse_loss(model(x), y).backward()
                (opt.step if i == 0 else step)()
                opt.zero_grad()
        opt.close()
        assert [str(w.message) for w in record if "lru_cache" in str(w.message)] == []
        rows.append(path.read_text())
    assert rows[0] == rows[1]


def test_compiled_step_over_several_fused_inner_optimizers() -> None:
    """torch.compile(opt.step) over [fused SGD (the matrices), fused AdamW (the biases)]: the skip goes to
    both as found_inf from the compiled step; the parameters equal the eager wrapper's (a clipped update
    and a NaN skip included)."""
    model = _model()
    eager_model = copy.deepcopy(model)

    def train(m: nn.Module, compile_step: bool) -> ClippedOptimizer:
        matrices = [p for p in m.parameters() if p.ndim == 2]
        others = [p for p in m.parameters() if p.ndim != 2]
        inner = [
            torch.optim.SGD(matrices, lr=0.05, momentum=0.9, fused=True),
            torch.optim.AdamW(others, lr=1e-2, fused=True),
        ]
        opt = ClippedOptimizer(inner, max_norm=0.5)
        return _four_updates_with_a_nan(m, opt, compile_step)

    compiled_opt = train(model, True)
    eager_opt = train(eager_model, False)
    for p, q in zip(eager_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert compiled_opt.num_skipped == eager_opt.num_skipped == 1
