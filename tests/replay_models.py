"""Models that go non-finite in known places, and real training runs that snapshot them.

Used by ``test_replay`` and ``test_cli_replay`` (whose ``--model`` and ``--loss``
name the factories and loss functions here, e.g. ``tests.replay_models:log_model``).
Every model is a ``Sequential`` whose first layer has positive weights and bias, so
that the good batches (inputs in ``[0, 1)``) keep every hidden value positive;
each bad batch is one row that breaks one known operation:

- :class:`LogFeatures` (``log_model``): ``log`` of the hidden values; a row with
  feature 0 = -3 makes :data:`LOG_BAD_UNITS` of them negative, so the forward is NaN there.
- :class:`RadialFeature` (``radial_model``): appends ``sqrt(sum(h**2))``, the
  length of each hidden row; a zero row (no bias) has length 0: the forward is
  finite (0) but ``d sqrt/dx`` at 0 is infinite in the backward.
- :class:`HalfLinear` (``half_model``): a matmul computed in float16 (weights 10);
  a row of :data:`HALF_BAD_VALUE` gives hidden values up to 4500 (finite in
  float16) whose weighted sums pass float16's largest value 65504: infinite in the forward.
- :class:`MaskedLog` (``masked_model``): the log of ``log_model`` next to a
  ``-inf`` mask that is harmless (made on purpose, finite after the softmax);
  :class:`BufferMaskedLog` (``buffer_masked_model``) the same with the mask in a buffer.
- :class:`Branches` (``branch_model``): ``a(x[:, :3]) + b(x[:, 3:])``; a batch
  whose last 3 features are 50 times larger is a gradient spike in ``b``.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import clipopt
from clipopt import ClippedOptimizer

IN, HIDDEN, BATCH = 3, 4, 8
#: lin's weights: units 0 and 1 go negative for feature 0 = LOG_BAD_VALUE (with bias 0.5), 2 and 3 do not.
LIN_WEIGHT = [[1.0, 0.2, 0.3], [0.8, 0.5, 0.1], [0.1, 0.4, 0.6], [0.05, 0.3, 0.2]]
LOG_BAD_VALUE = -3.0
LOG_BAD_UNITS = 2
BAD_ROW = 5
HALF_BAD_VALUE = 3000.0


class LogFeatures(nn.Module):
    """``log(h)``: NaN where ``h`` is negative."""

    def forward(self, h: Tensor) -> Tensor:
        return torch.log(h)


class InPlaceLogFeatures(nn.Module):
    """:class:`LogFeatures` computed in place (``log_`` of a copy of ``h``)."""

    def forward(self, h: Tensor) -> Tensor:
        return h.clone().log_()


class RadialFeature(nn.Module):
    """``[h, |h|]`` with ``|h| = sqrt(sum(h**2))`` per row: infinite gradient at ``h = 0``."""

    def forward(self, h: Tensor) -> Tensor:
        return torch.cat([h, torch.sqrt((h * h).sum(-1, keepdim=True))], dim=-1)


class HalfLinear(nn.Module):
    """A linear layer (float32 weights) whose matmul is computed in float16."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((n_out, n_in), 10.0))

    def forward(self, h: Tensor) -> Tensor:
        return (h.half() @ self.weight.half().t()).float()


class MaskedLog(nn.Module):
    """``softmax(h masked with -inf in its last unit) * log(h)``: the ``-inf`` is made on purpose (and
    the softmax is finite); the NaN comes from ``log`` where ``h`` is negative."""

    def forward(self, h: Tensor) -> Tensor:
        mask = torch.zeros(h.shape[-1], dtype=torch.bool)
        mask[-1] = True
        weights = h.masked_fill(mask, float("-inf")).softmax(-1)  # before the log: made first
        return weights * torch.log(h)


