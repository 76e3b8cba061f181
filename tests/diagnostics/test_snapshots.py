"""Anomaly snapshots (docs/diagnostics.md, 'Anomaly snapshots'): content, replay, atomic writes,
limits and ``attach``.

The model used throughout is ``Linear -> GuardedSqrt -> Linear``.  ``GuardedSqrt``
is the classic ``torch.where`` pitfall: ``where(x > 0, sqrt(x), 0)`` is finite in
the forward pass, but its backward multiplies the zero gradient of the discarded
branch by ``d sqrt/dx`` at a negative ``x``, which is NaN.  With positive first-layer
weights and bias, inputs in ``[0, 1)`` never reach a negative value; one input
with a large negative feature does, and only for the hidden units whose weight on
that feature is large.  The non-finite gradient then appears in ``lin1`` only (the
layer before the culprit; NaN gradients flow towards the input, never towards the
output), in a known part of it, while the loss and ``lin2``'s gradients stay finite.

All comparisons of gradients are exact (``atol=rtol=0``, NaN equal to NaN): the
reference repeats the same CPU kernels on the same inputs in the same order.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import clipopt
from clipopt import LAYER_FIELDS, ClippedOptimizer, NonFiniteGradientError

# Most tests here use unnamed parameters on purpose; the warning about it is tested elsewhere.
pytestmark = pytest.mark.filterwarnings("ignore:snapshot_dir is set but the parameters have no names")

# ----------------------------------------------------------------------------- the model and the data


class GuardedSqrt(nn.Module):
    """``sqrt`` for positive inputs, 0 elsewhere -- with a NaN gradient at negative inputs."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.where(x > 0, x.sqrt(), torch.zeros_like(x))


#: lin1's weights on feature 0: units 0 and 1 go negative for x0 = BAD_VALUE, units 2 and 3 do not.
LIN1_WEIGHT = [[1.0, 0.2, 0.3], [0.8, 0.5, 0.1], [0.1, 0.4, 0.6], [0.05, 0.3, 0.2]]
BAD_VALUE = -2.0  # -2 * 0.8 + 0.5 < 0, -2 * 0.1 + 0.5 > 0
BAD_UNITS = 2  # hidden units whose pre-activation is negative for the bad row
IN, HIDDEN, OUT, BATCH = 3, 4, 2, 8


def make_model(seed: int = 0) -> nn.Sequential:
    """The model; ``seed`` changes lin2 only, lin1 is fixed so that good inputs stay positive."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        OrderedDict(lin1=nn.Linear(IN, HIDDEN), root=GuardedSqrt(), lin2=nn.Linear(HIDDEN, OUT))
    )
    with torch.no_grad():
        model.lin1.weight.copy_(torch.tensor(LIN1_WEIGHT))
        model.lin1.bias.fill_(0.5)
    return model


def batch(seed: int, bad: bool = False) -> tuple[Tensor, Tensor]:
    """A batch of inputs in [0, 1); with ``bad`` its row 5 has feature 0 = BAD_VALUE."""
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.rand(BATCH, IN, generator=g)
    y = torch.randn(BATCH, OUT, generator=g)
    if bad:
        x[5, 0] = BAD_VALUE
    return x, y


def loss_of(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.mse_loss(model(x), y)


def weights(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a: Tensor, b: Tensor) -> None:
    """Exactly equal, NaN where the other is NaN."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def snapshot_files(directory: Path) -> list[str]:
    """Every entry of ``directory``, hidden (temporary) files included."""
    return sorted(os.listdir(directory)) if directory.exists() else []


def train_into_snapshot(
    directory: Path, bad_step: int = 3, steps: int = 4, **opt_kw: Any
) -> tuple[nn.Module, ClippedOptimizer]:
    """SGD on good batches, the bad batch at window ``bad_step``; attach(inputs, targets) every time."""
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        max_norm=1.0,
        param_names=model.named_parameters(),
        snapshot_dir=directory,
        **opt_kw,
    )
    for step in range(1, steps + 1):
        x, y = batch(step, bad=step == bad_step)
        loss_of(model, x, y).backward()
        opt.attach(inputs=x, targets=y)
        opt.step()
        opt.zero_grad()
    return model, opt


def make_snapshot(directory: Path) -> tuple[str, dict[str, Any]]:
    """The snapshot of :func:`train_into_snapshot` (bad batch at step 3): its path and content."""
    _model, opt = train_into_snapshot(directory)
    assert opt.last_snapshot is not None
    return opt.last_snapshot, clipopt.load_snapshot(opt.last_snapshot)


