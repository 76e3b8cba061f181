"""What a Rewind copy holds beside the parameters, the inner optimizer's state and the buffers.

:class:`Held` gathers it at a copy and loads it back at a rewind: the state of every active part
with :attr:`~clipopt._part.Part.held` (its ``state_dict()`` under its keyword: ``"update_clip"``,
``"spike_guard"``), and the wrapper's clip policy and GradScaler under ``"policy"`` and
``"scaler"`` (the layout copies have always had, so that saved copies load).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from .._part import Part

__all__ = ["Held"]


class Held:
    """The held state of one wrapper over ``inner``: its held ``parts`` and its policy (None: a float
    bound or no bound) and ``scaler`` (None when off)."""

    __slots__ = ("inner", "parts", "policy", "scaler")

    def __init__(self, parts: Sequence[Part], policy: Any, scaler: Any, inner: Optimizer) -> None:
        self.parts = tuple(parts)
        self.policy, self.scaler, self.inner = policy, scaler, inner

    def state(self) -> dict[str, Any]:
        """The state a copy holds (device tensors, copied to the host by the Rewind); a part's empty
        state is held as None."""
        out: dict[str, Any] = {
            "policy": None if self.policy is None else self.policy.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }
        for part in self.parts:
            state = part.state_dict()
            if state is not None:
                out[part.keyword] = state or None
        return out

    def restore(self, saved: dict[str, Any]) -> None:
        """Load the state of the copy a rewind went back to (see :meth:`state`); an entry the copy
        lacks (a part off when it was taken), or one the part cannot load (it was replaced since:
        ``opt.update_clip`` of another mode), leaves the current state as it is."""
        if saved.get("policy") is not None and self.policy is not None:
            self.policy.load_state_dict(saved["policy"])
        for part in self.parts:
            if saved.get(part.keyword) is None:
                continue
            try:
                checked = part.check_state(saved[part.keyword], self.inner)
            except ValueError:
                continue
            part.load_state(checked)
        if saved.get("scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(saved["scaler"])
