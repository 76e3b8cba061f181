"""Pure tensor functions behind :class:`~clipopt.SpikeGuard`: a ring-buffer history and z-scores.

The history of one or more signals is a ``(signals, window)`` tensor plus a
``(signals,)`` count of the values ever accepted; slot ``count % window`` is
the next one written.  Every function returns new tensors and never reads a
value back to the host, so a decision built from them stays on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["history_mean_std", "push_history", "spike_scores"]


def history_mean_std(buffer: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and sample standard deviation (Bessel's correction) of each row's valid entries.

    Row ``i`` holds ``min(count[i], window)`` valid entries (which slots does not
    matter: the order of a ring buffer is irrelevant to mean and std).  A row
    with fewer than two entries gets std 0 (mean 0 when empty).
    """
    window = buffer.shape[-1]
    n = count.clamp(max=window)
    valid = torch.arange(window, device=buffer.device) < n.unsqueeze(-1)
    nf = n.to(buffer.dtype)
    values = torch.where(valid, buffer, torch.zeros((), dtype=buffer.dtype, device=buffer.device))
    mean = values.sum(-1) / nf.clamp_min(1)
    dev = torch.where(
        valid, buffer - mean.unsqueeze(-1), torch.zeros((), dtype=buffer.dtype, device=buffer.device)
    )
    var = (dev * dev).sum(-1) / (nf - 1).clamp_min(1)
    return mean, var.sqrt()


def spike_scores(
    values: Tensor, buffer: Tensor, count: Tensor, warmup: int, eps: float
) -> tuple[Tensor, Tensor]:
    """``(z, scored)`` of each signal's current value against its history.

    ``z = (value - mean) / (std + eps)`` (one-sided: only values above the mean
    score high).  ``scored`` is True where the signal has at least ``warmup``
    values of history and the current value is finite; elsewhere ``z`` is 0.
    """
    mean, std = history_mean_std(buffer, count)
    finite = torch.isfinite(values)
    scored = finite & (count >= warmup)
    safe = torch.where(finite, values, mean)
    z = torch.where(scored, (safe - mean) / (std + eps), torch.zeros_like(mean))
    return z, scored


def push_history(buffer: Tensor, count: Tensor, values: Tensor, accept: Tensor) -> tuple[Tensor, Tensor]:
    """The history after appending ``values`` where ``accept`` (and the value is finite).

    ``accept`` is a 0-d or per-signal bool tensor.  Rows that do not accept keep
    their buffer and count; nothing is written in place.
    """
    window = buffer.shape[-1]
    take = accept & torch.isfinite(values)
    slot = (count % window).unsqueeze(-1)
    current = buffer.gather(-1, slot).squeeze(-1)
    new = torch.where(take, values.to(buffer.dtype), current)
    return buffer.scatter(-1, slot, new.unsqueeze(-1)), count + take.to(count.dtype)
