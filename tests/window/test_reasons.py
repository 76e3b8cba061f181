"""The skip reasons' one table (clipopt/_reasons.py): every reason a real run produces is written by
every logger and read back as itself by the report's reader; the table covers every code."""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from clipopt import ClippedOptimizer, CSVLogger, Rewind, SpikeGuard
from clipopt._reasons import NAMES, NONFINITE_NAMES, REASONS, by_code, by_name, tag_of
from clipopt._report.read import read_log

from ..helpers import batches_for, model_for

PACKAGE = Path(__file__).resolve().parents[2] / "clipopt"

Batch = tuple[Tensor, Tensor]


def _loss(model: nn.Module, batch: Batch) -> Tensor:
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def _spiky(n: int, spikes: set[int]) -> list[Batch]:
    """``n`` batches, those at ``spikes`` with targets 1000 times larger (a loss and norm spike)."""
    return [(x, y * 1000) if i in spikes else (x, y) for i, (x, y) in enumerate(batches_for(n, seed=2))]


def _plain(grad_at: Callable[[int, nn.Module], None] | None = None) -> Callable:
    """5 windows of SGD on the tiny model, ``grad_at(i, model)`` changing gradients after backward."""

    def run(loggers: list[object]) -> tuple[ClippedOptimizer, list[str | None]]:
        model = model_for()
        opt = ClippedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), max_norm=1.0, loggers=loggers)
        reasons = []
        for i, batch in enumerate(batches_for(5, seed=1)):
            _loss(model, batch).backward()
            if grad_at is not None:
                grad_at(i, model)
            opt.step()
            opt.zero_grad()
            assert opt.last_stats is not None
            reasons.append(opt.last_stats.reason)
        return opt, reasons

    return run


def _set_grad(value: float | torch.Tensor) -> Callable[[int, nn.Module], None]:
    def change(i: int, model: nn.Module) -> None:
        if i == 2:
            model[0].weight.grad.view(-1)[: 3 if isinstance(value, float) else len(value)] = value

    return change


def _nonfinite_update(loggers: list[object]) -> tuple[ClippedOptimizer, list[str | None]]:
    """5 windows whose third update is inf from finite gradients (an inner optimizer dividing by
    zero), with update_stats=True: that update is put back, reason "nonfinite_update"."""
    from ..helpers import ZeroDivideSGD

    model = model_for()
    inner = ZeroDivideSGD(model.parameters(), lr=0.01, bad_calls={3})
    opt = ClippedOptimizer(inner, max_norm=1.0, loggers=loggers, update_stats=True)
    reasons = []
    for batch in batches_for(5, seed=1):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
        assert opt.last_stats is not None
        reasons.append(opt.last_stats.reason)
    return opt, reasons


def _no_grad_at_2(i: int, model: nn.Module) -> None:
    if i == 2:
        for p in model.parameters():
            p.grad = None


def _overflow(loggers: list[object]) -> tuple[ClippedOptimizer, list[str | None]]:
    """A GradScaler run whose third loss overflows once scaled (reason "overflow")."""
    model = model_for()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    opt = ClippedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), max_norm=1.0, scaler=scaler, loggers=loggers
    )
    reasons = []
    for i, batch in enumerate(batches_for(5, seed=1)):
        scaler.scale(_loss(model, batch) * (3e38 if i == 2 else 1.0)).backward()
        opt.step()
        opt.zero_grad()
        assert opt.last_stats is not None
        reasons.append(opt.last_stats.reason)
    return opt, reasons


def _guarded(rewind: bool) -> Callable:
    """A SpikeGuard run with spikes at batches 12 and 14; with a Rewind, the check at window 16 rewinds."""

    def run(loggers: list[object]) -> tuple[ClippedOptimizer, list[str | None]]:
        model = model_for()
        kw: dict[str, object] = {"spike_guard": SpikeGuard(z_thresh=50.0, window=8, warmup=4)}
        if rewind:
            kw["rewind"] = Rewind(
                every=5, keep=2, spikes=2, within=5, skip_batches=0, module=model, check_every=1
            )
        opt = ClippedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), loggers=loggers, **kw)
        reasons = []
        for batch in _spiky(20, {12, 14}):
            loss = _loss(model, batch)
            loss.backward()
            opt.step(loss=loss.detach())
            opt.zero_grad()
            assert opt.last_stats is not None
            reasons.append(opt.last_stats.reason)
        return opt, reasons

    return run


