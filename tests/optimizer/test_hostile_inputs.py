"""Standing adversarial suite (issue #11), part 1: hostile arguments, odd dtypes, hostile state
dicts, re-evaluating closures and errors at every stage of ``step()``.

Each class of input is one section.  The items of issue #11 are named where a test is the
regression test of one (each of those failed before its fix).  Files (torn, full, hostile, killed
writers) are in ``test_adversarial_files.py``.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import clipopt
from clipopt import AGC, AutoClip, ClippedOptimizer, CSVLogger, ZClip

from ..helpers import mlp
from ..optim_db import OptimInfo, get, select
from ..strategies import grad_arrays, norm_types

# ---------------------------------------------------------------------------------------------- helpers


make_model = partial(mlp, (3, 4, 2), randn_init=True)  # make_model(seed): weights from a seeded generator


def backward(model: nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    """One micro-batch's backward pass on seeded data."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, generator=g)
    (model(x).pow(2).sum() * scale).backward()


def weights(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(model: nn.Module, ref: dict[str, Tensor]) -> bool:
    return all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def options(inner: torch.optim.Optimizer) -> list[Any]:
    """The groups' options and parameter identities (tensors compared by identity)."""
    return [
        ({k: v for k, v in g.items() if k != "params"}, [id(p) for p in g["params"]])
        for g in inner.param_groups
    ]


def wrapper_state(opt: ClippedOptimizer) -> tuple[Any, ...]:
    """What an error inside step() must not change: counters, window, signals, history."""
    return (
        opt.micro_batches,
        opt.num_windows,
        opt.num_updates,
        opt.num_skipped,
        opt.update_applied,
        opt.step_was_skipped,
        opt.last_stats,
        len(opt.stats),
        int(opt._run.counters.consecutive),
    )


# ---------------------------------------------------------------------------------------------- arguments

BAD_CONSTRUCTOR_VALUES: dict[str, list[Any]] = {
    "max_norm": ["1", True, -1.0, 0.0, math.nan, math.inf, [1.0]],
    "norm_type": ["2", 0, -2.0, math.nan, None, -math.inf],
    "clip_value": ["1", 0, -1, math.inf, True, math.nan],
    "accumulation_steps": [0, -1, 2.5, "4", True, None],
    "reduction": ["avg", None, 1, "MEAN"],
    "skip_nonfinite": [1, "yes", None],
    "max_consecutive_nonfinite": [0, 1.5, "3", True],
    "scaler": [object(), 1],
    "stats_history": [0, 1.5, None],
    "foreach": ["yes", 1],
    "param_names": [5, "abc", [1, 2], [("a", 1)], 3.5],
    "layer_stats": [-1, 0.5, "x", None],
    "loggers": [None, "x", [1], 5],
    "snapshot_dir": [5, b"x", 1.0],
    "max_snapshots": [0, None, 1.5],
}


@pytest.mark.parametrize(
    ("name", "value"),
    [(k, v) for k, vs in BAD_CONSTRUCTOR_VALUES.items() for v in vs],
    ids=lambda v: "object()" if type(v) is object else repr(v),  # a stable id: no memory address
)
def test_every_constructor_argument_refuses_wrong_types_and_values(name: str, value: Any) -> None:
    """Every keyword of ClippedOptimizer, given a wrong type or value, raises TypeError/ValueError whose
    message names the argument and a fix ("pass ..."), and the inner optimizer is left untouched."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    groups = options(inner)
    with pytest.raises((TypeError, ValueError)) as info:
        ClippedOptimizer(inner, **{name: value})
    message = str(info.value)
    assert name in message and "pass" in message, message
    assert options(inner) == groups and len(inner.state) == 0


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (AutoClip, {"percentile": -1}),
        (AutoClip, {"percentile": 101}),
        (AutoClip, {"percentile": math.nan}),
        (AutoClip, {"history": 0}),
        (ZClip, {"alpha": 1.0}),
        (ZClip, {"alpha": "x"}),
        (ZClip, {"z_thresh": 0}),
        (ZClip, {"warmup_steps": 1.5}),
        (ZClip, {"clip_option": "x"}),
        (ZClip, {"skip_spikes": 1}),
        (AGC, {"clip_factor": 0}),
        (AGC, {"clip_factor": math.inf}),
        (AGC, {"eps": "x"}),
        (CSVLogger, {"path": 5}),
        (CSVLogger, {"path": "g.csv", "flush_every": 0}),
        (CSVLogger, {"path": "g.csv", "flush_every": "3"}),
    ],
    ids=repr,
)
def test_policies_and_loggers_refuse_wrong_arguments(
    factory: Callable[..., Any], kwargs: dict[str, Any]
) -> None:
    """Policies and loggers name the wrong argument and a fix, like the wrapper does."""
    name = next(k for k in kwargs if k != "path" or len(kwargs) == 1)
    with pytest.raises((TypeError, ValueError)) as info:
        factory(**kwargs)
    assert name in str(info.value) and "pass" in str(info.value), str(info.value)


def test_step_refuses_a_closure_that_is_not_callable() -> None:
    """opt.step(5) names the closure argument instead of failing with "'int' object is not callable",
    and counts nothing."""
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    backward(model)
    with pytest.raises(TypeError, match=r"^closure must be a callable or None, got int; pass a function"):
        opt.step(5)  # type: ignore[arg-type]
    assert opt.micro_batches == 0


# ---------------------------------------------------------------------------------------------- param_names


def test_repeated_param_names_are_refused() -> None:
    """Item 1: param_names=["a", "a"] was accepted and the snapshot kept one tensor under "a" (a weight
    was lost); now a ValueError names the repeated name."""
    model = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=re.escape("param_names gives 1 name(s) to more than one parameter ('a')")
    ):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), param_names=["a", "a"])


def test_repeated_names_in_pairs_are_refused() -> None:
    """The same through (name, parameter) pairs: two parameters both called "w"."""
    model = nn.Linear(2, 2)
    pairs = [("w", model.weight), ("w", model.bias)]
    with pytest.raises(ValueError, match=r"param_names gives 1 name\(s\) to more than one parameter \('w'\)"):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), param_names=pairs)


def test_param_names_that_is_not_iterable_names_the_argument() -> None:
    """Item 2: param_names=5 raised "'int' object is not iterable"; now the message names param_names."""
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"^param_names must be model\.named_parameters\(\).*got 5 \(int\)"):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), param_names=5)


def test_param_names_of_another_model_are_refused() -> None:
    """Item 3: names of none of the optimizer's parameters were accepted silently (group0.0 names);
    now a ValueError says so and how to fix it."""
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"^param_names names 2 parameters, none of which the optimizer holds"
    ):
        ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), param_names=other.named_parameters())


def test_named_groups_that_repeat_a_name_are_accepted_and_qualified() -> None:
    """Review of #11: an inner optimizer built from the named_parameters() of two modules (torch
    accepts two groups that both name a parameter "weight") was refused by the new uniqueness check
    although the user passed no param_names; the repeated names are now qualified with their group."""
    enc, dec = nn.Linear(2, 3), nn.Linear(3, 2)
    inner = torch.optim.AdamW([{"params": enc.named_parameters()}, {"params": dec.named_parameters()}])
    opt = ClippedOptimizer(inner, max_norm=1.0)
    assert opt.layer_names() == ["group0.weight", "group0.bias", "group1.weight", "group1.bias"]


def test_group_added_later_with_a_repeated_name_loses_no_tensor(tmp_path: Any) -> None:
    """Review of #11: add_param_group with named parameters repeating a name ("weight") gave two
    parameters the same layer name, and a snapshot kept two of the four tensors; now the later
    ones are qualified with their group and every tensor is saved."""
    enc, dec = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = ClippedOptimizer(
        torch.optim.SGD(enc.named_parameters(), lr=0.1), max_norm=1.0, snapshot_dir=tmp_path
    )
    opt.add_param_group({"params": list(dec.named_parameters())})
    assert opt.layer_names() == ["weight", "bias", "group1.weight", "group1.bias"]
    (dec(enc(torch.ones(1, 2))).sum() * math.nan).backward()
    opt.step()
    assert opt.last_snapshot is not None
    assert sorted(clipopt.load_snapshot(opt.last_snapshot)["params"]) == [
        "bias",
        "group1.bias",
        "group1.weight",
        "weight",
    ]


def test_param_names_of_a_larger_model_are_accepted() -> None:
    """Naming a superset (the whole model, the optimizer holding part of it) still works."""
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.SGD(model[2].parameters(), lr=0.1), param_names=model.named_parameters()
    )
    assert opt.layer_names() == ["2.weight", "2.bias"]


# ---------------------------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_parameters_are_clipped_like_clip_grad_norm(norm_type: float, dtype: torch.dtype) -> None:
    """Item 4: a complex parameter made step() fail in linalg.vector_norm; now the recorded norm and
    the update equal clip_grad_norm_ (norm of |g|) followed by the same optimizer's step."""
    g = torch.Generator().manual_seed(1)
    w = nn.Parameter(torch.randn(3, 4, dtype=dtype, generator=g))
    b = nn.Parameter(torch.randn(4, generator=g))
    w_ref, b_ref = copy.deepcopy(w), copy.deepcopy(b)
    opt = ClippedOptimizer(torch.optim.Adam([w, b], lr=0.1), max_norm=0.5, norm_type=norm_type)
    ref = torch.optim.Adam([w_ref, b_ref], lr=0.1)
    for _ in range(3):
        gw, gb = torch.randn(3, 4, dtype=dtype, generator=g) * 5, torch.randn(4, generator=g) * 5
        w.grad, b.grad = gw.clone(), gb.clone()
        w_ref.grad, b_ref.grad = gw.clone(), gb.clone()
        opt.step()
        norm = torch.nn.utils.clip_grad_norm_([w_ref, b_ref], 0.5, norm_type=norm_type)
        ref.step()
        tol = 1e-5 if dtype == torch.complex64 else 1e-12
        assert float(opt.last_stats.total_norm) == pytest.approx(float(norm), rel=tol)
        torch.testing.assert_close(w, w_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(b, b_ref, rtol=tol, atol=tol)
        opt.zero_grad()


@given(arrays=grad_arrays(), imag_seed=st.integers(0, 2**16), p=norm_types)
def test_complex_total_norm_is_the_norm_of_the_moduli(
    arrays: list[np.ndarray], imag_seed: int, p: float
) -> None:
    """get_total_norm of complex gradients (mixed with real ones) equals the p-norm of |g| over all
    elements, computed in float64 NumPy."""
    rng = np.random.default_rng(imag_seed)
    values = [a.astype(np.complex128) + 1j * rng.normal(size=a.shape) * 10 for a in arrays]
    grads = [torch.tensor(v, dtype=torch.complex64) for v in values]
    grads.append(torch.tensor(arrays[0]))  # a real one among them
    flat = np.concatenate(
        [np.abs(v).ravel() for v in values] + [np.abs(arrays[0].astype(np.float64)).ravel()]
    )
    ref = float(flat.max()) if math.isinf(p) else float(np.sum(flat**p) ** (1.0 / p))
    got = float(clipopt.functional.get_total_norm(grads, p))
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-30)


