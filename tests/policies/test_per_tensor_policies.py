"""What every per-tensor policy promises, tested from one table: AdaGC and StableSPAM against their
``pytorch_optimizer`` references, and as wrapper policies (state, skips, host reads, groups).

Each policy's own rules (its arguments, the checks of its state, its settings key) stay in
``test_policy_adagc.py`` and ``test_policy_stable_spam.py``.  The StableSPAM reference runs with
its momentum reset off (``update_proj_gap`` beyond the run) and without its cosine schedule of
``gamma1`` (``t_max=None``, its default): what is left of its optimizer is Adam with decoupled
weight decay, which ``torch.optim.AdamW`` computes the same way.
"""

from __future__ import annotations

import copy
import functools
import io
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from pytorch_optimizer import AdaGC as ReferenceAdaGC
from pytorch_optimizer import StableSPAM as ReferenceStableSPAM

from clipopt import AdaGC, ClippedOptimizer, ClipPolicy, SpikeGuard, StableSPAM

from ..helpers import reads_per_step, square_mean
from ..policy_runs import (
    SPIKES,
    UPDATES,
    assert_same_run,
    largest_difference,
    layers,
    spiked_model,
    train_spiked,
    trajectory,
    with_and_without,
)
from ..window.test_skip import assert_identical

#: update_proj_gap: the StableSPAM reference resets its moments every that many updates (never here).
NO_RESET = 10**9


@dataclass(frozen=True)
class PolicyCase:
    """One per-tensor policy and the reference optimizer it reproduces around ``torch.optim.AdamW``."""

    id: str
    adam: dict[str, Any]  #: AdamW's settings, the same in both runs
    policy: Callable[[], ClipPolicy]  #: clipopt's policy with the settings the reference is given
    reference: Callable[[Iterable[torch.nn.Parameter], dict[str, Any]], torch.optim.Optimizer]
    state_keys: tuple[str, ...]  #: the policy's statistics, in its state dict
    #: the policy for the skip and host-read tests (AdaGC: a short warm-up, so its EMAs are in use)
    quick: Callable[[], ClipPolicy] = field(default=lambda: StableSPAM())

    def ours(self, accumulation: int = 1, foreach: bool = False) -> Callable[[torch.nn.Module], Any]:
        return lambda m: ClippedOptimizer(
            torch.optim.AdamW(m.parameters(), foreach=foreach, **self.adam),
            max_norm=self.policy(),
            accumulation_steps=accumulation,
        )

    def theirs(self) -> Callable[[torch.nn.Module], Any]:
        return lambda m: self.reference(m.parameters(), self.adam)


