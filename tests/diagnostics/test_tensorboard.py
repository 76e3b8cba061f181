"""TensorBoardLogger: scalars and histograms read back from the event file, buffering, host reads,
and the ImportError without the optional extra."""

from __future__ import annotations

import builtins
import subprocess
import sys
import threading
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("tensorboard", reason="TensorBoardLogger needs the optional extra clipopt[tensorboard]")

from tensorboard.backend.event_processing import event_accumulator

from clipopt import LAYER_FIELDS, ClippedOptimizer, StepStats
from clipopt._diagnostics.tensorboard import TensorBoardLogger

from ..helpers import inputs, mlp, train
from ..hostreads import count_host_reads

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]
ACC = 2  # micro-batches per window
# its second micro-batch has an inf input (NaN gradients): skipped, and a layer-stats window (layer_stats=2)
BAD_WINDOW = 4


_model = partial(mlp, (4, 6, 2))  # Linear(4, 6), Tanh, Linear(6, 2), global seed 0
# Inputs; those in ``bad`` hold an inf, which leaves a NaN column in 0.weight's gradient only.
# (tanh saturates, so the rest of the gradient stays finite: 0 * inf = nan in that column.)
_batches = partial(inputs, shape=(5, 4), seed=1, scale=3, bad_value=float("inf"))


def _events(log_dir: Path) -> event_accumulator.EventAccumulator:
    """Everything on disk in ``log_dir`` (no sampling: every scalar and histogram is kept)."""
    acc = event_accumulator.EventAccumulator(
        str(log_dir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0}
    )
    acc.Reload()
    return acc


def _scalars(acc: event_accumulator.EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


class _GradSpy:
    """A logger placed after the TensorBoardLogger: copies p.grad as the loggers see it, per step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    def log(self, stats: StepStats, optimizer: ClippedOptimizer) -> None:
        self.grads[stats.step] = {
            n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None
        }

    def close(self) -> None:
        pass


@pytest.fixture(scope="module", params=["foreach", "fused"])
def run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ClippedOptimizer, _GradSpy, Path]:
    """Six windows of two micro-batches with two parameter groups; window 4 is non-finite (skipped).

    A skipped window leaves no gradients on the host path (AdamW foreach); with fused AdamW
    (windows 2-6) the kernel skips on the device and the non-finite gradients stay in p.grad.
    """
    log_dir = tmp_path_factory.mktemp("tb")
    model = _model()
    spy = _GradSpy(model)
    groups = [
        {"params": list(model[0].parameters()), "lr": 0.01},
        {"params": list(model[2].parameters()), "lr": 0.003},
    ]
    fused = request.param == "fused"
    inner = torch.optim.AdamW(groups, fused=fused, foreach=None if fused else True)
    opt = ClippedOptimizer(
        inner,
        max_norm=0.5,
        accumulation_steps=ACC,
        param_names=model.named_parameters(),
        layer_stats=2,
        loggers=[TensorBoardLogger(log_dir), spy],
    )
    train(model, opt, _batches(6 * ACC, bad={(BAD_WINDOW - 1) * ACC + 1}))
    opt.close()
    assert bool(spy.grads[BAD_WINDOW]) == fused  # the fused kernel left the skipped window's p.grad
    return opt, spy, log_dir


def test_scalars_match_stats(run: tuple[ClippedOptimizer, _GradSpy, Path]) -> None:
    """Every window's scalars are in the event file, at global_step = stats.step, equal to opt.stats."""
    opt, _, log_dir = run
    acc = _events(log_dir)
    stats = {s.step: s for s in opt.stats}
    assert sorted(stats) == [1, 2, 3, 4, 5, 6]
    total_norm = _scalars(acc, "clipopt/total_norm")
    assert sorted(total_norm) == sorted(stats)
    for step, s in stats.items():
        if step == BAD_WINDOW:
            assert total_norm[step] != total_norm[step]  # nan
        else:
            assert total_norm[step] == pytest.approx(s.total_norm, rel=1e-6)
        assert _scalars(acc, "clipopt/clip_coef")[step] == pytest.approx(s.clip_coef, rel=1e-6, nan_ok=True)
        assert _scalars(acc, "clipopt/clipped")[step] == float(s.clipped)
        assert _scalars(acc, "clipopt/max_norm")[step] == pytest.approx(0.5)
        assert _scalars(acc, "clipopt/micro_batches")[step] == ACC
        assert _scalars(acc, "clipopt/lr")[step] == pytest.approx(0.01, rel=1e-6)
        assert _scalars(acc, "clipopt/lr.1")[step] == pytest.approx(0.003, rel=1e-6)
    assert _scalars(acc, "clipopt/skipped") == {k: float(k == BAD_WINDOW) for k in stats}
    assert any(s.clipped for s in stats.values())  # clip_coef/clipped are not trivially 1/0


def test_max_norm_scalar_absent_when_off(tmp_path: Path) -> None:
    """Without norm clipping there is no clipopt/max_norm tag (and histograms=False writes none)."""
    model = _model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        max_norm=None,
        layer_stats=True,
        loggers=[TensorBoardLogger(tmp_path, histograms=False)],
    )
    train(model, opt, _batches(3))
    opt.close()
    acc = _events(tmp_path)
    assert "clipopt/max_norm" not in acc.Tags()["scalars"]
    assert sorted(_scalars(acc, "clipopt/total_norm")) == [1, 2, 3]
    assert sorted(_scalars(acc, "clipopt/layers/group0.0/grad_norm")) == [1, 2, 3]
    assert acc.Tags()["histograms"] == []


