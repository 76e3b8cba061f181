"""Per-parameter ("per-layer") gradient statistics and parameter names."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["LAYER_FIELDS", "LayerStats", "compute_layer_stats", "resolve_param_names"]

#: The statistics kept per parameter, in column order.
LAYER_FIELDS = ("grad_norm", "grad_max", "grad_min", "nonfinite", "param_norm")


class LayerStats:
    """Per-parameter statistics of one window's combined, pre-clip gradient.

    For each parameter: ``grad_norm`` (L2, float32), ``grad_max`` (max |g|),
    ``grad_min`` (min |g|), ``nonfinite`` (number of nan/inf elements) and
    ``param_norm`` (L2 of the parameter).  Gradient fields are ``nan`` for a
    parameter without a gradient.  The values stay one ``[P, 5]`` tensor on
    the device until first read; reading them is one host read.
    """

    __slots__ = ("_rows", "_values", "names")

    def __init__(self, names: Sequence[str], values: Tensor | list[list[float]]) -> None:
        self.names = tuple(names)
        self._values: Tensor | None = values if isinstance(values, Tensor) else None
        self._rows: list[list[float]] | None = None if isinstance(values, Tensor) else values

    def rows(self) -> list[list[float]]:
        """One list of :data:`LAYER_FIELDS` values per parameter, in :attr:`names` order."""
        if self._rows is None:
            values = self._values
            self._rows = [] if values is None else values.tolist()
            self._values = None
        return self._rows

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{name: {field: value}}`` as Python floats."""
        pairs = zip(self.names, self.rows(), strict=True)
        return {name: dict(zip(LAYER_FIELDS, row, strict=True)) for name, row in pairs}

    def __getitem__(self, name: str) -> dict[str, float]:
        return dict(zip(LAYER_FIELDS, self.rows()[self.names.index(name)], strict=True))

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"LayerStats({len(self.names)} parameters)"


@torch.no_grad()
def compute_layer_stats(
    params: Sequence[Tensor], names: Sequence[str], scale: float, count_nonfinite: bool
) -> LayerStats:
    """Statistics of ``scale * p.grad`` (the combined gradient) and of ``p`` for every parameter.

    ``count_nonfinite=False`` records 0 non-finite elements without counting
    them: callers pass True only when the window's norm was not finite (a finite
    norm means every element is finite).  One temporary the size of the largest
    gradient is allocated at a time (for ``|g|``).
    """
    if not params:
        return LayerStats([], [])
    device = params[0].device
    grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
    grad_norms = iter(torch._foreach_norm(grads, 2.0, dtype=torch.float32) if grads else [])
    param_norms = torch._foreach_norm(list(params), 2.0, dtype=torch.float32)
    nan = torch.full((), math.nan, device=device)
    zero = torch.zeros((), device=device)
    rows: list[Tensor] = []
    for p, param_norm in zip(params, param_norms, strict=True):
        g = p.grad
        if g is None:
            rows.append(torch.stack([nan, nan, nan, zero, param_norm.to(device)]))
            continue
        values = (g.coalesce().values() if g.is_sparse else g).reshape(-1)
        lo, hi = torch.aminmax(values.abs()) if values.numel() else (zero, zero)
        bad = values.numel() - torch.isfinite(values).sum() if count_nonfinite else zero
        row = [next(grad_norms), hi, lo, bad, param_norm]
        rows.append(torch.stack([t.to(device=device, dtype=torch.float32) for t in row]))
    out = torch.stack(rows)
    if scale != 1.0:
        out[:, :3] *= scale
    return LayerStats(names, out)


def resolve_param_names(optimizer: torch.optim.Optimizer, param_names: Any) -> dict[Tensor, str]:
    """Names for the optimizer's parameters.

    From ``param_names`` (``model.named_parameters()``, a ``{name: param}``
    mapping, or names in the optimizer's parameter order), else from the inner
    optimizer's own ``param_names`` (set when it was built from
    ``named_parameters()``), else ``group<g>.<i>``.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names: dict[Tensor, str] = {}
    for gi, group in enumerate(optimizer.param_groups):
        own = group.get("param_names")
        for i, p in enumerate(group["params"]):
            names[p] = own[i] if own is not None and i < len(own) else f"group{gi}.{i}"
    if param_names is None:
        return names
    if isinstance(param_names, Mapping):
        pairs: Iterable[Any] = param_names.items()
    elif isinstance(param_names, (str, bytes)):
        raise TypeError(_NAMES_HELP.format(got=repr(param_names)))
    else:
        pairs = list(param_names)
    items = list(pairs)
    if items and all(isinstance(x, str) for x in items):
        if len(items) != len(params):
            raise ValueError(
                f"param_names lists {len(items)} names but the optimizer has {len(params)} parameters; "
                "pass param_names=model.named_parameters() instead"
            )
        return dict(zip(params, items, strict=True))
    known = {id(p) for p in params}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(_NAMES_HELP.format(got=f"an item {item!r:.60}"))
        name, p = item
        if id(p) in known:
            names[p] = name
    return names


_NAMES_HELP = (
    "param_names must be model.named_parameters(), a {{name: parameter}} dict, "
    "or a list of names in the optimizer's parameter order, got {got}; "
    "pass param_names=model.named_parameters()"
)
