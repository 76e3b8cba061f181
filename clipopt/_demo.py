"""``clipopt demo``: the same model trained twice, without and with clipopt.

The model is a character-level language model — embedding (32), a tanh RNN
(hidden 192), a linear read-out — trained with plain SGD at a high learning
rate (3.0) on text that ships with Python: the source of the standard
library's ``argparse`` module (about 100k characters).  Plain SGD meets an
exploding gradient within the first updates and its loss jumps above ten times
its starting value (or turns non-finite); the same run wrapped in
``ClippedOptimizer(max_norm=1.0)`` stays finite and learns: its held-out loss
ends well below the trivial baseline of predicting character frequencies.

Both runs start from the same initialisation and see the same batches; both
log to CSV (the plain run through a ``ClippedOptimizer`` with clipping and
skipping off, which only observes), and ``clipopt report`` analyses both logs.
"""

from __future__ import annotations

import argparse as _argparse_module
import copy
import inspect
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ._diagnostics.loggers import CSVLogger
from ._optimizer import ClippedOptimizer
from ._report.text import fmt_num, json_safe, whole_number

if TYPE_CHECKING:
    from ._report.read import GradLog

__all__ = ["DemoConfig", "DemoResult", "RunResult", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    """Everything that defines the demo; the defaults are what ``clipopt demo`` runs."""

    steps: int = 600
    seed: int = 1
    hidden: int = 192
    embedding: int = 32
    lr: float = 3.0
    max_norm: float = 1.0
    batch: int = 32
    seq_len: int = 32
    layer_stats: int = 25


@dataclass
class RunResult:
    """One of the two runs."""

    name: str
    losses: list[float] = field(default_factory=list)  #: training loss per update (nan once non-finite)
    #: the update (= the log's step) where ``clipopt report`` puts the explosion's onset; None: not exploding
    blew_up_at: int | None = None
    blew_up_loss: float = math.nan  #: the loss logged at that update
    heldout_loss: float = math.nan  #: cross-entropy on held-out text after training, nats per character
    updates: int = 0
    clipped: int = 0
    skipped: int = 0
    max_grad_norm: float = math.nan
    seconds: float = 0.0
    verdict: str = ""


@dataclass
class DemoResult:
    config: DemoConfig
    corpus: str
    characters: int
    vocabulary: int
    baseline: float  #: held-out cross-entropy of predicting the training character frequencies
    uniform: float  #: log(vocabulary)
    plain: RunResult
    clipped: RunResult
    files: list[str] = field(default_factory=list)

    @property
    def shows_both_halves(self) -> bool:
        """Plain blew up; clipopt stayed finite and ended clearly below the baseline."""
        return (
            self.plain.blew_up_at is not None
            and self.clipped.blew_up_at is None
            and self.clipped.heldout_loss < 0.8 * self.baseline
        )


def corpus() -> tuple[str, str]:
    """The text: argparse's source, or (in installs without sources) standard-library docstrings."""
    try:
        return "the source of Python's argparse module", inspect.getsource(_argparse_module)
    except (OSError, TypeError):
        import collections
        import json as json_module
        import pathlib

        modules = (collections, json_module, pathlib, inspect, _argparse_module)
        docs = [inspect.getdoc(m) or "" for m in modules]
        return "docstrings of Python's standard library", "\n".join(docs) * 4


@dataclass(frozen=True)
class _Text:
    """The demo's corpus encoded as character indices, split into training and held-out text."""

    name: str  #: what the text is (see :func:`corpus`)
    characters: int  #: its length in characters
    vocab: int  #: distinct characters
    train: torch.Tensor  #: the first 90 % of the text, as indices
    heldout: torch.Tensor  #: the rest
    baseline: float  #: held-out cross-entropy of predicting the training character frequencies


def _encode_corpus() -> _Text:
    """:func:`corpus` as character indices, its split, and the frequency baseline."""
    name, text = corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train, heldout = data[:split], data[split:]
    vocab = len(chars)
    freq = torch.bincount(train, minlength=vocab).double() + 1e-3  # frequencies, smoothed
    logp = (freq / freq.sum()).log()
    baseline = float(-logp[heldout].mean())
    return _Text(name, len(text), vocab, train, heldout, baseline)


class CharRNN(torch.nn.Module):
    """Embedding -> tanh RNN -> linear read-out over the vocabulary."""

    def __init__(self, vocab: int, embedding: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, embedding)
        self.rnn = torch.nn.RNN(embedding, hidden, nonlinearity="tanh", batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        logits: torch.Tensor = self.head(out)
        return logits


def _batches(data: torch.Tensor, cfg: DemoConfig, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random batches of ``(input, next character)`` windows, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
        idx = starts[:, None] + torch.arange(cfg.seq_len + 1)
        window = data[idx]
        yield window[:, :-1], window[:, 1:]


@torch.no_grad()
def _heldout_loss(model: torch.nn.Module, data: torch.Tensor, vocab: int) -> float:
    """The model's cross-entropy on the held-out text, nats per character."""
    chunk = 128
    n = (len(data) - 1) // chunk
    x = data[: n * chunk].view(n, chunk)
    y = data[1 : n * chunk + 1].view(n, chunk)
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
    return float(loss)


def _progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar when tqdm is installed (extra ``demo``), else a plain line every 10 %."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="update", leave=True, file=sys.stderr)
    except ImportError:
        return _PlainProgress(total, desc)


class _PlainProgress:
    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n, self.shown = total, desc, 0, -1

    def update(self, k: int = 1) -> None:
        self.n += k
        tenth = 10 * self.n // max(1, self.total)
        if tenth != self.shown:
            self.shown = tenth
            print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr)

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _train(
    name: str,
    model: torch.nn.Module,
    opt: ClippedOptimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    cfg: DemoConfig,
    vocab: int,
    progress: bool,
) -> RunResult:
    """Train one run for cfg.steps updates (stopping early once a parameter is non-finite); its figures."""
    result = RunResult(name)
    bar = _progress(cfg.steps, name, progress)
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step(loss=loss)
        opt.zero_grad()
        value = float(loss.detach())
        result.losses.append(value)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"loss {value:.3g}")
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            result.losses += [math.nan] * (cfg.steps - step)  # nothing left to learn: stop here
            break
    if bar is not None:
        bar.close()
    result.seconds = time.perf_counter() - start
    result.updates = opt.num_updates
    result.skipped = opt.num_skipped
    result.clipped = sum(bool(s.clipped) for s in opt.stats)
    norms = [s.total_norm for s in opt.stats if math.isfinite(s.total_norm)]
    result.max_grad_norm = max(norms) if norms else math.nan
    return result


def run_demo(out: str | Path, config: DemoConfig | None = None, progress: bool = True) -> DemoResult:
    """Train both runs, write the CSV logs, reports and plots into ``out``; return the figures."""
    cfg = config or DemoConfig()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = _encode_corpus()
    torch.manual_seed(cfg.seed)
    model = CharRNN(text.vocab, cfg.embedding, cfg.hidden)
    twin = copy.deepcopy(model)
    plain = _run("plain SGD", model, None, out / "plain.csv", text, cfg, progress)
    clipped = _run("clipopt", twin, cfg.max_norm, out / "clipopt.csv", text, cfg, progress)
    demo = DemoResult(
        cfg, text.name, text.characters, text.vocab, text.baseline, math.log(text.vocab), plain, clipped
    )
    demo.files = [str(out / "plain.csv"), str(out / "clipopt.csv")]
    _write_reports(demo, out)
    return demo


def _run(
    label: str,
    net: torch.nn.Module,
    max_norm: float | None,
    csv_path: Path,
    text: _Text,
    cfg: DemoConfig,
    progress: bool,
) -> RunResult:
    """One run, logged to ``csv_path``: clipping at ``max_norm`` and skipping, or (None) only observing."""
    csv_path.unlink(missing_ok=True)
    opt = ClippedOptimizer(
        torch.optim.SGD(net.parameters(), lr=cfg.lr),
        max_norm=max_norm,
        skip_nonfinite=max_norm is not None,
        param_names=net.named_parameters(),
        layer_stats=cfg.layer_stats,
        loggers=[CSVLogger(csv_path)],
        stats_history=cfg.steps,
    )
    batches = _batches(text.train, cfg, cfg.seed + 1)
    result = _train(label, net, opt, batches, cfg, text.vocab, progress)
    opt.close()
    result.heldout_loss = _heldout_loss(net, text.heldout, text.vocab)
    return result


def _write_reports(demo: DemoResult, out: Path) -> None:
    """report.txt / report.json for both logs; report plots and demo.png when matplotlib is there."""
    from ._report.report import analyze, format_report, plot_log, read_log

    texts, reports = [], {}
    logs = {}
    for run, stem in ((demo.plain, "plain"), (demo.clipped, "clipopt")):
        log = read_log(out / f"{stem}.csv")
        report = analyze(log)
        run.verdict = str(report["verdict"])
        _take_onset(run, log, report)
        logs[stem] = (log, report)
        reports[stem] = report
        texts.append(f"== {run.name} ({stem}.csv) ==\n{format_report(report)}")
    (out / "report.txt").write_text("\n\n".join(texts) + "\n")
    summary = {"demo": json_safe(asdict(demo.config)), "reports": reports, "summary": summary_dict(demo)}
    (out / "report.json").write_text(json.dumps(json_safe(summary), indent=1, allow_nan=False) + "\n")
    demo.files += [str(out / "report.txt"), str(out / "report.json")]
    try:
        for stem, (log, report) in logs.items():
            plot_log(log, report, out / f"{stem}-report.png")
            demo.files.append(str(out / f"{stem}-report.png"))
        plot_demo(demo, out / "demo.png")
        demo.files.append(str(out / "demo.png"))
    except ImportError:
        print(PLOTS_SKIPPED, file=sys.stderr)


def _take_onset(run: RunResult, log: GradLog, report: dict[str, Any]) -> None:
    """``run.blew_up_at`` / ``blew_up_loss``: the step and logged loss of the report's first explosion
    finding (the demo's CSV step is its update count, from 1), so that the summary and the report name
    the same update."""
    onset = next((f for f in report["findings"] if f["kind"] in ("blowup", "growth")), None)
    if onset is None:
        run.blew_up_at, run.blew_up_loss = None, math.nan
        return
    run.blew_up_at = int(onset["step"])
    run.blew_up_loss = log.loss[int(onset["values"]["row"])]


#: What the demo says (on stderr) when matplotlib is missing.
PLOTS_SKIPPED = (
    "clipopt demo: plots skipped: matplotlib is not installed (pip install 'clipopt[demo]'); "
    "the CSV logs and reports are written"
)


def summary_dict(demo: DemoResult) -> dict[str, Any]:
    """The side-by-side figures as a dict."""
    return {
        "corpus": demo.corpus,
        "characters": demo.characters,
        "vocabulary": demo.vocabulary,
        "baseline_frequencies": demo.baseline,
        "baseline_uniform": demo.uniform,
        "runs": {
            r.name: {k: v for k, v in asdict(r).items() if k != "losses"} for r in (demo.plain, demo.clipped)
        },
        "shows_both_halves": demo.shows_both_halves,
    }


def _fmt(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals (nan and inf as they are)."""
    return f"{value:.{digits}f}" if math.isfinite(value) else str(value)


def format_summary(demo: DemoResult) -> str:
    """The side-by-side summary ``clipopt demo`` prints."""
    rows = _comparison_rows(demo)
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [*_intro_lines(demo), ""]
    lines += [f"  {a:<{w0}}  {b:<{w1}}  {d}" for a, b, d in rows]
    lines += ["", *_conclusion_lines(demo)]
    lines.append("Files: " + ", ".join(demo.files))
    return "\n".join(lines)


def _intro_lines(demo: DemoResult) -> list[str]:
    """What was trained, on what, how."""
    cfg = demo.config
    return [
        f"clipopt demo: a character-level tanh RNN language model (hidden {cfg.hidden}) on {demo.corpus}",
        f"({demo.characters:,} characters, {demo.vocabulary} symbols), plain SGD lr={cfg.lr:g}, "
        f"batch {cfg.batch} x {cfg.seq_len} characters, {cfg.steps} updates, seed {cfg.seed}; "
        "same initialisation and batches for both runs.",
    ]


def _comparison_rows(demo: DemoResult) -> list[tuple[str, str, str]]:
    """The side-by-side table: what, plain run, clipopt run."""
    p, c = demo.plain, demo.clipped
    return [
        ("", "plain torch.optim.SGD", f"ClippedOptimizer(max_norm={demo.config.max_norm:g})"),
        ("blew up (onset, as clipopt report finds it)", _blew_up_text(p), _blew_up_text(c)),
        ("final training loss (mean of last 20)", _fmt(_tail_mean(p.losses)), _fmt(_tail_mean(c.losses))),
        ("held-out loss, nats/char", _fmt(p.heldout_loss), _fmt(c.heldout_loss)),
        ("largest gradient norm (finite)", _fmt(p.max_grad_norm, 1), _fmt(c.max_grad_norm, 1)),
        (
            "updates applied / clipped / skipped",
            f"{p.updates} / - / -",
            f"{c.updates} / {c.clipped} / {c.skipped}",
        ),
        ("clipopt report verdict", p.verdict, c.verdict),
        ("time", f"{p.seconds:.1f} s", f"{c.seconds:.1f} s"),
    ]


def _blew_up_text(r: RunResult) -> str:
    """``at update 5 (loss 35.87)`` (the loss as the report writes it), or ``no``."""
    if r.blew_up_at is None:
        return "no"
    return f"at update {r.blew_up_at} (loss {fmt_num(r.blew_up_loss)})"


def _conclusion_lines(demo: DemoResult) -> list[str]:
    """The trivial baselines, and whether the run showed both halves."""
    lines = [
        f"Trivial baseline (predict character frequencies): {demo.baseline:.3f} nats/char "
        f"(uniform over {demo.vocabulary} symbols: {demo.uniform:.3f}).",
    ]
    p, c = demo.plain, demo.clipped
    if demo.shows_both_halves:
        lines.append(
            f"Without clipping the run blew up at update {p.blew_up_at}; with clipopt it stayed finite and "
            f"learned: held-out loss {c.heldout_loss:.3f} vs baseline {demo.baseline:.3f}."
        )
    else:
        lines.append("This run did not show both halves (try the default --steps and --seed).")
    return lines


def _tail_mean(values: list[float], k: int = 20) -> float:
    """The mean of the last ``k`` values (nan when there are none)."""
    tail = values[-k:]
    return sum(tail) / len(tail) if tail else math.nan


def plot_demo(demo: DemoResult, path: Path) -> None:
    """demo.png: training loss and pre-clip gradient norm of both runs, side by side."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'clipopt[plot]'") from exc
    from ._report.report import read_log

    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax_loss, ax_norm = fig.subplots(1, 2)
    colours = {"plain": "#d62728", "clipopt": "#1f77b4"}
    for run, stem in ((demo.plain, "plain"), (demo.clipped, "clipopt")):
        steps = list(range(1, len(run.losses) + 1))
        shown = [v if math.isfinite(v) else math.nan for v in run.losses]
        ax_loss.plot(steps, shown, color=colours[stem], lw=1, label=run.name)
        if run.blew_up_at is not None:
            ax_loss.axvline(run.blew_up_at, color=colours[stem], ls=":", lw=1)
        log = read_log(path.parent / f"{stem}.csv")
        norms = [v if math.isfinite(v) and v > 0 else math.nan for v in log.total_norm]
        ax_norm.plot(log.steps, norms, color=colours[stem], lw=1, label=f"{run.name} (pre-clip)")
    ax_loss.axhline(demo.baseline, color="grey", ls="--", lw=1, label="baseline: character frequencies")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("update")
    ax_loss.set_ylabel("training loss (nats/char, log scale)")
    ax_loss.set_title("Loss: plain SGD blows up, clipopt learns")
    ax_loss.legend(fontsize=8)
    limit = demo.config.max_norm
    ax_norm.axhline(limit, color="black", ls="--", lw=1, label=f"max_norm={limit:g}")
    ax_norm.set_yscale("log")
    ax_norm.set_xlabel("update")
    ax_norm.set_ylabel("total gradient norm (log scale)")
    ax_norm.set_title("Gradient norm before clipping")
    ax_norm.legend(fontsize=8)
    fig.suptitle(
        f"clipopt demo: char-level RNN on {demo.corpus}, SGD lr={demo.config.lr:g}, seed {demo.config.seed}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)


#: Threads for the demo: its matrices are small (batch 32 x hidden 192), and on a busy machine a second
#: thread waits more than it computes. Measured on a shared 2-core machine, whole demo, interleaved:
#: 1 thread 23 s and 33 s, 2 threads 163 s and 102 s (load 2.4-7.4).
DEMO_THREADS = 1


def add_arguments(parser: _argparse_module.ArgumentParser) -> None:
    """The ``clipopt demo`` options."""
    defaults = DemoConfig()
    parser.add_argument(
        "--out", default="clipopt-demo", help="folder for the logs, reports and plots (default: %(default)s)"
    )
    parser.add_argument(
        "--steps", type=_steps, default=defaults.steps, help="updates per run, >= 2 (default: %(default)s)"
    )
    parser.add_argument(
        "--seed",
        type=_seed,
        default=defaults.seed,
        help="seed of the initialisation and batches (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=_threads,
        default=DEMO_THREADS,
        help="CPU threads for torch (default: %(default)s: the model is small, more threads only contend)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (they are shown only when stderr is a terminal)",
    )


def _steps(text: str) -> int:
    return whole_number(text, 2)


def _seed(text: str) -> int:
    return whole_number(text, None)


def _threads(text: str) -> int:
    return whole_number(text, 1)


def main(args: _argparse_module.Namespace, echo: Callable[[str], None] = print) -> int:
    """Run the demo for parsed ``args``; 0 when it showed both halves, else 1."""
    cfg = DemoConfig(steps=args.steps, seed=args.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        demo = run_demo(args.out, cfg, progress=not args.no_progress and sys.stderr.isatty())
    finally:
        torch.set_num_threads(threads)
    if args.json:
        echo(json.dumps(json_safe(summary_dict(demo)), indent=1, allow_nan=False))
    else:
        echo(format_summary(demo))
    return 0 if demo.shows_both_halves else 1