def test_complex_nonfinite_gradient_is_skipped() -> None:
    """A nan in a complex gradient skips the update bit-identically, like any other."""
    w = nn.Parameter(torch.ones(2, 2, dtype=torch.complex64))
    opt = ClippedOptimizer(torch.optim.SGD([w], lr=0.1, momentum=0.9), max_norm=1.0)
    before = w.detach().clone()
    w.grad = torch.full((2, 2), complex(math.nan, 1.0), dtype=torch.complex64)
    opt.step()
    assert opt.step_was_skipped and torch.equal(w, before) and len(opt.state[w]) == 0


def test_complex_parameters_refuse_clip_value() -> None:
    """clip_value has no meaning for complex numbers (no order; clip_grad_value_ is undefined there):
    refused at construction, and at step() for a complex group added later, before anything changes."""
    w = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    r = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"^clip_value=0\.5 cannot clip complex parameters"):
        ClippedOptimizer(torch.optim.SGD([w], lr=0.1), clip_value=0.5)
    opt = ClippedOptimizer(torch.optim.SGD([r], lr=0.1), clip_value=0.5)
    opt.add_param_group({"params": [w]})
    r.grad, w.grad = torch.full((2,), 3.0), torch.ones(2, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"^clip_value does not support complex gradients"):
        opt.step()
    assert torch.equal(r.grad, torch.full((2,), 3.0)) and opt.micro_batches == 0 and opt.num_windows == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_parameters_match_clip_grad_norm(dtype: torch.dtype) -> None:
    """float16/bfloat16/float64 parameters: the norm is accumulated in float32 (float64 kept) and
    matches clip_grad_norm_ on float64 copies; the update matches within the dtype's precision."""
    g = torch.Generator().manual_seed(2)
    w = nn.Parameter(torch.randn(8, 8, generator=g).to(dtype))
    ref = nn.Parameter(w.detach().to(torch.float64))
    opt = ClippedOptimizer(torch.optim.SGD([w], lr=0.1), max_norm=0.3)
    grad = torch.randn(8, 8, generator=g).to(dtype) * 10
    w.grad, ref.grad = grad.clone(), grad.to(torch.float64)
    opt.step()
    norm = torch.nn.utils.clip_grad_norm_([ref], 0.3)
    with torch.no_grad():
        ref -= 0.1 * ref.grad
    assert float(opt.last_stats.total_norm) == pytest.approx(float(norm), rel=1e-5)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(w.detach().to(torch.float64), ref.detach(), rtol=tol, atol=tol)