CASES = [
    PolicyCase(
        "AdaGC",
        {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1},
        lambda: AdaGC(warmup=20),
        lambda params, adam: ReferenceAdaGC(params, warmup_steps=20, **adam),
        ("gamma", "count"),
        quick=lambda: AdaGC(warmup=5),
    ),
    PolicyCase(
        "StableSPAM",
        {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
        StableSPAM,
        lambda params, adam: ReferenceStableSPAM(params, update_proj_gap=NO_RESET, **adam),
        ("m_max", "m_norm", "v_norm", "count"),
    ),
]
BY_ID = {case.id: case for case in CASES}
EVERY = [pytest.param(case.id, id=case.id) for case in CASES]


# ------------------------------------------------------------------------------ trajectories


@functools.cache
def _reference_trajectory(name: str) -> list[torch.Tensor]:
    """The reference's trajectory with the default settings: computed once per test run, then read."""
    return trajectory(BY_ID[name].theirs(), mean_grads=True)


@functools.cache
def _plain_trajectory(name: str) -> list[torch.Tensor]:
    """The same run under plain AdamW (no policy): computed once per test run, then read."""
    adam = BY_ID[name].adam
    return trajectory(lambda m: torch.optim.AdamW(m.parameters(), foreach=False, **adam))


@pytest.mark.parametrize("name", EVERY)
@pytest.mark.parametrize("foreach", [False, True])
def test_the_policy_reproduces_the_reference_trajectory(name: str, foreach: bool) -> None:
    """300 updates with gradient spikes (x1e3 on four updates, one element +1e6 on another) give
    parameters identical, update by update, to the reference's with the same settings (tolerance
    0: measured 0.0 with torch.optim.AdamW foreach=False and foreach=True); the run without the
    policy differs by more than 0.1, so the spikes matter."""
    want = _reference_trajectory(name)
    got = trajectory(BY_ID[name].ours(foreach=foreach))
    assert largest_difference(got, want) == 0.0
    assert largest_difference(_plain_trajectory(name), want) > 0.1


@pytest.mark.parametrize("name", EVERY)
def test_with_accumulation_the_policy_reproduces_the_reference_on_the_mean_gradient(name: str) -> None:
    """accumulation_steps=3 (reduction 'mean'): each update equals the reference stepping on the
    mean of the three micro-batches' gradients (tolerance 0)."""
    case = BY_ID[name]
    want = trajectory(case.theirs(), accumulation=3, mean_grads=True)
    got = trajectory(case.ours(accumulation=3), accumulation=3)
    assert largest_difference(got, want) == 0.0


@pytest.mark.parametrize("name", EVERY)
def test_the_policy_records_the_spikes_as_clipped(name: str) -> None:
    """StepStats: no global bound (max_norm None, clip_coef 1.0); a spike update is clipped."""
    model = spiked_model()
    opt = BY_ID[name].ours()(model)
    train_spiked(model, opt, range(60))
    assert all(s.max_norm is None and s.clip_coef == 1.0 for s in opt.stats)
    assert all(opt.stats[i].clipped for i in SPIKES if i < 60)


# ------------------------------------------------------------------------------ state, skips


@pytest.mark.parametrize("name", EVERY)
def test_the_policys_state_dict_resumes_identically(name: str) -> None:
    """Saved after 150 updates (past AdaGC's warm-up), loaded into a fresh wrapper with a fresh
    policy (through torch.save / torch.load), the run continues exactly as the uninterrupted one."""
    case = BY_ID[name]
    model = spiked_model()
    opt = case.ours()(model)
    train_spiked(model, opt, range(150))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    model2 = copy.deepcopy(model)
    opt2 = case.ours()(model2)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer, weights_only=True))
    train_spiked(model, opt, range(150, UPDATES))
    train_spiked(model2, opt2, range(150, UPDATES))
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", EVERY)
def test_a_skipped_window_leaves_the_policy_as_if_it_never_happened(name: str) -> None:
    """A window with a NaN gradient is skipped, and the policy's statistics (its state_keys, the
    count among them) and the parameters are those of the run that never saw it."""
    case = BY_ID[name]
    bad = (torch.randn(8, 6), torch.randn(8, 3))
    bad[0][0, 0] = math.nan

    def make(m: torch.nn.Module) -> Any:
        inner = torch.optim.AdamW(m.parameters(), foreach=False, **case.adam)
        return ClippedOptimizer(inner, max_norm=case.quick())

    with_bad, without = with_and_without(make, bad)
    assert with_bad[1].stats[10].skipped and with_bad[1].stats[10].reason == "nonfinite"  # type: ignore[attr-defined]
    assert float(with_bad[1].max_norm.state_dict()["count"]) == 30  # type: ignore[attr-defined]
    assert_same_run(with_bad, without, case.state_keys)