def divergence_job(rank: int, port: int, out_dir: str) -> None:
    """2 gloo ranks under DDP, 3 windows; in window 2 rank 1 scales its gradient after the all-reduce,
    so the replicas disagree (reason "divergence" on every rank); rank 0 logs (CSV and TensorBoard)."""
    from clipopt import TensorBoardLogger

    from ..distributed_jobs import init_world, leave_process_group

    init_world(rank, port)
    out = Path(out_dir)
    ddp = nn.parallel.DistributedDataParallel(model_for())
    loggers = [CSVLogger(out / "log.csv"), TensorBoardLogger(out / "tb")]
    opt = ClippedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.01), max_norm=1.0, loggers=loggers)
    reasons = []
    for i, batch in enumerate(batches_for(3, seed=1 + rank)):
        _loss(ddp, batch).backward()
        if i == 1 and rank == 1:
            next(iter(ddp.module.parameters())).grad.mul_(1.001)
        opt.step()
        opt.zero_grad()
        assert opt.last_stats is not None
        reasons.append(opt.last_stats.reason)
    opt.close()
    torch.save(reasons, out / f"reasons{rank}.pt")
    leave_process_group()


def _diverged(out: Path) -> list[str | None]:
    """The divergence job's reasons (rank 0's, the same on rank 1); its logs are in ``out``."""
    from ..helpers import free_port, join_spawned, start_ranks

    join_spawned(start_ranks(divergence_job, (free_port(), str(out)), 2), "divergence")
    reasons = [torch.load(out / f"reasons{rank}.pt") for rank in range(2)]
    assert reasons[0] == reasons[1]
    return reasons[0]


def _in_process(run: Callable) -> Callable[[Path], list[str | None]]:
    """``run(loggers)`` with a CSVLogger and a TensorBoardLogger writing into ``out``; its reasons."""

    def logged(out: Path) -> list[str | None]:
        from clipopt import TensorBoardLogger

        opt, reasons = run([CSVLogger(out / "log.csv"), TensorBoardLogger(out / "tb")])
        opt.close()
        return reasons

    return logged


#: A real run that skips a window for each reason of the table.
#: Each writes ``log.csv`` and ``tb`` into the folder it is given and returns StepStats' reasons.
RUNS: dict[str, Callable[[Path], list[str | None]]] = {
    "nonfinite": _in_process(_plain(_set_grad(math.nan))),
    "overflow": _in_process(_overflow),
    "spike": _in_process(_guarded(rewind=False)),
    "divergence": _diverged,
    "nograd": _in_process(_plain(_no_grad_at_2)),
    "rewind": _in_process(_guarded(rewind=True)),
    # finite elements whose norm (4.2e38) exceeds float32's range (a smaller one is taken without overflow)
    "norm_overflow": _in_process(_plain(_set_grad(torch.tensor([3e38, -3e38])))),
    "nonfinite_update": _in_process(_nonfinite_update),
}


@pytest.mark.parametrize("reason", [r.name for r in REASONS])
def test_every_reason_reads_back_as_itself_through_every_logger(reason: str, tmp_path: Path) -> None:
    """A real run skipping a window for ``reason``, logged by CSVLogger and TensorBoardLogger (the
    events written by TensorBoard's own SummaryWriter): the report's reader gives back, for every
    skipped window, the reason StepStats had ("divergence": 2 gloo ranks under DDP, one changing its
    gradient after the all-reduce) (before the table: "nograd" and "divergence" read back
    from TensorBoard as "nonfinite", having no tag of their own)."""
    pytest.importorskip("tensorboard")
    reasons = RUNS[reason](tmp_path)
    csv_path, tb_dir = tmp_path / "log.csv", tmp_path / "tb"
    want = {step: r for step, r in enumerate(reasons, start=1) if r is not None}
    assert reason in want.values(), reasons
    for path in (csv_path, tb_dir):
        log = read_log(path)
        assert {log.steps[i]: r for i, r in log.reason.items()} == want, path


def test_every_reason_in_the_table_has_a_run_here() -> None:
    """The round-trip test covers every row of the table (a new reason needs a run in RUNS)."""
    assert sorted(RUNS) == sorted(r.name for r in REASONS)


