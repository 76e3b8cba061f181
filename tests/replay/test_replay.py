"""``clipopt.replay`` (docs/replay.md): from an anomaly snapshot to the operation that went non-finite.

Every snapshot here is written by a real training run through
``ClippedOptimizer(snapshot_dir=...)`` (``tests.replay_models.train``) on a model
that fails in a known place (see ``tests/replay_models.py``); the expectations
(module, phase, operator, counts) follow from how the model and the bad batch
are built, and the numbers are recomputed here with NumPy from the snapshot.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import clipopt
from clipopt import ReplayResult, ZClip, replay
from clipopt._replay.replay import ReplayInputError
from clipopt._report.text import json_safe

from .. import replay_jobs
from ..helpers import free_port, join_spawned, start_ranks
from ..markers import GLOO
from ..replay_models import (
    BAD_ROW,
    BAD_TOKEN,
    HALF_BAD_VALUE,
    HIDDEN,
    LOG_BAD_UNITS,
    LOG_BAD_VALUE,
    autocast_model,
    batch,
    branch_model,
    buffer_masked_model,
    dropout_log_model,
    half_model,
    inplace_log_model,
    inplace_masked_model,
    log_model,
    masked_model,
    mse,
    mse_fp16,
    mse_window,
    radial_model,
    snapshots,
    sparse_embedding_model,
    train,
)

# ----------------------------------------------------------------------------- the runs


def _bad(index: int, row_value: float | None = None, cell: tuple[int, float] | None = None) -> Any:
    x, y = batch(index)
    if row_value is not None:
        x[BAD_ROW] = row_value
    if cell is not None:
        x[BAD_ROW, cell[0]] = cell[1]
    return x, y


def _run(folder: Path, factory: Any, bad: Any, **kwargs: Any) -> str:
    """Two good updates, then ``bad``: the one snapshot the run wrote (step 3)."""
    train(factory(), [batch(0), batch(1), bad], folder, **kwargs)
    files = snapshots(folder)
    assert len(files) == 1, files
    return files[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The snapshot path of every failing run, by name."""
    root = tmp_path_factory.mktemp("replay")
    out = {
        "log": _run(root / "log", log_model, _bad(2, cell=(0, LOG_BAD_VALUE))),
        "radial": _run(root / "radial", radial_model, _bad(2, row_value=0.0)),
        "half": _run(root / "half", half_model, _bad(2, row_value=HALF_BAD_VALUE)),
        "autocast": _run(
            root / "autocast", autocast_model, _bad(2, row_value=HALF_BAD_VALUE), loss_fn=mse_fp16
        ),
        "data": _run(root / "data", log_model, _bad(2, cell=(1, math.nan))),
        "masked": _run(root / "masked", masked_model, _bad(2, cell=(0, LOG_BAD_VALUE))),
        "buffer": _run(root / "buffer", buffer_masked_model, _bad(2, cell=(0, LOG_BAD_VALUE))),
    }
    model = buffer_masked_model()
    model.mix.register_forward_hook(_NanOnce(call=2))
    train(model, [batch(i) for i in range(3)], root / "buffer-transient")
    out["buffer-transient"] = snapshots(root / "buffer-transient")[0]
    model = log_model()
    model.act.register_forward_hook(_NanOnce(call=3))  # only the original run's third forward
    train(model, [batch(i) for i in range(4)], root / "transient")
    out["transient"] = snapshots(root / "transient")[0]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    train(log_model(), [batch(0, targets=100.0)], root / "scale", loss_fn=mse_fp16, scaler=scaler)
    out["scale"] = snapshots(root / "scale")[0]
    for name, factory, bad in (
        ("scaled-radial", radial_model, _bad(2, row_value=0.0)),
        ("scaled-log", log_model, _bad(2, cell=(0, LOG_BAD_VALUE))),
    ):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        out[name] = _run(root / name, factory, bad, loss_fn=mse_fp16, scaler=scaler)
    return out


class _NanOnce:
    """A forward hook that puts a NaN into the output of its ``call``-th call only."""

    def __init__(self, call: int) -> None:
        self.calls = 0
        self.call = call

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        if self.calls != self.call:
            return None
        output = output.clone()
        output[0, 0] = math.nan
        return output


def _hidden(snap: dict[str, Any]) -> np.ndarray:
    """The first layer's output for the snapshot's batch, in float64 NumPy."""
    x = snap["attached"]["inputs"].double().numpy()
    w = snap["params"]["lin.weight"].double().numpy()
    b = snap["params"]["lin.bias"].double().numpy() if "lin.bias" in snap["params"] else 0.0
    return x @ w.T + b


