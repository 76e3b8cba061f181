"""clipopt: safe gradient clipping, accumulation and non-finite skipping for PyTorch.

Swap ``torch.optim.AdamW(...)`` for
``ClippedOptimizer(torch.optim.AdamW(...), max_norm=1.0, accumulation_steps=4)``
and keep calling ``step()``.
"""

from __future__ import annotations

from . import functional
from ._errors import NonFiniteGradientError
from ._layers import LAYER_FIELDS, LayerStats
from ._logging import CSVLogger, Logger
from ._optimizer import ClippedOptimizer
from ._policies import AGC, AutoClip, ClipPolicy, ZClip
from ._scheduler import PerUpdateScheduler, per_update
from ._snapshot import load_snapshot
from ._stats import StepStats, materialize
from ._tensorboard import TensorBoardLogger
from ._version import __version__

__all__ = [
    "AGC",
    "AutoClip",
    "CSVLogger",
    "ClipPolicy",
    "ClippedOptimizer",
    "LAYER_FIELDS",
    "LayerStats",
    "Logger",
    "NonFiniteGradientError",
    "PerUpdateScheduler",
    "StepStats",
    "TensorBoardLogger",
    "ZClip",
    "__version__",
    "functional",
    "load_snapshot",
    "materialize",
    "per_update",
]
