"""Small tensor helpers shared by the norm kernels (:mod:`clipopt.functional`), the
per-layer statistics (:mod:`clipopt._diagnostics.layers`) and the update's put-back
(:mod:`clipopt._window.update_apply`)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["cpu_value", "cpu_values", "flat"]


def cpu_values(t: Tensor) -> list[float]:
    """The values of the CPU tensor ``t`` (a vector), read on the host.

    On the CPU this waits for nothing: it is the one kind of host read clipopt
    makes where an accelerator would need a synchronisation (the code that calls
    it takes a device path elsewhere); ``tests/hostreads.py`` counts it apart.
    """
    if t.device.type != "cpu":
        raise ValueError(f"cpu_values reads CPU tensors only, got one on {t.device}")
    return [float(v) for v in t.reshape(-1).tolist()]


def cpu_value(t: Tensor) -> float:
    """The value of the one-element CPU tensor ``t``, read on the host: :func:`cpu_values` for a
    scalar, at the cost of an ``item()`` (0.2 µs where the list takes 2): the norm's overflow check
    (:func:`clipopt.functional.overflowed`) reads it every window."""
    if not t.is_cpu:
        raise ValueError(f"cpu_value reads CPU tensors only, got one on {t.device}")
    return t.item()


def flat(t: Tensor) -> Tensor:
    """``t`` as a 1-d tensor without a copy where its memory is dense (contiguous, channels_last,
    transposed: the dimensions permuted into memory order), else a contiguous copy.

    Norms and statistics do not depend on the order of the elements; a strided
    view would make ``torch.dot`` accumulate sequentially (less accurate).
    """
    if t.is_contiguous():
        return t.view(-1)
    strides = t.stride()
    permuted = t.permute(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return permuted.view(-1) if permuted.is_contiguous() else t.contiguous().view(-1)
