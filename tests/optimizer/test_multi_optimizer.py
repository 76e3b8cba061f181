"""Several inner optimizers, one decision: ``ClippedOptimizer([muon, adamw], ...)``.

torch's ``Muon`` takes only 2-D parameters, so a model trains with Muon for its
weight matrices and AdamW for the biases.  The reference for every update is
plain torch: ``clip_grad_norm_`` over *all* parameters, then ``muon.step()`` and
``adamw.step()``.
"""

from __future__ import annotations

import copy
import csv
import io
import math
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import clipopt
from clipopt import ClippedOptimizer, CSVLogger

from ..helpers import assert_tensors_close, mlp, mse, pairs, spawn_job
from ..hostreads import count_host_reads


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The model's weight matrices (Muon's) and its other parameters (AdamW's)."""
    params = list(model.parameters())
    return [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]


def _muon_adamw(model: nn.Module, **adamw: Any) -> list[torch.optim.Optimizer]:
    matrices, others = _split(model)
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=0.01, **adamw)]


def _all_fused(model: nn.Module) -> list[torch.optim.Optimizer]:
    matrices, others = _split(model)
    return [
        torch.optim.SGD(matrices, lr=0.05, momentum=0.9, fused=True),
        torch.optim.AdamW(others, lr=0.01, fused=True),
    ]