# ----------------------------------------------------------------------------- where it went non-finite


def test_log_of_negative_is_named_in_the_forward(runs: dict[str, str]) -> None:
    """log of a negative hidden value: forward, module ``act`` (LogFeatures), aten.log, every replay."""
    r = replay(runs["log"], log_model(), mse)
    h = _hidden(clipopt.load_snapshot(runs["log"]))
    assert (r.reproduced, r.repeats, r.reproduced_runs, r.consistent) == (True, 3, 3, True)
    assert (r.cause, r.phase, r.module, r.module_type) == ("operation", "forward", "act", "LogFeatures")
    assert (r.op, r.node, r.inputs_finite) == ("aten.log.default", None, True)
    assert r.inputs[0].shape == h.shape and r.inputs[0].min == pytest.approx(h.min(), rel=1e-6)
    assert r.output is not None and r.output.nan == int((h < 0).sum()) == LOG_BAD_UNITS
    assert r.output.posinf == r.output.neginf == 0
    assert r.loss_finite is False and r.attached_nonfinite == () and r.params_nonfinite == ()
    assert (r.step, r.reason, r.rank, r.scale) == (3, "nonfinite", None, None)
    assert r.file == runs["log"]
    assert math.isnan(r.snapshot_norm) and math.isnan(r.replay_norm)


def test_in_place_log_is_named_with_its_input_as_it_was(runs: dict[str, str]) -> None:
    """``log_`` in place: the operator is named with its input's statistics from before it ran (the
    hidden values, finite, smallest negative), not those of its own output."""
    r = replay(runs["log"], inplace_log_model(), mse)
    h = _hidden(clipopt.load_snapshot(runs["log"]))
    assert (r.cause, r.phase, r.module, r.op) == ("operation", "forward", "act", "aten.log_.default")
    assert r.inputs_finite is True and len(r.inputs) == 1
    assert r.inputs[0].nonfinite == 0 and r.inputs[0].min == pytest.approx(h.min(), rel=1e-6)
    assert r.output is not None and r.output.nan == LOG_BAD_UNITS


def test_dropout_under_deterministic_algorithms_is_not_the_origin(runs: dict[str, str]) -> None:
    """Under ``torch.use_deterministic_algorithms(True)`` uninitialized tensors are filled with NaN; the
    one a training-mode Dropout fills with its mask (``empty_like``, then ``bernoulli_``) is no origin:
    the log after it is."""
    model = dropout_log_model()
    torch.use_deterministic_algorithms(True)
    try:
        r = replay(runs["log"], model, mse)
    finally:
        torch.use_deterministic_algorithms(False)
    assert model.training and r.reproduced
    assert (r.cause, r.phase, r.module, r.op) == ("operation", "forward", "act", "aten.log.default")


def test_sparse_embedding_gradient(tmp_path: Path) -> None:
    """nn.Embedding(sparse=True) has a sparse gradient: the replay reads its stored values (it raised
    NotImplementedError); the log of the bad token's row is named, the non-finite gradients are the
    snapshot's."""
    g = torch.Generator().manual_seed(7)
    batches = [
        (torch.randint(0, BAD_TOKEN, (8, 2), generator=g), torch.randn(8, 2, 1, generator=g))
        for _ in range(3)
    ]
    batches[2][0][BAD_ROW, 1] = BAD_TOKEN
    train(sparse_embedding_model(), batches, tmp_path)
    r = replay(snapshots(tmp_path)[0], sparse_embedding_model(), mse)
    assert (r.reproduced, r.cause, r.phase, r.module, r.op) == (
        True,
        "operation",
        "forward",
        "act",
        "aten.log.default",
    )
    assert r.output is not None and r.output.nan == LOG_BAD_UNITS
    assert r.replay_nonfinite_grads == r.snapshot_nonfinite_grads == ("emb.weight", "out.weight", "out.bias")


def test_sqrt_at_zero_is_named_in_the_backward(runs: dict[str, str]) -> None:
    """sqrt of a zero length: finite forward, infinite d sqrt/dx: backward, module ``radial``,
    the division of SqrtBackward0, one infinite element (the zero row); only lin.weight ends non-finite."""
    r = replay(runs["radial"], radial_model(), mse)
    h = _hidden(clipopt.load_snapshot(runs["radial"]))
    zero_rows = int((np.abs(h).sum(axis=1) == 0).sum())
    assert r.reproduced and r.cause == "operation"
    assert (r.phase, r.module, r.module_type) == ("backward", "radial", "RadialFeature")
    assert (r.op, r.node, r.inputs_finite) == ("aten.div.Tensor", "SqrtBackward0", True)
    assert r.output is not None and r.output.posinf == zero_rows == 1 and r.output.nan == 0
    assert r.loss_finite is True
    assert r.replay_nonfinite_grads == r.snapshot_nonfinite_grads == ("lin.weight",)