def nan_window(model: nn.Module, opt: ClippedOptimizer) -> None:
    """One window whose gradients are NaN everywhere (NaN input)."""
    x, y = batch(99)
    x[0, 0] = math.nan
    loss_of(model, x, y).backward()
    opt.step()
    opt.zero_grad()


def good_window(model: nn.Module, opt: ClippedOptimizer, seed: int = 1) -> None:
    x, y = batch(seed)
    loss_of(model, x, y).backward()
    opt.step()
    opt.zero_grad()


# ----------------------------------------------------------------------------- content


def test_snapshot_content_with_accumulation(tmp_path: Path) -> None:
    """A NaN window (2 micro-batches, mean) saves the exact pre-clip state needed to reproduce it.

    The file loads with ``torch.load(weights_only=True)`` and ``load_snapshot``;
    ``params`` are the weights at that moment (the skipped update leaves them so),
    ``grads`` are the mean of the two micro-batch gradients (recomputed on a deep
    copy), the optimizer state is the one before the window, ``layer_stats`` counts
    the real non-finite elements, an attachment given twice is a list of two
    tensors, one given once is the value itself, and ``load_state_dict`` of
    ``params`` restores the weights into a fresh model.
    """
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        max_norm=0.5,
        accumulation_steps=2,
        reduction="mean",
        param_names=model.named_parameters(),
        snapshot_dir=tmp_path,
    )
    for seed in (1, 2):  # window 1: applied, so Adam has state to save
        x, y = batch(seed)
        loss_of(model, x, y).backward()
        opt.step()
    opt.zero_grad()
    assert opt.num_updates == 1 and opt.last_snapshot is None

    (x1, y1), (x2, y2) = batch(3), batch(4, bad=True)
    reference = copy.deepcopy(model)
    for x, y in ((x1, y1), (x2, y2)):
        loss_of(reference, x, y).backward()
    ref_grads = {n: p.grad * 0.5 for n, p in reference.named_parameters()}
    assert not all(torch.isfinite(g).all() for g in ref_grads.values())  # the window is bad ...
    assert torch.isfinite(ref_grads["lin1.weight"]).any()  # ... partly: finite entries are compared too

    loss_of(model, x1, y1).backward()
    opt.attach(inputs=x1, targets=y1, epoch=7)
    opt.step()
    loss_of(model, x2, y2).backward()
    opt.attach(inputs=x2, targets=y2)
    at_the_moment = weights(model)
    inner_state = copy.deepcopy(opt.optimizer.state_dict())
    opt.step()
    assert opt.step_was_skipped and opt.last_stats is not None and opt.last_stats.reason == "nonfinite"
    opt.zero_grad()

    path = tmp_path / "anomaly-step00000002-nonfinite.pt"
    assert opt.last_snapshot == str(path)
    assert snapshot_files(tmp_path) == [path.name]  # no temporary file left behind
    raw = torch.load(path, weights_only=True)
    assert isinstance(raw, dict)
    snap = clipopt.load_snapshot(path)
    assert snap["step"] == 2 and snap["reason"] == "nonfinite" and snap["micro_batches"] == 2
    assert math.isnan(snap["total_norm"])
    datetime.datetime.fromisoformat(snap["time"])

    names = [n for n, _ in model.named_parameters()]
    assert list(snap["params"]) == names and list(snap["grads"]) == names
    for n, p in model.named_parameters():
        assert_same(snap["params"][n], at_the_moment[n])
        assert_same(snap["params"][n], p.detach())  # skipped: still the weights after the window
        assert_same(snap["grads"][n], ref_grads[n])

    optim_sd = snap["optimizer"]
    assert "clipopt" in optim_sd
    assert optim_sd["param_groups"][0]["lr"] == 1e-2
    assert set(optim_sd["state"]) == set(inner_state["state"]) == {0, 1, 2, 3}
    for i, state in inner_state["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert_same(optim_sd["state"][i][key], state[key])

    assert list(snap["layer_stats"]) == names
    for n in names:
        assert set(snap["layer_stats"][n]) == set(LAYER_FIELDS)
        real = int((~torch.isfinite(ref_grads[n])).sum())
        assert snap["layer_stats"][n]["nonfinite"] == real
    assert snap["layer_stats"]["lin1.weight"]["nonfinite"] == BAD_UNITS * IN
    assert snap["layer_stats"]["lin1.bias"]["nonfinite"] == BAD_UNITS
    for n in ("lin2.weight", "lin2.bias"):
        assert snap["layer_stats"][n]["grad_norm"] == pytest.approx(float(ref_grads[n].norm()), rel=1e-6)

    attached = snap["attached"]
    assert set(attached) == {"inputs", "targets", "epoch"}
    assert isinstance(attached["inputs"], list) and len(attached["inputs"]) == 2
    assert_same(attached["inputs"][0], x1)
    assert_same(attached["inputs"][1], x2)
    assert_same(attached["targets"][1], y2)
    assert attached["epoch"] == 7

    assert snap["versions"]["clipopt"] == clipopt.__version__
    assert snap["versions"]["torch"] == str(torch.__version__)
    assert {"python", "platform"} <= set(snap["versions"])

    fresh = make_model(seed=5)
    assert not torch.equal(fresh.lin2.weight, model.lin2.weight)
    result = fresh.load_state_dict(snap["params"], strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for n, p in fresh.named_parameters():
        assert_same(p.detach(), at_the_moment[n])


def test_snapshot_params_after_earlier_updates(tmp_path: Path) -> None:
    """After applied updates the snapshot holds the updated weights, not the initial ones."""
    model, opt = train_into_snapshot(tmp_path, bad_step=3, steps=3)
    assert opt.num_updates == 2 and opt.num_skipped == 1
    snap = clipopt.load_snapshot(opt.last_snapshot or "")
    initial = make_model()
    for n, p in model.named_parameters():
        assert_same(snap["params"][n], p.detach())
    assert not torch.equal(snap["params"]["lin2.weight"], initial.lin2.weight)
    assert snap["step"] == 3
    assert_same(snap["attached"]["inputs"], batch(3, bad=True)[0])  # one attach: the tensor itself


# ----------------------------------------------------------------------------- replay


def test_replay_reproduces_the_nonfinite_gradient(tmp_path: Path) -> None:
    """Loading a snapshot's params and attached batch into a FRESH model reproduces the bad gradient.

    The replayed gradients equal the saved ones exactly (NaN in the same places).
    The bad layer of the replay is defined as the module of the first parameter
    whose gradient the backward pass produces non-finite: NaN gradients only
    flow towards the input, so that is the layer nearest the culprit (here
    ``lin1``, just before ``GuardedSqrt``; ``lin2`` stays finite).  It is the
    layer of the parameter with the most non-finite elements in the snapshot's
    ``layer_stats``, and its parameters are exactly the flagged ones there.
    The attached batch is the trigger: the same weights with a good batch give
    finite gradients.
    """
    _path, snap = make_snapshot(tmp_path)
    fresh = make_model(seed=123)
    result = fresh.load_state_dict(snap["params"], strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []

    order: list[tuple[str, bool]] = []  # (parameter, finite) in the order backward produces them
    for name, p in fresh.named_parameters():
        p.register_hook(lambda g, name=name: order.append((name, bool(torch.isfinite(g).all()))))
    x, y = snap["attached"]["inputs"], snap["attached"]["targets"]
    loss = loss_of(fresh, x, y)
    assert torch.isfinite(loss)  # the forward pass hides the problem
    loss.backward()

    replay = {n: p.grad for n, p in fresh.named_parameters()}
    for n, g in replay.items():
        assert g is not None
        assert_same(g, snap["grads"][n])
    first_bad = next(name for name, finite in order if not finite)
    bad_layer = first_bad.rsplit(".", 1)[0]
    assert bad_layer == "lin1"
    reached_before = order[: [name for name, _ in order].index(first_bad)]
    assert {name for name, _ in reached_before} == {"lin2.weight", "lin2.bias"}
    assert all(finite for _, finite in reached_before)

    stats = snap["layer_stats"]
    worst = max(stats, key=lambda n: stats[n]["nonfinite"])
    assert worst.rsplit(".", 1)[0] == bad_layer
    flagged = {n for n, s in stats.items() if s["nonfinite"] > 0}
    assert flagged == {n for n, g in replay.items() if g is not None and not torch.isfinite(g).all()}
    assert flagged == {"lin1.weight", "lin1.bias"}

    fresh.zero_grad()
    loss_of(fresh, *batch(1)).backward()
    assert all(torch.isfinite(p.grad).all() for p in fresh.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------- failures, limits


def _recorded(record: list[warnings.WarningMessage], text: str) -> list[str]:
    return [
        str(w.message) for w in record if issubclass(w.category, RuntimeWarning) and text in str(w.message)
    ]


def test_unwritable_snapshot_dir_warns_and_training_continues(tmp_path: Path) -> None:
    """A snapshot_dir under a regular file (mkdir fails): a RuntimeWarning naming the path; training goes on.

    The bad window is still skipped, later windows apply, nothing is created, and
    ``last_snapshot`` stays None.
    """
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file")
    directory = blocker / "snaps"
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=directory)
    before = weights(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        nan_window(model, opt)
    messages = _recorded(record, "could not write the anomaly snapshot")
    assert len(messages) == 1 and str(directory) in messages[0], [str(w.message) for w in record]
    where = [w.filename for w in record if "could not write the anomaly snapshot" in str(w.message)]
    assert where == [__file__]  # the line calling opt.step()
    assert opt.step_was_skipped and opt.last_snapshot is None
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    good_window(model, opt)
    assert opt.update_applied and opt.num_updates == 1
    assert not torch.equal(model.lin2.weight, before["lin2.weight"])
    assert blocker.read_text() == "a file" and sorted(os.listdir(tmp_path)) == ["not-a-dir"]
    assert opt.last_snapshot is None


@pytest.mark.parametrize("entry", ["step", "step with a hook", "step with a scheduler", "flush"])
def test_snapshot_warnings_point_at_the_users_line(tmp_path: Path, entry: str) -> None:
    """Both snapshot warnings (a write that fails, the max_snapshots limit reached) name the user's
    line however the window closes: ``step()``, ``step()`` through torch's hook wrapper (a step hook
    is registered) or an LR scheduler's (it wraps ``step``), or ``flush()`` (a shorter call path)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file")
    model = make_model()
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    failing = ClippedOptimizer(sgd(), accumulation_steps=2, snapshot_dir=blocker / "s")
    limited = ClippedOptimizer(sgd(), accumulation_steps=2, snapshot_dir=tmp_path / "ok", max_snapshots=1)
    for opt in (failing, limited):
        if entry == "step with a hook":
            opt.register_step_pre_hook(lambda *args: None)
        elif entry == "step with a scheduler":
            torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    lines: list[int] = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for opt in (failing, limited, limited):
            x, y = batch(99)
            x[0, 0] = math.nan
            loss_of(model, x, y).backward()
            opt.step()  # the window's first micro-batch
            loss_of(model, x, y).backward()
            lines.append(sys._getframe().f_lineno + 1)
            opt.flush() if entry == "flush" else opt.step()
            opt.zero_grad()
    runtime = [w for w in record if issubclass(w.category, RuntimeWarning)]
    assert [str(w.message).split(" ")[1] for w in runtime] == ["could", "1"]  # the write failed; the limit
    assert [(w.filename, w.lineno) for w in runtime] == [(__file__, lines[0]), (__file__, lines[2])]


def test_failed_write_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.save`` failing half-way (disk full) leaves no file, not even a temporary one.

    The warning names the path and the cause; ``last_snapshot`` stays None until a
    write succeeds; the windows in between apply, and the next anomaly is saved.
    """
    real_save = torch.save
    calls = [0]

    def full_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            f.write(b"PK\x03\x04 partial snapshot")
            raise OSError("No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr("clipopt._diagnostics.snapshot.torch.save", full_disk)
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=tmp_path / "snaps")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        nan_window(model, opt)
    messages = _recorded(record, "No space left on device")
    expected = tmp_path / "snaps" / "anomaly-step00000001-nonfinite.pt"
    assert len(messages) == 1 and str(expected) in messages[0]
    assert snapshot_files(tmp_path / "snaps") == []
    assert opt.last_snapshot is None and opt.step_was_skipped

    before = weights(model)
    good_window(model, opt)
    assert opt.update_applied and not torch.equal(model.lin2.weight, before["lin2.weight"])

    nan_window(model, opt)  # the disk has room again
    written = tmp_path / "snaps" / "anomaly-step00000003-nonfinite.pt"
    assert opt.last_snapshot == str(written)
    assert snapshot_files(tmp_path / "snaps") == [written.name]
    assert clipopt.load_snapshot(written)["step"] == 3


def test_max_snapshots_keeps_the_first_ones(tmp_path: Path) -> None:
    """max_snapshots=2: the first two anomalies are written, later ones are not; one warning says so."""
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=tmp_path, max_snapshots=2
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            nan_window(model, opt)
    assert snapshot_files(tmp_path) == [
        "anomaly-step00000001-nonfinite.pt",
        "anomaly-step00000002-nonfinite.pt",
    ]
    assert opt.last_snapshot == str(tmp_path / "anomaly-step00000002-nonfinite.pt")
    runtime = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1 and "further nonfinite anomalies are not saved" in runtime[0]
    assert opt.num_skipped == 5


def test_snapshot_dir_assigned_mid_run_keeps_max_snapshots(tmp_path: Path) -> None:
    """``opt.snapshot_dir`` reads the folder (None when off); assigned mid-run, its writer takes the
    wrapper's ``max_snapshots`` (1 here: one file of three non-finite windows), and so does a
    ``max_snapshots`` assigned later (2: one more)."""
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_snapshots=1)
    assert opt.snapshot_dir is None
    nan_window(model, opt)  # off: nothing written
    opt.snapshot_dir = tmp_path
    assert opt.snapshot_dir == tmp_path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the limit's warning
        for _ in range(3):
            nan_window(model, opt)
        assert snapshot_files(tmp_path) == ["anomaly-step00000002-nonfinite.pt"]
        opt.max_snapshots = 2
        nan_window(model, opt)
        nan_window(model, opt)
    assert snapshot_files(tmp_path) == [
        "anomaly-step00000002-nonfinite.pt",
        "anomaly-step00000005-nonfinite.pt",
    ]


def test_nonfinite_error_names_the_latest_snapshot(tmp_path: Path) -> None:
    """max_consecutive_nonfinite=2: the error at the 2nd bad window in a row names that window's snapshot."""
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=tmp_path, max_consecutive_nonfinite=2
    )
    nan_window(model, opt)
    good_window(model, opt)  # resets the run of skips
    nan_window(model, opt)
    with pytest.raises(NonFiniteGradientError) as info:
        nan_window(model, opt)
    latest = str(tmp_path / "anomaly-step00000004-nonfinite.pt")
    assert info.value.snapshot == latest == opt.last_snapshot
    assert latest in str(info.value)
    assert info.value.count == 2 and info.value.step == 4
    assert os.path.exists(latest)


def test_overflow_snapshots_over_the_limit_copy_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GradScaler run overflows routinely: past max_snapshots=1 its overflow windows build no
    snapshot (no copy of the parameters, gradients and optimizer state), one warning (pointing at the
    user's step() line) says so, and NonFiniteGradientError names the one overflow snapshot written."""
    import clipopt._window.diagnose as diagnostics_module

    built: list[int] = []
    real = diagnostics_module.snapshot_payload
    monkeypatch.setattr(
        diagnostics_module, "snapshot_payload", lambda **kw: built.append(kw["step"]) or real(**kw)
    )
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler=scaler,
        snapshot_dir=tmp_path,
        max_snapshots=1,
        max_consecutive_nonfinite=4,
    )
    x, y = batch(1)
    x[0, 0] = math.inf
    with warnings.catch_warnings(record=True) as record, pytest.raises(NonFiniteGradientError) as info:
        warnings.simplefilter("always")
        for _ in range(4):
            scaler.scale(loss_of(model, x, y)).backward()
            opt.step()
            opt.zero_grad()
    assert built == [1]
    assert snapshot_files(tmp_path) == ["anomaly-step00000001-overflow.pt"]
    runtime = [w for w in record if issubclass(w.category, RuntimeWarning)]
    assert [str(w.message) for w in runtime] == [
        f"clipopt: 1 overflow snapshots are in {tmp_path}; further overflow anomalies are not saved "
        "(raise max_snapshots to keep more)"
    ]
    assert runtime[0].filename == __file__
    assert info.value.snapshot == str(tmp_path / "anomaly-step00000001-overflow.pt")
    assert str(info.value).endswith(f"; latest anomaly snapshot: {info.value.snapshot}")


def test_scaler_overflow_snapshot(tmp_path: Path) -> None:
    """With a GradScaler a non-finite window is an overflow: skipped, the scale drops, and the snapshot
    has reason ``"overflow"`` and the scale its backward used (what ``clipopt.replay`` needs).

    The snapshot's gradients are the unscaled ones (``scaler.unscale_`` ran first):
    the infinite input makes ``lin1``'s gradient non-finite, and its finite entries
    equal an unscaled float32 backward of the same batch.
    """
    model = make_model()
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler, snapshot_dir=tmp_path / "s"
    )
    x, y = batch(1)
    x[0, 0] = math.inf
    opt.attach(inputs=x)
    scaler.scale(loss_of(model, x, y)).backward()
    opt.step()
    assert opt.step_was_skipped and opt.last_stats is not None and opt.last_stats.reason == "overflow"
    assert scaler.get_scale() == 2.0**15
    files = snapshot_files(tmp_path / "s")
    assert files == ["anomaly-step00000001-overflow.pt"]
    assert opt.last_snapshot == str(tmp_path / "s" / files[0])
    snap = clipopt.load_snapshot(opt.last_snapshot)
    assert snap["reason"] == "overflow" and snap["scale"] == 2.0**16
    loss_of(reference, x, y).backward()
    want = [p.grad for p in reference.parameters()]
    for got, ref in zip(snap["grads"].values(), want, strict=True):
        torch.testing.assert_close(got, ref, equal_nan=True)


# ----------------------------------------------------------------------------- attach


def test_attach_rejects_unsupported_values_before_changing_anything(tmp_path: Path) -> None:
    """attach() with an object() is a TypeError naming the argument; none of that call's values are kept."""
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=tmp_path)
    x, _ = batch(1)
    with pytest.raises(TypeError, match=r"attach\(\) got meta=object"):
        opt.attach(inputs=x, meta=object())
    with pytest.raises(TypeError, match=r"batch\['ids'\]=object"):
        opt.attach(batch={"x": x, "ids": object()})
    nan_window(model, opt)
    assert opt.last_snapshot is not None
    assert clipopt.load_snapshot(opt.last_snapshot)["attached"] == {}


