"""Observing never changes the run (SPEC §10): a logger, ``layer_stats``, ``update_stats``,
``snapshot_dir`` or a SpikeGuard that never fires leaves every parameter bit-identical, with fused,
foreach and for-loop inner optimizers and an active clip.

Both runs execute the same optimizer kernels on the same gradients, so bit-identity holds by
construction on any CPU: an observer sends windows through the general close instead of the plain
one, and both take the norm bound's scale from one formula (``clipopt/_window/coefficient.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from clipopt import AutoClip, ClippedOptimizer, CSVLogger, SpikeGuard, TensorBoardLogger

KINDS = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "for-loop": {"foreach": False},
}

#: Each observer as the keyword arguments it adds, given a folder to write into.
OBSERVERS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "csv_logger": lambda d: {"loggers": [CSVLogger(d / "grads.csv")]},
    "tensorboard_logger": lambda d: {"loggers": [TensorBoardLogger(d / "tb")]},
    "layer_stats": lambda d: {"layer_stats": 3},
    "layer_stats_every_window": lambda d: {"layer_stats": True},
    "update_stats": lambda d: {"update_stats": True},
    "snapshot_dir": lambda d: {"snapshot_dir": d / "snaps"},
    "spike_guard_that_never_fires": lambda d: {"spike_guard": SpikeGuard(z_thresh=1e30)},
}


WINDOWS = 12


def _train(
    kind: str, extra: dict[str, Any], max_norm: Any, accumulation: int, least_clipped: int = WINDOWS - 2
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, **KINDS[kind])
    opt = ClippedOptimizer(
        inner,
        max_norm=max_norm,
        accumulation_steps=accumulation,
        param_names=model.named_parameters(),
        **extra,
    )
    gen = torch.Generator().manual_seed(1)
    clipped = 0
    for _ in range(WINDOWS * accumulation):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step(loss=loss)
        if opt.micro_batches == 0:
            clipped += bool(opt.last_stats.clipped)
        opt.zero_grad()
    opt.close()
    assert clipped >= least_clipped, "the clip must be active for the comparison to mean anything"
    return [p.detach().clone() for p in model.parameters()]


@functools.cache
def _bare(kind: str, accumulation: int) -> list[torch.Tensor]:
    """The run without observers (once per test run)."""
    return _train(kind, {}, 0.05, accumulation)


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("observer", list(OBSERVERS))
def test_an_observer_leaves_every_parameter_bit_identical(
    observer: str, kind: str, accumulation: int, tmp_path: Path
) -> None:
    bare = _bare(kind, accumulation)
    observed = _train(kind, OBSERVERS[observer](tmp_path), 0.05, accumulation)
    for a, b in zip(bare, observed, strict=True):
        assert torch.equal(a, b), (observer, kind, (a - b).abs().max().item())


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_observer_leaves_a_policy_run_bit_identical(kind: str, tmp_path: Path) -> None:
    """A policy's threshold (on the device) goes through the same formula with and without a logger."""
    bare = _train(kind, {}, AutoClip(percentile=10), 1, least_clipped=WINDOWS // 2)
    logger = {"loggers": [CSVLogger(tmp_path / "g.csv")]}
    observed = _train(kind, logger, AutoClip(percentile=10), 1, least_clipped=WINDOWS // 2)
    for a, b in zip(bare, observed, strict=True):
        assert torch.equal(a, b), (kind, (a - b).abs().max().item())


def test_every_observer_part_is_checked_here(tmp_path: Path) -> None:
    """Each part that declares itself an observer (``Part.observer``: left out of the ranks'
    agreement, trusted to leave the run alone) is one of OBSERVERS above, so its promise is tested."""
    from clipopt._config import REGISTRY

    declared = {c.keyword for c in REGISTRY if c.observer}
    tested = {keyword for make in OBSERVERS.values() for keyword in make(tmp_path)}
    assert declared and declared <= tested, declared - tested