def test_checks_stop_once_a_backward_origin_is_found(
    runs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the origin (sqrt's backward) no operator output is checked any more, as the module says;
    the origin is still named."""
    import clipopt._replay.replay
    import clipopt._replay.watch

    found: list[bool] = [False]
    checked_after: list[str] = []

    class Recording(clipopt._replay.watch.NonFiniteWatch):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            found[0] = self.origin is not None
            return super().__torch_dispatch__(func, types, args, kwargs)

    real = clipopt._replay.watch.all_finite

    def all_finite(t: torch.Tensor) -> bool:
        if found[0]:
            checked_after.append(str(tuple(t.shape)))
        return real(t)

    monkeypatch.setattr(clipopt._replay.replay, "NonFiniteWatch", Recording)
    monkeypatch.setattr(clipopt._replay.watch, "all_finite", all_finite)
    r = replay(runs["radial"], radial_model(), mse, repeats=1)
    assert (r.phase, r.module, r.node) == ("backward", "radial", "SqrtBackward0")
    assert checked_after == []


def test_float16_matmul_overflow_is_named(runs: dict[str, str]) -> None:
    """A float16 matmul whose sums pass 65504: forward, module ``f16``, aten.mm, cause fp16-overflow;
    the infinite outputs are those whose float64 sum is past float16's largest value."""
    r = replay(runs["half"], half_model(), mse)
    snap = clipopt.load_snapshot(runs["half"])
    h16 = _hidden(snap).astype(np.float16).astype(np.float64)
    sums = h16 @ snap["params"]["f16.weight"].double().numpy().T
    assert r.reproduced and r.cause == "fp16-overflow"
    assert (r.phase, r.module, r.module_type, r.op) == ("forward", "f16", "HalfLinear", "aten.mm.default")
    assert r.inputs_finite is True and [s.dtype for s in r.inputs] == ["float16", "float16"]
    assert r.inputs[0].max == float(h16.max()) < float(np.finfo(np.float16).max)
    assert r.output is not None and r.output.dtype == "float16"
    assert r.output.posinf == int((sums > float(np.finfo(np.float16).max)).sum()) == HIDDEN
    assert r.output.nan == 0


def test_autocast_float16_overflow_is_named(runs: dict[str, str]) -> None:
    """Under CPU autocast to float16 (no scaler) nn.Linear ``wide`` (no bias) overflows: its mm, in
    float16, gives +inf for the bad row's 4 outputs (finite in float32); cause fp16-overflow."""
    r = replay(runs["autocast"], autocast_model(), mse_fp16)
    assert r.reproduced and r.cause == "fp16-overflow" and r.scale is None
    assert (r.phase, r.module, r.module_type) == ("forward", "wide", "Linear")
    assert r.op == "aten.mm.default" and r.inputs_finite is True
    assert r.output is not None and r.output.dtype == "float16"
    assert (r.output.posinf, r.output.nan) == (HIDDEN, 0)


def test_nan_from_the_data_names_the_first_module_that_sees_it(runs: dict[str, str]) -> None:
    """A NaN in the attached inputs: cause data, forward, the first Linear (``lin``) is the first to see
    it, its input is non-finite (one NaN), and the attached entry is named."""
    r = replay(runs["data"], log_model(), mse)
    assert r.reproduced and r.cause == "data"
    assert (r.phase, r.module, r.module_type, r.op) == ("forward", "lin", "Linear", "aten.addmm.default")
    assert r.inputs_finite is False and r.attached_nonfinite == ("inputs",)
    assert [s.nan for s in r.inputs] == [0, 1, 0]  # bias, the batch, the weight
    assert r.inputs[1].shape == (8, 3)


def test_nan_from_the_data_converted_in_loss_fn(runs: dict[str, str]) -> None:
    """The data NaN first goes through an operator of loss_fn (a scaling, outside the model's modules):
    the module named is still the first of the model that sees it, with its operator."""

    def scaled(model: nn.Module, attached: dict[str, Any]) -> torch.Tensor:
        return mse(model, {**attached, "inputs": attached["inputs"] * 1.0})

    r = replay(runs["data"], log_model(), scaled)
    assert (r.cause, r.phase, r.module, r.op) == ("data", "forward", "lin", "aten.addmm.default")
    assert r.inputs_finite is False


def test_transient_fault_is_not_reproduced(runs: dict[str, str]) -> None:
    """A NaN injected only in the original run (a hook that fired once): no replay shows it; the replay's
    norm is that of a plain backward of the same parameters and batch (torch's own norm)."""
    r = replay(runs["transient"], log_model(), mse)
    snap = clipopt.load_snapshot(runs["transient"])
    reference = log_model()
    reference.load_state_dict(snap["params"])
    mse(reference, snap["attached"]).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    assert (r.reproduced, r.reproduced_runs, r.cause) == (False, 0, "transient")
    assert (r.phase, r.module, r.op, r.output) == (None, None, None, None)
    assert r.loss_finite is True and r.replay_nonfinite_grads == ()
    assert r.snapshot_nonfinite_grads == ("lin.weight", "lin.bias", "out.weight", "out.bias")
    assert r.replay_norm == pytest.approx(float(norm), rel=1e-6)


def test_accumulated_window(tmp_path: Path) -> None:
    """With accumulation_steps=2 the snapshot attaches both micro-batches (a list); a loss_fn averaging
    them replays the window: the bad second micro-batch reproduces in ``act``, and a transient window's
    replay norm is that of the averaged gradient (torch's norm of a plain backward of the mean loss)."""
    x, y = _bad(3, cell=(0, LOG_BAD_VALUE))
    train(log_model(), [batch(0), batch(1), batch(2), (x, y)], tmp_path / "bad", accumulation_steps=2)
    snap_path = snapshots(tmp_path / "bad")[0]
    assert Path(snap_path).name == "anomaly-step00000002-nonfinite.pt"
    r = replay(snap_path, log_model(), mse_window)
    assert (r.reproduced, r.phase, r.module, r.op) == (True, "forward", "act", "aten.log.default")
    model = log_model()
    model.act.register_forward_hook(_NanOnce(call=4))
    train(model, [batch(i) for i in range(4)], tmp_path / "transient", accumulation_steps=2)
    snap = clipopt.load_snapshot(snapshots(tmp_path / "transient")[0])
    assert [t.shape for t in snap["attached"]["inputs"]] == [torch.Size([8, 3])] * 2
    reference = log_model()
    reference.load_state_dict(snap["params"])
    mse_window(reference, snap["attached"]).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    r = replay(snap, log_model(), mse_window)
    assert (r.reproduced, r.cause) == (False, "transient")
    assert r.replay_norm == pytest.approx(float(norm), rel=1e-6)


_ONE_BATCH_ON_A_WINDOW = (
    "replay(): loss_fn raised TypeError (linear(): argument 'input' (position 1) must be Tensor, not "
    "list) on the attachments of a window that accumulated 2 micro-batches: each attached name "
    "('inputs', 'targets') is a list of the window's micro-batches, e.g. attached['inputs'] = "
    "[tensor (8, 3), tensor (8, 3)], not one batch; make loss_fn take the lists and return the mean "
    "of the micro-batch losses (as reduction='mean' averages the gradients), e.g. "
    "torch.stack([one_batch_loss(model, {k: v[i] for k, v in attached.items()}) for i in range(2)]).mean()"
)


def test_a_one_batch_loss_on_an_accumulated_window_says_the_inputs_are_lists(tmp_path: Path) -> None:
    """A loss_fn written for one micro-batch, given an accumulation window's snapshot, gets one
    ReplayTypeError naming what it received (lists of 2 micro-batches) and what to write instead
    (before: torch's 'must be Tensor, not list' from deep inside the model); the model is restored.
    A loss_fn that fails the same way on a one-batch window keeps its own error."""
    x, y = _bad(3, cell=(0, LOG_BAD_VALUE))
    train(log_model(), [batch(0), batch(1), batch(2), (x, y)], tmp_path / "window", accumulation_steps=2)
    model = log_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ReplayInputError) as info:
        replay(snapshots(tmp_path / "window")[0], model, mse)
    assert isinstance(info.value, TypeError) and str(info.value) == _ONE_BATCH_ON_A_WINDOW
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    def broken(model: nn.Module, attached: dict[str, Any]) -> torch.Tensor:
        return model(list(attached["inputs"]))

    train(log_model(), [batch(0), (x, y)], tmp_path / "single")
    with pytest.raises(TypeError, match=re.escape("must be Tensor, not list")) as own:
        replay(snapshots(tmp_path / "single")[0], log_model(), broken)
    assert not isinstance(own.value, ReplayInputError)


def test_a_minus_inf_mask_is_not_the_origin(runs: dict[str, str]) -> None:
    """``masked_fill(mask, -inf)`` makes an infinity on purpose (its -inf is an argument, the softmax
    after it is finite): the origin is still the log of the negative value, in ``mix``."""
    r = replay(runs["masked"], masked_model(), mse)
    assert r.reproduced and r.cause == "operation"
    assert (r.phase, r.module, r.module_type, r.op) == ("forward", "mix", "MaskedLog", "aten.log.default")
    assert r.output is not None and r.output.nan == LOG_BAD_UNITS


def test_an_in_place_minus_inf_mask_is_not_the_origin(runs: dict[str, str]) -> None:
    """``masked_fill_(mask, -inf)`` in place: its input, before it ran, is finite, so its -inf is made on
    purpose (it was named the origin, its input read after the fill): the origin is the log, in ``mix``."""
    r = replay(runs["masked"], inplace_masked_model(), mse)
    assert r.reproduced and r.cause == "operation"
    assert (r.phase, r.module, r.op) == ("forward", "mix", "aten.log.default")
    assert r.module_type == "InPlaceMaskedLog"
    assert r.output is not None and r.output.nan == LOG_BAD_UNITS


def test_a_minus_inf_mask_buffer_is_not_the_origin(runs: dict[str, str]) -> None:
    """A -inf mask registered as a buffer (non-finite, not made by an operator of the replay) is
    followed like a constant: the origin is the log, not the addition of the mask."""
    r = replay(runs["buffer"], buffer_masked_model(), mse)
    assert r.reproduced and r.cause == "operation"
    assert (r.phase, r.module, r.op) == ("forward", "mix", "aten.log.default")


def test_a_finite_replay_names_no_operator(runs: dict[str, str]) -> None:
    """A transient NaN in a model with a -inf mask: the replay's mask infinities are absorbed (loss and
    gradients finite), so no operator is named although some outputs were infinite on the way."""
    r = replay(runs["buffer-transient"], buffer_masked_model(), mse)
    assert (r.reproduced, r.cause, r.loss_finite) == (False, "transient", True)
    assert (r.phase, r.module, r.op, r.output, r.inputs) == (None, None, None, None, ())


# ----------------------------------------------------------------------------- GradScaler


def test_scaler_overflow_of_the_loss_scale(runs: dict[str, str]) -> None:
    """A GradScaler run's first window at scale 2**16 with large targets: its backward overflows float16
    only because of the scale (a replay without it is finite): cause loss-scale, in the backward, in the
    float16 cast that autocast put into loss_fn (outside the model's modules)."""
    r = replay(runs["scale"], log_model(), mse_fp16)
    assert (r.reason, r.step, r.scale) == ("overflow", 1, 2.0**16)
    assert r.reproduced and r.cause == "loss-scale" and r.unscaled_finite is True
    assert (r.phase, r.module, r.op, r.node) == ("backward", None, "aten._to_copy.default", "ToCopyBackward0")
    assert r.output is not None and r.output.dtype == "float16" and r.output.nan == 0
    assert r.loss_finite is True


def test_scaler_overflow_text_shows_the_loss_scale_in_full(runs: dict[str, str]) -> None:
    """The text account of the 2**16 overflow names the scale as 65536 in both places (the scale
    line and the loss-scale cause), not rounded to four digits (before: "6.554e+04")."""
    from clipopt._replay.text import format_text

    text = format_text(replay(runs["scale"], log_model(), mse_fp16))
    assert "  loss scale 65536 (GradScaler), as in the original backward" in text.splitlines()
    assert "the backward overflowed only with the loss scale 65536; without it" in text


def test_scaler_snapshot_of_a_genuine_backward_fault(runs: dict[str, str]) -> None:
    """sqrt at 0 in a GradScaler run: the snapshot's reason is overflow, but the backward is infinite
    without the scale too, and the division is infinite in float32 as well: a genuine fault, named."""
    r = replay(runs["scaled-radial"], radial_model(), mse_fp16)
    assert (r.reason, r.scale) == ("overflow", 2.0**8)
    assert r.reproduced and r.cause == "operation" and r.unscaled_finite is False
    assert (r.phase, r.module, r.node) == ("backward", "radial", "SqrtBackward0")


def test_scaler_snapshot_of_a_genuine_forward_fault(runs: dict[str, str]) -> None:
    """log of a negative value in a GradScaler run: non-finite in the forward, which no scale changes
    (no unscaled replay is needed)."""
    r = replay(runs["scaled-log"], log_model(), mse_fp16)
    assert (r.reason, r.cause, r.unscaled_finite) == ("overflow", "operation", None)
    assert (r.phase, r.module, r.op) == ("forward", "act", "aten.log.default")


# ----------------------------------------------------------------------------- spikes


@pytest.fixture(scope="module")
def spike(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An Adam run with ZClip skipping spikes: 12 ordinary batches, then one whose b-branch inputs are
    50 times larger (b.weight's gradient is proportional to them)."""
    folder = tmp_path_factory.mktemp("spike")
    batches = [batch(i, features=6) for i in range(12)]
    x, y = batch(12, features=6)
    x[:, 3:] *= 50
    train(
        branch_model(),
        [*batches, (x, y)],
        folder,
        optimizer="adam",
        max_norm=ZClip(warmup_steps=5, z_thresh=10.0, skip_spikes=True),
    )
    files = snapshots(folder)
    assert [Path(f).name for f in files] == ["anomaly-step00000013-spike.pt"]
    return files[0]


def test_spike_names_the_layer_that_grew_most(spike: str) -> None:
    """A spike replays with the snapshot's norm (reproduced); the layer named is net.b.weight, and every
    growth ratio is the gradient norm over Adam's bias-corrected RMS history, recomputed here."""
    r = replay(spike, branch_model(), mse)
    snap = clipopt.load_snapshot(spike)
    assert (r.reason, r.reproduced, r.cause) == ("spike", True, "spike")
    assert r.replay_norm == pytest.approx(r.snapshot_norm, rel=1e-5)
    assert (r.layer, r.module, r.phase, r.op) == ("net.b.weight", "net.b", None, None)
    beta2 = snap["optimizer"]["param_groups"][0]["betas"][1]
    want = {}
    for i, name in enumerate(snap["params"]):
        state = snap["optimizer"]["state"][i]
        history = math.sqrt(state["exp_avg_sq"].double().sum().item() / (1 - beta2 ** float(state["step"])))
        want[name] = np.linalg.norm(snap["grads"][name].double().numpy()) / history
    assert {g.name: g.ratio for g in r.growth} == pytest.approx(want, rel=1e-9)
    assert r.growth[0].name == max(want, key=lambda n: want[n])
    assert r.growth[0].ratio > 10 * r.growth[1].ratio and r.growth[0].source == "exp_avg_sq"


def test_spike_without_optimizer_history_says_so(spike: str) -> None:
    """Without inner state (stripped here, as after SGD without momentum) no layer is named, and why."""
    snap = clipopt.load_snapshot(spike)
    snap["optimizer"]["state"] = {}
    r = replay(snap, branch_model(), mse)
    assert r.reproduced and r.layer is None and r.growth == ()
    assert r.growth_missing == (
        "the inner optimizer keeps no gradient history (no state yet, or SGD without momentum)"
    )


def test_spike_of_one_rank_is_not_compared_with_the_averaged_norm(spike: str) -> None:
    """A spike snapshot marked as one rank's (as DDP writes them): its norm is of the averaged gradient,
    so the cause says so instead of "transient"; the layer is still named from the snapshot."""
    from clipopt._replay.text import format_text

    snap = clipopt.load_snapshot(spike)
    snap["rank"] = 1
    r = replay(snap, branch_model(), mse)
    assert (r.rank, r.cause, r.layer) == (1, "averaged", "net.b.weight")
    last = format_text(r).splitlines()[-1]
    norm = f"{r.snapshot_norm:.4g}"
    assert last.startswith(f"Cause: averaged -- rank 1's snapshot norm {norm} is that of the gradient")


# ----------------------------------------------------------------------------- data parallel


@pytest.fixture(scope="module")
def ddp_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The two rank files of the DDP run of ``tests/replay_jobs.py`` (killed after 240 s)."""
    if not GLOO:
        pytest.fail("this torch build has no torch.distributed with the gloo backend")
    out = tmp_path_factory.mktemp("ddp")
    ctx = start_ranks(replay_jobs.ddp_snapshot_job, (free_port(), str(out)), replay_jobs.WORLD)
    join_spawned(ctx, "DDP snapshot")
    return snapshots(out)


def test_ddp_rank_files_replay_without_a_process_group(ddp_files: list[str]) -> None:
    """One file per rank; rank 1's (the NaN batch) reproduces as data, seen first by ``lin``; rank 0's
    batch is finite: not reproduced, and its account points at the other ranks' files."""
    from clipopt._replay.text import format_text

    assert [Path(f).name for f in ddp_files] == [
        "anomaly-step00000002-nonfinite-rank0.pt",
        "anomaly-step00000002-nonfinite-rank1.pt",
    ]
    assert not torch.distributed.is_initialized()
    bad = replay(ddp_files[1], log_model(), mse)
    assert (bad.rank, bad.reproduced, bad.cause) == (1, True, "data")
    assert (bad.phase, bad.module, bad.attached_nonfinite) == ("forward", "lin", ("inputs",))
    good = replay(ddp_files[0], log_model(), mse)
    assert (good.rank, good.reproduced, good.cause) == (0, False, "transient")
    assert good.snapshot_nonfinite_grads == (
        "module.lin.weight",
        "module.lin.bias",
        "module.out.weight",
        "module.out.bias",
    )
    assert "replay the other ranks' files (-rank<r>.pt)" in format_text(good)


# ----------------------------------------------------------------------------- the model afterwards


def test_training_mode_is_restored(runs: dict[str, str]) -> None:
    """A loss_fn that switches the model to eval mode (or a submodule back to train) leaves every
    module's training flag as it was before the replay."""
    model = log_model()
    model.out.eval()

    def switching(m: nn.Module, attached: dict[str, Any]) -> torch.Tensor:
        m.eval()
        m.out.train()
        return mse(m, attached)

    replay(runs["log"], model, switching, repeats=1)
    assert [(name, m.training) for name, m in model.named_modules()] == [
        ("", True),
        ("lin", True),
        ("act", True),
        ("out", False),
    ]


def test_model_is_left_as_it_was(runs: dict[str, str]) -> None:
    """Parameters, buffers, .grad and training mode are restored; no hook and no dispatch mode remain."""
    model = log_model()
    model.register_buffer("counter", torch.tensor([7.0]))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = copy.deepcopy(model.state_dict())
    grads = [p.grad for p in model.parameters()]
    model.eval()
    replay(runs["log"], model, mse)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert not model.training
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert _get_current_dispatch_mode() is None


def test_loaded_snapshot_gives_the_same_result(runs: dict[str, str]) -> None:
    """A snapshot passed as load_snapshot()'s dict gives the same result as its path (file None)."""
    by_path = replay(runs["radial"], radial_model(), mse, repeats=1)
    by_dict = replay(clipopt.load_snapshot(runs["radial"]), radial_model(), mse, repeats=1)
    assert by_dict.file is None and by_path.file == runs["radial"] and by_path.repeats == 1
    assert json_safe(by_dict.as_dict()) == json_safe({**by_path.as_dict(), "file": None})  # nan as "nan"


def test_result_as_dict_is_plain_data(runs: dict[str, str]) -> None:
    """as_dict() has every field; tensor statistics become dicts."""
    r = replay(runs["log"], log_model(), mse, repeats=1)
    d = r.as_dict()
    assert set(d) == set(ReplayResult.__dataclass_fields__)
    assert d["output"] == {
        "shape": [8, 4],
        "dtype": "float32",
        "nan": LOG_BAD_UNITS,
        "posinf": 0,
        "neginf": 0,
        "min": r.output.min if r.output else None,
        "max": r.output.max if r.output else None,
    }


# ----------------------------------------------------------------------------- bad input


def test_bad_arguments_are_refused_before_the_model_is_touched(runs: dict[str, str]) -> None:
    """TypeError/ValueError naming the argument, the value and the fix; the model is unchanged."""
    model = log_model()
    before = copy.deepcopy(model.state_dict())
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"model": "m"}, TypeError, "replay() got model=str; pass the torch.nn.Module that was trained"),
        (
            {"loss_fn": 3},
            TypeError,
            "replay() got loss_fn=int, which is not callable; pass a function loss_fn(model, attached) "
            "returning the loss",
        ),
        ({"repeats": 0}, ValueError, "replay() got repeats=0; pass a positive int, e.g. repeats=3"),
        ({"repeats": True}, TypeError, "replay() got repeats=True; pass a positive int, e.g. repeats=3"),
        ({"repeats": -1}, ValueError, "replay() got repeats=-1; pass a positive int, e.g. repeats=3"),
        ({"repeats": "3"}, TypeError, "replay() got repeats='3'; pass a positive int, e.g. repeats=3"),
        (
            {"snapshot": 5},
            TypeError,
            "replay() got snapshot=int; pass a snapshot path or what clipopt.load_snapshot() returned",
        ),
        (
            {"snapshot": {"step": 1}},
            ValueError,
            "replay() got a snapshot dict without reason, total_norm, params, grads, optimizer, attached; "
            "pass a path or what clipopt.load_snapshot() returned",
        ),
    ]
    for change, kind, message in cases:
        args: dict[str, Any] = {"snapshot": runs["log"], "model": model, "loss_fn": mse, **change}
        with pytest.raises(kind) as info:
            replay(**args)
        assert str(info.value) == message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_snapshot_that_does_not_fit_the_model(runs: dict[str, str]) -> None:
    """Another model, other shapes, or positional names: ValueError saying what to pass."""
    with pytest.raises(ValueError) as info:
        replay(runs["log"], radial_model(), mse)
    assert str(info.value) == (
        "the snapshot's parameter 'lin.bias' is not in the model (Sequential, whose parameters are "
        "lin.weight, out.weight, out.bias); pass the model that was trained, built the same way"
    )
    wide = nn.Sequential()
    wide.add_module("lin", nn.Linear(3, 5))
    wide.add_module("out", nn.Linear(5, 1))
    with pytest.raises(ValueError) as info:
        replay(runs["log"], wide, mse)
    assert str(info.value) == (
        "the snapshot's parameter 'lin.weight' has shape (4, 3) but the model's 'lin.weight' has (5, 3); "
        "pass the model that was trained"
    )
    snap = clipopt.load_snapshot(runs["log"])
    snap["params"] = {f"group0.{i}": t for i, t in enumerate(snap["params"].values())}
    with pytest.raises(ValueError) as info:
        replay(snap, log_model(), mse)
    assert str(info.value) == (
        "the snapshot's parameter names are positional (group<g>.<i>), so they cannot be matched to the "
        "model; train with ClippedOptimizer(..., param_names=model.named_parameters())"
    )


