"""Which settings of a framework's own clip count as on, and what the warning says (no framework needed)."""

from __future__ import annotations

import math
import warnings

import pytest

from clipopt.integrations import StackedClipWarning
from clipopt.integrations._stacked import clips_before_clipopt, warn_stacked_clip


@pytest.mark.parametrize(
    ("value", "on"),
    [
        (1.0, True),
        (0.5, True),
        (3, True),
        (None, False),
        (0.0, False),
        (0, False),
        (-1.0, False),
        (math.nan, False),
        (math.inf, False),  # bounds nothing (torchtitan's documented way to turn its clip off)
        (False, False),
    ],
)
def test_a_framework_clips_only_above_zero(value: object, on: bool) -> None:
    """As transformers (``max_grad_norm > 0``) and Lightning (``clip_val <= 0`` returns) decide."""
    assert clips_before_clipopt(value) is on


def test_the_warning_names_the_setting_the_bound_and_the_fix() -> None:
    """The message says what clips, what clipopt then records, and how to turn the framework's clip off;
    it points at the caller's line."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warn_stacked_clip("SFTConfig.max_grad_norm", 1.0, "SFTConfig(max_grad_norm=0.0)")
    (w,) = record
    assert w.category is StackedClipWarning and w.filename == __file__
    assert str(w.message).startswith(
        "SFTConfig.max_grad_norm=1.0 clips the gradients before clipopt sees them"
    )
    assert "already bounded by 1.0" in str(w.message) and "SFTConfig(max_grad_norm=0.0)" in str(w.message)