def _reason_codes_used(module: str) -> set[str]:
    """The names imported from ``._reasons`` in a module that are reason codes (upper case)."""
    tree = ast.parse((PACKAGE / module).read_text())
    return {
        a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "_reasons"
        for a in node.names
        if a.name.isupper() and a.name not in {"REASONS", "NAMES", "NONFINITE_NAMES", "TAG_PREFIX"}
    }


def test_the_table_covers_every_code_the_decision_can_give() -> None:
    """Every reason code the decision code uses (its imports from _reasons, whatever module decides) is a
    row of the table, its row at its code; codes, names and tags are unique; the tagged reasons of
    earlier versions keep their tags byte for byte (their logs read the same); 0 is no reason."""
    import clipopt._reasons as reasons_module

    used = set().union(*(_reason_codes_used(str(p.relative_to(PACKAGE))) for p in PACKAGE.rglob("*.py")))
    codes = {name: getattr(reasons_module, name) for name in used - {"NO_REASON"}}
    assert codes and all(by_code(code).code == code for code in codes.values())
    assert [r.code for r in REASONS] == list(range(1, len(REASONS) + 1))
    assert len({r.name for r in REASONS}) == len({r.tag for r in REASONS}) == len(REASONS)
    assert NAMES == (
        None,
        "nonfinite",
        "overflow",
        "spike",
        "divergence",
        "nograd",
        "rewind",
        "norm_overflow",
        "nonfinite_update",
    )
    for name in ("overflow", "spike", "rewind", "norm_overflow", "nonfinite_update"):
        assert tag_of(name) == f"clipopt/{name}"
    assert {"nonfinite", "overflow"} == NONFINITE_NAMES
    assert all(by_name(r.name) is r for r in REASONS) and by_name("later") is None and tag_of("later") is None


def test_a_code_without_a_reason_is_refused() -> None:
    """by_code names the codes that exist when given one that does not (0 is no reason)."""
    with pytest.raises(ValueError, match="no skip reason has code 0; the codes are 1 to 8"):
        by_code(0)


def test_every_column_and_tag_the_loggers_write_is_one_the_report_reads(tmp_path: Path) -> None:
    """A real run with two parameter groups (one with its own max_norm: per-group columns), per-layer
    statistics and a loss, logged by CSVLogger and TensorBoardLogger: the report's reader takes every
    column and tag the loggers wrote (names shared in clipopt/_log_names.py) but the
    three it has no
    use for (micro-batches, the coefficient, a further group's learning rate), and reads back the
    groups' norms, the layers' rows and the losses StepStats had."""
    pytest.importorskip("tensorboard")
    from clipopt import TensorBoardLogger

    model = model_for()
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    inner = torch.optim.SGD([{"params": first}, {"params": second, "max_norm": 0.5}], lr=0.01)
    csv_path, tb_dir = tmp_path / "log.csv", tmp_path / "tb"
    opt = ClippedOptimizer(
        inner,
        max_norm=1.0,
        layer_stats=2,
        param_names=model.named_parameters(),
        loggers=[CSVLogger(csv_path), TensorBoardLogger(tb_dir)],
    )
    stats = []
    for batch in batches_for(4, seed=1):
        loss = _loss(model, batch)
        loss.backward()
        opt.step(loss=loss.detach())
        opt.zero_grad()
        stats.append(opt.last_stats)
    opt.close()
    norms = [[s.group_norms[g] for s in stats] for g in range(2)]
    layer_norms = [s.layers.as_dict()["0.weight"]["grad_norm"] for s in stats if s.layers is not None]
    assert len(layer_norms) == 2
    for path, unused in (
        (csv_path, {"micro_batches", "clip_coef", "lr.1"}),
        (tb_dir, {"clipopt/micro_batches", "clipopt/clip_coef", "clipopt/lr.1"}),
    ):
        log = read_log(path)
        assert set(log.ignored) == unused, path
        assert log.has_clipping and list(log.clipped) == [int(s.clipped) for s in stats]
        for g in range(2):
            assert list(log.groups[g]["norm"]) == pytest.approx(norms[g], rel=1e-6)
        assert list(log.layers["0.weight"]["grad_norm"]) == pytest.approx(layer_norms, rel=1e-6)
        assert list(log.loss) == pytest.approx([s.loss for s in stats], rel=1e-6)