def _inner_states(optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    return [copy.deepcopy(o.state_dict()) for o in optimizers]


def _assert_same(a: Any, b: Any) -> None:
    """Nested dicts/lists of tensors and numbers, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b or (a != a and b != b)


def _assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------- one decision


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_equals_clip_grad_norm_over_all_parameters_then_each_step(reduction: str) -> None:
    """Four windows of three micro-batches: the parameters and inner states of clip_grad_norm_ over every
    parameter followed by muon.step() and adamw.step(), and the same total norm (one norm, one
    coefficient); bit for bit with reduction='sum' ('mean' folds 1/3 into the coefficient: one rounding
    apart from dividing the gradients first).  clip_grad_norm_ is given the parameters in the
    wrapper's order (Muon's, then AdamW's): the total is the norm of the per-tensor norms, and a sum
    in another order rounds differently on some CPUs (ATEN_CPU_CAPABILITY=default: 1 ulp, #33)."""
    model = mlp((5, 4, 3))
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(_muon_adamw(model), max_norm=0.3, accumulation_steps=3, reduction=reduction)
    ref_muon, ref_adamw = _muon_adamw(ref)
    in_order = [p for o in (ref_muon, ref_adamw) for group in o.param_groups for p in group["params"]]
    batches = pairs(12, (8, 5), (8, 3), seed=1)
    for w in range(4):
        window = batches[3 * w : 3 * w + 3]
        for batch in window:
            mse(model, batch).backward()
            opt.step()
            opt.zero_grad()
            mse(ref, batch).backward()
        if reduction == "mean":
            for p in ref.parameters():
                p.grad.div_(3)
        norm = torch.nn.utils.clip_grad_norm_(in_order, 0.3)
        ref_muon.step()
        ref_adamw.step()
        ref.zero_grad()
        assert opt.last_stats.clipped
        if reduction == "sum":
            assert opt.last_stats.total_norm == norm.item()
            _assert_params_equal(model, ref)
        else:
            assert opt.last_stats.total_norm == pytest.approx(norm.item(), rel=1e-6)
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    assert opt.num_updates == 4
    if reduction == "sum":
        _assert_same(_inner_states(opt.optimizers), _inner_states([ref_muon, ref_adamw]))


@pytest.mark.parametrize("norm_type", [1.0, 3.0, math.inf])
@pytest.mark.parametrize("clip_value", [None, 0.01])
def test_every_norm_type_and_clip_value_over_all_parameters(norm_type: float, clip_value: Any) -> None:
    """norm_type 1, 3 and inf, with and without clip_value, windows of two micro-batches (sum): bit for
    bit clip_grad_value_ and clip_grad_norm_ over every parameter of both optimizers, then each step();
    the recorded norm is the pre-clip norm of all of them (summed in the optimizers' order: Muon's
    matrices, then AdamW's biases)."""
    model = mlp((5, 4, 3))
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(
        _muon_adamw(model),
        0.3,
        norm_type=norm_type,
        clip_value=clip_value,
        accumulation_steps=2,
        reduction="sum",
    )
    ref_optimizers = _muon_adamw(ref)
    batches = pairs(6, (8, 5), (8, 3), seed=11)
    for w in range(3):
        for batch in batches[2 * w : 2 * w + 2]:
            mse(model, batch).backward()
            opt.step()
            opt.zero_grad()
            mse(ref, batch).backward()
        params = [p for o in ref_optimizers for g in o.param_groups for p in g["params"]]  # sum in this order
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, clip_value)
        torch.nn.utils.clip_grad_norm_(params, 0.3, norm_type)
        for o in ref_optimizers:
            o.step()
        ref.zero_grad()
        assert opt.last_stats.total_norm == norm.item()
        _assert_params_equal(model, ref)


@pytest.mark.parametrize("make", [_muon_adamw, _all_fused], ids=["muon+adamw", "all-fused"])
def test_nan_in_one_optimizers_gradient_leaves_every_parameter_and_state_untouched(make: Any) -> None:
    """A NaN in a single weight gradient (Muon's) skips the whole update: the AdamW biases do not move
    either, and both inner states (AdamW's step count included) stay bit-identical."""
    model = mlp((5, 4, 3))
    opt = ClippedOptimizer(make(model), max_norm=1.0)
    for batch in pairs(2, (8, 5), (8, 3), seed=2):  # state in both optimizers (the fused path is ready)
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad()
    before_params = [p.detach().clone() for p in model.parameters()]
    before_states = _inner_states(opt.optimizers)
    mse(model, pairs(1, (8, 5), (8, 3), seed=3)[0]).backward()
    model[0].weight.grad[0, 0] = math.nan  # only the first optimizer's gradient
    opt.step()
    assert opt.step_was_skipped and opt.last_stats.reason == "nonfinite"
    for p, q in zip(model.parameters(), before_params, strict=True):
        assert torch.equal(p, q)
        assert p.grad is None or not p.grad.isnan().any() or p is model[0].weight
    _assert_same(_inner_states(opt.optimizers), before_states)
    assert opt.num_updates == 2 and opt.num_skipped == 1


@pytest.mark.parametrize("make", [_muon_adamw, _all_fused], ids=["muon+adamw", "all-fused"])
def test_a_skipped_first_window_creates_no_inner_state(make: Any) -> None:
    """The very first window non-finite (AdamW's gradient): no inner optimizer creates state (fused
    SGD's momentum buffers would stay uninitialised memory), and the next windows equal plain torch
    started from there: clip_grad_norm_ over every parameter, then each inner step()."""
    model = mlp((5, 4, 3))
    ref = copy.deepcopy(model)
    opt = ClippedOptimizer(make(model), max_norm=0.3)
    ref_optimizers = make(ref)
    batches = pairs(4, (8, 5), (8, 3), seed=8)
    mse(model, batches[0]).backward()
    model[2].bias.grad[0] = math.nan
    opt.step()
    opt.zero_grad()
    assert opt.step_was_skipped and [len(o.state) for o in opt.optimizers] == [0, 0]
    for batch in batches[1:]:
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad()
        mse(ref, batch).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        for o in ref_optimizers:
            o.step()
        ref.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    for o, r in zip(opt.optimizers, ref_optimizers, strict=True):
        for p, q in zip(o.state.values(), r.state.values(), strict=True):
            assert p.keys() == q.keys()
            for k in p:
                torch.testing.assert_close(p[k], q[k], rtol=1e-6, atol=1e-7)


def test_all_fused_list_reads_nothing_and_a_mix_reads_once_per_update() -> None:
    """Fused SGD (with or without momentum) + fused AdamW: updates (applied or skipped) read nothing
    from the device, found_inf handed to each; Muon + fused AdamW: one flag per update, none inside a
    window (not one per optimizer)."""

    def reads(optimizers: list[torch.optim.Optimizer], model: nn.Module, pattern: str) -> list[int]:
        opt = ClippedOptimizer(optimizers, max_norm=0.1, accumulation_steps=2)
        counts = []
        for i, c in enumerate(pattern):
            x = pairs(1, (8, 5), (8, 3), seed=10 + i)[0]
            mse(model, x).backward()
            if c == "b":
                model[0].bias.grad[0] = math.inf
            with count_host_reads() as r:
                opt.step()
            counts.append(len(r))
            opt.zero_grad()
        return counts

    fused_model = mlp((5, 4, 3))
    assert reads(_all_fused(fused_model), fused_model, "gg" + "ggbggg")[2:] == [0] * 6
    plain = mlp((5, 4, 3))  # fused SGD without momentum keeps no state: ready from the start
    matrices, others = _split(plain)
    stateless = [torch.optim.SGD(matrices, lr=0.05, fused=True), torch.optim.AdamW(others, fused=True)]
    assert reads(stateless, plain, "gg" + "ggbggg")[2:] == [0] * 6
    mixed = mlp((5, 4, 3))
    matrices, others = _split(mixed)
    mix = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=0.01, fused=True)]
    assert reads(mix, mixed, "ggggbggg") == [0, 1] * 4


def test_an_error_in_the_second_inner_step_says_the_first_already_applied_its_update() -> None:
    """An error raised by AdamW's step() (a pre-hook here; a CUDA OOM allocating its state in practice)
    after Muon stepped carries a note naming both: Muon's weights did change, AdamW's biases did not, so
    the caller cannot mistake the update for undone (the window itself is discarded, as for one
    optimizer)."""
    model = mlp((5, 4, 3))
    muon, adamw = optimizers = _muon_adamw(model)
    opt = ClippedOptimizer(optimizers, max_norm=1.0)

    def fail(*_: Any) -> None:
        raise RuntimeError("out of memory")

    adamw.register_step_pre_hook(fail)
    before = [p.detach().clone() for p in model.parameters()]
    mse(model, pairs(1, (8, 5), (8, 3), seed=5)[0]).backward()
    with pytest.raises(RuntimeError, match="out of memory") as info:
        opt.step()
    note = (
        "clipopt: optimizer[1] (AdamW) raised in step() after optimizer[0] (Muon) applied this update: "
        "those parameters and states are updated, the others are not; load a checkpoint before training on"
    )
    assert note in info.value.__notes__
    changed = [not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)]
    assert changed == [True, False, True, False]  # 0.weight, 0.bias, 2.weight, 2.bias
    assert opt.num_windows == 0 and len(muon.state) == 2 and len(adamw.state) == 0


