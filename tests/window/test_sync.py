"""Host-read freedom: what clipopt reads back from the device, per call, across optimizers."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from clipopt import ClippedOptimizer

from ..helpers import TwoHeads, mlp
from ..hostreads import count_host_reads
from ..optim_db import PLAIN, OptimInfo, params, select

FUSED = select("fused")
OTHERS = select(exclude=("fused", *PLAIN))  # the foreach and for-loop variants a plain loop can drive


_model = partial(mlp, (6, 5, 2))  # Linear(6, 5), Tanh, Linear(5, 2), global seed 0


def _backward(model: torch.nn.Module, bad: bool = False) -> None:
    x = torch.randn(4, 6)
    if bad:
        x[0, 0] = float("nan")
    model(x).pow(2).sum().mul(10).backward()


def _run(info: OptimInfo, pattern: str, **kwargs: object) -> list[int]:
    """Reads per step() call for a pattern of micro-batches ('g' good, 'b' bad)."""
    model = _model()
    opt = ClippedOptimizer(info.make(list(model.parameters())), max_norm=0.1, **kwargs)  # type: ignore[arg-type]
    counts = []
    for c in pattern:
        _backward(model, bad=c == "b")
        with count_host_reads() as reads:
            opt.step()
            stats = opt.last_stats  # recording and holding statistics reads nothing
        counts.append(len(reads))
        del stats
        opt.zero_grad()
    return counts


@pytest.mark.parametrize("info", params(FUSED + OTHERS))
def test_micro_batch_calls_read_nothing(info: OptimInfo) -> None:
    """A micro-batch call (inside a window) makes no host read, for every optimizer."""
    counts = _run(info, "gggggggg", accumulation_steps=4)
    assert [counts[i] for i in (0, 1, 2, 4, 5, 6)] == [0] * 6


@pytest.mark.parametrize("info", params(FUSED))
def test_fused_update_reads_nothing(info: OptimInfo) -> None:
    """With a fused inner optimizer a whole update, applied or skipped, reads nothing (after the first)."""
    counts = _run(info, "ggbgbbg", accumulation_steps=1)
    assert counts[0] <= 1  # the first update, before the optimizer has state, may read once
    assert counts[1:] == [0] * 6


@pytest.mark.parametrize("info", params(FUSED))
def test_fused_update_with_value_clipping_and_accumulation_reads_nothing(info: OptimInfo) -> None:
    """Value clipping, mean accumulation and a skipped window add no read on the fused path."""
    counts = _run(info, "gg" + "gggg" + "ggbg" + "gggg", accumulation_steps=2, clip_value=0.05)
    assert counts[2:] == [0] * 12


@pytest.mark.parametrize("info", params(OTHERS))
def test_other_optimizers_read_at_most_once_per_update(info: OptimInfo) -> None:
    """Every other optimizer: clipopt reads at most one flag per update, none when skip_nonfinite=False."""
    assert max(_run(info, "ggbgg", accumulation_steps=1)) <= 1
    assert _run(info, "ggg", accumulation_steps=1, skip_nonfinite=False) == [0, 0, 0]


def test_fused_with_grad_scaler_reads_nothing() -> None:
    """Fused AdamW with a GradScaler: unscale, clip, step and scaler update without a host read."""
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), max_norm=0.1, scaler=scaler)
    counts = []
    for bad in (False, False, True, False):
        x = torch.randn(4, 6)
        if bad:
            x[0, 0] = float("inf")
        scaler.scale(model(x).pow(2).sum()).backward()
        with count_host_reads() as reads:
            opt.step()
        counts.append(len(reads))
        opt.zero_grad()
    assert counts[1:] == [0, 0, 0]
    assert opt.num_skipped == 1


def test_counter_detects_reads() -> None:
    """The interceptor itself sees .item(), float(), bool(), tolist() and boolean-mask indexing."""
    t = torch.tensor([1.0, 2.0])
    with count_host_reads() as reads:
        t.sum().item()
        float(t[0])
        bool(t[1] > 0)
        t.tolist()
        t[t > 1]
    assert len(reads) >= 5


# ------------------------------------------------------------------------ tensor learning rates


def test_tensor_learning_rate_is_not_read_on_the_fused_path() -> None:
    """A tensor lr (fused AdamW) is recorded without a host read; it becomes a float when read."""
    model = TwoHeads()
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True))
    reads = []
    for _ in range(3):
        model.loss("a", torch.ones(2, 3)).backward()
        with count_host_reads() as r:
            opt.step()
        reads.append(len(r))
        opt.zero_grad()
    assert reads[1:] == [0, 0]
    assert opt.last_stats is not None and opt.last_stats.lr == (pytest.approx(0.01),)


class _FromPythonData(torch.utils._python_dispatch.TorchDispatchMode):
    """Records ``aten.lift_fresh``: a tensor made from Python data (``torch.tensor(x, ...)``); on an
    accelerator that is a blocking host-to-device copy, which sync debug mode "error" refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.lift_fresh.default:
            self.seen += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("info", params(FUSED))
def test_fused_update_without_norm_clipping_makes_no_tensor_from_python_data(info: OptimInfo) -> None:
    """max_norm=None with mean accumulation leaves a Python scale (1/2) for the fused kernel's
    grad_scale: it is made on the device (torch.full), not copied from the host (torch.tensor)."""
    model = _model()
    opt = ClippedOptimizer(info.make(list(model.parameters())), max_norm=None, accumulation_steps=2)
    for i in range(8):
        _backward(model)
        mode = _FromPythonData()
        with mode:
            opt.step()
        opt.zero_grad()
        if i >= 3:  # after the first update (state exists: the fused path)
            assert mode.seen == 0, i
    assert opt.num_updates == 4


@pytest.mark.parametrize("info", params(FUSED))
@pytest.mark.parametrize("every_grad", [True, False], ids=["every-param-has-a-grad", "one-head-without"])
def test_windows_with_a_candidate_row_make_no_tensor_from_python_data(
    tmp_path: Path, info: OptimInfo, every_grad: bool
) -> None:
    """With per-layer rows logged (layer_stats + a CSV logger), every window that is not due keeps a
    candidate bad row from the norm pass: its row index is not copied from a Python list each
    window (a blocking host-to-device copy on an accelerator), and the window reads nothing; also
    when some parameters have no gradient (a two-headed model trained on one head)."""
    from clipopt import CSVLogger

    model = TwoHeads()
    logger = CSVLogger(tmp_path / "grads.csv", flush_every=1000)
    opt = ClippedOptimizer(info.make(list(model.parameters())), layer_stats=1000, loggers=[logger])
    for i in range(6):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(i))
        (model.loss("a", x) + (model.loss("b", x) if every_grad else 0.0)).backward()
        mode = _FromPythonData()
        with mode, count_host_reads() as reads:
            opt.step()
        opt.zero_grad()
        if i >= 2:  # after the first update (state exists: the fused path) and the first row
            assert (mode.seen, len(reads)) == (0, 0), i
    assert opt.num_updates == 6
    opt.close()