def test_loss_fn_must_return_one_element(runs: dict[str, str]) -> None:
    """A loss_fn returning a vector or a float is a TypeError saying what to return."""
    with pytest.raises(TypeError) as info:
        replay(runs["log"], log_model(), lambda m, a: m(a["inputs"]))
    assert str(info.value) == (
        "replay(): loss_fn returned a tensor of shape (8, 1); return the loss as a tensor with one element"
    )
    with pytest.raises(TypeError) as info:
        replay(runs["log"], log_model(), lambda m, a: 1.0)
    assert str(info.value) == "replay(): loss_fn returned float; return the loss as a tensor with one element"


def test_loss_fn_must_return_a_loss_with_a_gradient(runs: dict[str, str]) -> None:
    """A detached loss (or one computed under no_grad) has no backward: a ValueError saying what to
    return, not a replay without gradients read as "transient"."""
    for detached in (lambda m, a: mse(m, a).detach(), lambda m, a: torch.no_grad()(mse)(m, a)):
        with pytest.raises(ValueError) as info:
            replay(runs["transient"], log_model(), detached)
        assert str(info.value) == (
            "replay(): loss_fn returned a loss that does not require grad (detached, or computed under "
            "torch.no_grad()); return the loss whose backward gives the parameters' gradients"
        )


