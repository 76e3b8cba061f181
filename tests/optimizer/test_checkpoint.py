"""Checkpoints of ClippedOptimizer: bit-identical resume, counters, interop with plain
optimizers, "wraps, never copies", validation with rollback, pickling/deepcopy, hooks, scaler."""

from __future__ import annotations

import copy
import io
import pickle
import re
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from clipopt import ClippedOptimizer, NonFiniteGradientError

from .. import helpers
from ..helpers import TwoHeads, mlp, pairs, task_run
from ..hostreads import count_host_reads
from ..optim_db import get, pick

ACC = 3  # micro-batches per window in most tests
N_BATCHES = 15  # five windows
BAD = 7  # the non-finite micro-batch: the third window (batches 6, 7, 8) is skipped

# The inner optimizers of the checkpoint tests: two fused, one foreach, one for-loop (with nesterov).
OPTIMIZERS = [o.id for o in pick("Adam-foreach", "AdamW-fused", "SGD-nesterov-forloop", "SGD-momentum-fused")]
LR = 1e-2  # every checkpoint optimizer runs at this rate (a test checks it survives loading)
FUSED = {name for name in OPTIMIZERS if "fused" in get(name).tags}
HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


# ---------------------------------------------------------------------------------------------- helpers


# make_model(seed): a small MLP whose weights come from a seeded generator (no global RNG)
make_model = partial(mlp, (4, 8, 3), randn_init=True)


# A fixed list of (x, y) batches; batches listed in ``bad`` give NaN gradients.
make_batches = partial(pairs, x_shape=(5, 4), y_shape=(5, 3), seed=0, scale=3)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y) * 10


# The user loop: ``loss.backward(); opt.step(); opt.zero_grad()`` per micro-batch (scaler= optional).
train = partial(helpers.train, loss=_loss)


def wrap(
    model: nn.Module, name: str = "Adam-foreach", reduction: str = "mean", acc: int = ACC, **kw: Any
) -> ClippedOptimizer:
    kw.setdefault("max_norm", 1.0)
    kw.setdefault("clip_value", 0.5)
    return ClippedOptimizer(
        get(name).make(model.parameters(), lr=LR), accumulation_steps=acc, reduction=reduction, **kw
    )


def roundtrip(obj: Any) -> Any:
    """torch.save to memory, then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_tree_equal(a: Any, b: Any, path: str = "sd") -> None:
    """Nested dicts/lists equal; tensors bit-identical (same dtype and shape; NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True), f"{path}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: dict vs {type(b).__name__}"
        assert a.keys() == b.keys(), f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"


def assert_params_identical(m1: nn.Module, m2: nn.Module) -> None:
    for (name, p), q in zip(m1.named_parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q), f"parameter {name} differs (max diff {(p - q).abs().max().item()})"


def counters(opt: ClippedOptimizer) -> tuple[int, int, int, int]:
    return opt.num_updates, opt.num_skipped, opt.num_windows, opt.micro_batches


# ------------------------------------------------------------------------------ 1. bit-identical resume