class InPlaceMaskedLog(nn.Module):
    """:class:`MaskedLog` with the mask applied in place (``masked_fill_``, as attention code does)."""

    def forward(self, h: Tensor) -> Tensor:
        mask = torch.zeros(h.shape[-1], dtype=torch.bool)
        mask[-1] = True
        weights = h.clone().masked_fill_(mask, float("-inf")).softmax(-1)  # before the log: made first
        return weights * torch.log(h)


class BufferMaskedLog(nn.Module):
    """:class:`MaskedLog` with the ``-inf`` mask in a registered buffer (added to ``h``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([0.0, 0.0, 0.0, -math.inf]))

    def forward(self, h: Tensor) -> Tensor:
        weights = (h + self.mask).softmax(-1)  # before the log: made first
        return weights * torch.log(h)


class Branches(nn.Module):
    """``a(x[:, :3]) + b(x[:, 3:])``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 1)
        self.b = nn.Linear(3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x[:, :3]) + self.b(x[:, 3:])


def _first_layer(bias: bool = True) -> nn.Linear:
    lin = nn.Linear(IN, HIDDEN, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(LIN_WEIGHT))
        if bias:
            lin.bias.fill_(0.5)
    return lin


def log_model() -> nn.Module:
    """``lin -> act (LogFeatures) -> out``."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(lin=_first_layer(), act=LogFeatures(), out=nn.Linear(HIDDEN, 1)))


def inplace_log_model() -> nn.Module:
    """``lin -> act (InPlaceLogFeatures) -> out``: ``log_model``'s parameters, its log in place."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(lin=_first_layer(), act=InPlaceLogFeatures(), out=nn.Linear(HIDDEN, 1)))


def dropout_log_model() -> nn.Module:
    """``lin -> drop (Dropout 0.1) -> act (LogFeatures) -> out``: ``log_model``'s parameters, with a
    dropout (its mask fills an uninitialized tensor in place) before the log."""
    torch.manual_seed(0)
    drop = nn.Dropout(0.1)
    layers = OrderedDict(lin=_first_layer(), drop=drop, act=LogFeatures(), out=nn.Linear(HIDDEN, 1))
    return nn.Sequential(layers)


#: The token whose embedding row of ``sparse_embedding_model`` has LOG_BAD_UNITS negative entries.
BAD_TOKEN = 5


def sparse_embedding_model() -> nn.Module:
    """``emb (Embedding, sparse gradient) -> act (LogFeatures) -> out``: positive embedding rows except
    :data:`BAD_TOKEN`'s, whose first :data:`LOG_BAD_UNITS` entries are negative."""
    torch.manual_seed(0)
    emb = nn.Embedding(BAD_TOKEN + 1, HIDDEN, sparse=True)
    with torch.no_grad():
        emb.weight.abs_().add_(0.1)
        emb.weight[BAD_TOKEN, :LOG_BAD_UNITS] *= -1
    return nn.Sequential(OrderedDict(emb=emb, act=LogFeatures(), out=nn.Linear(HIDDEN, 1)))


def masked_model() -> nn.Module:
    """``lin -> mix (MaskedLog) -> out``."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(lin=_first_layer(), mix=MaskedLog(), out=nn.Linear(HIDDEN, 1)))


def inplace_masked_model() -> nn.Module:
    """``lin -> mix (InPlaceMaskedLog) -> out``."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(lin=_first_layer(), mix=InPlaceMaskedLog(), out=nn.Linear(HIDDEN, 1)))


def buffer_masked_model() -> nn.Module:
    """``lin -> mix (BufferMaskedLog) -> out``."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(lin=_first_layer(), mix=BufferMaskedLog(), out=nn.Linear(HIDDEN, 1)))


def radial_model() -> nn.Module:
    """``lin (no bias) -> radial (RadialFeature) -> out``."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(lin=_first_layer(bias=False), radial=RadialFeature(), out=nn.Linear(HIDDEN + 1, 1))
    )