def test_layer_scalars_only_at_layer_stats_steps(run: tuple[ClippedOptimizer, _GradSpy, Path]) -> None:
    """clipopt/layers/<name>/<field> exists for every parameter and field, at steps 2, 4, 6 only."""
    opt, _, log_dir = run
    acc = _events(log_dir)
    layer_tags = {t for t in acc.Tags()["scalars"] if t.startswith("clipopt/layers/")}
    assert layer_tags == {f"clipopt/layers/{n}/{f}" for n in NAMES for f in LAYER_FIELDS}
    for s in opt.stats:
        if s.layers is None:
            continue
        for name, values in s.layers.as_dict().items():
            for field, value in values.items():
                got = _scalars(acc, f"clipopt/layers/{name}/{field}")
                assert sorted(got) == [2, 4, 6]
                assert got[s.step] == pytest.approx(value, rel=1e-6, nan_ok=True)
    assert _scalars(acc, "clipopt/layers/0.weight/nonfinite")[BAD_WINDOW] > 0


def test_histograms_only_at_applied_layer_stats_steps(run: tuple[ClippedOptimizer, _GradSpy, Path]) -> None:
    """clipopt/grad/<name> histograms p.grad at log time, at layer-stats steps whose update was applied."""
    _, spy, log_dir = run
    acc = _events(log_dir)
    assert set(acc.Tags()["histograms"]) == {f"clipopt/grad/{n}" for n in NAMES}
    for name in NAMES:
        events = acc.Histograms(f"clipopt/grad/{name}")
        assert [e.step for e in events] == [2, 6]  # 4 is a layer-stats step, but skipped
        for e in events:
            g = spy.grads[e.step][name].double()
            h = e.histogram_value
            assert h.num == g.numel()
            assert h.min == pytest.approx(g.min().item(), rel=1e-5)
            assert h.max == pytest.approx(g.max().item(), rel=1e-5)
            assert h.sum == pytest.approx(g.sum().item(), rel=1e-4, abs=1e-9)


def test_histograms_leave_out_nonfinite_elements(tmp_path: Path) -> None:
    """An applied window with NaN gradient elements (skip_nonfinite=False) histograms the finite ones."""
    model = _model()
    spy = _GradSpy(model)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        max_norm=None,  # a NaN norm would make the clip coefficient (and every element) NaN
        skip_nonfinite=False,
        param_names=model.named_parameters(),
        layer_stats=True,
        loggers=[TensorBoardLogger(tmp_path), spy],
    )
    train(model, opt, _batches(2, bad={1}))
    opt.close()
    acc = _events(tmp_path)
    grad = spy.grads[2]["0.weight"]
    finite = grad[torch.isfinite(grad)].double()
    assert 0 < finite.numel() < grad.numel()  # control: some, not all, elements are NaN
    (event,) = [e for e in acc.Histograms("clipopt/grad/0.weight") if e.step == 2]
    assert event.histogram_value.num == finite.numel()
    assert event.histogram_value.sum == pytest.approx(finite.sum().item(), rel=1e-4, abs=1e-9)
    assert [e.step for e in acc.Histograms("clipopt/grad/2.weight")] == [1, 2]


def test_flush_every_buffers_scalars(tmp_path: Path) -> None:
    """Nothing is written before flush_every windows; a full buffer is written; close() writes the rest."""
    model = _model()
    logger = TensorBoardLogger(tmp_path, flush_every=3)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loggers=[logger])
    batches = _batches(5)
    seen = []
    for i in range(5):
        train(model, opt, batches[i : i + 1])
        seen.append(sorted(_scalars(_events(tmp_path), "clipopt/total_norm")))
    assert seen == [[], [], [1, 2, 3], [1, 2, 3], [1, 2, 3]]
    opt.close()
    assert sorted(_scalars(_events(tmp_path), "clipopt/total_norm")) == [1, 2, 3, 4, 5]
    opt.close()  # a second close is harmless and writes nothing twice
    assert [e.step for e in _events(tmp_path).Scalars("clipopt/total_norm")] == [1, 2, 3, 4, 5]


