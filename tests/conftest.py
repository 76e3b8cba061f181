"""Shared test configuration: hypothesis profiles and a printed seed, and the fixtures that several
test modules use."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" (default): bounded and reproducible, the seed is printed on failure.
# HYPOTHESIS_PROFILE=dev runs more examples.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide state (the accelerator, the gradient accumulation plugin) that
    an ``Accelerator`` or a Hugging Face ``Trainer`` sets up: reset it around each test that uses
    this fixture, so that none leaks into the next."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def pytest_configure(config: pytest.Config) -> None:
    """Pick (and later print) a hypothesis seed so every failure can be replayed."""
    if getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = int(os.environ.get("HYPOTHESIS_SEED", random.randrange(2**32)))


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.option.hypothesis_seed
    return (
        f"torch {torch.__version__}; hypothesis profile {settings._current_profile}; "
        f"seed {seed} (replay: python -m pytest --hypothesis-seed={seed})"
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the seed at the end of every run too: the header is not shown with ``-q``."""
    seed = terminalreporter.config.option.hypothesis_seed
    terminalreporter.write_line(f"hypothesis seed {seed} (replay: python -m pytest --hypothesis-seed={seed})")
