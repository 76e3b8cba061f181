"""Training runs with injected gradient spikes, for the per-tensor policies' tests (AdaGC, StableSPAM).

The same model, data and spikes drive clipopt's wrapper and the reference optimizers of
``pytorch_optimizer``, so that their parameters can be compared update by update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .helpers import mlp, mse, one_thread, pairs

#: update -> factor on that update's loss (every gradient x1e3)
SPIKES = {40: 1e3, 41: 1e3, 150: 1e3, 220: 1e3}
#: the update whose first weight gets one huge gradient element (+1e6)
HUGE = 120
UPDATES = 300

MakeOpt = Callable[[nn.Module], torch.optim.Optimizer]


def spiked_model() -> nn.Sequential:
    """``Linear(6, 16), Tanh, Linear(16, 3)``, torch's default initialisation, global seed 0."""
    return mlp((6, 16, 3))


@functools.cache
def _data(accumulation: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of :data:`UPDATES` updates (made once; never written into)."""
    return pairs(UPDATES * accumulation, (8, 6), (8, 3), seed=seed)


def layers(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The first and the last ``Linear`` of :func:`spiked_model` (two parameter groups)."""
    assert isinstance(model, nn.Sequential)
    return model[0], model[2]


def spiked_backward(model: nn.Module, update: int, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One micro-batch's backward: the MSE loss, x1e3 on a spike update, then on update
    :data:`HUGE` +1e6 on the first weight's element [0, 0]."""
    (mse(model, batch) * SPIKES.get(update, 1.0)).backward()
    if update == HUGE:
        first = next(model.parameters())
        with torch.no_grad():
            first.grad[0, 0] += 1e6  # type: ignore[index]


def train_spiked(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    updates: Iterable[int],
    *,
    accumulation: int = 1,
    mean_grads: bool = False,
    seed: int = 1,
) -> None:
    """``accumulation`` micro-batches per update (``opt.step()`` after each, for a wrapper; with
    ``mean_grads`` one ``opt.step()`` per update on the mean gradient, for a reference optimizer)."""
    data = _data(accumulation, seed)
    with one_thread():
        for update in updates:
            for k in range(accumulation):
                spiked_backward(model, update, data[update * accumulation + k])
                if not mean_grads:
                    opt.step()
            if mean_grads:
                if accumulation != 1:
                    for p in model.parameters():
                        p.grad.mul_(1.0 / accumulation)  # type: ignore[union-attr]
                opt.step()
            opt.zero_grad()


def trajectory(make: MakeOpt, *, accumulation: int = 1, mean_grads: bool = False) -> list[torch.Tensor]:
    """The parameters after each of :data:`UPDATES` spiked updates, flattened into one vector each."""
    model = spiked_model()
    opt = make(model)
    out = []
    with one_thread():
        for update in range(UPDATES):
            train_spiked(model, opt, [update], accumulation=accumulation, mean_grads=mean_grads)
            out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return out


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest absolute difference between two trajectories, over every update."""
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def with_and_without(
    make: MakeOpt, bad: tuple[torch.Tensor, torch.Tensor], *, at: int = 10, n: int = 30
) -> tuple[tuple[nn.Module, torch.optim.Optimizer], tuple[nn.Module, torch.optim.Optimizer]]:
    """Two runs of ``n`` MSE micro-batches from one seeded generator (one ``step()`` each): the
    first with ``bad`` inserted before batch ``at``, the second without it."""
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(n)]
    runs = []
    for data in ([*batches[:at], bad, *batches[at:]], batches):
        model = spiked_model()
        opt = make(model)
        for x, y in data:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    return runs[0], runs[1]


def assert_same_run(
    a: tuple[nn.Module, torch.optim.Optimizer],
    b: tuple[nn.Module, torch.optim.Optimizer],
    keys: Iterable[str],
) -> None:
    """The two runs' parameters and their policies' statistics ``keys`` are identical."""
    sa, sb = a[1].max_norm.state_dict(), b[1].max_norm.state_dict()  # type: ignore[attr-defined]
    for key in keys:
        assert torch.equal(sa[key], sb[key]), key
    for p, q in zip(a[0].parameters(), b[0].parameters(), strict=True):
        assert torch.equal(p, q)