def test_close_stops_the_writer(tmp_path: Path) -> None:
    """close() closes the event writer: the writer thread it started is gone."""
    before = set(threading.enumerate())
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loggers=[TensorBoardLogger(tmp_path)])
    train(model, opt, _batches(2))
    assert [t for t in threading.enumerate() if t not in before]  # control: the writer runs a thread
    opt.close()
    assert [t for t in threading.enumerate() if t not in before] == []


def test_logging_after_close_continues(tmp_path: Path) -> None:
    """A closed logger keeps working: later windows go to a new event file in the same folder."""
    model = _model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loggers=[TensorBoardLogger(tmp_path)])
    train(model, opt, _batches(2))
    opt.close()
    train(model, opt, _batches(2))
    opt.close()
    assert sorted(_scalars(_events(tmp_path), "clipopt/total_norm")) == [1, 2, 3, 4]


def test_no_host_read_on_windows_not_written(tmp_path: Path) -> None:
    """With fused AdamW, windows without layer stats and before a flush read nothing from the device."""
    model = _model()
    logger = TensorBoardLogger(tmp_path, flush_every=4)
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), fused=True), max_norm=0.1, layer_stats=4, loggers=[logger]
    )
    reads: list[list[str]] = []
    for x in _batches(7):
        model(x).pow(2).mean().backward()
        with count_host_reads() as r:
            opt.step()
        reads.append(r.ours)
        opt.zero_grad()
    # window 1 takes the host path (no inner state yet); 4 has layer stats and is a flush boundary
    assert reads[1] == [] and reads[2] == [] and reads[4] == [] and reads[5] == [] and reads[6] == []
    assert len(reads[3]) > 1  # the optimizer's flag, then the logger's reads
    assert sorted(_scalars(_events(tmp_path), "clipopt/total_norm")) == [1, 2, 3, 4]
    with count_host_reads() as r:
        opt.close()  # windows 5-7: one read
    assert len(r) == 1, r.ours


def test_import_error_without_tensorboard(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without tensorboard, constructing the logger raises ImportError naming the extra to install."""
    loaded = ("tensorboard", "tensorboard.", "torch.utils.tensorboard")
    for name in [m for m in sys.modules if m.startswith(loaded)]:
        monkeypatch.delitem(sys.modules, name)
    real_import = builtins.__import__

    def blocked(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)
    with pytest.raises(ImportError, match=r"pip install 'clipopt\[tensorboard\]'"):
        TensorBoardLogger(tmp_path)
    assert not list(tmp_path.iterdir())


def test_import_clipopt_without_tensorboard() -> None:
    """Importing clipopt and its TensorBoard module works without tensorboard (the import is lazy)."""
    code = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "import clipopt, clipopt._diagnostics.tensorboard\n"
        "assert 'torch.utils.tensorboard' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_arguments_checked(tmp_path: Path) -> None:
    """Bad arguments are refused with the fix in the message."""
    with pytest.raises(ValueError, match="flush_every=100"):
        TensorBoardLogger(tmp_path, flush_every=0)
    with pytest.raises(TypeError, match="log_dir"):
        TensorBoardLogger(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="histograms"):
        TensorBoardLogger(tmp_path, histograms="yes")  # type: ignore[arg-type]


def test_failing_event_file_neither_piles_up_rows_nor_breaks_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of #11: once TensorBoard's writer failed (disk full) every later write raised, so the
    logger kept every window's scalars in memory for ever and close() raised the OSError (at exit
    too).  Now one warning, the dropped windows are counted, the buffer stays bounded, close() works."""
    import errno

    import tensorboard.summary.writer.record_writer as record_writer

    model = torch.nn.Linear(3, 1)
    tb = TensorBoardLogger(tmp_path / "tb", flush_every=5, histograms=False)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), max_norm=1.0, loggers=[tb])

    def window() -> None:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(5):
        window()

    def full(self: Any, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # TensorBoard's thread dies
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(30):
            window()
        tb.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "could not write the TensorBoard log" in messages[0]
    assert len(tb._buffer) == 0 and tb.rows_dropped == 30


def test_spike_and_rewind_reasons_reach_tensorboard_and_the_report(tmp_path: Path) -> None:
    """Spike skips and rewinds are scalars clipopt/spike and clipopt/rewind; the report reads them back."""
    from clipopt import Rewind, SpikeGuard
    from clipopt._report.report import analyze, read_log

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    rewind = Rewind(every=5, spikes=2, within=5, skip_batches=0, check_every=1)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        spike_guard=SpikeGuard(z_thresh=50.0, window=8, warmup=4),
        rewind=rewind,
        loggers=[TensorBoardLogger(tmp_path / "tb")],
    )
    gen = torch.Generator().manual_seed(1)
    for i in range(20):
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
        loss = ((model(x) - y * (1000 if i in (12, 14) else 1)) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    log = read_log(str(tmp_path / "tb"))
    assert sorted((log.steps[i], r) for i, r in log.reason.items()) == [
        (13, "spike"),
        (15, "spike"),
        (16, "rewind"),
    ]
    assert analyze(log)["summary"]["rewinds"] == 1
