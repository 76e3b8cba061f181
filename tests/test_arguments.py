"""Bad input: each gets a TypeError/ValueError naming the argument, the value and the fix."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from clipopt import ClippedOptimizer


def _inner() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


BAD_ARGUMENTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    (
        {"max_norm": 0.0},
        ValueError,
        "max_norm must be a positive finite number or None, got 0.0; "
        "pass e.g. max_norm=1.0, or max_norm=None to turn it off",
    ),
    (
        {"max_norm": -1},
        ValueError,
        "max_norm must be a positive finite number or None, got -1; "
        "pass e.g. max_norm=1.0, or max_norm=None to turn it off",
    ),
    (
        {"max_norm": float("inf")},
        ValueError,
        "max_norm must be a positive finite number or None, got inf; "
        "pass e.g. max_norm=1.0, or max_norm=None to turn it off",
    ),
    (
        {"max_norm": "1.0"},
        TypeError,
        "max_norm must be a float, a ClipPolicy (AutoClip, ZClip, AGC, AdaGC, StableSPAM) or None, "
        "got '1.0' (str); "
        "pass e.g. max_norm=1.0 or max_norm=AutoClip()",
    ),
    (
        {"max_norm": True},
        TypeError,
        "max_norm must be a float, a ClipPolicy (AutoClip, ZClip, AGC, AdaGC, StableSPAM) or None, "
        "got True (bool); "
        "pass e.g. max_norm=1.0 or max_norm=AutoClip()",
    ),
    (
        {"norm_type": 0},
        ValueError,
        "norm_type must be > 0 or float('inf'), got 0; pass e.g. norm_type=2.0 or norm_type=float('inf')",
    ),
    (
        {"norm_type": -float("inf")},
        ValueError,
        "norm_type must be > 0 or float('inf'), got -inf; pass e.g. norm_type=2.0 or norm_type=float('inf')",
    ),
    (
        {"norm_type": "fro"},
        TypeError,
        "norm_type must be a float, got 'fro' (str); pass e.g. norm_type=2.0 or norm_type=float('inf')",
    ),
    (
        {"clip_value": -0.5},
        ValueError,
        "clip_value must be a positive finite number or None, got -0.5; "
        "pass e.g. clip_value=0.5, or clip_value=None to turn it off",
    ),
    (
        {"accumulation_steps": 0},
        ValueError,
        "accumulation_steps must be an int >= 1, got 0; pass e.g. accumulation_steps=4",
    ),
    (
        {"accumulation_steps": 2.0},
        TypeError,
        "accumulation_steps must be an int >= 1, got 2.0 (float); pass e.g. accumulation_steps=4",
    ),
    (
        {"reduction": "avg"},
        ValueError,
        "reduction must be 'mean' or 'sum', got 'avg'; pass e.g. reduction='mean'",
    ),
    (
        {"skip_nonfinite": 1},
        TypeError,
        "skip_nonfinite must be True or False, got 1 (int); pass skip_nonfinite=True or skip_nonfinite=False",
    ),
    (
        {"max_consecutive_nonfinite": 0},
        ValueError,
        "max_consecutive_nonfinite must be an int >= 1 or None, got 0; "
        "pass e.g. max_consecutive_nonfinite=8, or max_consecutive_nonfinite=None to turn it off",
    ),
    (
        {"max_consecutive_nonfinite": 3, "skip_nonfinite": False},
        ValueError,
        "max_consecutive_nonfinite=3 counts skipped updates but skip_nonfinite=False skips none; "
        "set skip_nonfinite=True or max_consecutive_nonfinite=None",
    ),
    (
        {"scaler": object()},
        TypeError,
        "scaler must be a torch.amp.GradScaler or None, got object; pass scaler=torch.amp.GradScaler()",
    ),
    (
        {"stats_history": 0},
        ValueError,
        "stats_history must be an int >= 1, got 0; pass e.g. stats_history=4",
    ),
    (
        {"foreach": "yes"},
        TypeError,
        "foreach must be True or False, got 'yes' (str); pass foreach=True or foreach=False",
    ),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    BAD_ARGUMENTS,
    ids=[
        f"{name}={'object()' if type(v) is object else repr(v)}"
        for k, _, _ in BAD_ARGUMENTS
        for name, v in [next(iter(k.items()))]
    ],
)
def test_bad_argument_message(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    """Each bad argument raises the documented error with its exact message."""
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        ClippedOptimizer(_inner(), **kwargs)


def test_optimizer_must_be_an_optimizer() -> None:
    """A non-optimizer is rejected with a TypeError that shows what to pass."""
    model = torch.nn.Linear(2, 2)
    msg = "optimizer must be a torch.optim.Optimizer, got generator"
    with pytest.raises(TypeError, match=re.escape(msg)):
        ClippedOptimizer(model.parameters())  # type: ignore[arg-type]


def test_double_wrapping_is_rejected() -> None:
    """Wrapping a ClippedOptimizer again is a TypeError pointing at .optimizer."""
    opt = ClippedOptimizer(_inner())
    with pytest.raises(TypeError, match=re.escape("optimizer is already a ClippedOptimizer")):
        ClippedOptimizer(opt)


def test_bad_argument_touches_nothing() -> None:
    """A rejected construction leaves the inner optimizer's state and groups as they were."""
    inner = _inner()
    groups = [dict(g) for g in inner.param_groups]
    with pytest.raises(ValueError):
        ClippedOptimizer(inner, accumulation_steps=0)
    assert [dict(g) for g in inner.param_groups] == groups
    assert len(inner.state) == 0
    assert not hasattr(inner, "grad_scale")


def test_closure_with_scaler_is_rejected() -> None:
    """step(closure) with a GradScaler is a TypeError that explains the alternative."""
    model = torch.nn.Linear(2, 1)
    opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match=re.escape("step(closure) cannot be used with scaler=...")):
        opt.step(lambda: model(torch.ones(1, 2)).sum())
    assert opt.micro_batches == 0


def test_state_dict_must_be_a_dict() -> None:
    """load_state_dict of a non-dict is a TypeError naming what to pass."""
    opt = ClippedOptimizer(_inner())
    with pytest.raises(TypeError, match=re.escape("state_dict must be a dict, got list")):
        opt.load_state_dict([])  # type: ignore[arg-type]


def test_no_assert_for_user_input() -> None:
    """The library never uses assert statements (they vanish under python -O)."""
    import pathlib

    import clipopt

    root = pathlib.Path(clipopt.__file__).parent
    offenders = [
        f"{path.name}:{i}"
        for path in root.rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if line.strip().startswith("assert ")
    ]
    assert offenders == []