@pytest.mark.parametrize("name", EVERY)
def test_a_spike_skipped_by_spike_guard_leaves_the_policy_as_if_it_never_happened(name: str) -> None:
    """A finite window that SpikeGuard skips (reason "spike") after the policy clipped it leaves the
    policy's statistics and the parameters those of the run that never saw it."""
    case = BY_ID[name]
    bad = (torch.randn(8, 6) * 1e4, torch.randn(8, 3))

    def make(m: torch.nn.Module) -> Any:
        guard = SpikeGuard(z_thresh=4.0, window=8, signals=("grad_norm",))
        inner = torch.optim.AdamW(m.parameters(), foreach=False, **case.adam)
        return ClippedOptimizer(inner, max_norm=case.quick(), spike_guard=guard)

    with_bad, without = with_and_without(make, bad)
    assert with_bad[1].stats[10].skipped and with_bad[1].stats[10].reason == "spike"  # type: ignore[attr-defined]
    assert_same_run(with_bad, without, case.state_keys)


# ------------------------------------------------------------------------------ sync, groups


@pytest.mark.parametrize("name", EVERY)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_policy_reads_nothing_on_the_fused_path(name: str, accumulation: int) -> None:
    """The policy keeps a fused AdamW update free of host reads (after the first window)."""
    model = spiked_model()
    opt = ClippedOptimizer(
        torch.optim.AdamW(model.parameters(), fused=True),
        max_norm=BY_ID[name].quick(),
        accumulation_steps=accumulation,
    )
    reads = reads_per_step(model, opt, [torch.randn(4, 6) for _ in range(8)], square_mean)
    assert reads[accumulation:] == [0] * (8 - accumulation)


@pytest.mark.parametrize("name", EVERY)
def test_with_an_excluded_group_the_policy_matches_the_reference_on_the_others(name: str) -> None:
    """A group with 'max_norm': None is left out of the policy: the other group follows the reference
    over its parameters alone, the excluded one plain AdamW (tolerance 0)."""
    case = BY_ID[name]

    def ours(m: torch.nn.Module) -> Any:
        first, second = layers(m)
        groups = [{"params": first.parameters()}, {"params": second.parameters(), "max_norm": None}]
        return ClippedOptimizer(torch.optim.AdamW(groups, foreach=False, **case.adam), max_norm=case.policy())

    class Both(torch.optim.Optimizer):
        def __init__(self, m: torch.nn.Module) -> None:
            first, second = layers(m)
            self.a = case.reference(first.parameters(), case.adam)
            self.b = torch.optim.AdamW(second.parameters(), foreach=False, **case.adam)
            super().__init__(list(m.parameters()), {})

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            self.a.step()
            self.b.step()

    want = trajectory(Both, mean_grads=True)
    got = trajectory(ours)
    assert largest_difference(got, want) == 0.0


# ------------------------------------------------------------------------------ growing, loading

#: The update at which the first layer's bias joins (a group of its own).
JOINS = 60
#: AdaGC with a warm-up bound above every norm after the first spikes: the tensor that joins has a
#: warm-up of its own (updates 60-78), in which the reference sums the per-tensor norms in its own
#: order (the new group last) and clipopt in the wrapper's (``into=0``: the new group second), which
#: can round differently; a bound above both sums makes the coefficient exactly 1 on both sides.
GROWN = {
    "AdaGC": (
        lambda: AdaGC(warmup=20, lambda_abs=10.0),
        lambda params, adam: ReferenceAdaGC(params, warmup_steps=20, lambda_abs=10.0, **adam),
    ),
    "StableSPAM": (BY_ID["StableSPAM"].policy, BY_ID["StableSPAM"].reference),
}


def _grown_trajectory(
    make: Callable[[torch.nn.Module], Any], add: Callable[[Any, torch.Tensor], None], *, mean: bool
) -> list[torch.Tensor]:
    """:func:`trajectory`, with the first layer's bias frozen (no gradient) until update
    :data:`JOINS`, where ``add(opt, bias)`` gives it to the optimizer as a new group."""
    model = spiked_model()
    bias = layers(model)[0].bias
    bias.requires_grad_(False)
    opt = make(model)
    out = []
    for update in range(UPDATES):
        if update == JOINS:
            bias.requires_grad_(True)
            add(opt, bias)
        train_spiked(model, opt, [update], mean_grads=mean)
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return out


