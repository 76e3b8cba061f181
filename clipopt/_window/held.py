"""What a Rewind copy holds beside the parameters, the inner optimizer's state and the buffers.

:class:`Held` gathers it at a copy and loads it back at a rewind: the state of every active part
with :attr:`~clipopt._part.Part.held` (its ``state_dict()`` under its keyword), and the wrapper's
clip policy, GradScaler and update-clip history under ``"policy"``, ``"scaler"`` and
``"update_clip"`` (the layout copies have always had, so that saved copies load).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._part import Part
from .update_clip import fits

__all__ = ["Held"]


class Held:
    """The held state of one wrapper: its held ``parts`` and its policy (None: a float bound or no
    bound), ``scaler`` and ``update_clip`` (each None when off)."""

    __slots__ = ("parts", "policy", "scaler", "update_clip")

    def __init__(self, parts: Sequence[Part], policy: Any, scaler: Any, update_clip: Any) -> None:
        self.parts = tuple(parts)
        self.policy, self.scaler, self.update_clip = policy, scaler, update_clip

    def state(self) -> dict[str, Any]:
        """The state a copy holds (device tensors, copied to the host by the Rewind)."""
        update_clip = self.update_clip
        out: dict[str, Any] = {
            "policy": None if self.policy is None else self.policy.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "update_clip": (update_clip.state_dict() or None) if update_clip is not None else None,
        }
        for part in self.parts:
            state = part.state_dict()
            if state is not None:
                out[part.keyword] = state
        return out

    def restore(self, saved: dict[str, Any]) -> None:
        """Load the state of the copy a rewind went back to (see :meth:`state`); an entry the copy
        lacks (a part off when it was taken) leaves the current state as it is, and so does an
        update-clip history of another window (``opt.update_clip`` was replaced since)."""
        if saved.get("policy") is not None and self.policy is not None:
            self.policy.load_state_dict(saved["policy"])
        for part in self.parts:
            if saved.get(part.keyword) is not None:
                part.load_state(saved[part.keyword])
        if saved.get("scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(saved["scaler"])
        update_clip = saved.get("update_clip")
        if update_clip is not None and self.update_clip is not None and fits(self.update_clip, update_clip):
            self.update_clip.load_state_dict(update_clip)
