"""The plain window (``clipopt/_window/plain.py``) closes as the general close would.

A wrapper with nothing but a norm bound closes its windows on the short path; the same wrapper
made to take the general path (its ``_is_plain`` answering False) is the reference.  Both see the
same gradients, finite or not, over every dense optimizer of the table, and must agree on each
window's record, the counters, the skips, and the parameters and inner state: bit for bit on the
host path, and to float32 rounding on the fused path, whose kernel divides by ``grad_scale``
computed directly (``max(1, (norm + 1e-6) / max_norm)``) rather than as ``1 / coef``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from clipopt import ClippedOptimizer, StepStats
from clipopt import functional as F
from clipopt._state import PENDING_LIMIT, WrapperState

from ..optim_db import PLAIN, OptimInfo, params, pick, select

DENSE = select(exclude=PLAIN)

#: What a micro-batch's gradients hold: ordinary values, large ones (clipped hard), a nan, an inf,
#: finite elements whose float32 norm overflows (taken without overflow and clipped, #35), or
#: finite elements whose norm exceeds float32's range (reason "norm_overflow").
KINDS = ("normal", "large", "nan", "inf", "overflow", "beyond")

SHAPES = [(3, 4), (4,), (2, 2, 2)]


def _grads(kind: str, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]
    if kind == "large":
        grads = [g * 1e3 for g in grads]
    elif kind == "nan":
        grads[1][0] = math.nan
    elif kind == "inf":
        grads[2][0, 1, 0] = -math.inf
    elif kind == "overflow":
        grads[0].fill_(1e25)  # every element finite; the float32 sum of squares is not
    elif kind == "beyond":
        grads[0].view(-1)[:2] = torch.tensor([3e38, -3e38]).to(dtype)  # norm 4.2e38: not a float32
    return grads


def _pair(info: OptimInfo, dtype: torch.dtype, **options: Any) -> list[tuple[ClippedOptimizer, list[Any]]]:
    """Two identical wrappers over identical parameters; the second closes on the general path."""
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in SHAPES]
        out.append((ClippedOptimizer(info.make(params), **options), params))
    object.__setattr__(out[1][0]._run, "is_plain", lambda s: False)  # the reference: the general close
    return out


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if exact:
        return torch.equal(a, b) or bool(
            torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        )
    return torch.allclose(a, b, rtol=2e-6, atol=1e-7, equal_nan=True)


def _record(s: StepStats) -> dict[str, Any]:
    row = s.as_dict()
    row["total_norm"] = "nan" if math.isnan(row["total_norm"]) else row["total_norm"]
    row["clip_coef"] = "nan" if math.isnan(row["clip_coef"]) else row["clip_coef"]
    row["loss"] = "nan" if math.isnan(row["loss"]) else row["loss"]
    return row


def _run_both(info: OptimInfo, dtype: torch.dtype, kinds: list[str], seed: int, **options: Any) -> None:
    """Run the plain close and the general close over the same windows, comparing them after each
    micro-batch (fused: to float32 rounding, else bit for bit)."""
    (plain, p_params), (general, g_params) = _pair(info, dtype, **options)
    exact = "fused" not in info.tags
    for i, kind in enumerate(kinds):
        for opt, ps in ((plain, p_params), (general, g_params)):
            for p, g in zip(ps, _grads(kind, seed + i, dtype), strict=True):
                p.grad = g
            opt.step()
        where = (info.id, options, i, kind)
        assert plain._run.is_plain(plain._run.plan.settings(1, plain._inner)), where  # the path under test
        assert plain.num_windows == general.num_windows
        if plain.last_stats is not None:
            assert general.last_stats is not None
            assert _record(plain.last_stats) == _record(general.last_stats), where
        saved, want = plain.state_dict()["clipopt"], general.state_dict()["clipopt"]
        assert (saved["skipped"], saved["consecutive"]) == (want["skipped"], want["consecutive"]), where
        for a, b in zip(p_params, g_params, strict=True):
            assert _same(a.detach(), b.detach(), exact), where
            for key, value in plain.optimizer.state[a].items():
                if isinstance(value, torch.Tensor):
                    assert _same(value, general.optimizer.state[b][key], exact), (*where, key)


#: The optimizers compared setting by setting: each fused one, and host-path ones with and without
#: state (Adam is nearly blind to a gradient's scale; SGD is not).
COMPARED = pick(
    "AdamW-fused",
    "SGD-fused",
    "SGD-momentum-fused",
    "Adagrad-fused",
    "AdamW-foreach",
    "SGD-forloop",
    "SGD-momentum-foreach",
    "RMSprop-forloop",
)

#: Windows that go through every branch: clipped, a norm that overflows (finite elements), nan, inf.
SEQUENCE = ["normal", "large", "overflow", "normal", "nan", "large", "inf", "normal"]


@pytest.mark.parametrize("info", params(COMPARED))
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_the_plain_close_agrees_with_the_general_close(info: OptimInfo, norm_type: float) -> None:
    """For each setting of reduction, accumulation, skipping and the bound, window by window over
    SEQUENCE, the plain close and the general close record the same window, count the same skips
    and leave the same parameters and inner state (fused: to float32 rounding)."""
    for reduction in ("mean", "sum"):
        for accumulation_steps in (1, 2):
            for skip_nonfinite in (True, False):
                for max_norm in (None, 0.5):
                    options = dict(
                        max_norm=max_norm,
                        norm_type=norm_type,
                        reduction=reduction,
                        accumulation_steps=accumulation_steps,
                        skip_nonfinite=skip_nonfinite,
                    )
                    _run_both(info, torch.float32, SEQUENCE, 7, **options)


@given(
    info=st.sampled_from(DENSE),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=9),
    seed=st.integers(0, 2**16),
    options=st.fixed_dictionaries(
        {
            "max_norm": st.sampled_from([None, 0.5, 1.0, 4.0]),
            "norm_type": st.sampled_from([1.0, 2.0, 3.0, math.inf]),
            "reduction": st.sampled_from(["mean", "sum"]),
            "accumulation_steps": st.integers(1, 3),
            "skip_nonfinite": st.booleans(),
        }
    ),
)
def test_the_plain_close_agrees_with_the_general_close_anywhere(
    info: OptimInfo, dtype: torch.dtype, kinds: list[str], seed: int, options: dict[str, Any]
) -> None:
    """The same comparison over every dense optimizer of the table, float64 too, random settings and
    windows."""
    _run_both(info, dtype, kinds, seed, **options)


@pytest.mark.parametrize("max_norm", [0.25, 1.0, 3.0])
def test_a_plain_windows_coefficient_is_torchs_bit_for_bit(max_norm: float) -> None:
    """The coefficient a plain window records (fused: computed from the norm when read; otherwise
    before scaling) is torch's ``clamp(max_norm / (norm + 1e-6), max=1)`` bit for bit, and its
    ``clipped`` is ``coef < 1``; the host path's parameters match ``clip_grad_norm_`` + ``step()``
    bit for bit."""
    for inner in ({"fused": True}, {"foreach": True}, {"foreach": False}):
        torch.manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
        ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = ClippedOptimizer(torch.optim.AdamW(params, lr=0.1, **inner), max_norm=max_norm)
        torch_opt = torch.optim.AdamW(ref, lr=0.1, **inner)
        for scale in (0.01, 1.0, 50.0):
            grads = [torch.randn(5, 3) * scale for _ in params]
            for p, q, g in zip(params, ref, grads, strict=True):
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
            torch_opt.step()
            want = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            stats = opt.last_stats
            assert stats is not None
            assert stats.total_norm == norm.item()
            assert stats.clip_coef == want.item(), inner
            assert stats.clipped == (want.item() < 1.0)
            if "fused" not in inner:
                assert all(torch.equal(p, q) for p, q in zip(params, ref, strict=True)), inner


def test_the_coefficient_is_derived_once_when_several_records_are_read_at_once() -> None:
    """``materialize`` (a logger reading many records) derives each plain record's coefficient from
    its own norm, like reading ``clip_coef`` one record at a time."""
    from clipopt._diagnostics.stats import materialize

    params = [torch.nn.Parameter(torch.zeros(4))]
    opt = ClippedOptimizer(torch.optim.AdamW(params, fused=True), max_norm=2.0, stats_history=8)
    for scale in (0.5, 3.0, 40.0):
        params[0].grad = torch.full((4,), scale)
        opt.step()
    records = list(opt.stats)
    materialize(records)
    for s, scale in zip(records, (0.5, 3.0, 40.0), strict=True):
        norm = torch.tensor(2 * scale)  # |(s, s, s, s)| = 2s
        assert s.clip_coef == torch.clamp(2.0 / (norm + 1e-6), max=1.0).item()
        assert s.clipped == (scale * 2 > 2.0)


def test_skip_flags_wait_uncounted_and_count_as_one_at_a_time() -> None:
    """Device skip flags recorded by plain windows wait in the counters (no kernel per window) and,
    when a counter is read, give the counts of recording them one at a time; more than
    PENDING_LIMIT are never kept."""
    gen = torch.Generator().manual_seed(3)
    for n in (1, 2, 5, PENDING_LIMIT - 1, PENDING_LIMIT, PENDING_LIMIT + 7, 3 * PENDING_LIMIT):
        flags = (torch.rand(n, generator=gen) < 0.6).tolist()
        pending, one_by_one = WrapperState(), WrapperState()
        skipped = run = 0
        for f in flags:
            t = torch.tensor(float(f))
            pending.record(t, t)
            assert len(pending._pending) < PENDING_LIMIT
            one_by_one.record(t, t.clone())  # two tensors: counted at once, on the device
            skipped, run = skipped + f, run + 1 if f else 0
        assert (int(pending.skipped), int(pending.consecutive)) == (skipped, run), n
        assert (int(one_by_one.skipped), int(one_by_one.consecutive)) == (skipped, run), n


def test_a_run_of_skips_spans_the_pending_flags() -> None:
    """A run of non-finite skips that began before the pending flags goes on through them when all
    of them are skips, and restarts after the latest applied window otherwise."""
    state = WrapperState(windows=10, skipped=4, consecutive=3)
    for _ in range(5):
        state.record(torch.tensor(1.0), torch.tensor(1.0))
    one = torch.tensor(1.0)
    for _ in range(5):
        state.record(one, one)
    assert (int(state.skipped), int(state.consecutive)) == (14, 13)
    zero = torch.tensor(0.0)
    for flag in (one, zero, one, one):
        state.record(flag, flag)
    assert (int(state.skipped), int(state.consecutive)) == (17, 2)


def test_a_copy_of_the_counters_keeps_its_pending_flags() -> None:
    """A copy (what a failed close puts back) has the same counts, and counting on the copy leaves the
    original's pending flags as they were."""
    state = WrapperState()
    one = torch.tensor(1.0)
    state.record(one, one)
    state.record(one, one)
    copy = state.copy()
    copy.record(torch.tensor(0.0), torch.tensor(0.0))
    assert int(copy.skipped) == 2 and int(copy.consecutive) == 0
    assert int(state.skipped) == 2 and int(state.consecutive) == 2