@pytest.mark.parametrize("name", EVERY)
@pytest.mark.parametrize("into", [0, 1])
def test_statistics_follow_their_tensors_through_add_param_group(name: str, into: int) -> None:
    """#32: a wrapper over two AdamW, [first.weight] and [second.weight, second.bias]; at update 60
    first.bias joins optimizer ``into`` as a group of its own (``into=0``: the second layer's
    tensors move one place on in the wrapper's list of parameters).  Each tensor keeps its own
    statistics (kept by inner optimizer and index in it), the new one starts unseen, and the 300
    updates equal pytorch_optimizer's, given the same group at the same update, with tolerance 0
    (kept by position, the second layer got the first bias' statistics and the bias the second
    weight's)."""
    make_policy, reference = GROWN[name]
    adam = BY_ID[name].adam

    def ours(m: torch.nn.Module) -> Any:
        first, second = layers(m)
        inner = [
            torch.optim.AdamW([first.weight], foreach=False, **adam),
            torch.optim.AdamW(second.parameters(), foreach=False, **adam),
        ]
        return ClippedOptimizer(inner, max_norm=make_policy())

    def theirs(m: torch.nn.Module) -> Any:
        first, second = layers(m)
        return reference([first.weight, *second.parameters()], adam)

    got = _grown_trajectory(ours, lambda o, b: o.add_param_group({"params": [b]}, optimizer=into), mean=False)
    want = _grown_trajectory(theirs, lambda o, b: o.add_param_group({"params": [b]}), mean=True)
    assert largest_difference(got, want) == 0.0


@pytest.mark.parametrize("name", EVERY)
def test_a_state_for_more_tensors_than_the_wrapper_has_is_refused_at_load(name: str) -> None:
    """#32: a policy state of four tensors (saved over the whole model) loaded into a wrapper over
    the first layer (two tensors) mid-window was accepted, and the next close failed after the
    window's gradients were discarded.  It is refused at load with a ValueError naming the policy
    and the parameter the wrapper lacks, before anything changes: the policy, the inner state and
    the open window's gradients are as they were, and the window closes."""
    case = BY_ID[name]
    whole = spiked_model()
    big = case.ours()(whole)
    train_spiked(whole, big, range(3))
    model = spiked_model()
    first = layers(model)[0]
    small = ClippedOptimizer(
        torch.optim.AdamW(first.parameters(), foreach=False, **case.adam),
        max_norm=case.policy(),
        accumulation_steps=2,
    )
    train_spiked(model, small, range(2), accumulation=2)
    sd = copy.deepcopy(small.state_dict())
    sd["clipopt"]["policy"] = copy.deepcopy(big.state_dict()["clipopt"]["policy"])
    (torch.nn.functional.mse_loss(model(torch.ones(8, 6)), torch.zeros(8, 3))).backward()
    small.step()  # one micro-batch of two: the window is open
    grads = [p.grad.clone() for p in first.parameters()]  # type: ignore[union-attr]
    policy_before = copy.deepcopy(small.max_norm.state_dict())  # type: ignore[union-attr]
    inner_before = copy.deepcopy(small.optimizer.state_dict())
    message = f"invalid {name} state: it holds statistics of 4 tensors, among them parameter 2 of optimizer 0"
    with pytest.raises(ValueError, match=re.escape(message)):
        small.load_state_dict(sd)
    after = small.max_norm.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(after[k].nan_to_num(-1.0), policy_before[k].nan_to_num(-1.0)) for k in after)
    assert_identical(small.optimizer.state_dict(), inner_before)
    assert all(torch.equal(p.grad, g) for p, g in zip(first.parameters(), grads, strict=True))  # type: ignore[arg-type]
    assert small.micro_batches == 1
    (torch.nn.functional.mse_loss(model(torch.ones(8, 6)), torch.zeros(8, 3))).backward()
    small.step()
    assert small.micro_batches == 0 and small.num_updates == 3