def test_float16_gradients_beyond_65504_are_finite() -> None:
    """Finite float16 gradients whose norm overflows float16 are not skipped (norm in float32)."""
    w = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = ClippedOptimizer(torch.optim.SGD([w], lr=1e-6), max_norm=1.0)
    w.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    opt.step()
    assert not opt.step_was_skipped and float(opt.last_stats.total_norm) == pytest.approx(120000.0)


def test_step_without_any_gradient_applies_nothing() -> None:
    """A window where no parameter has a gradient was reported as update_applied=True; now nothing is
    applied, update_applied is False, last_stats says skipped with reason "nograd", the inner
    optimizer keeps no state, and it does not count as a non-finite skip."""
    model = make_model()
    opt = ClippedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.1), max_consecutive_nonfinite=1, accumulation_steps=2
    )
    before = weights(model)
    opt.step()
    opt.step()
    assert not opt.update_applied and opt.num_updates == 0 and opt.num_windows == 1
    stats = opt.last_stats
    assert stats is not None and stats.skipped and stats.reason == "nograd" and stats.micro_batches == 2
    assert float(stats.total_norm) == 0.0
    assert same_weights(model, before) and len(opt.state) == 0
    backward(model)
    opt.step()
    opt.step()
    assert opt.update_applied and opt.num_updates == 1


