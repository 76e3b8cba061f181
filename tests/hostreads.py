"""Count host reads of tensor values (what would be a host-device sync on an accelerator).

CPU has no ``torch.cuda.set_sync_debug_mode``; a ``TorchDispatchMode`` sees every
aten op instead.  A value reaches Python only through a few ops
(``_local_scalar_dense`` for ``.item()``/``float()``/``bool()``/``if t:``,
``is_nonzero``, ``equal``, data-dependent shapes such as ``nonzero`` and
``masked_select``) or through ``tolist``/``numpy``/``__array__``, which are
patched here.

Reads made by the inner optimizer's own implementation (``torch/optim/*.py``,
e.g. single-tensor Adam reading its CPU ``step`` tensor, which is no device
sync on CUDA) are recorded separately as ``inner``: clipopt's promise is about
the reads *it* adds.  So are reads through ``clipopt._tensors.cpu_values`` (and ``cpu_value``), as
``cpu``: it reads CPU tensors only, on a path that an accelerator does not take
(the update's put-back on the CPU, ``_window/update_apply.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READ_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.index.Tensor,  # boolean-mask indexing (checked below)
}

_TORCH_DIR = os.path.dirname(torch.__file__)
_CPU_READER = os.path.join("clipopt", "_tensors.py")
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim")


@dataclass
class HostReads:
    """Host reads seen inside :func:`count_host_reads`."""

    ours: list[str] = field(default_factory=list)
    """Reads not made by torch.optim internals: 'file:line op' of the reading frame."""
    inner: list[str] = field(default_factory=list)
    """Reads made inside torch/optim/<algorithm>.py (the inner optimizer's own)."""
    cpu: list[str] = field(default_factory=list)
    """Reads made through ``clipopt._tensors.cpu_values`` or ``cpu_value`` (CPU tensors only: no sync
    anywhere)."""

    def __len__(self) -> int:
        return len(self.ours)


def _caller() -> tuple[str, str]:
    """Where the read came from, and whose it is: ``"inner"``, ``"cpu"`` or ``"ours"``.

    Walks outwards from the read: the first frame inside ``torch/optim/<algorithm>.py``
    marks the inner optimizer's read, a frame of ``clipopt._tensors.cpu_values`` a CPU
    read; the first frame outside torch is the reader.
    """
    frame = sys._getframe(2)
    while frame is not None:
        fname = frame.f_code.co_filename
        if fname.startswith(_TORCH_DIR):
            if fname.startswith(_OPTIM_DIR) and not fname.endswith(("optimizer.py", "lr_scheduler.py")):
                return f"{os.path.relpath(fname, _TORCH_DIR)}:{frame.f_lineno}", "inner"
        elif fname.endswith(_CPU_READER) and frame.f_code.co_name in ("cpu_values", "cpu_value"):
            back = frame.f_back
            where = "?" if back is None else f"{os.path.basename(back.f_code.co_filename)}:{back.f_lineno}"
            return where, "cpu"
        elif fname != __file__:
            return f"{os.path.basename(fname)}:{frame.f_lineno}", "ours"
        frame = frame.f_back  # type: ignore[assignment]
    return "?", "ours"


class _Recorder(TorchDispatchMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        is_read = func in _READ_OPS
        if func is torch.ops.aten.index.Tensor:
            indices = args[1] if len(args) > 1 else []
            is_read = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        if is_read:
            where, whose = _caller()
            getattr(self.reads, whose).append(f"{where} {func}")
        return func(*args, **kwargs)


@contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Record every host read of a tensor value made inside the block."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "__array__")}

    def patched(name: str) -> Any:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            where, whose = _caller()
            getattr(reads, whose).append(f"{where} Tensor.{name}")
            return original(self, *args, **kwargs)

        return read

    for name in originals:
        setattr(torch.Tensor, name, patched(name))
    try:
        with _Recorder(reads):
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