def test_an_error_in_the_second_fused_step_of_a_skipped_update_adds_no_partial_note() -> None:
    """All fused, a non-finite window (found_inf handed to each): an error in the second optimizer's
    step() carries no note that the first applied the update (it skipped it), and nothing changed."""
    model = mlp((5, 4, 3))
    sgd, adamw = optimizers = _all_fused(model)
    opt = ClippedOptimizer(optimizers, max_norm=1.0)
    for batch in pairs(2, (8, 5), (8, 3), seed=2):  # state in both: the fused path is taken
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad()

    def fail(*_: Any) -> None:
        raise RuntimeError("out of memory")

    adamw.register_step_pre_hook(fail)
    before = [p.detach().clone() for p in model.parameters()]
    mse(model, pairs(1, (8, 5), (8, 3), seed=5)[0]).backward()
    model[0].weight.grad[0, 0] = math.nan
    with pytest.raises(RuntimeError, match="out of memory") as info:
        opt.step()
    assert not any("applied this update" in n for n in getattr(info.value, "__notes__", []))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert len(sgd.state) == 2


# ---------------------------------------------------------------- the optimizer's surface


def test_param_groups_state_and_defaults_are_the_inner_optimizers() -> None:
    """param_groups are every inner optimizer's group dicts in order (the same objects, re-read after an
    inner load_state_dict), state reaches each optimizer's entries, defaults merges theirs, opt.optimizers
    lists them and opt.optimizer names opt.optimizers."""
    model = mlp((5, 4, 3))
    muon, adamw = optimizers = _muon_adamw(model)
    opt = ClippedOptimizer(optimizers)
    assert opt.optimizers == [muon, adamw]
    groups = opt.param_groups
    assert len(groups) == 2 and groups[0] is muon.param_groups[0] and groups[1] is adamw.param_groups[0]
    assert opt.param_groups is groups  # cached while unchanged
    mse(model, pairs(1, (8, 5), (8, 3), seed=4)[0]).backward()
    opt.step()
    w, b = model[0].weight, model[0].bias
    assert opt.state[w] is muon.state[w] and opt.state[b] is adamw.state[b]
    assert w in opt.state and len(opt.state) == 4 and set(opt.state) == set(model.parameters())
    assert opt.defaults["momentum"] == 0.95 and opt.defaults["betas"] == (0.9, 0.999)
    for _ in range(3):  # new group dicts in a new list, each time (a freed list's id may come back)
        adamw.load_state_dict(adamw.state_dict())
    assert opt.param_groups[1] is adamw.param_groups[0]
    with pytest.raises(
        AttributeError,
        match=re.escape(
            "this ClippedOptimizer wraps 2 optimizers (Muon, AdamW); opt.optimizer is the inner "
            "optimizer of one: use opt.optimizers[i]"
        ),
    ):
        _ = opt.optimizer
    with pytest.raises(
        TypeError,
        match=re.escape(
            "cannot assign param_groups of a ClippedOptimizer over several optimizers; assign each inner "
            "optimizer's (opt.optimizers[i].param_groups = ...)"
        ),
    ):
        opt.param_groups = []
    single = ClippedOptimizer([muon])
    assert single.optimizer is muon and single.optimizers == [muon]


def test_a_group_dict_replaced_in_an_inner_list_is_seen_by_the_wrapper() -> None:
    """adamw.param_groups[0] = {...} (same list, same length, a new dict): opt.param_groups holds the new
    dict, so an LR scheduler over the wrapper changes the lr AdamW uses (it wrote into the old dict)."""
    model = mlp((5, 4, 3))
    muon, adamw = optimizers = _muon_adamw(model)
    opt = ClippedOptimizer(optimizers, max_norm=1.0)
    assert opt.param_groups[1] is adamw.param_groups[0]
    adamw.param_groups[0] = {**adamw.param_groups[0], "lr": 0.5}
    assert opt.param_groups[1] is adamw.param_groups[0]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    mse(model, pairs(1, (8, 5), (8, 3), seed=7)[0]).backward()
    opt.step()
    sched.step()
    assert adamw.param_groups[0]["lr"] == pytest.approx(0.05) and muon.param_groups[0]["lr"] == pytest.approx(
        0.002
    )