# ---------------------------------------------------------------------------------------------- state dicts


def _trained(
    info: OptimInfo, overrides: dict[str, Any]
) -> tuple[nn.Module, ClippedOptimizer, Callable[[Any], torch.optim.Optimizer]]:
    def factory(p: Any) -> torch.optim.Optimizer:
        return info.make(p, **overrides)

    model = make_model()
    opt = ClippedOptimizer(factory(model.parameters()), max_norm=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # adds initial_lr to the groups
    for i in range(2):

        def closure(i: int = i) -> Tensor:
            opt.zero_grad()
            g = torch.Generator().manual_seed(i)
            loss = model(torch.randn(5, 3, generator=g)).pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        sched.step()
    return model, opt, factory


# Every optimizer a dense model with biases takes (the closure one included: each step uses a
# closure), plus non-default betas with amsgrad and a tensor learning rate.
STATE_DICT_OPTIMIZERS = [
    *[pytest.param(o, {}, id=o.id) for o in select(exclude=("sparse", "matrix"))],
    pytest.param(get("Adam-amsgrad-forloop"), {"betas": (0.8, 0.9)}, id="Adam-amsgrad-betas"),
    pytest.param(get("AdamW-forloop"), {"lr": torch.tensor(0.01)}, id="AdamW-tensor-lr"),
]


@pytest.mark.parametrize(("info", "overrides"), STATE_DICT_OPTIMIZERS)
def test_genuine_state_dicts_of_every_optimizer_still_load(
    info: OptimInfo, overrides: dict[str, Any]
) -> None:
    """The stricter checks refuse none of torch's optimizers' own state dicts (Adafactor's factored
    row/column statistics, LBFGS's flat history, tensor learning rates, scheduler keys), into a
    fresh optimizer and into one that already holds state."""
    _, opt, factory = _trained(info, overrides)
    sd = copy.deepcopy(opt.state_dict())
    fresh = ClippedOptimizer(factory(make_model().parameters()), max_norm=1.0)
    torch.optim.lr_scheduler.StepLR(fresh, step_size=1)
    fresh.load_state_dict(copy.deepcopy(sd))
    opt.load_state_dict(sd)
    assert fresh.num_windows == opt.num_windows == 2


BAD_HYPERPARAMETERS = [
    ("lr", "fast", r"parameter group 0 has lr='fast' \(str\), but the optimizer's lr is a number"),
    ("betas", "x", r"parameter group 0 has betas='x' \(str\), but the optimizer's betas is a tuple"),
    (
        "betas",
        (0.9,),
        r"parameter group 0 has betas=\(0\.9,\) \(tuple\), but the optimizer's betas is a tuple",
    ),
    ("betas", (0.9, "x"), r"parameter group 0 has betas=\(0\.9, 'x'\) \(tuple\)"),
    (
        "amsgrad",
        "yes",
        r"parameter group 0 has amsgrad='yes' \(str\), but the optimizer's amsgrad is True or",
    ),
    ("weight_decay", None, r"parameter group 0 has weight_decay=None \(NoneType\)"),
    ("eps", [1e-8], r"parameter group 0 has eps=\[1e-08\] \(list\)"),
    ("lr", torch.ones(3), r"parameter group 0 has lr=tensor\(\[1\., 1\., 1\.\]\) \(Tensor\)"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD_HYPERPARAMETERS, ids=lambda v: repr(v)[:30])
def test_hyperparameters_of_the_wrong_type_are_refused(key: str, value: Any, message: str) -> None:
    """Item 5: load_state_dict accepted lr="fast" and betas="x" and the next step() failed; now a
    ValueError names the group, key and value, and the optimizer is unchanged and still steps."""
    model = make_model()
    opt = ClippedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), max_norm=1.0)
    backward(model)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0][key] = value
    groups, state = options(opt), copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(ValueError, match="^invalid state_dict: " + message):
        opt.load_state_dict(sd)
    assert options(opt) == groups
    assert all(torch.equal(v, state[0][k]) for k, v in opt.state_dict()["state"][0].items())
    opt.zero_grad()
    backward(model, 1)
    opt.step()
    assert opt.update_applied


