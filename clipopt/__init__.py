"""clipopt: safe gradient clipping, accumulation and non-finite skipping for PyTorch.

Swap ``torch.optim.AdamW(...)`` for
``ClippedOptimizer(torch.optim.AdamW(...), max_norm=1.0, accumulation_steps=4)``
and keep calling ``step()``.
"""

from __future__ import annotations

from . import functional
from ._errors import NonFiniteGradientError
from ._optimizer import ClippedOptimizer
from ._scheduler import PerUpdateScheduler, per_update
from ._stats import StepStats

__version__ = "0.1.0.dev0"

__all__ = [
    "ClippedOptimizer",
    "NonFiniteGradientError",
    "PerUpdateScheduler",
    "StepStats",
    "__version__",
    "functional",
    "per_update",
]
