"""Shared test configuration: hypothesis profiles and the host-read guard."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# "ci": bounded and reproducible (the seed is printed on failure); "dev": more examples.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_report_header() -> str:
    return f"torch {torch.__version__}; hypothesis profile {settings._current_profile}"