def test_no_feature_is_lost_on_the_plain_path() -> None:
    """Each feature that needs the general close turns the plain path off: a logger, a snapshot
    folder, update statistics, a value bound, a policy, per-layer statistics, a GradScaler, a
    group's own bound; with none of them the window is plain."""
    from clipopt import AutoClip, CSVLogger

    def plain(**options: Any) -> bool:
        params = [torch.nn.Parameter(torch.zeros(3))]
        opt = ClippedOptimizer(torch.optim.AdamW(params, fused=True), **options)
        return opt._run.is_plain(opt._run.plan.settings(1, opt._inner))

    assert plain(max_norm=1.0) and plain(max_norm=None) and plain(accumulation_steps=4)
    assert not plain(loggers=[CSVLogger("/dev/null")])
    assert not plain(update_stats=True)
    assert not plain(clip_value=0.5)
    assert not plain(max_norm=AutoClip())
    assert not plain(layer_stats=1)
    assert not plain(scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("fused", [False, True])
def test_the_windows_between_statistics_windows_close_plain(fused: bool) -> None:
    """With ``layer_stats=3`` windows 3 and 6 take the general close and record statistics; the others
    close as plain windows, with the records and parameters of a run without statistics."""
    torch.manual_seed(0)
    grads = [[torch.randn(4, 3) * 5, torch.randn(3) * 5] for _ in range(6)]
    runs = []
    for layer_stats in (3, False):
        params = [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))]
        opt = ClippedOptimizer(torch.optim.AdamW(params, fused=fused), max_norm=1.0, layer_stats=layer_stats)
        plain = []
        for window in grads:
            for p, g in zip(params, window, strict=True):
                p.grad = g.clone()
            plain.append(opt._run.is_plain(opt._run.plan.settings(1, opt._inner)))
            opt.step()
        runs.append((opt, params, plain))
    (with_stats, params, plain), (without, ref_params, ref_plain) = runs
    assert plain == [True, True, False, True, True, False] and all(ref_plain)
    assert [s.layers is not None for s in with_stats.stats] == [False, False, True, False, False, True]
    assert [s.total_norm for s in with_stats.stats] == [s.total_norm for s in without.stats]
    for p, q in zip(
        params, ref_params, strict=True
    ):  # the statistics windows' general close: float32 rounding
        torch.testing.assert_close(p, q, rtol=0 if not fused else 1e-6, atol=0 if not fused else 1e-7)


