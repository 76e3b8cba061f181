"""Shared test scaffolding: the tiny model, seeded batches, and a short training run.

Every test module builds its model and data here, so that a change of scaffolding is made
once. Each function reproduces bit for bit what the modules wrote before (same shapes,
same random draws in the same order), so the values the tests check are unchanged.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from .hostreads import count_host_reads

Batch = Any  # a tensor of inputs, or an (inputs, targets) pair
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def mlp(
    sizes: tuple[int, int, int] = (4, 6, 2),
    seed: int | None = 0,
    *,
    act: type[nn.Module] = nn.Tanh,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    bias: bool = True,
    randn_init: bool = False,
) -> nn.Sequential:
    """``Linear(a, b), act(), Linear(b, c)`` for ``sizes == (a, b, c)``, moved to ``device``
    and ``dtype`` where given (made on the CPU, so the values do not depend on the device).

    By default the global RNG is seeded with ``seed`` first (``seed=None``: not seeded), so
    the layers get torch's default initialisation. With ``randn_init`` every parameter is
    overwritten with standard-normal draws from a generator seeded with ``seed``, and the
    global RNG is not seeded.
    """
    a, b, c = sizes
    if seed is not None and not randn_init:
        torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(a, b, bias=bias), act(), nn.Linear(b, c, bias=bias))
    if randn_init:
        g = torch.Generator().manual_seed(0 if seed is None else seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
    return model if dtype is None and device is None else model.to(device=device, dtype=dtype)


def inputs(
    n: int,
    shape: tuple[int, ...],
    *,
    seed: int,
    scale: float | Mapping[int, float] = 1.0,
    bad: Iterable[int] = (),
    bad_value: float = math.nan,
) -> list[torch.Tensor]:
    """``n`` input tensors drawn from one seeded generator, each times ``scale`` (a number,
    or per index with 1.0 elsewhere); in those listed in ``bad`` element ``[0, 0]`` is ``bad_value``."""
    gen = torch.Generator().manual_seed(seed)
    bad = set(bad)
    out = []
    for i in range(n):
        factor = scale.get(i, 1.0) if isinstance(scale, Mapping) else scale
        x = torch.randn(*shape, generator=gen) * factor
        if i in bad:
            x[0, 0] = bad_value
        out.append(x)
    return out


def pairs(
    n: int,
    x_shape: tuple[int, ...],
    y_shape: tuple[int, ...],
    *,
    seed: int,
    scale: float = 1.0,
    bad: Iterable[int] = (),
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (inputs, targets) pairs drawn in turn from one seeded generator, inputs times
    ``scale``; in the pairs listed in ``bad`` the input's element ``[0, 0]`` is NaN."""
    gen = torch.Generator().manual_seed(seed)
    bad = set(bad)
    out = []
    for i in range(n):
        x = torch.randn(*x_shape, generator=gen) * scale
        y = torch.randn(*y_shape, generator=gen)
        if i in bad:
            x[0, 0] = math.nan
        out.append((x, y))
    return out


def model_for(kind: str = "dense") -> nn.Module:
    """The tiny model an optimizer of that kind trains (``OptimInfo.model``), global seed 0:
    "dense" ``mlp((5, 4, 3))``, "matrix" the same without biases (2-D parameters only),
    "sparse" ``Embedding(10, 4, sparse=True)``. :func:`batches_for` makes its data."""
    if kind == "dense":
        return mlp((5, 4, 3))
    if kind == "matrix":
        return mlp((5, 4, 3), bias=False)
    if kind == "sparse":
        torch.manual_seed(0)
        return nn.Embedding(10, 4, sparse=True)
    raise AssertionError(f"unknown model kind {kind!r}")


def batches_for(n: int, seed: int, kind: str = "dense") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (inputs, targets) pairs for :func:`model_for` ``(kind)`` from one seeded generator:
    8 x 5 inputs and 8 x 3 targets (:func:`pairs`), or for "sparse" 6 token ids in [0, 10) and
    6 x 4 targets."""
    if kind != "sparse":
        return pairs(n, (8, 5), (8, 3), seed=seed)
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 10, (6,), generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def square_mean(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The loss ``model(x).pow(2).mean()``."""
    return model(x).pow(2).mean()


def square_sum(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The loss ``model(x).pow(2).sum()``."""
    return model(x).pow(2).sum()


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss ``((model(x) - y) ** 2).mean()`` of an (inputs, targets) pair."""
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterable[Batch],
    loss: LossFn = square_mean,
    scaler: Any = None,
) -> None:
    """The user loop, per micro-batch: ``loss.backward(); opt.step(); opt.zero_grad()``
    (the loss scaled by ``scaler`` when one is given)."""
    for batch in batches:
        value = loss(model, batch)
        (value if scaler is None else scaler.scale(value)).backward()
        opt.step()
        opt.zero_grad()