@pytest.mark.parametrize(
    ("entry", "shape"),
    [("step", (3, 7)), ("exp_avg", (4,)), ("exp_avg_sq", (4, 3, 1)), ("extra", (5, 5))],
)
def test_state_tensors_that_cannot_belong_to_their_parameter_are_refused(
    entry: str, shape: tuple[int, ...]
) -> None:
    """Item 5: a per-parameter state tensor of a shape no parameter state can have (step of shape
    (3, 7), an unknown entry larger than the parameter) was accepted; now refused before loading,
    whether the optimizer already holds state or not."""
    for warm in (False, True):
        model = make_model()
        opt = ClippedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), max_norm=1.0)
        backward(model)
        opt.step()
        sd = copy.deepcopy(opt.state_dict())
        target = opt if warm else ClippedOptimizer(torch.optim.Adam(make_model().parameters(), lr=0.01))
        sd["state"][0][entry] = torch.zeros(shape)
        before = len(target.state)
        with pytest.raises(
            ValueError, match=re.escape(f"state[0][{entry!r}] has shape {shape}, parameter has (4, 3)")
        ):
            target.load_state_dict(sd)
        assert len(target.state) == before


class _FactoredOptimizer(torch.optim.Optimizer):
    """A third-party optimizer in the style of Shampoo and 8-bit optimizers: per-parameter state of
    shapes that are neither the parameter's nor a reduction of it."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state and p.dim() == 2:
                    state["left"] = torch.eye(p.shape[0])  # Kronecker factors (d, d)
                    state["right"] = torch.eye(p.shape[1])
                    state["qmap"] = torch.linspace(-1.0, 1.0, 256)  # an 8-bit code book
                p.add_(p.grad, alpha=-group["lr"])


def test_third_party_state_of_any_shape_still_loads() -> None:
    """Review of #11: the shape check refused a third-party optimizer's own state (Shampoo-style (d, d)
    factors, an 8-bit code book of 256 entries) when resuming into a fresh optimizer, although
    the state dict was its own; entries of optimizers outside torch.optim are not guessed at."""
    model = make_model()
    opt = ClippedOptimizer(_FactoredOptimizer(model.parameters()), max_norm=1.0)
    backward(model)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    fresh = ClippedOptimizer(_FactoredOptimizer(make_model().parameters()), max_norm=1.0)
    fresh.load_state_dict(sd)
    assert fresh.state[fresh.param_groups[0]["params"][0]]["left"].shape == (4, 4)


def test_lbfgs_state_without_line_search_loads_into_one_with_it() -> None:
    """Review of #11: line_search_fn=None saved, "strong_wolfe" now was refused as "not a string",
    where torch's own load_state_dict takes it (None turns an option off)."""
    model = make_model()
    sd = torch.optim.LBFGS(model.parameters()).state_dict()
    inner = torch.optim.LBFGS(model.parameters(), line_search_fn="strong_wolfe")
    ClippedOptimizer(inner, max_norm=1.0).load_state_dict(sd)
    assert inner.param_groups[0]["line_search_fn"] is None


