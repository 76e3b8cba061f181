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

import torch

import clipopt
from clipopt import ClippedOptimizer

PACKAGE = str(Path(clipopt.__file__).parent)

#: Entry points of features that are off in a plain run (module file, function name).
OFF_FEATURES = {
    ("_recovery/part.py", "commit"),  # SpikeGuard / Rewind
    ("_distributed/replicas.py", "end_window"),  # replica agreement
    ("_optimizer.py", "_sync_unsynced"),  # no_sync()
    ("_window/diagnose.py", "diagnose"),  # layer statistics, anomaly snapshots
    ("_diagnostics/loggers.py", "log_window"),  # loggers
    ("_window/groups.py", "check_policy_with_groups"),  # per-group options
    ("_window/update_apply.py", "start_update"),  # update_clip, update_stats
}


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
        assert ("_optimizer.py", "_finish_window") in entered  # the window did close
        assert entered & OFF_FEATURES == set(), inner


def test_a_plain_micro_batch_step_only_counts() -> None:
    """A micro-batch ``step()`` inside an open window, without loss or closure, enters only the step
    itself and the window guard (no loss or closure checks, no attribute forwarding check)."""
    opt, params = _plain(4, fused=True)
    for _ in range(5):  # one closed window, then the second micro-batch of the next
        _fill(params)
        opt.step()
    _fill(params)
    assert _entered(opt.step) == [
        ("_optimizer.py", "step"),
        ("_optimizer.py", "_step"),
        ("_window/guard.py", "step"),
    ]