def test_attachments_are_cleared_after_each_window(tmp_path: Path) -> None:
    """What was attached in one window is not saved with the next window's snapshot."""
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=tmp_path)
    x1, y1 = batch(1)
    opt.attach(inputs=x1)
    loss_of(model, x1, y1).backward()
    opt.step()  # a good window: nothing saved, attachments dropped
    opt.zero_grad()
    assert opt.last_snapshot is None
    nan_window(model, opt)
    first = clipopt.load_snapshot(opt.last_snapshot or "")
    assert first["attached"] == {}

    x3, y3 = batch(3, bad=True)
    opt.attach(inputs=x3, note="third")
    loss_of(model, x3, y3).backward()
    opt.step()
    opt.zero_grad()
    nan_window(model, opt)  # after a bad window the attachments are dropped as well
    third = clipopt.load_snapshot(str(tmp_path / "anomaly-step00000003-nonfinite.pt"))
    assert_same(third["attached"]["inputs"], x3) and third["attached"]["note"] == "third"
    assert clipopt.load_snapshot(opt.last_snapshot or "")["attached"] == {}


def test_attached_tensors_are_detached_cpu_copies(tmp_path: Path) -> None:
    """A tensor that requires grad is saved detached; changing it after the window leaves the file as is."""
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=tmp_path)
    x, y = batch(1)
    x[0, 0] = math.nan
    emb = x.clone().requires_grad_(True)
    loss_of(model, emb, y).backward()
    opt.attach(inputs=emb, pair=(x, 3))
    opt.step()
    with torch.no_grad():
        emb.fill_(0.0)
    snap = clipopt.load_snapshot(opt.last_snapshot or "")
    assert not snap["attached"]["inputs"].requires_grad
    assert_same(snap["attached"]["inputs"], x)
    assert isinstance(snap["attached"]["pair"], tuple) and snap["attached"]["pair"][1] == 3