# ---------------------------------------------------------------------------------------------- closures


def _mse_closure(
    opt: ClippedOptimizer,
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    bad_call: int | None,
    inf_loss_only: bool = False,
) -> tuple[Callable[[], Tensor], list[int]]:
    """An MSE closure and its call count (``calls[0]``). On call ``bad_call`` its loss and gradients
    are NaN; with ``inf_loss_only`` the gradients of that call stay finite and the loss it returns
    (detached) is inf."""
    calls = [0]

    def closure() -> Tensor:
        calls[0] += 1
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        bad = calls[0] == bad_call
        if inf_loss_only:
            loss.backward()
            return loss.detach() + (math.inf if bad else 0.0)
        loss = loss * (math.nan if bad else 1.0)
        loss.backward()
        return loss

    return closure, calls


def _lbfgs_run(bad_call: int | None, seed: int = 0) -> tuple[nn.Module, ClippedOptimizer, list[int]]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 1)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
    opt = ClippedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5), max_norm=1.0)
    closure, calls = _mse_closure(opt, model, x, y, bad_call)
    opt._test_closure = closure  # type: ignore[attr-defined]
    return model, opt, calls


@pytest.mark.parametrize("bad_call", [2, 3, 4])
def test_lbfgs_nonfinite_reevaluation_skips_the_window(bad_call: int) -> None:
    """Item 10: a closure whose loss and gradient are NaN only on a re-evaluation inside LBFGS's step
    turned the weights into NaN; now the window is skipped as if it never happened (weights and
    LBFGS state as before, reason "nonfinite"), and the next window applies normally."""
    model, opt, calls = _lbfgs_run(bad_call)
    before = weights(model)
    opt.step(opt._test_closure)  # type: ignore[attr-defined]
    assert calls[0] >= bad_call
    assert same_weights(model, before) and len(opt.state) == 0
    assert opt.step_was_skipped and not opt.update_applied
    assert opt.last_stats is not None and opt.last_stats.reason == "nonfinite" and opt.num_skipped == 1
    # the next window equals the first window of a run that never saw the NaN
    ref_model, ref_opt, _ = _lbfgs_run(None)
    ref_opt.step(ref_opt._test_closure)  # type: ignore[attr-defined]
    opt.step(opt._test_closure)  # type: ignore[attr-defined]
    assert opt.update_applied and same_weights(model, weights(ref_model))


def test_lbfgs_skip_after_applied_windows_restores_its_history() -> None:
    """With LBFGS history built up by applied windows, a window whose re-evaluation goes NaN is
    undone completely: the run then continues bit-identically to one that never had that window."""

    def run(windows: list[tuple[int, bool]]) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = ClippedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), max_norm=1.0)
        for seed, bad in windows:
            g = torch.Generator().manual_seed(seed)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
            closure, _ = _mse_closure(opt, model, x, y, 3 if bad else None)
            opt.step(closure)
            assert opt.step_was_skipped == bad
        return model

    with_skip = run([(0, False), (1, False), (2, True), (2, False), (3, False)])
    without = run([(0, False), (1, False), (2, False), (3, False)])
    assert same_weights(with_skip, weights(without))


def test_lbfgs_nonfinite_loss_with_finite_gradients_on_reevaluation_skips() -> None:
    """A re-evaluation whose loss is inf while its gradients stay finite also ends in a skip
    (LBFGS compares losses; an inf loss misleads its line search)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = ClippedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), max_norm=1.0)
    closure, _ = _mse_closure(opt, model, x, y, 2, inf_loss_only=True)
    before = weights(model)
    opt.step(closure)
    assert same_weights(model, before) and opt.step_was_skipped


def test_lbfgs_finite_closure_is_unchanged_by_the_guard() -> None:
    """With finite re-evaluations the wrapped LBFGS step equals torch's LBFGS on gradients clipped
    by the same rule (clip_grad_norm_ on every evaluation)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    opt = ClippedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5), max_norm=0.1)
    ref_opt = torch.optim.LBFGS(ref.parameters(), lr=0.5, max_iter=5)

    def closure_for(m: nn.Module, o: torch.optim.Optimizer, clip: bool) -> Callable[[], Tensor]:
        def closure() -> Tensor:
            o.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            return loss

        return closure

    opt.step(closure_for(model, opt, False))
    ref_opt.step(closure_for(ref, ref_opt, True))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------- errors in step()


