"""A plain window (no groups, recovery, replicas, loggers, diagnostics) calls only what its settings need.

Measured with ``sys.setprofile``: the Python functions a ``step()`` enters.  Reference: the features'
own entry points, which a plain run must not reach (issue #24, 'Speed where most users are').
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import clipopt
from clipopt import ClippedOptimizer

PACKAGE = str(Path(clipopt.__file__).parent)

#: Entry points of features that are off in a plain run (module file, function name).
OFF_FEATURES = {
    ("_recovery/spike_guard.py", "commit"),  # SpikeGuard
    ("_recovery/rewind.py", "commit"),  # Rewind
    ("_distributed/replicas.py", "end_window"),  # replica agreement
    ("_window/runtime.py", "sync_unsynced"),  # no_sync()
    ("_window/diagnose.py", "diagnose"),  # layer statistics, anomaly snapshots
    ("_diagnostics/loggers.py", "log_window"),  # loggers
    ("_window/groups.py", "check_policy_with_groups"),  # per-group options
    ("_window/update_apply.py", "start_update"),  # update_clip, update_stats
}


#: What one closing ``step()`` of a plain run costs (issue #24), AdamW over 8 tensors of 16x16: clipopt
#: functions entered (130 fused / 135 foreach before the window plan, 84 / 89 with it, 45 / 42 with the
#: plain window of ``_window/plain.py``) and ATen operators dispatched, the inner step's own included
#: (29 / 50, then 20 / 41, now 12 / 37). A change that adds work to every plain window fails here:
#: measure it (benchmarks/small.py) and raise the bound knowingly.
#: Fused 47 -> 48 (#32): the kernel's grad_scale comes from the one formula that every fused path
#: calls (_window/coefficient.py), so that observing never changes the arithmetic.
PLAIN_WINDOW_CALLS = {"fused": 49, "foreach": 45}
PLAIN_WINDOW_OPS = {"fused": 11, "foreach": 36}


class _Ops(TorchDispatchMode):
    """Counts the ATen operators dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_every_feature_entry_point_exists() -> None:
    """Each entry of OFF_FEATURES names a function defined in that module of the package: after a
    module or function is moved or renamed (the layout of #23), the plain-window check would
    otherwise pass without looking at anything."""
    for path, function in sorted(OFF_FEATURES):
        tree = ast.parse((Path(PACKAGE) / path).read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in defined, (path, function)


def _entered(call: Callable[[], Any]) -> list[tuple[str, str]]:
    """(file path in the package, function name) of every clipopt function ``call()`` enters, in order."""
    seen: list[tuple[str, str]] = []

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            seen.append((frame.f_code.co_filename[len(PACKAGE) + 1 :], frame.f_code.co_name))

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def _plain(accumulation_steps: int, **inner: Any) -> tuple[ClippedOptimizer, list[torch.nn.Parameter]]:
    """A wrapper with only ``max_norm`` around AdamW (``inner``: fused/foreach) of 8 tensors of 16x16."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(8)]
    opt = ClippedOptimizer(
        torch.optim.AdamW(params, **inner), max_norm=1.0, accumulation_steps=accumulation_steps
    )
    return opt, params


def _fill(params: list[torch.nn.Parameter]) -> None:
    """A fresh random gradient for every parameter."""
    for p in params:
        p.grad = torch.randn(16, 16)


def test_a_plain_closing_step_calls_no_feature_that_is_off() -> None:
    """A closing ``step()`` of a plain run (fused and foreach AdamW) enters none of the entry points of
    SpikeGuard/Rewind, replica agreement, no_sync, diagnostics, loggers or per-group options."""
    for inner in ({"fused": True}, {"foreach": True}):
        opt, params = _plain(1, **inner)
        for _ in range(3):
            _fill(params)
            opt.step()
        _fill(params)
        entered = set(_entered(opt.step))
        assert ("_window/runtime.py", "close_plain") in entered  # the window did close, as a plain one
        assert entered & OFF_FEATURES == set(), inner


def test_a_plain_micro_batch_step_only_counts() -> None:
    """A micro-batch ``step()`` inside an open window, without loss or closure, enters only the step
    itself, the hook check and the window guard (the fast path at the top of ``step()``: no loss or
    closure checks, no ``_step``, no attribute forwarding check)."""
    opt, params = _plain(4, fused=True)
    for _ in range(5):  # one closed window, then the second micro-batch of the next
        _fill(params)
        opt.step()
    _fill(params)
    assert _entered(opt.step) == [
        ("_optimizer.py", "step"),
        ("_hooks.py", "step_hooked"),
        ("_window/guard.py", "step"),
    ]


def test_the_one_pass_norm_is_the_general_paths_norm() -> None:
    """``get_total_norm``'s one-pass case (dense, real, one device and dtype, no large CPU tensor)
    gives bit for bit the norm of the same kernels (``_foreach_norm``, ``stack``, ``vector_norm``);
    lists it does not cover (a large CPU tensor, mixed dtypes, a sparse gradient) go the general
    way, checked before any kernel runs."""
    from clipopt import functional as F

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(16, 16, generator=gen) * 3 for _ in range(8)]
    for p in (1.0, 2.0, 3.0, float("inf")):
        want = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, p, dtype=torch.float32)), p)
        assert torch.equal(F.get_total_norm(grads, p), want), p
        assert torch.equal(F.foreach_total_norm(grads, p, None), want), p
    big = [torch.ones(F.DOT_MIN_NUMEL)]  # measured directly with dot, not _foreach_norm
    assert F.foreach_total_norm(big, 2.0, None) is None
    assert F.get_total_norm(big, 2.0).item() == pytest.approx(F.DOT_MIN_NUMEL**0.5)
    mixed = [torch.ones(3), torch.ones(3, dtype=torch.float64)]
    assert F.foreach_total_norm(mixed, 2.0, None) is None
    assert F.get_total_norm(mixed, 2.0).item() == pytest.approx(6**0.5)
    half = [torch.full((4,), 3.0), torch.full((4,), 2.0, dtype=torch.bfloat16)]
    assert F.foreach_total_norm(half, 2.0, None) is None
    assert F.get_total_norm(half, 2.0).item() == pytest.approx(52**0.5)
    sparse = torch.sparse_coo_tensor([[0]], [3.0], (4,))
    assert F.foreach_total_norm([torch.ones(3), sparse], 2.0, None) is None
    assert F.get_total_norm([torch.full((4,), 4.0), sparse], 2.0).item() == pytest.approx(73**0.5)


def test_a_plain_closing_step_stays_within_its_call_and_kernel_budget() -> None:
    """A closing ``step()`` of a plain run enters at most PLAIN_WINDOW_CALLS clipopt functions and
    dispatches at most PLAIN_WINDOW_OPS ATen operators (fused: norm 3, non-finite flag 2, grad_scale
    2, the inner step 3, and no record_function pair: torch's step wrapper is passed by, with no hook
    and no profiler; the coefficient, ``clipped`` and the
    counters are computed when read; foreach: the one read of the norm, torch's coefficient 4 and
    scaling 1, the inner step's own; both: the overflow check's read of the CPU norm, one call and
    one operator, #35)."""
    for kind in ("fused", "foreach"):
        opt, params = _plain(1, **{kind: True})
        for _ in range(3):
            _fill(params)
            opt.step()
        _fill(params)
        entered = _entered(opt.step)
        _fill(params)
        with _Ops() as mode:
            opt.step()
        assert ("_window/runtime.py", "close_plain") in entered  # the window did close, as a plain one
        assert len(entered) <= PLAIN_WINDOW_CALLS[kind], (kind, entered)
        assert len(mode.ops) <= PLAIN_WINDOW_OPS[kind], (kind, mode.ops)
