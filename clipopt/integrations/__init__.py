"""Training-framework integrations: Lightning, Hugging Face Trainer, Accelerate.

Nothing here is imported until used, and nothing new is required at runtime:

* :class:`StatsReader` (no framework) — the statistics of the updates closed
  since its previous read, as a flat ``{"clipopt/...": float}`` dict for any
  logger (``accelerator.log(reader.read(), step=...)`` with Accelerate);
* :class:`ClipoptLightningCallback` — a ``lightning.pytorch.Callback`` that
  logs them through ``LightningModule.log_dict`` (needs ``lightning``);
* :class:`ClipoptTrainerCallback` — a ``transformers.TrainerCallback`` that
  adds them to the Trainer's logs and ``trainer_state.json`` (needs
  ``transformers``).

Both callbacks warn once (:class:`StackedClipWarning`) when the framework's own
clipping is on (``max_grad_norm`` of the Trainer's arguments, default 1.0;
Lightning's ``gradient_clip_val``): it bounds the gradients before clipopt sees them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._stacked import StackedClipWarning
from ._stats import STAT_KEYS, StatsReader, find_clipped

if TYPE_CHECKING:
    from ._hf import ClipoptTrainerCallback
    from ._lightning import ClipoptLightningCallback

__all__ = [
    "STAT_KEYS",
    "ClipoptLightningCallback",
    "ClipoptTrainerCallback",
    "StackedClipWarning",
    "StatsReader",
    "find_clipped",
]


def __getattr__(name: str) -> Any:
    if name == "ClipoptLightningCallback":
        from ._lightning import ClipoptLightningCallback

        return ClipoptLightningCallback
    if name == "ClipoptTrainerCallback":
        from ._hf import ClipoptTrainerCallback

        return ClipoptTrainerCallback
    raise AttributeError(f"module 'clipopt.integrations' has no attribute {name!r}")