def test_error_inside_step_does_not_advance_the_window() -> None:
    """Item 11: sparse gradients with clip_value raised inside step() but left the micro-batch counter
    advanced, so the next window divided by 2; now the failed call is not counted and the next
    window divides by 1, as if the failed call never happened."""
    emb = nn.Embedding(5, 2, sparse=True)
    opt = ClippedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), clip_value=10.0, max_norm=None)
    emb(torch.tensor([1, 2])).sum().backward()
    state = wrapper_state(opt)
    with pytest.raises(TypeError, match=r"^clip_value does not support sparse gradients"):
        opt.step()
    assert wrapper_state(opt) == state
    emb.weight.grad = torch.ones(5, 2)  # the user switches to a dense gradient
    before = emb.weight.detach().clone()
    opt.step()
    assert opt.last_stats is not None and opt.last_stats.micro_batches == 1
    torch.testing.assert_close(emb.weight.detach(), before - 0.1)


class _Boom(RuntimeError):
    """The injected fault."""


def _inject(monkeypatch: pytest.MonkeyPatch, opt: ClippedOptimizer, stage: str) -> None:
    """Make ``stage`` of the next window raise :class:`_Boom`."""

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise _Boom(stage)

    if stage == "norm":
        monkeypatch.setattr(clipopt.functional, "get_total_norm", boom)
    elif stage == "layer_stats":
        monkeypatch.setattr("clipopt._window.diagnose.compute_layer_stats", boom)
    elif stage == "snapshot":
        monkeypatch.setattr("clipopt._diagnostics.snapshot.SnapshotWriter.save", boom)
    elif stage == "policy":
        policy = opt._policy
        assert policy is not None
        real = type(policy).threshold

        def threshold_then_boom(total_norm: Tensor) -> Tensor:
            real(policy, total_norm)  # the policy has seen the window: its state must be rolled back
            raise _Boom(stage)

        monkeypatch.setattr(policy, "threshold", threshold_then_boom)
    elif stage == "inner_step":
        monkeypatch.setattr(opt.optimizer, "step", boom)
    else:
        raise AssertionError(stage)