def test_add_param_group_goes_to_the_optimizer_named_by_index() -> None:
    """add_param_group(group, optimizer=i) adds to opt.optimizers[i] (params may be a generator); without
    the index, with one out of range, or with a parameter another optimizer holds, it refuses before
    anything changes."""
    model = mlp((5, 4, 3))
    adamw = (optimizers := _muon_adamw(model))[1]
    opt = ClippedOptimizer(optimizers)
    extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "add_param_group over 2 optimizers (Muon, AdamW) needs the index of the one to add the "
            "group to, 0 to 1, got optimizer=None; pass e.g. opt.add_param_group(group, optimizer=1) "
            "(an index into opt.optimizers)"
        ),
    ):
        opt.add_param_group({"params": [extra]})
    with pytest.raises(ValueError, match=re.escape("0 to 1, got optimizer=2; pass e.g.")):
        opt.add_param_group({"params": [extra]}, optimizer=2)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "optimizer[0] (Muon) and optimizer[1] (AdamW) both hold parameter group 0 index 0 (shape (4, 5))"
        ),
    ):
        opt.add_param_group({"params": [model[0].weight]}, optimizer=1)
    assert len(adamw.param_groups) == 1 and len(opt.param_groups) == 2
    opt.add_param_group({"params": (q for q in [extra]), "lr": 0.5}, optimizer=1)  # a generator
    assert len(adamw.param_groups) == 2 and opt.param_groups[2]["params"] == [extra]


@pytest.mark.parametrize("acc", [1, 2])
def test_a_parameter_added_to_an_inner_optimizer_that_another_holds_is_refused(acc: int) -> None:
    """#33: a group added through opt.optimizers[1].add_param_group(...) with a parameter optimizer 0
    holds would be stepped twice; the next step() refuses it before anything changes, and once the group
    is removed the window is plain torch's (clip_grad_norm_, then each optimizer's step), bit for bit."""
    model = mlp((5, 4, 3))
    ref = copy.deepcopy(model)
    optimizers, ref_optimizers = _muon_adamw(model), _muon_adamw(ref)
    opt = ClippedOptimizer(optimizers, max_norm=0.3, accumulation_steps=acc, reduction="sum")
    batches = pairs(acc, (8, 5), (8, 3), seed=1)
    optimizers[1].add_param_group({"params": [model[0].weight]})  # Muon's already
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "optimizer[0] (Muon) and optimizer[1] (AdamW) both hold parameter group 0 index 0 "
            "(shape (4, 5)); the optimizers must hold disjoint parameters: give each parameter to one of "
            "them; a group added to an inner optimizer (opt.optimizers[i].add_param_group(...))"
        ),
    ):
        for batch in batches:
            mse(model, batch).backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert (opt.micro_batches, opt.num_windows) == (0, 0) and not any(o.state for o in optimizers)
    optimizers[1].param_groups.pop()
    opt.zero_grad()
    for batch in batches:
        mse(model, batch).backward()
        opt.step()
        mse(ref, batch).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
    for o in ref_optimizers:
        o.step()
    assert opt.num_updates == 1
    _assert_params_equal(model, ref)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (
            "empty",
            ValueError,
            "optimizer is an empty list; pass an optimizer, or a list of optimizers over "
            "disjoint parameters, e.g. [torch.optim.Muon(matrices), torch.optim.AdamW(others)]",
        ),
        (
            "second",
            TypeError,
            "optimizer[1] must be a torch.optim.Optimizer, got str; pass e.g. "
            "torch.optim.AdamW(model.parameters())",
        ),
        (
            "overlap",
            ValueError,
            "optimizer[0] (Muon) and optimizer[1] (AdamW) both hold parameter group 0 "
            "index 1 (shape (3, 4)); the optimizers must hold disjoint parameters: give each parameter to "
            "one of them",
        ),
        (
            "lbfgs",
            TypeError,
            "optimizer[1] is LBFGS, which re-evaluates its closure inside step(); it "
            "cannot share one step with other optimizers: wrap it alone, ClippedOptimizer(lbfgs, ...)",
        ),
        (
            "wrapped",
            TypeError,
            "optimizer[0] is already a ClippedOptimizer; wrap its inner optimizer (opt.optimizer) once",
        ),
        (
            "twice",
            ValueError,
            "optimizer[0] and optimizer[2] are the same Muon object; list each optimizer once",
        ),
    ],
)
def test_bad_lists_are_refused_with_the_fix(value: Any, error: type, message: str) -> None:
    """An empty list, a non-optimizer element, a parameter in two optimizers, LBFGS in a list, an
    already wrapped element and one optimizer listed twice are refused at construction, naming the
    element and the fix (twice: not "both hold parameter ...", which sends the user after the params)."""
    model = mlp((5, 4, 3))
    matrices, others = _split(model)
    muon = torch.optim.Muon(matrices, lr=0.02)
    arg = {
        "empty": lambda: [],
        "second": lambda: [muon, "adamw"],
        "overlap": lambda: [muon, torch.optim.AdamW([*others, matrices[1]])],
        "lbfgs": lambda: [muon, torch.optim.LBFGS(others)],
        "wrapped": lambda: [ClippedOptimizer(muon), torch.optim.AdamW(others)],
        "twice": lambda: [muon, torch.optim.AdamW(others), muon],
    }[value]()
    with pytest.raises(error, match=re.escape(message)):
        ClippedOptimizer(arg)


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_mid_window_resumes_bit_for_bit_through_torch_save() -> None:
    """A state dict taken mid-window ({'optimizers': [muon's, adamw's], 'clipopt': ...}) saved with
    torch.save and read with weights_only=True resumes into fresh optimizers exactly as the run goes on."""
    model = mlp((5, 4, 3))
    opt = ClippedOptimizer(_muon_adamw(model), max_norm=0.3, accumulation_steps=2)
    batches = pairs(9, (8, 5), (8, 3), seed=5)
    for batch in batches[:5]:
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    assert len(opt.state_dict()["optimizers"]) == 2
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = mlp((5, 4, 3), seed=7)
    resumed.load_state_dict(saved["model"])
    opt2 = ClippedOptimizer(_muon_adamw(resumed), max_norm=0.3, accumulation_steps=2)
    opt2.load_state_dict(saved["opt"])
    assert opt2.micro_batches == 1 and opt2.num_updates == 2
    for m, o in ((model, opt), (resumed, opt2)):
        for batch in batches[5:]:
            mse(m, batch).backward()
            o.step()
            o.zero_grad()
    _assert_params_equal(model, resumed)
    _assert_same(_inner_states(opt.optimizers), _inner_states(opt2.optimizers))