def test_an_error_in_loss_fn_restores_the_model(runs: dict[str, str]) -> None:
    """loss_fn's own error propagates with a note naming the snapshot; the model's parameters (not the
    snapshot's, which were loaded for the replay), hooks and dispatch mode are as before."""
    model = log_model()
    with torch.no_grad():
        model.out.weight.fill_(0.125)
    before = copy.deepcopy(model.state_dict())

    def failing(m: nn.Module, attached: dict[str, Any]) -> torch.Tensor:
        m(attached["inputs"])
        raise RuntimeError("broken loss")

    with pytest.raises(RuntimeError, match="broken loss") as info:
        replay(runs["log"], model, failing)
    assert info.value.__notes__ == [
        f"clipopt.replay: raised while replaying {runs['log']}; the model was restored"
    ]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert _get_current_dispatch_mode() is None


def test_some_replays_only_is_intermittent(runs: dict[str, str]) -> None:
    """A loss_fn that goes NaN in its second call only (a nondeterministic fault): 1 of 3 replays shows
    it, so not reproduced, cause intermittent; where is that replay's (the first one was finite): the
    multiplication by NaN in loss_fn; the loss and norm fields are the first replay's."""
    calls = [0]

    def flaky(model: nn.Module, attached: dict[str, Any]) -> torch.Tensor:
        calls[0] += 1
        loss = mse(model, attached)
        return loss * math.nan if calls[0] == 2 else loss

    r = replay(runs["transient"], log_model(), flaky)
    assert (r.reproduced, r.reproduced_runs, r.repeats, r.cause) == (False, 1, 3, "intermittent")
    assert (r.phase, r.module, r.op) == ("forward", None, "aten.mul.Tensor") and r.consistent
    assert r.loss_finite is True