def test_get_total_norm_matches_the_plain_norm() -> None:
    """The plain window's norm (one foreach kernel) is ``get_total_norm``'s, bit for bit."""
    from clipopt._window.plain import _measure
    from clipopt._window.settings import WindowSettings

    grads = [torch.randn(7, 3) for _ in range(4)]
    for p in (1.0, 2.0, math.inf):
        s = WindowSettings(
            norm_type=p,
            clip_value=None,
            divisor=1.0,
            foreach=None,
            policy=None,
            max_norm=1.0,
            skip_enabled=True,
            scaled=False,
            norm_group=None,
            plan=None,
        )
        norm, _, uniform, _ = _measure(s, grads)
        assert uniform and torch.equal(norm, F.get_total_norm(grads, p))


def test_pending_skip_flags_survive_a_copy_a_pickle_and_a_state_dict() -> None:
    """Skip flags waiting uncounted after fused plain windows are counted in a deep copy, a pickled
    copy and the state dict alike; the copies then go on counting on their own."""
    import copy
    import pickle

    params = [torch.nn.Parameter(torch.zeros(4))]
    opt = ClippedOptimizer(torch.optim.AdamW(params, fused=True), max_norm=1.0)
    for value in (1.0, 2.0, math.nan, math.inf, math.nan):  # the first update readies the state
        params[0].grad = torch.full((4,), value)
        opt.step()
    assert opt._run.counters._pending  # the skips of the fused windows wait uncounted
    copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    for other in copies:
        assert (other.num_skipped, other.num_updates) == (3, 2)
        other.optimizer.param_groups[0]["params"][0].grad = torch.full((4,), math.nan)
        other.step()  # one more skip, in the copy only
        assert other.num_skipped == 4
    saved = opt.state_dict()["clipopt"]
    assert (saved["skipped"], saved["consecutive"], saved["applied"]) == (3, 3, 2)
    params[0].grad = torch.ones(4)
    opt.step()
    assert (opt.num_skipped, opt.num_updates) == (3, 3)
    assert opt.state_dict()["clipopt"]["consecutive"] == 0