def test_state_dict_of_the_wrong_count_is_refused_before_anything_changes() -> None:
    """A state dict holding one optimizer's state where two are wrapped, or a single optimizer's plain
    layout, raises ValueError naming the count and leaves both inner optimizers as they were."""
    model = mlp((5, 4, 3))
    opt = ClippedOptimizer(_muon_adamw(model))
    mse(model, pairs(1, (8, 5), (8, 3), seed=6)[0]).backward()
    opt.step()
    sd = opt.state_dict()
    before = _inner_states(opt.optimizers)
    short = {**sd, "optimizers": sd["optimizers"][:1]}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "invalid state_dict: 'optimizers' must hold one state dict per inner optimizer, 2 (Muon, AdamW), "
            "got 1 state dicts; pass the dict returned by opt.state_dict() of a ClippedOptimizer over the "
            "same optimizers, in the same order"
        ),
    ):
        opt.load_state_dict(short)
    with pytest.raises(ValueError, match=re.escape("2 (Muon, AdamW), got no 'optimizers' list")):
        opt.load_state_dict(opt.optimizers[1].state_dict())
    bad = copy.deepcopy(sd)
    bad["optimizers"][1]["param_groups"][0]["params"] = [0]  # AdamW's group lost a parameter
    with pytest.raises(ValueError, match=re.escape("parameter group 0 has 1 parameters")):
        opt.load_state_dict(bad)
    _assert_same(_inner_states(opt.optimizers), before)


def test_a_state_dict_of_several_into_a_wrapper_over_one_says_so() -> None:
    """Loading the state dict of a wrapper over [Muon, AdamW] into a wrapper over one optimizer raises a
    ValueError that names the layout (not only "'state' must be a dict, got NoneType"), changing nothing."""
    model = mlp((5, 4, 3))
    several = ClippedOptimizer(_muon_adamw(model), max_norm=1.0)
    mse(model, pairs(1, (8, 5), (8, 3), seed=6)[0]).backward()
    several.step()
    one = ClippedOptimizer(torch.optim.AdamW(mlp((5, 4, 3)).parameters()), max_norm=1.0)
    message = (
        "it is the state dict of a ClippedOptimizer over 2 optimizers ({'optimizers': [...]}); "
        "load it into a ClippedOptimizer over the same list of optimizers"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        one.load_state_dict(several.state_dict())
    assert one.num_windows == 0 and len(one.state) == 0


def test_a_failing_second_inner_load_puts_the_first_back() -> None:
    """When the second inner optimizer refuses its part while loading, the first one, already loaded,
    is put back too: the wrapper's load_state_dict changes all or nothing."""
    model = mlp((5, 4, 3))
    muon, adamw = optimizers = _muon_adamw(model)
    opt = ClippedOptimizer(optimizers)
    mse(model, pairs(1, (8, 5), (8, 3), seed=8)[0]).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["optimizers"][0]["param_groups"][0]["lr"] = 0.5  # visible if Muon's part were loaded
    muon_state, muon_groups = muon.state, muon.param_groups

    def refuse(_optimizer: Any, _state_dict: Any) -> None:
        raise RuntimeError("refused")

    adamw.register_load_state_dict_pre_hook(refuse)
    with pytest.raises(ValueError, match=re.escape("the inner AdamW rejected it (refused)")):
        opt.load_state_dict(sd)
    assert muon.state is muon_state and muon.param_groups is muon_groups
    assert muon.param_groups[0]["lr"] == 0.02


def test_pickle_and_deepcopy_keep_the_inner_optimizers() -> None:
    """A wrapper over two optimizers survives pickle and deepcopy (with its model): both inner
    optimizers, their groups and the state view come back, and the next update is the original's."""
    model = mlp((5, 4, 3))
    opt = ClippedOptimizer(_muon_adamw(model), max_norm=0.3)
    mse(model, pairs(1, (8, 5), (8, 3), seed=9)[0]).backward()
    opt.step()
    opt.zero_grad()
    copies = [pickle.loads(pickle.dumps((model, opt))), copy.deepcopy((model, opt)), (model, opt)]
    batch = pairs(1, (8, 5), (8, 3), seed=11)[0]
    for m, o in copies:
        assert [type(i) for i in o.optimizers] == [torch.optim.Muon, torch.optim.AdamW]
        assert o.param_groups[0] is o.optimizers[0].param_groups[0] and len(o.state) == 4
        mse(m, batch).backward()
        o.step()
    _assert_params_equal(copies[0][0], model)
    _assert_params_equal(copies[1][0], model)


# ---------------------------------------------------------------- schedulers, loggers


def test_per_update_scheduler_sets_both_optimizers_lr_and_waits_on_a_skip() -> None:
    """clipopt.per_update(LambdaLR(opt, ...)) over the wrapper writes every inner optimizer's lr (the
    groups are their dicts) and does not advance on a skipped window."""
    model = mlp((5, 4, 3))
    muon, adamw = optimizers = _muon_adamw(model)
    opt = ClippedOptimizer(optimizers, max_norm=1.0)
    sched = clipopt.per_update(torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k))
    for i, bad in enumerate([False, True, False]):
        mse(model, pairs(1, (8, 5), (8, 3), seed=20 + i)[0]).backward()
        if bad:
            model[0].weight.grad[0, 0] = math.nan
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.num_updates == 2
    assert muon.param_groups[0]["lr"] == 0.02 * 0.25 and adamw.param_groups[0]["lr"] == 0.01 * 0.25