STAGES = ["norm", "layer_stats", "snapshot", "policy"]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("stage", STAGES)
def test_errors_at_every_stage_leave_the_wrapper_as_before(
    stage: str, fused: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Item 11: an error raised at any stage of closing a window before the gradients are changed
    (norm, per-layer statistics, snapshot, policy) leaves the counters, the open window, the
    signals, the statistics history and the policy state exactly as before the call, and the
    parameters and inner state untouched; once the fault is gone, the same call closes the window."""
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    opt = ClippedOptimizer(
        inner,
        max_norm=AutoClip(percentile=50),
        accumulation_steps=2,
        layer_stats=1,
        snapshot_dir=tmp_path,
        param_names=model.named_parameters(),
    )
    for i in range(4):  # two applied windows: state exists, the fused path is taken
        backward(model, i)
        opt.step(loss=float(i))
        opt.zero_grad()
    backward(model, 10, scale=math.nan if stage == "snapshot" else 1.0)
    opt.step(loss=10.0)
    state, params = wrapper_state(opt), weights(model)
    policy = copy.deepcopy(opt._policy.state_dict()) if opt._policy is not None else None
    inner_state = copy.deepcopy(inner.state_dict()["state"])
    with monkeypatch.context() as m:
        _inject(m, opt, stage)
        with pytest.raises(_Boom):
            opt.step(loss=20.0)
    assert wrapper_state(opt) == state
    assert (opt._run.loss.total, opt._run.loss.count) == (10.0, 1)  # the failed call's loss is not kept
    assert same_weights(model, params)
    assert opt._policy is not None and policy is not None
    for k, v in opt._policy.state_dict().items():
        assert torch.allclose(v, policy[k], rtol=0, atol=0, equal_nan=True), k
    for i, entry in inner.state_dict()["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, inner_state[i][k]), (i, k)
    opt.step(loss=20.0)  # the retried call closes the window (2 micro-batches, 2 losses)
    assert opt.num_windows == state[1] + 1 and opt.last_stats is not None
    assert opt.last_stats.micro_batches == 2
    assert float(opt.last_stats.loss) == 15.0


@pytest.mark.parametrize("scaler", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_error_in_the_inner_step_discards_the_changed_gradients(
    fused: bool, scaler: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error raised by the inner optimizer comes after the gradients were combined, clipped (and
    unscaled): counters, policy, parameters and inner state are as before, but the gradients are
    discarded and the window's micro-batches not counted (the note on the error says so), so a
    retry never divides or unscales them twice: the next window equals a fresh run's window."""

    def build() -> tuple[nn.Module, ClippedOptimizer]:
        model = make_model()
        amp = torch.amp.GradScaler("cpu", init_scale=4.0) if scaler else None
        inner = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        return model, ClippedOptimizer(inner, max_norm=0.5, accumulation_steps=2, scaler=amp)

    def micro_batch(model: nn.Module, opt: ClippedOptimizer, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        loss = model(torch.randn(5, 3, generator=g)).pow(2).sum()
        (opt.scaler.scale(loss) if opt.scaler is not None else loss).backward()

    model, opt = build()
    micro_batch(model, opt, 0)
    opt.step()
    micro_batch(model, opt, 1)
    state, params = wrapper_state(opt), weights(model)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise _Boom("inner step")

    with monkeypatch.context() as m:
        m.setattr(opt.optimizer, "step", boom)
        with pytest.raises(_Boom) as info:
            opt.step(loss=7.0)
    assert opt._run.loss.count == 0  # the discarded window's losses go with its gradients
    assert "the window's gradients were already changed in place" in "".join(info.value.__notes__)
    assert wrapper_state(opt)[1:] == state[1:] and opt.micro_batches == 0
    assert same_weights(model, params) and all(p.grad is None for p in model.parameters())
    assert len(opt.state) == 0
    for i in (2, 3):
        micro_batch(model, opt, i)
        opt.step()
    ref_model, ref = build()
    for i in (2, 3):
        micro_batch(ref_model, ref, i)
        ref.step()
    assert ref.last_stats is not None and opt.last_stats is not None
    assert float(opt.last_stats.total_norm) == float(ref.last_stats.total_norm)
    assert same_weights(model, weights(ref_model))


def test_error_after_the_inner_step_counts_the_applied_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while recording a window whose update was already applied cannot undo the update:
    the window is counted (not rolled back into an open window that would be applied twice)."""
    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    backward(model)
    opt.step()
    before = weights(model)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise _Boom("record")

    with monkeypatch.context() as m:
        m.setattr("clipopt._window.runtime.StepStats", boom)
        with pytest.raises(_Boom):
            opt.step()
    assert not same_weights(model, before)
    assert opt.micro_batches == 0 and opt.num_windows == 1 and opt.num_updates == 1


def test_logger_failure_after_the_update_leaves_a_consistent_wrapper() -> None:
    """A custom logger's own bug raises after the window is complete: the update is applied and
    counted (it cannot be taken back), the next window starts clean."""

    class Broken:
        def log(self, stats: Any, optimizer: Any) -> None:
            raise KeyError("bug in a custom logger")

        def close(self) -> None:
            pass

    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loggers=[Broken()])
    backward(model)
    with pytest.raises(KeyError):
        opt.step()
    assert opt.num_windows == 1 and opt.num_updates == 1 and opt.micro_batches == 0 and opt.update_applied


def test_logger_oserror_does_not_interrupt_training() -> None:
    """Item 7: a logger raising OSError (disk full) no longer escapes opt.step() after the update was
    applied: one warning per cause, training and logging go on."""

    class Full:
        calls = 0

        def log(self, stats: Any, optimizer: Any) -> None:
            Full.calls += 1
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    model = make_model()
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loggers=[Full()])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(3):
            backward(model, i)
            opt.step()
            opt.zero_grad()
    messages = [str(w.message) for w in record if "could not write" in str(w.message)]
    assert len(messages) == 1 and "No space left on device" in messages[0]
    assert opt.num_updates == 3 and Full.calls == 3