def reads_per_step(
    model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[Batch], loss: LossFn = square_mean
) -> list[int]:
    """:func:`train`, counting the host reads clipopt makes inside each ``opt.step()``
    (tests/hostreads.py: the inner optimizer's own reads are not counted)."""
    counts = []
    for batch in batches:
        loss(model, batch).backward()
        with count_host_reads() as reads:
            opt.step()
        counts.append(len(reads))
        opt.zero_grad()
    return counts


class TwoHeads(nn.Module):
    """A trunk and two heads; each task's loss reaches only its own head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 4)
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)

    def loss(self, task: str, x: torch.Tensor) -> torch.Tensor:
        head = self.a if task == "a" else self.b
        return head(torch.tanh(self.trunk(x))).pow(2).sum()


def task_run(model: TwoHeads, opt: torch.optim.Optimizer, plan: list[tuple[str, bool]]) -> None:
    """Train on the plan; batch i is the same tensor whatever came before (a bad batch is a NaN one)."""
    for i, (task, bad) in enumerate(plan):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(100 + i))
        if bad:
            x[0, 0] = float("nan")
        model.loss(task, x).backward()
        opt.step()
        opt.zero_grad()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside, the count restored after: for the long runs of a tiny
    model, whose tensors are far too small to be split, where a second thread only adds hand-offs
    (the 300-update runs of tests/policy_runs.py took 5 times as long with two on a busy 2-core
    machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The modules the fork server of :func:`start_ranks` imports once per test run: torch alone takes
#: seconds to import (more on a busy machine), and every spawned rank imported it again.
RANK_PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "clipopt",
    "tests.distributed_jobs",
)


def start_ranks(job: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> Any:
    """``torch.multiprocessing.spawn(job, args=args, nprocs=nprocs, join=False)``, the processes
    forked from one fork server per test run that has imported :data:`RANK_PRELOAD` (each rank
    still a fresh process: no state of the test process, no process group, no threads), where
    the platform has one; spawned otherwise.  Wait for them with :func:`join_spawned`."""
    import multiprocessing

    import torch.multiprocessing as mp

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(list(RANK_PRELOAD))  # read when the server starts
    return mp.start_processes(job, args=args, nprocs=nprocs, join=False, start_method=method)


def spawn_job(
    job: Callable[..., None],
    name: str,
    out: Path,
    world: int,
    *,
    pass_world: bool = False,
    weights_only: bool = True,
    timeout_s: float = 240,
) -> list[dict[str, Any]]:
    """Run ``job(rank, port, out[, world])`` in ``world`` processes and load what each rank saved
    (``out/<name><rank>.pt``); fail, killing them, if they have not finished after ``timeout_s``."""
    args = (free_port(), str(out), world) if pass_world else (free_port(), str(out))
    join_spawned(start_ranks(job, args, world), name, timeout_s)
    return [torch.load(out / f"{name}{rank}.pt", weights_only=weights_only) for rank in range(world)]


def join_spawned(ctx: Any, name: str, timeout_s: float = 240) -> None:
    """Wait for the processes of :func:`start_ranks`; fail, killing them, if they have not finished
    after ``timeout_s`` (a rank waiting for another never hangs CI)."""
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            pytest.fail(f"the {name} job did not finish within {timeout_s:g} s (ranks wait for each other)")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``clipopt *argv`` in this process (``clipopt._cli.main``): its exit code, and what it
    printed to stdout and stderr (read, and so cleared, from ``capsys``)."""
    from clipopt._cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_tensors_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Equally many tensors, each close to its reference (rtol 1e-5, atol 1e-6: float32 across ranks)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


class ZeroDivideSGD(torch.optim.Optimizer):
    """SGD with momentum whose ``step()`` divides the update by zero at the calls in ``bad_calls``
    (1-based): a non-finite update from finite gradients.  Its state (a momentum buffer and a step
    count, both tensors written in place) lives on the parameters' device, as a foreach optimizer's."""

    def __init__(self, params: Iterable[Any], lr: float = 0.01, bad_calls: Iterable[int] = ()) -> None:
        super().__init__(params, {"lr": lr})
        self.bad_calls = set(bad_calls)
        self.calls = 0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self.calls += 1
        divisor = 0.0 if self.calls in self.bad_calls else 1.0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                    state["step"] = torch.zeros((), device=p.device)
                state["momentum"].mul_(0.9).add_(p.grad)
                state["step"].add_(1.0)
                p.sub_(group["lr"] * state["momentum"] / divisor)
        return None