def test_per_update_over_each_inner_optimizer_keeps_its_own_schedule() -> None:
    """A schedule per inner optimizer (StepLR for Muon, LambdaLR for AdamW), each through
    clipopt.per_update(sched, opt): both advance once per applied update of the wrapper and neither on a
    skipped window; each writes only its own optimizer's lr (values from the schedules' formulas)."""
    model = mlp((5, 4, 3))
    muon, adamw = optimizers = _muon_adamw(model)
    opt = ClippedOptimizer(optimizers, max_norm=1.0, accumulation_steps=2)
    lrs = torch.optim.lr_scheduler
    s_muon = clipopt.per_update(lrs.StepLR(muon, step_size=1, gamma=0.5), opt)
    s_adamw = clipopt.per_update(lrs.LambdaLR(adamw, lambda k: 1.0 / (1 + k)), opt)
    assert s_muon.optimizer is opt and s_adamw.base_lrs == [0.01]
    advanced = []
    for i, bad in enumerate([False, False, False, True, False, False, False, False]):
        mse(model, pairs(1, (8, 5), (8, 3), seed=30 + i)[0]).backward()
        if bad:
            model[2].bias.grad[0] = math.nan  # AdamW's gradient: the whole window is skipped
        opt.step()
        advanced.append((s_muon.step(), s_adamw.step()))
        opt.zero_grad()
    assert opt.num_updates == 3 and opt.num_skipped == 1
    assert advanced == [(x, x) for x in (False, True, False, False, False, True, False, True)]
    assert muon.param_groups[0]["lr"] == 0.02 * 0.5**3
    assert adamw.param_groups[0]["lr"] == 0.01 / 4


