"""The window's loss: micro-batch losses summed on the device, combined like the gradients.

``opt.step(loss=loss)`` (or the closure's return value) hands each micro-batch's
loss to the wrapper.  The losses of a window are summed as detached 0-d
tensors (or Python floats) without reading the device; when the window closes
the sum becomes the window's loss: divided by the number of losses given with
``reduction="mean"``, as is with ``"sum"``.  ``None`` when no loss was given.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

import torch
from torch import Tensor

from .._state import bad

__all__ = ["LossSum", "check_loss", "loss_of_closure"]


def check_loss(loss: Any) -> Tensor | float | None:
    """``step(loss=...)``: a one-element tensor (detached, float32 or wider) or a real number."""
    if loss is None:
        return None
    if isinstance(loss, Tensor):
        if loss.numel() != 1:
            raise ValueError(
                f"loss must be a one-element tensor or a float, got a tensor of shape {tuple(loss.shape)}; "
                "pass the reduced loss (e.g. loss.mean())"
            )
        if loss.is_complex() or not (loss.is_floating_point() or loss.dtype in _INT_DTYPES):
            raise TypeError(
                f"loss must be a real number or a real tensor, got a tensor of dtype {loss.dtype}; "
                "pass the loss returned by the loss function"
            )
        value = loss.detach().reshape(())
        return value if value.dtype == torch.float64 else value.to(torch.float32)
    if isinstance(loss, Real) and not isinstance(loss, bool):
        return float(loss)
    raise TypeError(
        f"loss must be a 0-d tensor or a float, got {type(loss).__name__}; "
        "pass opt.step(loss=loss) with the micro-batch's loss"
    )


_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def loss_of_closure(value: Any) -> Tensor | float | None:
    """The loss a closure returned, when it is one (other return values are not recorded)."""
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        return check_loss(value)
    if isinstance(value, Real) and not isinstance(value, bool):
        return float(value)
    return None


class LossSum:
    """The open window's sum of micro-batch losses and how many were given (part of the state dict)."""

    __slots__ = ("count", "total")

    def __init__(self, total: Tensor | float | None = None, count: int = 0) -> None:
        self.total = total
        self.count = count

    @classmethod
    def of(cls, outs: list[Any]) -> LossSum:
        """The sum of the losses that closures returned (``outs``: their return values)."""
        total = cls()
        for out in outs:
            total.add(loss_of_closure(out))
        return total

    def add(self, loss: Tensor | float | None) -> None:
        """Add one micro-batch's loss (already checked); no device read."""
        if loss is None:
            return
        if self.total is None:
            self.total = loss.clone() if isinstance(loss, Tensor) else loss
        elif isinstance(self.total, Tensor) and isinstance(loss, Tensor) and loss.device != self.total.device:
            self.total = self.total.to(loss.device) + loss  # a sum loaded on the CPU, losses on the device
        else:
            self.total = self.total + loss
        self.count += 1

    def combined(self, reduction: str) -> Tensor | float | None:
        """The window's loss (``mean`` over the losses given, or their ``sum``); None without one."""
        if self.total is None or self.count == 0:
            return None
        return self.total / self.count if reduction == "mean" and self.count != 1 else self.total

    def clear(self) -> None:
        """Start the next window's sum."""
        self.total, self.count = None, 0

    def to_dict(self) -> dict[str, Any]:
        total = self.total.detach().clone() if isinstance(self.total, Tensor) else self.total
        return {"loss_sum": total, "loss_count": self.count}

    @classmethod
    def from_dict(cls, ext: dict[str, Any], micro_batches: int) -> LossSum:
        """Read ``loss_sum``/``loss_count`` of a ``"clipopt"`` entry; absent (older state dicts): empty."""
        total, count = ext.get("loss_sum"), ext.get("loss_count", 0)
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= micro_batches:
            raise bad(
                "'clipopt.loss_count' must be an int from 0 to the pending "
                f"micro-batches ({micro_batches}), got {count!r}"
            )
        if total is not None and not (
            (isinstance(total, Tensor) and total.numel() == 1 and total.is_floating_point())
            or (isinstance(total, float))
        ):
            raise bad(
                "'clipopt.loss_sum' must be a float, a one-element float tensor "
                f"or None, got {type(total).__name__}"
            )
        if (total is None) != (count == 0):
            raise bad(f"'clipopt.loss_sum' is {total!r} but 'clipopt.loss_count' is {count}")
        if isinstance(total, Tensor):
            total = total.detach().reshape(()).clone()
        return cls(total, count)
