"""The ``clipopt`` command line (also ``python -m clipopt``).

Every subcommand is a pair of functions: ``_add_<name>(subparsers)`` declares
its arguments and sets ``func`` to ``_run_<name>(args) -> int``; register the
adder in :data:`_COMMANDS`.  The work itself lives in its own module
(``clipopt._replay.inspect`` for ``inspect``), imported when the command runs.

Exit codes: 0 success, 2 a usage error or a file that cannot be used (one line
on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._report.text import whole_number

if TYPE_CHECKING:
    from ._report.read import GradLog

__all__ = ["CommandError", "main"]

#: What argparse's ``add_subparsers()`` returns (its class is private).
_Subparsers = Any


class CommandError(Exception):
    """A failure to report as ``clipopt <command>: error: <message>`` with exit code 2."""


# ---------------------------------------------------------------------------- inspect


def _add_inspect(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="show which parameters went bad in an anomaly snapshot",
        description=(
            "Show an anomaly snapshot written by ClippedOptimizer(snapshot_dir=...): the step, reason "
            "and pre-clip norm of the window, its parameters ranked with the non-finite ones first "
            "(most non-finite elements first, then by gradient norm), their statistics, and what was "
            "attached with opt.attach()."
        ),
    )
    p.add_argument("file", help="a snapshot file, e.g. anomalies/anomaly-step00000042-nonfinite.pt")
    p.add_argument(
        "--json",
        action="store_true",
        help='print the same as JSON (non-finite numbers as the strings "nan", "inf", "-inf")',
    )
    p.set_defaults(func=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from ._replay.inspect import InspectError, format_json, format_text, inspect_file

    try:
        summary = inspect_file(args.file)
    except InspectError as exc:
        raise CommandError(str(exc)) from None
    print(format_json(summary) if args.json else format_text(summary))
    return 0


# ---------------------------------------------------------------------------- replay


def _add_replay(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "replay",
        help="rerun an anomaly snapshot and name the operation that went non-finite",
        description=(
            "Load an anomaly snapshot into the model built by --model, rerun --loss on the attached batch "
            "forward and backward (--repeats times) while watching every operator, and say whether the "
            "anomaly comes back (a model fault) or not (transient: data loading, hardware, another rank), "
            "and where: the phase (forward or backward), the module, the first operator that produced a "
            "non-finite value and the statistics of its tensors. GradScaler overflow snapshots tell an "
            "overflow of the loss scale from a genuine fault; spike snapshots name the layer whose "
            "gradient grew most against the optimizer's history. The model is left as it was."
        ),
    )
    p.add_argument(
        "file", metavar="SNAPSHOT", help="a snapshot file, e.g. anomalies/anomaly-step00000042-nonfinite.pt"
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="a function building the model that was trained, e.g. mypkg.models:build (or file.py:build)",
    )
    p.add_argument(
        "--loss",
        required=True,
        metavar="MODULE:FN",
        help="fn(model, attached) returning the loss of the snapshot's attached batch, e.g. mypkg.train:loss",
    )
    p.add_argument(
        "--repeats", type=whole_number, default=3, help="replays; reproduced means every time (default: 3)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print the result as JSON (non-finite numbers as the strings "nan", "inf", "-inf")',
    )
    p.set_defaults(func=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    from ._replay.cli import ReplayCommandError, run

    if args.repeats < 1:
        raise CommandError(f"--repeats must be at least 1, got {args.repeats}")
    try:
        print(run(args.file, args.model, args.loss, args.repeats, args.json))
    except ReplayCommandError as exc:
        raise CommandError(str(exc)) from None
    return 0


# ---------------------------------------------------------------------------- report


def _add_report(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="verdict and a suggested max_norm from a training log",
        description=(
            "Read a training log -- a clipopt.CSVLogger file, any CSV with a step and a gradient-norm "
            "column (total_norm, grad_norm, ...), a Hugging Face Trainer trainer_state.json, a Lightning "
            "metrics.csv or a TensorBoard log folder -- and give a verdict: exploding (the loss or the "
            "norm left its scale for good), nonfinite (a non-finite gradient, with the layer), spikes, "
            "vanishing (per-layer) or healthy, with the step and layer as evidence, one suggested "
            "max_norm, the fraction of updates clipped and whether max_norm looks too tight or too "
            "loose. It says which columns (tags) it read as the norm and the loss and which it "
            "ignored; --loss and --norm choose others. A folder of several TensorBoard runs is never "
            "merged: each run is reported on its own, or --run picks one. "
            "--plot draws the norms, the loss and the per-layer heatmap (needs matplotlib: "
            "pip install 'clipopt[plot]'). The rules and their reasons are in the documentation, "
            "page 'Choosing max_norm'."
        ),
    )
    p.add_argument(
        "csv",
        metavar="PATH",
        help="the log: grads.csv, metrics.csv, trainer_state.json or a TensorBoard log folder",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="also draw the total norm, the loss and the per-layer heatmap over updates into this image "
        "file (default: no plot)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print the report as JSON (non-finite numbers as the strings "nan", "inf", "-inf"); '
        'a folder of several TensorBoard runs gives {"runs": [one report per run]}',
    )
    _add_report_names(p)
    p.set_defaults(func=_run_report)


def _add_report_names(p: argparse.ArgumentParser) -> None:
    """``--loss``, ``--norm`` and ``--run``: the names the report reads."""
    p.add_argument(
        "--loss",
        metavar="NAME",
        help="the column (tag, log_history key) to read as the loss (default: a recognised name such as "
        "loss, train/loss, Loss/train, train_loss)",
    )
    p.add_argument(
        "--norm",
        metavar="NAME",
        help="the column (tag, log_history key) to read as the gradient norm (default: a recognised name "
        "such as total_norm, grad_norm, train/grad_norm, Grad/total_norm)",
    )
    p.add_argument(
        "--run",
        metavar="NAME",
        help="the TensorBoard run to read, as a folder below PATH (e.g. exp1 for runs/exp1); a folder "
        "holding several runs is never merged: without --run each run is reported on its own",
    )


def _run_report(args: argparse.Namespace) -> int:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the report's columns are small: threads only contend (restored after)
    try:
        return _report(args)
    finally:
        torch.set_num_threads(threads)


def _report(args: argparse.Namespace) -> int:
    from ._report.read import tensorboard_runs
    from ._report.report import analyze, format_json, format_report, plot_log

    plot = _plot_target(args.plot) if args.plot is not None else None
    runs = tensorboard_runs(args.csv)
    chosen: list[str | None] = [args.run] if args.run is not None or len(runs) < 2 else list(runs)
    if plot is not None and len(chosen) > 1:
        raise CommandError(
            f"--plot draws one run and {args.csv} holds {len(runs)} TensorBoard runs ({', '.join(runs)}); "
            "pick one with --run NAME"
        )
    try:
        logs = [_read_report_log(args, run) for run in chosen]
    except CommandError as exc:
        if len(chosen) < 2:
            raise
        raise CommandError(
            f"{exc}; {args.csv} holds {len(runs)} TensorBoard runs ({', '.join(runs)}): report a readable "
            "one with --run NAME"
        ) from None
    reports = [analyze(log) for log in logs]
    if args.json:
        print(format_json(reports[0] if len(reports) == 1 else {"runs": reports}))
    elif len(reports) == 1:
        print(format_report(reports[0]))
    else:
        print(
            f"{args.csv} holds {len(runs)} TensorBoard runs, each reported on its own "
            f"(--run NAME picks one): {', '.join(runs)}"
        )
        for run, report in zip(runs, reports, strict=True):
            print(f"\n=== run {run} ===\n{format_report(report)}")
    if plot is not None:
        sys.stdout.flush()
        try:
            plot_log(logs[0], reports[0], plot)
        except ImportError as exc:
            raise CommandError(_one_line(exc)) from None
        except (OSError, ValueError) as exc:  # an unwritable path, or an extension matplotlib cannot write
            raise CommandError(f"cannot write the plot {plot}: {_one_line(exc)}") from None
        if not args.json:
            print(f"\nPlot written to {plot}")
    return 0


def _read_report_log(args: argparse.Namespace, run: str | None) -> GradLog:
    """The log of ``clipopt report`` (one run of a TensorBoard folder: ``run``); a CommandError when it
    cannot be read."""
    from ._report.read import Names, read_log

    try:
        return read_log(args.csv, Names(loss=args.loss, norm=args.norm), run)
    except FileNotFoundError:
        raise CommandError(f"{args.csv}: no such file") from None
    except (OSError, ValueError, UnicodeError) as exc:
        raise CommandError(_one_line(exc)) from None


def _plot_target(path: str) -> str:
    """The file ``--plot PATH`` writes: PATH, with ``.png`` added when it has no extension (what
    matplotlib writes then); a CommandError before any work when its folder is missing or it is one."""
    target = path if os.path.splitext(path)[1][1:] else path.rstrip(".") + ".png"
    folder = os.path.dirname(target) or "."
    if not os.path.isdir(folder):
        raise CommandError(
            f"--plot {path}: the folder {folder} does not exist; create it, or pass a path in an existing "
            "folder"
        )
    if os.path.isdir(target):
        raise CommandError(
            f"--plot {path}: {target} is a folder; pass an image file, e.g. "
            f"{os.path.join(target, 'report.png')}"
        )
    return target


# ---------------------------------------------------------------------------- demo


def _add_demo(subparsers: _Subparsers) -> None:
    from ._demo import add_arguments

    p = subparsers.add_parser(
        "demo",
        help="train a small model twice, without and with clipopt, and compare",
        description=(
            "Train a character-level RNN language model on text that ships with Python twice, from the "
            "same initialisation: with plain SGD at a high learning rate, which blows up, and wrapped in "
            "ClippedOptimizer(max_norm=1.0), which stays finite and learns. Writes both CSV logs, the "
            "reports and the plots into --out and prints a side-by-side summary. Exit code 0 when the "
            "run showed both halves."
        ),
    )
    add_arguments(p)
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from ._demo import main

    try:
        return main(args)
    except OSError as exc:
        raise CommandError(_one_line(exc)) from None


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# ---------------------------------------------------------------------------- the entry point

#: Subcommands, in the order ``--help`` lists them.
_COMMANDS: tuple[Callable[[_Subparsers], None], ...] = (_add_demo, _add_report, _add_inspect, _add_replay)


def build_parser() -> argparse.ArgumentParser:
    """The ``clipopt`` argument parser with every subcommand of :data:`_COMMANDS`."""
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog="clipopt",
        description="clipopt: safe gradient clipping for PyTorch -- command-line tools.",
    )
    parser.add_argument("--version", action="version", version=f"clipopt {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for add in _COMMANDS:
        add(subparsers)
    for sub in subparsers.choices.values():  # so that main() can report a usage error with its usage
        sub.set_defaults(command_parser=sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an unknown argument is reported with the usage of the subcommand it follows."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        where: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        where.error(f"unrecognized arguments: {' '.join(unknown)}")  # prints the usage, exits with 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``clipopt`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = _parse(parser, argv)
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed it)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except CommandError as exc:
        print(f"clipopt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `clipopt inspect f | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"clipopt {args.command}: interrupted", file=sys.stderr)
        return 130
    return code