def half_model() -> nn.Module:
    """``lin -> f16 (HalfLinear, float16 matmul) -> out``."""
    torch.manual_seed(0)
    layers = OrderedDict(lin=_first_layer(), f16=HalfLinear(HIDDEN, HIDDEN), out=nn.Linear(HIDDEN, 1))
    return nn.Sequential(layers)


def autocast_model() -> nn.Module:
    """``lin -> wide (Linear, weights 10, no bias) -> out``, trained under CPU autocast to float16
    (:func:`mse_fp16`): ``wide``'s matmul of a :data:`HALF_BAD_VALUE` row overflows float16."""
    torch.manual_seed(0)
    wide = nn.Linear(HIDDEN, HIDDEN, bias=False)
    with torch.no_grad():
        wide.weight.fill_(10.0)
    return nn.Sequential(OrderedDict(lin=_first_layer(), wide=wide, out=nn.Linear(HIDDEN, 1)))


def branch_model() -> nn.Module:
    """:class:`Branches`, in a Sequential as ``net``."""
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(net=Branches()))


def mse(model: nn.Module, attached: dict[str, Any]) -> Tensor:
    """The loss of a snapshot's attached batch: mean squared error."""
    return nn.functional.mse_loss(model(attached["inputs"]), attached["targets"])


def mse_window(model: nn.Module, attached: dict[str, Any]) -> Tensor:
    """:func:`mse` of a window of micro-batches (``attach`` lists them), averaged like
    ``reduction="mean"``; a single batch as :func:`mse`."""
    xs, ys = attached["inputs"], attached["targets"]
    if isinstance(xs, Tensor):
        return mse(model, attached)
    losses = [nn.functional.mse_loss(model(x), y) for x, y in zip(xs, ys, strict=True)]
    return torch.stack(losses).mean()


def mse_fp16(model: nn.Module, attached: dict[str, Any]) -> Tensor:
    """:func:`mse` under CPU autocast to float16 (the GradScaler runs)."""
    with torch.autocast("cpu", dtype=torch.float16):
        return nn.functional.mse_loss(model(attached["inputs"]), attached["targets"])


def batch(index: int, features: int = IN, targets: float = 1.0) -> tuple[Tensor, Tensor]:
    """A good batch: inputs in [0, 1), targets normal times ``targets``."""
    g = torch.Generator().manual_seed(1000 + index)
    return torch.rand(BATCH, features, generator=g), torch.randn(BATCH, 1, generator=g) * targets


def train(
    model: nn.Module,
    batches: list[tuple[Tensor, Tensor]],
    snapshot_dir: str | os.PathLike[str],
    loss_fn: Any = mse,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: str = "sgd",
    **kwargs: Any,
) -> ClippedOptimizer:
    """Train ``model`` on ``batches`` through ClippedOptimizer with ``snapshot_dir``, one batch an update."""
    params = model.parameters()
    inner = torch.optim.Adam(params, lr=1e-3) if optimizer == "adam" else torch.optim.SGD(params, lr=0.01)
    opt = ClippedOptimizer(
        inner,
        max_norm=kwargs.pop("max_norm", 1.0),
        param_names=model.named_parameters(),
        snapshot_dir=snapshot_dir,
        scaler=scaler,
        **kwargs,
    )
    for x, y in batches:
        opt.attach(inputs=x, targets=y)
        loss = loss_fn(model, {"inputs": x, "targets": y})
        (loss if scaler is None else scaler.scale(loss)).backward()
        opt.step()
        opt.zero_grad()
    return opt


def snapshots(folder: str | os.PathLike[str]) -> list[str]:
    """The snapshot files in ``folder``, by name."""
    return sorted(str(p) for p in Path(folder).glob("anomaly-step*.pt"))


def loaded(path: str) -> dict[str, Any]:
    """``clipopt.load_snapshot(path)``."""
    return clipopt.load_snapshot(path)