# ----------------------------------------------------------------------------- spikes


def _zclip_run(tmp_path: Path, skip_spikes: bool) -> tuple[ClippedOptimizer, list[float]]:
    """Ten steady windows (gradient norms alternating 1.0 and 1.1), then one at 50: ZClip's
    z-score (warm-up 5) flags only that one."""
    model = nn.Linear(3, 2)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        max_norm=clipopt.ZClip(warmup_steps=5, skip_spikes=skip_spikes),
        snapshot_dir=tmp_path,
        param_names=model.named_parameters(),
    )
    scales = [1.0 + 0.1 * (i % 2) for i in range(10)] + [50.0]
    for i, scale in enumerate(scales):
        for p in model.parameters():
            g = torch.ones_like(p)
            p.grad = g * (scale / math.sqrt(8.0))  # 8 elements: the total norm is `scale`
        opt.attach(batch=torch.tensor([float(i)]))
        opt.step()
        opt.zero_grad()
    return opt, scales


@pytest.mark.parametrize("skip_spikes", [False, True])
def test_spiking_window_is_snapshotted_with_reason_spike(tmp_path: Path, skip_spikes: bool) -> None:
    """A spiking update (ZClip's z-score rule) is saved like a non-finite one (docs/diagnostics.md), with
    reason "spike" and the pre-clip gradients and norm; steady windows and warm-up write nothing; the
    same happens whether the spike is clipped or skipped."""
    opt, scales = _zclip_run(tmp_path, skip_spikes)
    path = tmp_path / "anomaly-step00000011-spike.pt"
    assert snapshot_files(tmp_path) == [path.name]
    assert opt.last_snapshot == str(path)
    snap = clipopt.load_snapshot(path)
    assert snap["reason"] == "spike" and snap["step"] == 11
    assert snap["total_norm"] == pytest.approx(scales[-1], rel=1e-6)
    grad_norm = math.sqrt(sum(float(g.double().square().sum()) for g in snap["grads"].values()))
    assert grad_norm == pytest.approx(scales[-1], rel=1e-6)  # pre-clip
    assert torch.equal(snap["attached"]["batch"], torch.tensor([10.0]))
    assert set(snap["layer_stats"]) == {"weight", "bias"}
    assert opt.last_stats is not None
    assert opt.last_stats.reason == ("spike" if skip_spikes else None)
    assert bool(opt.last_stats.skipped) is skip_spikes