def test_per_update_of_an_inner_optimizers_scheduler_names_the_wrapper_argument() -> None:
    """per_update on a scheduler of opt.optimizers[i] without the wrapper raises TypeError saying to pass
    it (with it, it is accepted); a wrapper the scheduler's optimizer is not part of raises ValueError;
    a non-wrapper TypeError."""
    model = mlp((5, 4, 3))
    muon, _ = optimizers = _muon_adamw(model)
    opt = ClippedOptimizer(optimizers, max_norm=1.0)
    step_lr = torch.optim.lr_scheduler.StepLR(muon, step_size=1)
    fix = "pass the wrapper too: per_update(StepLR(clipped_opt.optimizers[i], ...), clipped_opt)"
    with pytest.raises(TypeError, match=re.escape(fix)):
        clipopt.per_update(step_lr)
    assert clipopt.per_update(step_lr, opt).optimizer is opt
    other = ClippedOptimizer(torch.optim.AdamW(mlp((5, 4, 3)).parameters()))
    message = (
        "StepLR.optimizer (Muon) is neither this ClippedOptimizer nor one of its inner optimizers "
        "(AdamW); pass the ClippedOptimizer that wraps it"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        clipopt.per_update(step_lr, other)
    wrong = "per_update's optimizer must be a ClippedOptimizer, got Muon"
    with pytest.raises(TypeError, match=re.escape(wrong)):
        clipopt.per_update(step_lr, muon)


def test_csv_logger_writes_each_optimizers_lr(tmp_path: Path) -> None:
    """A CSVLogger row has one lr column per group of every inner optimizer, in order (lr: Muon's,
    lr.1: AdamW's), and the one total norm."""
    model = mlp((5, 4, 3))
    path = tmp_path / "grads.csv"
    opt = ClippedOptimizer(_muon_adamw(model), max_norm=0.3, loggers=[CSVLogger(path)])
    mse(model, pairs(1, (8, 5), (8, 3), seed=30)[0]).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    opt.step()
    opt.close()
    with open(path, newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["lr"]) == 0.02 and float(row["lr.1"]) == 0.01
    assert float(row["total_norm"]) == pytest.approx(norm, rel=1e-6)


def test_snapshot_of_several_optimizers_is_read_by_inspect_and_growth(tmp_path: Path) -> None:
    """An anomaly snapshot of a Muon + AdamW run holds {'optimizers': [...]}; `clipopt inspect` counts
    every inner optimizer's groups, learning rates and parameters with state, and the layer-growth
    reading (replay's spike diagnosis) finds AdamW's history, numbered in the wrapper's order."""
    from clipopt._replay.growth import layer_growth
    from clipopt._replay.inspect import inspect_file

    model = mlp((5, 4, 3))
    opt = ClippedOptimizer(_muon_adamw(model), snapshot_dir=tmp_path, param_names=model.named_parameters())
    for i in range(3):
        mse(model, pairs(1, (8, 5), (8, 3), seed=40 + i)[0]).backward()
        if i == 2:
            model[0].weight.grad[0, 0] = math.nan
        opt.step()
        opt.zero_grad()
    assert opt.last_snapshot is not None
    summary = inspect_file(opt.last_snapshot)
    assert summary["optimizer"] == {"param_groups": 2, "lr": [0.02, 0.01], "params_with_state": 4}
    growth, why = layer_growth(clipopt.load_snapshot(opt.last_snapshot))
    assert why is None
    assert {g.name for g in growth} >= {"0.bias", "2.bias"}
    assert all(g.source == "exp_avg_sq" for g in growth if g.name.endswith("bias"))


def test_grad_scaler_overflow_in_one_optimizer_skips_both_and_backs_off_once() -> None:
    """With a GradScaler the wrapper unscales every inner optimizer's gradients at once: an inf in one
    Muon gradient skips the whole update (both states untouched, reason 'overflow') and halves the
    scale once; the applied updates equal unscaled gradients + clip_grad_norm_ + each step()."""
    model = mlp((5, 4, 3))
    ref = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    opt = ClippedOptimizer(_muon_adamw(model), max_norm=0.3, scaler=scaler)
    ref_opts = _muon_adamw(ref)
    for i, batch in enumerate(pairs(4, (8, 5), (8, 3), seed=50)):
        scaler.scale(mse(model, batch)).backward()
        if i == 2:
            model[0].weight.grad[0, 0] = math.inf
            before = _inner_states(opt.optimizers)
        opt.step()
        opt.zero_grad()
        if i == 2:
            assert opt.last_stats.reason == "overflow" and scaler.get_scale() == 2.0**3
            _assert_same(_inner_states(opt.optimizers), before)
            continue
        mse(ref, batch).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        for o in ref_opts:
            o.step()
        ref.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert opt.num_updates == 3 and scaler.get_scale() == 2.0**3


def test_rewind_puts_back_both_inner_states() -> None:
    """SpikeGuard + Rewind over Muon + AdamW: two spikes rewind to the copy taken after window 11, and
    the parameters and both inner optimizers' states are that copy's, bit for bit."""
    from ..recovery.test_spike_recovery import _guard, _spiky

    model = mlp((5, 4, 3))
    rewind = clipopt.Rewind(every=5, keep=2, spikes=2, within=5, skip_batches=3, module=model, check_every=1)
    opt = ClippedOptimizer(_muon_adamw(model), spike_guard=_guard(), rewind=rewind)
    after: dict[int, Any] = {}
    for x, y in rewind.batches(_spiky(30, {12, 14})):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step(loss=loss)
        params = [p.detach().clone() for p in model.parameters()]
        after[opt.num_windows] = (params, _inner_states(opt.optimizers), opt.last_stats.reason)
    assert [after[w][2] for w in (13, 15, 16)] == ["spike", "spike", "rewind"]
    assert opt.rewinds == 1 and rewind.log[0].restored == 11
    _assert_same(after[16][:2], after[11][:2])


def test_a_groups_own_max_norm_works_across_the_inner_optimizers() -> None:
    """Per-group clipping over the wrapper's groups: AdamW's group with its own 'max_norm' is clipped by
    its own norm, Muon's group by the shared bound; equal to clip_grad_norm_ per part + each step()."""
    model = mlp((5, 4, 3))
    ref = copy.deepcopy(model)
    optimizers = _muon_adamw(model)
    optimizers[1].param_groups[0]["max_norm"] = 0.01
    opt = ClippedOptimizer(optimizers, max_norm=0.2)
    ref_opts = _muon_adamw(ref)
    for batch in pairs(3, (8, 5), (8, 3), seed=60):
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad()
        mse(ref, batch).backward()
        matrices, others = _split(ref)
        torch.nn.utils.clip_grad_norm_(matrices, 0.2)
        torch.nn.utils.clip_grad_norm_(others, 0.01)
        for o in ref_opts:
            o.step()
        ref.zero_grad()
        assert len(opt.last_stats.group_coefs) == 2 and opt.last_stats.group_coefs[1] < 1.0
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_group_check_failing_after_loading_puts_every_inner_optimizer_back() -> None:
    """Muon's saved group lacks a key its group has now (found only once loaded): the error leaves AdamW,
    loaded after Muon with its own part (lr 0.5), as it was too."""
    model = mlp((5, 4, 3))
    muon, adamw = optimizers = _muon_adamw(model)
    opt = ClippedOptimizer(optimizers)
    sd = copy.deepcopy(opt.state_dict())
    del sd["optimizers"][0]["param_groups"][0]["nesterov"]
    sd["optimizers"][1]["param_groups"][0]["lr"] = 0.5
    groups = (muon.param_groups, adamw.param_groups)
    with pytest.raises(ValueError, match=re.escape("invalid state_dict: parameter group 0 lacks 'nesterov'")):
        opt.load_state_dict(sd)
    assert (muon.param_groups, adamw.param_groups) == groups and adamw.param_groups[0]["lr"] == 0.01
    assert muon.param_groups is groups[0] and adamw.param_groups is groups[1]


# ---------------------------------------------------------------- inner methods and layouts


def test_a_method_of_the_inner_optimizers_is_called_on_each_that_has_it() -> None:
    """opt.eval()/opt.train() over [Muon, AdamWScheduleFree, SGDScheduleFree] call each schedule-free
    optimizer's own (Muon has none); an attribute none has, or one several hold as values, raises
    naming opt.optimizers[i]; assigning one names the optimizer that holds it."""
    import schedulefree

    model = mlp((5, 4, 3))
    matrices, others = _split(model)
    sf_adamw = schedulefree.AdamWScheduleFree([others[0]], lr=0.05)
    sf_sgd = schedulefree.SGDScheduleFree([others[1]], lr=0.05)
    opt = ClippedOptimizer([torch.optim.Muon(matrices, lr=0.02), sf_adamw, sf_sgd])
    opt.train()
    assert sf_adamw.param_groups[0]["train_mode"] and sf_sgd.param_groups[0]["train_mode"]
    opt.eval()
    assert not sf_adamw.param_groups[0]["train_mode"] and not sf_sgd.param_groups[0]["train_mode"]
    assert "train" in dir(opt)
    with pytest.raises(
        AttributeError,
        match=re.escape(
            "'ClippedOptimizer' object has no attribute 'nothing' (nor has any of its inner Muon, "
            "AdamWScheduleFree, SGDScheduleFree)"
        ),
    ):
        _ = opt.nothing
    with pytest.raises(
        AttributeError,
        match=re.escape(
            "cannot set 'train' on the ClippedOptimizer: it is the inner AdamWScheduleFree's attribute, read "
            "through the wrapper; set it there: opt.optimizers[1].train = ..."
        ),
    ):
        opt.train = None
    with pytest.raises(AttributeError, match=re.escape("opt.optimizer is the inner optimizer of one")):
        _ = opt.optimizer


def test_lookahead_in_a_list_round_trips_its_own_layout() -> None:
    """[Muon, Lookahead(AdamW)]: Lookahead's part of the state dict is in its own layout (checked by
    Lookahead once loaded), Muon's in torch's; saved with torch.save and loaded (weights_only) into
    fresh optimizers, training resumes bit for bit."""
    from pytorch_optimizer import Lookahead

    def build(model: nn.Module) -> ClippedOptimizer:
        matrices, others = _split(model)
        inner = Lookahead(torch.optim.AdamW(others, lr=0.05), k=2, pullback_momentum="none")
        return ClippedOptimizer([torch.optim.Muon(matrices, lr=0.02), inner], max_norm=0.3)

    model = mlp((5, 4, 3))
    opt = build(model)
    batches = pairs(7, (8, 5), (8, 3), seed=70)
    for batch in batches[:3]:
        mse(model, batch).backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert "state" not in saved["opt"]["optimizers"][1]  # Lookahead's own layout
    resumed = mlp((5, 4, 3), seed=3)
    resumed.load_state_dict(saved["model"])
    opt2 = build(resumed)
    opt2.load_state_dict(saved["opt"])
    for m, o in ((model, opt), (resumed, opt2)):
        for batch in batches[3:]:
            mse(m, batch).backward()
            o.step()
            o.zero_grad()
    _assert_params_equal(model, resumed)


# ---------------------------------------------------------------- data parallel


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="this torch build has no torch.distributed with the gloo backend",
)
def test_ddp_and_fsdp2_over_several_inner_optimizers_equal_one_process(tmp_path: Path) -> None:
    """Two gloo ranks under DDP, Muon + AdamW and fused SGD + fused AdamW, and under FSDP2 (fully_shard)
    SGD + AdamW: each applied window equals clip_grad_norm_ over the ranks' mean gradient then each
    inner step() in one process; a NaN loss on one rank skips that window on both, and the ranks end
    with the same parameters."""
    from .. import distributed_jobs as jobs

    ranks = spawn_job(jobs.multi_ddp_job, "multi", tmp_path, jobs.WORLD, timeout_s=120)
    for kind in ("muon", "fused", "fsdp"):
        for res in ranks:
            assert res[kind]["skipped"] == [False, True, False]
            assert_tensors_close(res[kind]["params"], res[kind]["ref_params"])
        for a, b in zip(ranks[0][kind]["params"], ranks[1][kind]["params"], strict=True):
            assert torch.equal(a, b)
