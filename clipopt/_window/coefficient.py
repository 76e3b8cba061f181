"""The norm bound's coefficient: one formula per kind of inner step, whatever else is on.

What the parameters become depends only on the settings that change the math (docs/design.md,
'Rounding'), never on what is observed or recorded: a logger, ``layer_stats``, ``update_stats``,
snapshots or a SpikeGuard that never fires send a window through the general close instead of the
plain one (:mod:`clipopt._window.plain`), and both closes take the scale of a norm bound from here.
With ``n`` the window's norm (after value clipping; divided by the ``k`` micro-batches with
``reduction="mean"``) and ``m`` the bound:

* an optimizer stepped on the host multiplies the gradients by ``coef / k``, with
  ``coef = min(1, m / (n + 1e-6))``: torch's ``clip_grads_with_norm_``, bit for bit
  (:func:`clipopt.functional.clip_coef`);
* a fused optimizer (Adam, AdamW, SGD, Adagrad) divides them inside its kernel by
  :func:`fused_grad_scale`, ``max(1, (n + 1e-6) / m) * k``: no pass of its own over the gradients.
  ``1 / coef`` and ``(n + 1e-6) / m`` round differently (a division against a reciprocal), and so do
  a multiplication before the kernel and the kernel's division by up to a few units in the last
  place per element, which is why every path of a fused optimizer takes this one.

The numbers these kernels take are cached 0-d tensors (:class:`Constants`): a Python number costs a
kernel a tensor of its own (about a microsecond on CPU), and on CUDA a division by a host scalar is
computed as a multiplication by its reciprocal, which would round differently again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import functional as F

__all__ = ["Constants", "constants", "fused_grad_scale"]


class Constants(NamedTuple):
    """The numbers a window's coefficient kernels take, as 0-d tensors of the norm's dtype and device,
    made once per dtype, device, bound and divisor, and never written."""

    zero: Tensor  #: 0.0, float32 (the non-finite flag of a finite norm; what ``ne_`` compares with)
    one: Tensor  #: 1.0
    eps: Tensor  #: 1e-6, the ``+ 1e-6`` of torch's ``clip_grads_with_norm_``
    max_norm: Tensor  #: the norm bound (1.0 when off or given as a tensor)
    divisor: Tensor  #: the micro-batches the summed gradients are divided by (``"mean"``), else 1.0
    inv: Tensor  #: ``1 / divisor``

    @classmethod
    def make(cls, dtype: torch.dtype, device: torch.device, max_norm: float, divisor: float) -> Constants:
        def full(value: float, kind: torch.dtype = dtype) -> Tensor:
            return torch.full((), value, dtype=kind, device=device)

        return cls(
            full(0.0, torch.float32),
            full(1.0),
            full(F.EPS),
            full(max_norm),
            full(divisor),
            full(1.0 / divisor),
        )


#: The constants by (dtype, device, max_norm, divisor); cleared when it grows past a few entries.
_CONSTANTS: dict[tuple[torch.dtype, torch.device, float, float], Constants] = {}


def constants(like: Tensor, max_norm: float | None, divisor: float) -> Constants:
    """The :class:`Constants` of a bound ``max_norm`` (None: off) and ``divisor`` for the norm ``like``."""
    key = (like.dtype, like.device, 1.0 if max_norm is None else max_norm, divisor)
    c = _CONSTANTS.get(key)
    if c is None:
        if len(_CONSTANTS) >= 16:
            _CONSTANTS.clear()
        c = _CONSTANTS[key] = Constants.make(*key)
    return c


def fused_grad_scale(
    norm: Tensor, max_norm: float | Tensor | None, divisor: float, c: Constants | None = None
) -> Tensor | None:
    """What a fused kernel divides the gradients by for the bound ``max_norm`` on the norm ``norm``
    (already divided by the ``divisor`` micro-batches): ``max(1, (norm + 1e-6) / max_norm) * divisor``,
    float32; ``divisor`` alone without a bound, None when that is 1 (nothing to scale).

    ``max_norm`` is a float (the wrapper's bound) or a 0-d tensor (a policy's threshold, on the
    device).  A division by 1 or a multiplication by 1 is exact, so none is dispatched.  ``c``: the
    window's :class:`Constants` when the caller already has them.
    """
    if c is None:
        c = constants(norm, max_norm if isinstance(max_norm, float) else None, divisor)
    if max_norm is None:
        if divisor == 1.0:
            return None
        return c.divisor if c.divisor.dtype == torch.float32 else c.divisor.float()
    scale = norm + c.eps
    if isinstance(max_norm, Tensor):
        scale.div_(max_norm)
    elif max_norm != 1.0:
        scale.div_(c.max_norm)
    scale.clamp_min_(c.one)
    if divisor != 1.0:
        scale.mul_(c.divisor)
    return scale if scale.dtype == torch.float32 else scale.float()