def test_spike_snapshots_do_not_use_up_the_room_of_a_nonfinite_one(tmp_path: Path) -> None:
    """max_snapshots counts per reason: after more spikes than max_snapshots (their own limit warns),
    a non-finite window is still saved, and NonFiniteGradientError names that snapshot."""
    model = nn.Linear(3, 2)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        max_norm=clipopt.ZClip(warmup_steps=5, alpha=0.5),
        snapshot_dir=tmp_path,
        max_snapshots=2,
        max_consecutive_nonfinite=1,
        param_names=model.named_parameters(),
    )
    scales = [1.0, 1.1] * 3 + [50.0, 1.0, 1.1, 1.0, 500.0, 1.0, 1.1, 1.0, 5000.0, 1.0, math.nan]

    def window(scale: float) -> None:
        for p in model.parameters():
            p.grad = torch.full_like(p, scale / math.sqrt(8.0))
        opt.step()
        opt.zero_grad()

    with pytest.warns(RuntimeWarning, match="2 spike snapshots are in"):
        for scale in scales[:-1]:
            window(scale)
    spikes = snapshot_files(tmp_path)
    assert len(spikes) == 2 and all(name.endswith("-spike.pt") for name in spikes)
    with pytest.raises(NonFiniteGradientError) as info:
        window(scales[-1])
    expected = str(tmp_path / f"anomaly-step{len(scales):08d}-nonfinite.pt")
    assert info.value.snapshot == expected == opt.last_snapshot


def test_last_snapshot_stays_assignable(tmp_path: Path) -> None:
    """``last_snapshot`` is a plain attribute to the user, as before the restructure (issue 12):
    assigning it (clearing it once a snapshot was handled) works and sticks; the next snapshot
    written replaces it, and an anomaly over ``max_snapshots`` (nothing written) leaves it as set."""
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), snapshot_dir=tmp_path, max_snapshots=2
    )
    nan_window(model, opt)
    assert opt.last_snapshot == str(tmp_path / "anomaly-step00000001-nonfinite.pt")
    opt.last_snapshot = None  # handled
    assert opt.last_snapshot is None
    good_window(model, opt)
    assert opt.last_snapshot is None
    nan_window(model, opt)
    assert opt.last_snapshot == str(tmp_path / "anomaly-step00000003-nonfinite.pt")
    opt.last_snapshot = "handled"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # over max_snapshots: not saved, and it says so
        nan_window(model, opt)
    assert opt.last_snapshot == "handled"
    assert snapshot_files(tmp_path) == [
        "anomaly-step00000001-nonfinite.pt",
        "anomaly-step00000003-nonfinite.pt",
    ]