@pytest.mark.parametrize("cut", range(N_BATCHES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_is_bit_identical(name: str, reduction: str, cut: int, tmp_path: Any) -> None:
    """A checkpoint after any micro-batch, loaded (weights_only) into fresh objects, resumes bit for bit."""
    batches = make_batches(N_BATCHES, bad={BAD})

    ref_model = make_model(0)
    ref = wrap(ref_model, name, reduction)
    train(ref_model, ref, batches)
    # The reference run exercises what the checkpoint must carry: clipping, a skip, several windows.
    assert counters(ref) == (4, 1, 5, 0)
    assert any(s.clipped and s.clip_coef < 1.0 for s in ref.stats if not s.skipped)

    model = make_model(0)
    opt = wrap(model, name, reduction)
    train(model, opt, batches[:cut])
    assert opt.micro_batches == cut % ACC
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    train(model, opt, batches[cut:])
    assert_params_identical(ref_model, model)  # taking the state dict changed nothing

    ckpt = torch.load(path, weights_only=True)
    assert (ckpt["opt"]["clipopt"]["pending_grads"] is not None) == (cut % ACC != 0)
    model2 = make_model(1)
    opt2 = wrap(model2, name, reduction)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.micro_batches == cut % ACC
    train(model2, opt2, batches[cut:])

    assert_params_identical(ref_model, model2)
    assert counters(opt2) == counters(ref)
    assert_tree_equal(ref.optimizer.state_dict(), opt2.optimizer.state_dict())
    assert opt2.last_stats is not None and opt2.last_stats.step == 5


def test_resume_without_pending_grads_diverges() -> None:
    """Control: dropping the wrapper entry of a mid-window checkpoint changes the result."""
    batches = make_batches(N_BATCHES)
    ref_model = make_model(0)
    ref = wrap(ref_model)
    train(ref_model, ref, batches)

    model = make_model(0)
    opt = wrap(model)
    train(model, opt, batches[:4])
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    del ckpt["opt"]["clipopt"]  # the entry, and its copy in the first group
    del ckpt["opt"]["param_groups"][0]["clipopt"]
    model2 = make_model(1)
    opt2 = wrap(model2)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    train(model2, opt2, batches[4:])
    pairs = zip(ref_model.parameters(), model2.parameters(), strict=True)
    assert not all(torch.equal(p, q) for p, q in pairs)


@pytest.mark.parametrize("entry", ["wrapper", "plain"])
def test_between_windows_checkpoint_loaded_mid_window_drops_the_open_window(entry: str) -> None:
    """#32: a state dict without an open window, loaded mid-window, drops that window's gradients, as a
    fresh wrapper has none: SGD(lr=1) then steps by the next window's gradients alone (1 + 1, sum)."""
    p = nn.Parameter(torch.zeros(1))
    opt = ClippedOptimizer(torch.optim.SGD([p], lr=1.0), max_norm=1e6, accumulation_steps=2, reduction="sum")
    sd = opt.state_dict() if entry == "wrapper" else opt.optimizer.state_dict()
    (50 * p).sum().backward()
    opt.step()  # the open window: a gradient of 50
    assert opt.micro_batches == 1
    opt.load_state_dict(sd)
    assert p.grad is None and opt.micro_batches == 0
    for _ in range(2):
        p.sum().backward()
        opt.step()
    assert p.item() == -2.0  # not -52: the dropped window's 50 is not added to the next one


@given(
    acc=st.integers(1, 4),
    n=st.integers(1, 9),
    data=st.data(),
    name=st.sampled_from(OPTIMIZERS),
    reduction=st.sampled_from(["mean", "sum"]),
    bad=st.one_of(st.none(), st.integers(0, 8)),
    seed=st.integers(0, 2**16),
)
def test_resume_any_cut_then_flush(
    acc: int, n: int, data: st.DataObject, name: str, reduction: str, bad: int | None, seed: int
) -> None:
    """Any accumulation_steps and cut: resume, then flush() the open window, equals the uninterrupted run."""
    cut = data.draw(st.integers(0, n), label="cut")
    batches = make_batches(n, seed=seed, bad=() if bad is None else {bad})

    ref_model = make_model(seed)
    ref = wrap(ref_model, name, reduction, acc=acc)
    train(ref_model, ref, batches)
    ref.flush()

    model = make_model(seed)
    opt = wrap(model, name, reduction, acc=acc)
    train(model, opt, batches[:cut])
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    model2 = make_model(seed + 1)
    opt2 = wrap(model2, name, reduction, acc=acc)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    train(model2, opt2, batches[cut:])
    opt2.flush()

    assert_params_identical(ref_model, model2)
    assert counters(opt2) == counters(ref)
    assert_tree_equal(ref.optimizer.state_dict(), opt2.optimizer.state_dict())


# ----------------------------------------------------------------------------------------- 2. counters


@pytest.mark.parametrize("cut", [6, 7, 8])
@pytest.mark.parametrize("name", ["Adam-foreach", "AdamW-fused"])
def test_counters_survive_including_skips(name: str, cut: int) -> None:
    """num_updates/num_skipped/num_windows/micro_batches are restored, also right after a skipped window."""
    batches = make_batches(12, bad={4})  # window 2 (batches 3-5) is skipped; fused: on the device
    model = make_model(0)
    opt = wrap(model, name)
    train(model, opt, batches[:cut])
    expected = (1, 1, 2, cut - 6)
    assert counters(opt) == expected
    assert opt.step_was_skipped

    sd = roundtrip(opt.state_dict())
    ext = sd["clipopt"]
    assert (ext["applied"], ext["skipped"], ext["windows"], ext["micro_batches"]) == expected
    assert all(type(ext[k]) is int for k in ("applied", "skipped", "windows", "micro_batches", "consecutive"))

    model2 = make_model(1)
    opt2 = wrap(model2, name)
    opt2.load_state_dict(sd)
    assert counters(opt2) == expected
    model2.load_state_dict(model.state_dict())
    train(model2, opt2, batches[cut:9])
    assert counters(opt2) == (2, 1, 3, 0)
    assert opt2.last_stats is not None and opt2.last_stats.step == 3


def test_consecutive_skips_survive() -> None:
    """The run of consecutive skips is restored: max_consecutive_nonfinite counts across the checkpoint."""
    batches = make_batches(3, bad={1, 2})
    model = make_model(0)
    opt = wrap(model, acc=1, max_consecutive_nonfinite=2)
    train(model, opt, batches[:2])
    sd = roundtrip(opt.state_dict())
    assert sd["clipopt"]["consecutive"] == 1

    fresh_model = make_model(0)
    fresh = wrap(fresh_model, acc=1, max_consecutive_nonfinite=2)
    train(fresh_model, fresh, batches[2:])  # control: a single skip does not raise
    assert fresh.num_skipped == 1

    model2 = make_model(0)
    opt2 = wrap(model2, acc=1, max_consecutive_nonfinite=2)
    opt2.load_state_dict(sd)
    with pytest.raises(NonFiniteGradientError):
        train(model2, opt2, batches[2:])


# ------------------------------------------------------------------- 3. interop with plain optimizers


def test_state_dict_has_usual_keys_and_loads_into_plain_adam() -> None:
    """The state dict has "state"/"param_groups"; a plain torch.optim.Adam loads it with equal state."""
    model = make_model(0)
    opt = wrap(model, "Adam-foreach")
    train(model, opt, make_batches(7))
    sd = roundtrip(opt.state_dict())
    assert {"state", "param_groups", "clipopt"} <= sd.keys()
    assert isinstance(sd["state"], dict) and isinstance(sd["param_groups"], list)
    assert set(sd["state"]) == {0, 1, 2, 3}

    plain = torch.optim.Adam(make_model(1).parameters(), lr=0.5, foreach=True)
    plain.load_state_dict(sd)
    assert_tree_equal(plain.state_dict()["state"], opt.optimizer.state_dict()["state"])
    assert plain.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2


def test_plain_state_dict_loads_into_wrapper() -> None:
    """A plain optimizer's state dict loads into ClippedOptimizer: counters reset to 0, inner state equal."""
    plain_model = make_model(0)
    plain = torch.optim.Adam(plain_model.parameters(), lr=3e-3, foreach=True)
    for x, y in make_batches(3):
        nn.functional.mse_loss(plain_model(x), y).backward()
        plain.step()
        plain.zero_grad()
    plain_sd = roundtrip(plain.state_dict())

    model = make_model(0)
    opt = wrap(model, "Adam-foreach")
    train(model, opt, make_batches(9, bad={4}))
    assert counters(opt) == (2, 1, 3, 0)
    opt.load_state_dict(plain_sd)
    assert counters(opt) == (0, 0, 0, 0)
    assert opt.state_dict()["clipopt"]["consecutive"] == 0
    assert opt.param_groups[0]["lr"] == 3e-3
    inner = opt.optimizer.state_dict()
    assert inner["param_groups"][0].pop("clipopt") is None  # the slot of the entry (test_savers.py)
    assert_tree_equal(inner, plain.state_dict())

    train(model, opt, make_batches(3, seed=5))
    assert counters(opt) == (1, 0, 1, 0)


# ------------------------------------------------------------------------------ 4. wraps, never copies


def assert_wraps(opt: ClippedOptimizer) -> None:
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    assert opt.defaults is opt.optimizer.defaults


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_wraps_never_copies(name: str) -> None:
    """param_groups/state/defaults are the inner optimizer's objects, before and after load_state_dict."""
    model = make_model(0)
    opt = wrap(model, name)
    assert_wraps(opt)
    train(model, opt, make_batches(4))
    assert_wraps(opt)
    groups_before, state_before = opt.optimizer.param_groups, opt.optimizer.state

    opt.load_state_dict(roundtrip(opt.state_dict()))
    # torch's load_state_dict replaced the inner objects; the wrapper must follow them.
    assert opt.optimizer.param_groups is not groups_before
    assert opt.optimizer.state is not state_before
    assert_wraps(opt)

    opt.param_groups[0]["lr"] = 0.25
    assert opt.optimizer.param_groups[0]["lr"] == 0.25
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, make_batches(2, seed=3))
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == 0.125

    new_groups = list(opt.param_groups)
    opt.param_groups = new_groups
    assert opt.optimizer.param_groups is new_groups


# ---------------------------------------------------------------------- 5. validation and rollback


def mid_window(name: str = "Adam-foreach", **kw: Any) -> tuple[nn.Module, ClippedOptimizer, dict[str, Any]]:
    """An optimizer one micro-batch into its second window, and a valid (loaded) copy of its state dict."""
    model = make_model(0)
    opt = wrap(model, name, **kw)
    train(model, opt, make_batches(4), scaler=kw.get("scaler"))
    assert opt.micro_batches == 1 and all(p.grad is not None for p in model.parameters())
    return model, opt, roundtrip(opt.state_dict())


def snapshot(opt: ClippedOptimizer) -> dict[str, Any]:
    inner = opt.optimizer
    params = [p for g in inner.param_groups for p in g["params"]]
    return {
        "groups": inner.param_groups,
        "group_dicts": list(inner.param_groups),
        "group_items": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        "state": inner.state,
        "state_tensors": {p: dict(s) for p, s in inner.state.items()},
        "grads": [p.grad for p in params],
        "sd": roundtrip(opt.state_dict()),  # deep copy of everything, pending grads and counters included
        "counters": counters(opt),
    }


def assert_untouched(opt: ClippedOptimizer, snap: dict[str, Any]) -> None:
    inner = opt.optimizer
    assert inner.param_groups is snap["groups"], "param_groups object replaced"
    assert all(a is b for a, b in zip(inner.param_groups, snap["group_dicts"], strict=True))
    assert [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups] == snap["group_items"]
    assert inner.state is snap["state"], "state object replaced"
    assert {p: dict(s) for p, s in inner.state.items()}.keys() == snap["state_tensors"].keys()
    for p, s in inner.state.items():
        assert all(s[k] is v for k, v in snap["state_tensors"][p].items()), "state tensors replaced"
    params = [p for g in inner.param_groups for p in g["params"]]
    assert all(p.grad is g for p, g in zip(params, snap["grads"], strict=True)), "p.grad replaced"
    assert counters(opt) == snap["counters"]
    assert_tree_equal(roundtrip(opt.state_dict()), snap["sd"])
    assert_wraps(opt)


def _set(*path: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(sd: dict[str, Any]) -> None:
        target = sd
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(*path: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(sd: dict[str, Any]) -> None:
        target = sd
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


CORRUPTIONS: list[Any] = [
    pytest.param(
        lambda sd: sd["param_groups"].append({**sd["param_groups"][0], "params": [10, 11]}),
        r"2 parameter groups, the optimizer has 1",
        id="extra-group",
    ),
    pytest.param(_set("param_groups", value=[]), r"0 parameter groups", id="no-groups"),
    pytest.param(
        lambda sd: sd["param_groups"][0]["params"].pop(),
        r"parameter group 0 has 3 parameters, the optimizer's has 4",
        id="group-missing-param",
    ),
    pytest.param(
        lambda sd: sd["param_groups"][0]["params"].append(4),
        r"parameter group 0 has 5 parameters",
        id="group-extra-param",
    ),
    pytest.param(
        _set("state", 0, "exp_avg", value=torch.zeros(7)),
        r"state\[0\]\['exp_avg'\] has shape \(7,\), parameter has \(8, 4\)",
        id="exp_avg-shape",
    ),
    pytest.param(
        _set("state", 3, "exp_avg_sq", value=torch.zeros(3, 1)),
        r"exp_avg_sq'\] has shape \(3, 1\), parameter has \(3,\)",
        id="exp_avg_sq-shape",
    ),
    pytest.param(_set("state", 9, value={}), r"parameter id 9", id="state-unknown-id"),
    pytest.param(_set("state", 0, value=3), r"state of parameter 0 must be a dict", id="state-not-dict"),
    pytest.param(
        _set("clipopt", "pending_grads", 1, value=torch.zeros(2, 2)),
        r"pending gradient 1 has shape \(2, 2\), parameter has \(8,\)",
        id="pending-grad-shape",
    ),
    pytest.param(
        _set("clipopt", "pending_grads", 2, value="grad"),
        r"pending gradient 2 has shape str",
        id="pending-grad-not-tensor",
    ),
    pytest.param(
        lambda sd: sd["clipopt"]["pending_grads"].pop(),
        r"pending_grads' must list 4 gradients, got 3",
        id="pending-list-short",
    ),
    pytest.param(
        lambda sd: sd["clipopt"]["pending_grads"].append(torch.zeros(3)),
        r"pending_grads' must list 4 gradients, got 5",
        id="pending-list-long",
    ),
    pytest.param(
        _set("clipopt", "pending_grads", value=(1, 2)), r"pending_grads.*tuple", id="pending-not-list"
    ),
    pytest.param(
        _set("clipopt", "pending_grads", value=None),
        r"micro_batches' > 0 but no 'pending_grads'",
        id="pending-missing",
    ),
    pytest.param(
        _set("clipopt", "micro_batches", value=ACC), r"micro_batches' must be <= 2, got 3", id="micro-eq-acc"
    ),
    pytest.param(
        _set("clipopt", "micro_batches", value=10), r"micro_batches' must be <= 2, got 10", id="micro-gt-acc"
    ),
    pytest.param(_set("clipopt", "micro_batches", value=-1), r"micro_batches.*>= 0, got -1", id="micro-neg"),
    pytest.param(_set("clipopt", "applied", value=-1), r"'clipopt.applied' must be an int >= 0", id="ap-neg"),
    pytest.param(_set("clipopt", "skipped", value=-3), r"clipopt.skipped.*-3", id="skipped-neg"),
    pytest.param(_set("clipopt", "windows", value=-1), r"clipopt.windows", id="windows-neg"),
    pytest.param(_set("clipopt", "consecutive", value=-1), r"clipopt.consecutive", id="consecutive-neg"),
    pytest.param(_set("clipopt", "windows", value=1.5), r"clipopt.windows.*1.5", id="windows-float"),
    pytest.param(_set("clipopt", "applied", value=True), r"clipopt.applied.*True", id="applied-bool"),
    pytest.param(_delete("clipopt", "windows"), r"clipopt.windows.*None", id="windows-missing"),
    pytest.param(_set("clipopt", "format", value=2), r"'clipopt.format' is 2, this clipopt reads 1", id="f2"),
    pytest.param(_delete("clipopt", "format"), r"'clipopt.format' is None", id="format-missing"),
    pytest.param(_set("clipopt", value=[1, 2]), r"'clipopt' must be a dict, got list", id="clipopt-list"),
    pytest.param(_set("clipopt", value="v1"), r"'clipopt' must be a dict, got str", id="clipopt-str"),
    pytest.param(_delete("state"), r"'state' must be a dict, got NoneType", id="state-missing"),
    pytest.param(_set("state", value=[]), r"'state' must be a dict, got list", id="state-list"),
    pytest.param(_delete("param_groups"), r"'param_groups' must be a list", id="groups-missing"),
]


@pytest.mark.parametrize(("corrupt", "match"), CORRUPTIONS)
def test_corrupt_state_dict_rejected_and_untouched(corrupt: Callable[[Any], None], match: str) -> None:
    """A corrupt or mismatched state dict raises ValueError naming the problem and changes nothing."""
    _, opt, sd = mid_window()
    corrupt(sd)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_untouched(opt, snap)


def test_valid_state_dict_loads_control() -> None:
    """Control for the corruption tests: the unmodified state dict loads and replaces the inner objects."""
    _, opt, sd = mid_window()
    groups = opt.optimizer.param_groups
    opt.load_state_dict(sd)
    assert opt.optimizer.param_groups is not groups
    assert opt.micro_batches == 1


@pytest.mark.parametrize("bad", [None, [("state", {})], "state", 3])
def test_non_dict_state_dict_raises_type_error(bad: Any) -> None:
    """A state dict that is not a dict raises TypeError and changes nothing."""
    _, opt, _ = mid_window()
    snap = snapshot(opt)
    with pytest.raises(TypeError, match=r"state_dict must be a dict, got " + type(bad).__name__):
        opt.load_state_dict(bad)
    assert_untouched(opt, snap)


def test_inner_load_failing_midway_rolls_back() -> None:
    """The inner Adam raising after swapping in its new state (entry without 'step') is rolled back."""
    _, opt, sd = mid_window()
    del sd["state"][2]["step"]  # torch swaps state/param_groups in, then Adam.__setstate__ raises KeyError
    sd["param_groups"][0]["lr"] = 0.5
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=r"inner Adam rejected it.*step"):
        opt.load_state_dict(sd)
    assert_untouched(opt, snap)
    assert opt.param_groups[0]["lr"] == 1e-2


def test_inner_load_mutating_then_raising_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """An inner load_state_dict that replaces state and param_groups and then raises is rolled back."""
    _, opt, sd = mid_window()
    inner = opt.optimizer

    def broken_load(state_dict: dict[str, Any]) -> None:
        inner.state = defaultdict(dict)
        inner.param_groups = [dict(g, lr=99.0) for g in inner.param_groups]
        raise RuntimeError("boom from the inner optimizer")

    monkeypatch.setattr(inner, "load_state_dict", broken_load)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=r"inner Adam rejected it \(boom from the inner optimizer\)"):
        opt.load_state_dict(sd)
    assert_untouched(opt, snap)


def test_pending_grad_wrong_dtype_rejected_or_cast() -> None:
    """A float64 pending grad for a float32 parameter is cast on load, or rejected leaving all untouched."""
    model, opt, sd = mid_window()
    sd["clipopt"]["pending_grads"] = [g.double() for g in sd["clipopt"]["pending_grads"]]
    sd["clipopt"]["windows"] = 7
    snap = snapshot(opt)
    try:
        opt.load_state_dict(sd)
    except ValueError:
        assert_untouched(opt, snap)
    else:
        assert opt.num_windows == 7
        for p, g in zip(model.parameters(), sd["clipopt"]["pending_grads"], strict=True):
            assert p.grad is not None and p.grad.dtype == p.dtype
            assert torch.equal(p.grad, g.to(p.dtype))


def test_corrupt_scaler_state_rejected_and_untouched() -> None:
    """A scaler entry missing keys is rejected with ValueError and leaves optimizer and scaler untouched."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _, opt, sd = mid_window(scaler=scaler)
    scaler_before = scaler.state_dict()
    sd["clipopt"]["scaler"] = {"scale": 3.0}  # missing growth_factor, backoff_factor, ...
    sd["clipopt"]["windows"] = 7  # consistent counters: only the scaler entry is wrong
    sd["clipopt"]["applied"] = 7 - sd["clipopt"]["skipped"]
    snap = snapshot(opt)
    with pytest.raises(ValueError, match="scaler"):
        opt.load_state_dict(sd)
    assert_untouched(opt, snap)
    assert scaler.state_dict() == scaler_before


def test_group_missing_hyperparameter_rejected() -> None:
    """A param group without 'betas' is rejected with ValueError (not left to break step()), untouched."""
    _, opt, sd = mid_window()
    del sd["param_groups"][0]["betas"]
    snap = snapshot(opt)
    with pytest.raises(ValueError, match="betas"):
        opt.load_state_dict(sd)
    assert_untouched(opt, snap)


# ------------------------------------------------------------------------------ 6. pickle / deepcopy


def _register_unpicklable_hooks(opt: ClippedOptimizer, calls: list[str]) -> None:
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd_post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))


COPIERS = {
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("how", list(COPIERS))
@pytest.mark.parametrize(
    "name",
    ["Adam-foreach", "SGD-nesterov-forloop", *sorted(FUSED)],
)
def test_copy_gives_working_optimizer(name: str, how: str) -> None:
    """Pickle/deepcopy of (model, opt) with hooks drops the hooks; the copy trains bit-identically."""
    batches = make_batches(12, bad={4})
    model = make_model(0)
    opt = wrap(model, name)
    calls: list[str] = []
    _register_unpicklable_hooks(opt, calls)
    train(model, opt, batches[:6])
    calls.clear()

    model2, opt2 = COPIERS[how]((model, opt))
    assert type(opt2) is ClippedOptimizer
    assert_wraps(opt2)
    assert opt2.optimizer is not opt.optimizer
    assert all(len(getattr(opt2, h)) == 0 for h in HOOK_DICTS)
    assert all(len(getattr(opt, h)) == 1 for h in HOOK_DICTS)  # the original keeps its hooks
    params2 = list(model2.parameters())
    assert all(a is b for a, b in zip(opt2.param_groups[0]["params"], params2, strict=True))
    assert not any(a is b for a, b in zip(params2, model.parameters(), strict=True))
    assert set(opt2.state) == set(params2)
    config = (opt2.max_norm, opt2.clip_value, opt2.accumulation_steps, opt2.reduction)
    assert config == (1.0, 0.5, ACC, "mean")
    assert counters(opt2) == counters(opt) == (1, 1, 2, 0)
    assert_tree_equal(opt2.state_dict(), opt.state_dict())
    assert calls == ["sd_pre", "sd_post"]  # only the original's hooks fired

    train(model, opt, batches[6:])
    train(model2, opt2, batches[6:])
    assert_params_identical(model, model2)
    assert_tree_equal(opt2.state_dict(), opt.state_dict())
    assert counters(opt2) == (3, 1, 4, 0)
    assert calls.count("pre") == calls.count("post") == 6


@pytest.mark.parametrize("name", ["Adam-foreach", "AdamW-fused"])
def test_deepcopy_of_optimizer_alone(name: str) -> None:
    """deepcopy(opt) alone: its param_groups/state are its own inner's, holding copies of the parameters."""
    model = make_model(0)
    opt = wrap(model, name)
    opt.register_step_pre_hook(lambda o, a, k: None)
    train(model, opt, make_batches(6))
    opt2 = copy.deepcopy(opt)
    assert_wraps(opt2)
    assert opt2.optimizer is not opt.optimizer and opt2.param_groups is not opt.param_groups
    own = opt2.param_groups[0]["params"]
    assert not any(a is b for a, b in zip(own, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(own, model.parameters(), strict=True))
    assert set(opt2.state) == set(own)
    assert len(opt2._optimizer_step_pre_hooks) == 0
    assert_tree_equal(opt2.state_dict(), opt.state_dict())

    # It trains its own parameters like the original trains the model's.
    for p, q in zip(model.parameters(), own, strict=True):
        p.grad = torch.full_like(p, 0.3)
        q.grad = torch.full_like(q, 0.3)
    for _ in range(ACC):
        opt.step()
        opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(own, model.parameters(), strict=True))
    assert counters(opt2) == counters(opt) == (3, 0, 3, 0)


def _fused_after_first_update(name: str) -> tuple[nn.Module, ClippedOptimizer, list[Any]]:
    batches = make_batches(9)
    model = make_model(0)
    opt = wrap(model, name)
    train(model, opt, batches[:3])  # the first update takes the host path (no inner state yet)
    return model, opt, batches[3:]


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_window_has_no_host_read(name: str) -> None:
    """Control for the copy test below: a fused wrapper closes a window without any host read."""
    model, opt, batches = _fused_after_first_update(name)
    with count_host_reads() as reads:
        train(model, opt, batches)
    assert reads.ours == reads.inner == []  # none by clipopt, none by the inner optimizer
    assert opt.num_updates == 3


@pytest.mark.parametrize("how", list(COPIERS))
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_copy_keeps_sync_free_path(name: str, how: str) -> None:
    """A pickled/deep-copied fused wrapper still closes a window without any host read."""
    model, opt, batches = _fused_after_first_update(name)
    model2, opt2 = COPIERS[how]((model, opt))
    with count_host_reads() as reads:
        train(model2, opt2, batches)
    assert reads.ours == reads.inner == []  # none by clipopt, none by the inner optimizer
    assert opt2.num_updates == 3


@pytest.mark.parametrize("how", list(COPIERS))
def test_copy_mid_window_keeps_pending_grads(how: str) -> None:
    """A copy of (model, opt) taken mid-window continues identically (accumulated gradients survive)."""
    batches = make_batches(9)
    model = make_model(0)
    opt = wrap(model)
    train(model, opt, batches[:4])
    model2, opt2 = COPIERS[how]((model, opt))
    assert opt2.micro_batches == 1
    train(model, opt, batches[4:])
    train(model2, opt2, batches[4:])
    assert_params_identical(model, model2)


# ------------------------------------------------------------------------------ 7. state-dict hooks


def test_state_dict_hooks_fire() -> None:
    """state_dict / load_state_dict pre and post hooks on the wrapper fire; their return values are used."""
    model = make_model(0)
    opt = wrap(model)
    train(model, opt, make_batches(4))
    calls: list[tuple[str, Any]] = []

    def sd_pre(o: Any) -> None:
        calls.append(("sd_pre", o))

    def sd_post(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append(("sd_post", o))
        assert "clipopt" in sd and sd["clipopt"]["micro_batches"] == 1  # runs on the complete dict
        return {**sd, "extra": "from post hook"}

    def load_pre(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append(("load_pre", o))
        assert sd["extra"] == "from post hook"
        sd = {k: v for k, v in sd.items() if k != "extra"}
        sd["param_groups"] = [dict(g, lr=0.123) for g in sd["param_groups"]]
        return sd

    def load_post(o: Any) -> None:
        calls.append(("load_post", o))
        assert o.param_groups[0]["lr"] == 0.123  # fires after loading

    handles = [
        opt.register_state_dict_pre_hook(sd_pre),
        opt.register_state_dict_post_hook(sd_post),
        opt.register_load_state_dict_pre_hook(load_pre),
        opt.register_load_state_dict_post_hook(load_post),
    ]
    sd = opt.state_dict()
    assert sd["extra"] == "from post hook"
    assert calls == [("sd_pre", opt), ("sd_post", opt)]

    calls.clear()
    opt.load_state_dict(roundtrip(sd))
    assert calls == [("load_pre", opt), ("load_post", opt)]
    assert opt.param_groups[0]["lr"] == 0.123
    assert opt.micro_batches == 1

    for h in handles:
        h.remove()
    calls.clear()
    opt.load_state_dict(opt.state_dict())
    assert calls == []


# ------------------------------------------------------------------------------------ 8. step hooks


@pytest.mark.parametrize("name", ["Adam-foreach", "SGD-nesterov-forloop", *sorted(FUSED)])
def test_step_hooks(name: str) -> None:
    """Wrapper step hooks fire on every step() call; inner step hooks when the inner step() runs.

    That is on applied updates only, except that a fused inner optimizer also runs (and changes
    nothing) on a skipped window after the first: the skip reaches its kernel as found_inf.
    """
    batches = make_batches(9, bad={4})  # windows: applied, skipped, applied
    model = make_model(0)
    opt = wrap(model, name)
    outer: list[tuple[str, int]] = []
    inner: list[tuple[str, int]] = []
    applied: list[bool] = []

    def outer_pre(o: Any, args: Any, kwargs: Any) -> None:
        assert o is opt
        outer.append(("pre", o.micro_batches))

    def outer_post(o: Any, args: Any, kwargs: Any) -> None:
        outer.append(("post", o.micro_batches))
        applied.append(o.update_applied)

    opt.register_step_pre_hook(outer_pre)
    opt.register_step_post_hook(outer_post)
    opt.optimizer.register_step_pre_hook(lambda o, a, k: inner.append(("pre", opt.num_windows)))
    opt.optimizer.register_step_post_hook(lambda o, a, k: inner.append(("post", opt.num_windows)))

    train(model, opt, batches)
    assert [k for k, _ in outer] == ["pre", "post"] * 9
    assert [m for k, m in outer if k == "pre"] == [0, 1, 2] * 3
    assert applied == [False, False, True, False, False, False, False, False, True]
    assert counters(opt) == (2, 1, 3, 0)
    if name in FUSED:
        assert inner == [("pre", 1), ("post", 1), ("pre", 2), ("post", 2), ("pre", 3), ("post", 3)]
    else:
        assert inner == [("pre", 1), ("post", 1), ("pre", 3), ("post", 3)]


# ----------------------------------------------------------------------------------------- 9. scaler


@pytest.mark.parametrize("cut", [4, 7, 10])
@pytest.mark.parametrize("name", ["Adam-foreach", "AdamW-fused"])
def test_scaler_state_restored(name: str, cut: int) -> None:
    """The GradScaler state is in the state dict and restored; training resumes bit-identically."""

    def new_scaler(**kw: Any) -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**10, **kw)

    growth = {"growth_factor": 3.0, "growth_interval": 2}
    batches = make_batches(15, bad={1})  # window 1 overflows: the scale backs off, then grows

    ref_model = make_model(0)
    ref_scaler = new_scaler(**growth)
    ref = wrap(ref_model, name, scaler=ref_scaler)
    train(ref_model, ref, batches, scaler=ref_scaler)
    assert counters(ref) == (4, 1, 5, 0)

    model = make_model(0)
    scaler = new_scaler(**growth)
    opt = wrap(model, name, scaler=scaler)
    train(model, opt, batches[:cut], scaler=scaler)
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    saved = ckpt["opt"]["clipopt"]["scaler"]
    assert saved == scaler.state_dict()
    assert saved["scale"] != 2.0**10 and saved["growth_interval"] == 2

    model2 = make_model(1)
    scaler2 = new_scaler()  # default growth_factor / growth_interval: restoring must overwrite them
    opt2 = wrap(model2, name, scaler=scaler2)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.scaler is scaler2
    assert scaler2.state_dict() == saved
    train(model2, opt2, batches[cut:], scaler=scaler2)

    assert_params_identical(ref_model, model2)
    assert scaler2.state_dict() == ref_scaler.state_dict()
    assert counters(opt2) == counters(ref)
    assert_tree_equal(ref.optimizer.state_dict(), opt2.optimizer.state_dict())


# ------------------------------------------ state the fused path caches, and the scaler's state


def test_fused_state_cache_does_not_survive_load_state_dict() -> None:
    """After loading a state dict without state, a skipped first window leaves no state behind."""
    model = TwoHeads()
    opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    fresh = copy.deepcopy(opt.state_dict())
    task_run(model, opt, [("a", False), ("b", False)])
    opt.load_state_dict(fresh)
    task_run(model, opt, [("a", True)])
    assert opt.step_was_skipped
    assert len(opt.state) == 0


def test_disabled_scaler_state_is_rejected_untouched() -> None:
    """A scaler state saved from a disabled GradScaler ({}) is refused before anything is loaded."""
    model = TwoHeads()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler, accumulation_steps=2)
    scaler.scale(model.loss("a", torch.ones(2, 3))).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["clipopt"]["scaler"] = {}
    opt2 = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        scaler=torch.amp.GradScaler("cpu", init_scale=8.0),
        accumulation_steps=2,
    )
    with pytest.raises(ValueError, match=re.escape("the GradScaler rejected 'clipopt.scaler'")):
        opt2.load_state_dict(sd)
    assert opt2.micro_batches == 0 and len(opt2.state) == 0


def test_new_step_stats_round_trip_through_pickle() -> None:
    """A StepStats recorded now (device values not read yet) pickles and keeps every field."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = ClippedOptimizer(torch.optim.SGD([w], lr=0.1), max_norm=1.0)
    w.grad = torch.tensor([float("nan"), 1.0])
    opt.step()
    assert opt.last_stats is not None
    copy = pickle.loads(pickle.dumps(opt.last_stats))
    assert copy.as_dict()["reason"] == "nonfinite" and copy.skipped and copy.step == 1
