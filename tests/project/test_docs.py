"""Every fenced ```python block of the documentation runs: each docs/*.md page, and the README.

The blocks of one page run in order in one namespace (a page builds on its earlier blocks), in a
temporary working directory, on the CPU (``torch.cuda.is_available()`` reads False while they run).
Pages are found with a glob, so a new page is tested without being listed here. Blocks that must not
run are fenced as ```text or ```bash.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from clipopt import ClippedOptimizer

REPO = Path(__file__).resolve().parents[2]
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]

#: A fence opening ```python (possibly indented inside a list item) up to the closing fence at that indent.
_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown text as (line number of the fence, dedented code)."""
    blocks = []
    for match in _BLOCK.finditer(text):
        indent = match["indent"]
        lines = match["code"].splitlines(keepends=True)
        code = "".join(line[len(indent) :] if line.startswith(indent) else line for line in lines)
        blocks.append((text.count("\n", 0, match.start()) + 1, code))
    return blocks


def test_block_extraction() -> None:
    """The extractor finds top-level and indented python blocks, dedents them, and skips other languages."""
    text = "intro\n```python\nx = 1\n```\n\n- item\n\n  ```python\n  y = x + 1\n  ```\n"
    text += "\n```text\nz = 3\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n"), (8, "y = x + 1\n")]


#: Any fence opening (``` or ~~~, possibly indented) and its info string.
_FENCE = re.compile(r"^[ \t]*(?:```|~~~)[ \t]*(?P<info>[^`\n]*?)[ \t]*$", re.M)
_LANGUAGES = {"python", "text", "bash"}


def fence_languages(text: str) -> list[str]:
    """The info string of every opening fence of a Markdown text (closing fences have none)."""
    infos, inside = [], False
    for match in _FENCE.finditer(text):
        if not inside:
            infos.append(match["info"])
        inside = not inside
    return infos


def test_fence_languages_flags_what_would_not_run() -> None:
    """The fence check sees a block that would render as Python but is not run (```py, a title)."""
    text = '```python\nx = 1\n```\n```py\ny = 2\n```\n~~~python title="a.py"\nz = 3\n~~~\n'
    assert fence_languages(text) == ["python", "py", 'python title="a.py"']
    assert len(python_blocks(text)) == 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_is_run_or_marked_not_to_run(page: Path) -> None:
    """Every fenced block is ```python (run by test_page_examples_run), ```text or ```bash; a block
    fenced any other way (```py, ```python3, a title, ~~~) would render as code and never run, and
    every ```python fence is one that the extractor finds."""
    text = page.read_text(encoding="utf-8")
    infos = fence_languages(text)
    assert [i for i in infos if i not in _LANGUAGES] == []
    assert len(python_blocks(text)) == infos.count("python")


def test_the_teaching_pages_have_examples() -> None:
    """The pages that teach the API carry python examples (so this test file actually runs something)."""
    teaching = ["getting-started.md", "concepts.md", "choosing-max-norm.md", "diagnostics.md"]
    teaching += ["integrations.md", "distributed.md"]
    for name in teaching:
        assert python_blocks((REPO / "docs" / name).read_text(encoding="utf-8")), name


@pytest.mark.parametrize(
    "page", [p for p in PAGES if python_blocks(p.read_text(encoding="utf-8"))], ids=lambda p: p.name
)
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each python block of the page runs without error, in order, in one namespace, on the CPU."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.manual_seed(0)
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    text = page.read_text(encoding="utf-8")
    failed = True
    try:
        for line, code in python_blocks(text):
            exec(compile(code, f"{page.relative_to(REPO)}, block at line {line}", "exec"), namespace)
        failed = False
    finally:
        for value in list(namespace.values()):
            if isinstance(value, ClippedOptimizer):
                try:
                    value.close()  # flush its loggers while tmp_path still exists
                except Exception:
                    if not failed:  # a page's own error stays the one reported
                        raise


def test_quiet_run_prints_the_hypothesis_seed() -> None:
    """`python -m pytest -q` (the documented test command) ends with the seed and how to replay it."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--hypothesis-seed=1234",
            "tests/project/test_docs.py::test_block_extraction",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "hypothesis seed 1234 (replay: python -m pytest --hypothesis-seed=1234)" in proc.stdout.splitlines()
    )


def test_api_reference_lists_every_public_name() -> None:
    """docs/api.md has a ``::: clipopt.NAME`` entry for every name in ``clipopt.__all__`` (but the
    version string), so the generated reference leaves none out."""
    import clipopt

    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    entries = set(re.findall(r"^::: clipopt\.(\w+)\s*$", text, re.M))
    assert sorted(set(clipopt.__all__) - {"__version__"} - entries) == []


def summary_table_names(text: str, module: str) -> list[str]:
    """The names in the first column of docs/api.md's summary table for ``module`` (``### `module` ``)."""
    start = text.index(f"\n### `{module}`\n")
    end = min(i for i in (text.find("\n## ", start), text.find("\n### ", start + 1), len(text)) if i >= 0)
    return re.findall(r"^\| `([\w.]+)` \|", text[start:end], re.M)


@pytest.mark.parametrize("module", ["clipopt", "clipopt.functional", "clipopt.integrations"])
def test_api_reference_has_a_readable_summary_of_every_public_name(module: str) -> None:
    """docs/api.md reads without the site: a table per module lists each name of its ``__all__`` once,
    and no name it lacks (before: only ``::: clipopt.X`` lines, empty unless the site is built)."""
    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    names = summary_table_names(text, module)
    assert sorted(names) == sorted(importlib.import_module(module).__all__)


def docstring_sections(doc: str) -> dict[str, list[str]]:
    """The parameters each Google-style section (``Args:``, ``Other Parameters:``) of ``doc`` documents."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(doc).splitlines():
        if re.fullmatch(r"[A-Z][A-Za-z ]*:", line):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and (match := re.match(r"    (?:\*\*)?(\w+): ", line)):
            current.append(match[1])
        elif line and not line.startswith(" "):
            current = None
    return sections


def _entry(doc: str, name: str) -> str:
    """The text of one parameter's entry in a Google-style docstring."""
    text = inspect.cleandoc(doc)
    start = text.index(f"\n    {name}: ")
    end = re.compile(r"\n(    \w+: |\S)").search(text, start + 1)
    return text[start : end.start() if end else len(text)]


def test_the_constructors_options_come_day_to_day_first() -> None:
    """ClippedOptimizer's docstring documents every argument once: the six a loop needs day to day
    under ``Args`` (the inner optimizer and max_norm first), every other under ``Other Parameters``."""
    sections = docstring_sections(ClippedOptimizer.__doc__ or "")
    day_to_day, other = sections.get("Args", []), sections.get("Other Parameters", [])
    assert day_to_day[:2] == ["optimizer", "max_norm"] and len(day_to_day) <= 6
    signature = [p for p in inspect.signature(ClippedOptimizer.__init__).parameters if p != "self"]
    assert sorted(day_to_day + other) == sorted(signature)


def test_the_max_norm_docstrings_name_every_policy_and_no_private_module() -> None:
    """The max_norm entry of the constructor and the max_norm property name every ClipPolicy of the
    package (AdaGC and StableSPAM too); the class docstring cites pages, not private module paths."""
    import clipopt

    policies = [n for n in clipopt.__all__ if isinstance(getattr(clipopt, n), type)]
    policies = [n for n in policies if issubclass(getattr(clipopt, n), clipopt.ClipPolicy)]
    policies.remove("ClipPolicy")
    assert {"AdaGC", "StableSPAM", "ZClip"} <= set(policies)
    doc = ClippedOptimizer.__doc__ or ""
    for text in (_entry(doc, "max_norm"), ClippedOptimizer.max_norm.__doc__ or ""):
        assert [p for p in policies if f":class:`{p}`" not in text] == []
    assert re.findall(r"clipopt/_\w+|\b_\w+\.py\b", doc) == []


# ---------------------------------------------------------------- figures come from the scripts' results

RESULTS = REPO / "benchmarks" / "results"


def flat(text: str) -> str:
    """``text`` with every run of white space one space (a page wraps its lines where it likes)."""
    return " ".join(text.split())


def _read(page: str) -> str:
    return (REPO / page).read_text(encoding="utf-8")


def page_section(page: Path, heading: str) -> str:
    """The ``## heading`` section of a page."""
    return section(page.read_text(encoding="utf-8"), heading)


def demo_record() -> tuple[str, str, list[str]]:
    """What benchmarks/demo.py recorded: the measured line, the table block, the other kernels' clauses."""
    text = (RESULTS / "demo.md").read_text(encoding="utf-8")
    measured, rest = text.split("\n\n```text\n", 1)
    block, rest = rest.split("```\n", 1)
    kernels = rest.strip().splitlines()[0].removeprefix("On the same machine ").rstrip(".")
    return measured, block, [c.removeprefix("with ") for c in kernels.split("; ")]


def test_the_demo_record_agrees_with_its_json() -> None:
    """demo.md is what benchmarks/demo.py writes from demo.json (so the pages below quote the run)."""
    record = json.loads((RESULTS / "demo.json").read_text(encoding="utf-8"))
    native = record["runs"][0]
    measured, block, clauses = demo_record()
    plain, clipped = native["summary"]["runs"]["plain SGD"], native["summary"]["runs"]["clipopt"]
    assert f"{plain['heldout_loss']:.3f}" in block and f"{clipped['heldout_loss']:.3f}" in block
    assert f"{plain['max_grad_norm']:.1f}" in block and f"600 / {clipped['clipped']} / 0" in block
    assert native["machine"]["cpu"] in measured and native["machine"]["torch"] in measured
    assert len(clauses) == len(record["runs"]) - 1 >= 1


@pytest.mark.parametrize(
    ("page", "heading"), [("README.md", "The demo"), ("docs/getting-started.md", "The demo")]
)
def test_the_demo_table_and_its_machine_are_the_recorded_run(page: str, heading: str) -> None:
    """The README and the getting-started page show the table benchmarks/demo.py recorded and say where it
    was measured (the plain run's figures change with the CPU's kernels: 9.050 here, 2.820 under avx2;
    before: 5.901 from another machine, with no machine named)."""
    measured, block, clauses = demo_record()
    text = page_section(REPO / page, "The demo")
    assert f"```text\n{block}```" in text
    assert flat(measured).lower().removeprefix("measured ") in flat(text).lower()
    if page == "README.md":
        assert [c for c in clauses if flat(c) not in flat(text)] == []


def test_the_suite_times_in_the_readme_are_the_recorded_run() -> None:
    """The README's test-suite figures are the sentence benchmarks/suite_time.py wrote from its record
    (hand-written before: 1919 passed in 53 s, figures no script regenerated)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_time", REPO / "benchmarks" / "suite_time.py")
    assert spec is not None and spec.loader is not None
    suite_time = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite_time)
    record = json.loads((RESULTS / "suite_time.json").read_text(encoding="utf-8"))
    sentence = (RESULTS / "suite_time.md").read_text(encoding="utf-8").strip()
    assert suite_time.sentence(record) == sentence
    assert all(run["returncode"] == 0 for run in record["runs"].values())
    assert flat(sentence) in flat(page_section(REPO / "README.md", "Development"))


def spike_rows() -> dict[str, dict[str, Any]]:
    """benchmarks/results/spikes.json's rows by configuration."""
    rows = json.loads((RESULTS / "spikes.json").read_text(encoding="utf-8"))["rows"]
    return {row["config"]: row for row in rows}


def table_after(text: str, header_start: str) -> list[list[str]]:
    """The body rows (cells stripped of ``**``) of the Markdown table whose header starts ``header_start``."""
    lines = [line.strip() for line in text[text.index(header_start) :].splitlines()[2:]]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("*") for cell in line.strip("|").split(" | ")])
    return rows


def test_the_spike_tables_are_the_benchmarks() -> None:
    """docs/beyond-clipping.md's table (every configuration, in the script's order) and
    docs/spike-recovery.md's (four of them) quote benchmarks/results/spikes.json."""
    rows = spike_rows()
    beyond = table_after(
        (REPO / "docs" / "beyond-clipping.md").read_text(encoding="utf-8"), "| configuration |"
    )
    assert len(beyond) == len(rows)
    for cells, row in zip(beyond, rows.values(), strict=True):
        per_seed = ", ".join(f"{x:.3f}" for x in row["heldout_per_seed"])
        lost = f"{row['lost']} ({row['skipped']} + {row['undone']})" if row["lost"] else "0"
        assert cells[1:6] == [
            f"{row['heldout_mean']:.3f} ± {row['heldout_sd']:.3f}",
            per_seed,
            f"{row['loss_spikes']} ({row['recovered']})",
            str(row["shard_recovery_median"]),
            lost,
        ], cells[0]
    recovery = table_after(
        (REPO / "docs" / "spike-recovery.md").read_text(encoding="utf-8"), "| configuration |"
    )
    for cells, name in zip(recovery, ["clip", "zclip", "spikeguard", "spikeguard+rewind"], strict=True):
        row = rows[name]
        assert cells[1:3] == [
            f"{row['heldout_median']:.3f}",
            ", ".join(f"{x:.3f}" for x in row["heldout_per_seed"]),
        ], cells[0]


def _update_cost_rows(optimizer: str) -> dict[str, dict[str, float]]:
    """benchmarks/update_cost.py's recorded rows for ``AdamW-<optimizer>``, by method."""
    path = RESULTS / f"update_cost_AdamW-{optimizer}.json"
    return json.loads(path.read_text(encoding="utf-8"))["rows"]  # type: ignore[no-any-return]


def test_beyond_clippings_update_clip_cost_is_the_benchmarks() -> None:
    """docs/beyond-clipping.md's UpdateClip cost since #36 holds what benchmarks/update_cost.py recorded
    (benchmarks/results/update_cost_AdamW-fused.json): each mode's ratio to the recipe a user would
    write, ``restore_state``'s, the recipes' ratio to the clipped update, and the copies held."""
    text = flat(_read("docs/beyond-clipping.md"))
    rows = _update_cost_rows("fused")
    modes = ["update_stats", "update-rms", "update-norm", "update-z"]
    span = re.search(r"time within ([0-9.]+-[0-9.]+)x of the recipe", text)
    assert span is not None and all(_within(span.group(1), rows[m]["vs_recipe"]) for m in modes)
    restore = re.search(r"\(([0-9.]+-[0-9.]+)x the recipe, three copies held\)", text)
    assert restore is not None and _within(restore.group(1), rows["update-norm-restore"]["vs_recipe"])
    recipes = re.search(r"which itself takes about ([0-9.]+-[0-9.]+)x the clipped", text)
    assert recipes is not None
    assert all(_within(recipes.group(1), rows[r]["paired_vs_clip"]) for r in ("recipe-norm", "recipe-rms"))
    param_bytes = json.loads((RESULTS / "update_cost_AdamW-fused.json").read_text(encoding="utf-8"))["meta"][
        "param_bytes"
    ]
    assert "one copy of the parameters held" in text
    assert all(round(rows[m]["held_bytes"] / param_bytes, 2) == 1.0 for m in modes)
    assert round(rows["update-norm-restore"]["held_bytes"] / param_bytes, 2) == 3.0


def test_the_qk_clip_cost_is_the_benchmarks() -> None:
    """docs/qk-clip.md quotes benchmarks/qk_clip_cost.py's record (benchmarks/results/qk_clip_cost.json):
    the paired ratios of a training step with QKClip, every window and every fourth, to the clipped one."""
    rows = json.loads((RESULTS / "qk_clip_cost.json").read_text(encoding="utf-8"))["rows"]
    every, fourth = rows["qk_clip"]["paired"], rows["qk_clip every=4"]["paired"]
    text = flat(_read("docs/qk-clip.md"))
    assert f"a training step took {every:.2f}x the plain clipped step's time with `QKClip(model)`" in text
    assert f"and {fourth:.2f}x with `QKClip(model, every=4)`" in text


def _within(cell: str, value: float) -> bool:
    """Whether ``value``, rounded to the cell's decimals, is the cell's figure or inside its range
    (``1.74x-1.81x``: the page gives the spread over runs, one of which is the recorded one)."""
    figures = [x.rstrip("x") for x in cell.split("-")]
    rounded = round(value, len(figures[0].split(".")[1]))
    return float(figures[0]) <= rounded <= float(figures[-1])


@pytest.mark.parametrize("page", ["docs/benchmarks.md", "benchmarks/README.md"])
def test_the_clipped_update_table_is_bench_pys_record(page: str) -> None:
    """The fused-AdamW table of docs/benchmarks.md and benchmarks/README.md quotes
    benchmarks/results/results.json (bench.py's record): each row's figure, or a range holding it."""
    rows = json.loads((RESULTS / "results.json").read_text(encoding="utf-8"))["rows"]
    recorded = {
        (r["model"], r["method"]): r
        for r in rows
        if r.get("optimizer") == "AdamW-fused" and r.get("accumulation") == 1
    }
    table = table_after(_read(page), "| model | `clip_grad_norm_` + step |")
    assert [cells[0].split(" ")[0] for cells in table] == ["tiny", "medium", "large"]
    for cells in table:
        model = cells[0].split(" ")[0]
        torch_row, ours = recorded[(model, "clip_grad_norm_")], recorded[(model, "clipopt")]
        assert _within(cells[1], torch_row["vs_bare"]), cells
        assert _within(cells[2], ours["vs_bare"]), cells
        assert _within(cells[3], ours["vs_clip_grad_norm_"]), cells
        assert cells[4] == f"{ours['host_reads']:g}", cells


def test_the_integrations_page_names_each_frameworks_own_clip() -> None:
    """docs/integrations.md says, for each framework that clips before clipopt, the setting and how to
    turn it off (TRL's SFTConfig and torchtitan's training.max_norm too)."""
    text = flat(page_section(REPO / "docs" / "integrations.md", "Turn the framework's own clipping off"))
    for needed in [
        "`TrainingArguments(max_grad_norm=...)` (1.0) | `max_grad_norm=0.0`",
        "`SFTConfig(max_grad_norm=...)`",
        "`Trainer(gradient_clip_val=...)`",
        "`[training] max_norm` (1.0)",
        "`--training.max_norm inf`",
        "StackedClipWarning",
    ]:
        assert needed in text


def test_the_limitations_page_says_what_an_extra_step_or_flush_does() -> None:
    """docs/limitations.md says, per backend, what one extra step() or flush() on one rank does and the
    flags that find it (before: only "gloo aborts" for flush(), which under FSDP2 waits instead)."""
    rows = table_after(page_section(REPO / "docs" / "limitations.md", "Distributed training"), "| setting |")
    found = {cells[0]: (cells[1], cells[2]) for cells in rows}
    assert set(found) == {"DDP, gloo", "FSDP2, gloo", "NCCL (DDP or FSDP2)"}
    assert "abort" in found["DDP, gloo"][0] and "PYTHONFAULTHANDLER=1" in found["DDP, gloo"][1]
    assert (
        "timeout" in found["FSDP2, gloo"][0] and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in found["FSDP2, gloo"][1]
    )
    assert "hang" in found["NCCL (DDP or FSDP2)"][0]
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in found["NCCL (DDP or FSDP2)"][1]


def test_the_limitations_table_is_what_rank_mismatch_recorded() -> None:
    """What docs/limitations.md says of an extra step()/flush() is what benchmarks/rank_mismatch.py saw:
    under DDP one rank aborts (SIGABRT) and the other loses its peer; under FSDP2 both time out, and
    with TORCH_DISTRIBUTED_DEBUG=DETAIL both name the mismatched collectives; DDP with DETAIL crashes."""
    record = json.loads((RESULTS / "rank_mismatch.json").read_text(encoding="utf-8"))
    cases = {case["case"]: case["ranks"] for case in record["cases"]}
    timeout = record["timeout"]
    for name in ("ddp-step", "ddp-flush"):
        aborted, other = cases[name]
        assert aborted["ended"] == "signal SIGABRT" and "collective mismatch" in aborted["error"]
        assert "Connection reset by peer" in other["error"]
        assert aborted["seconds_after_the_extra_call"] < timeout  # at once, not after the timeout
    for name in ("fsdp-step", "fsdp-flush"):
        assert any("Timed out waiting" in rank["error"] for rank in cases[name])
        assert all(rank["seconds_after_the_extra_call"] >= timeout for rank in cases[name])
    assert all("Detected mismatch between collectives" in r["error"] for r in cases["fsdp-flush-detail"])
    assert all(r["ended"] == "signal SIGSEGV" for r in cases["ddp-no-extra-call-detail"])
    text = flat(page_section(REPO / "docs" / "limitations.md", "Distributed training"))
    for quoted in [
        "dies with `SIGABRT` (`gloo::EnforceNotMet ... Is there a distributed collective mismatch in your "
        "code?`)",
        "`RuntimeError: ... Connection reset by peer`",
        "`RuntimeError: ... Timed out waiting ...ms for recv operation` (or `send`)",
        "`Detected mismatch between collectives on ranks`",
        "`TORCH_DISTRIBUTED_DEBUG=DETAIL` crashed DDP's constructor with a segmentation fault",
    ]:
        assert quoted in text


def test_the_readme_says_which_torch_the_docs_newer_features_need() -> None:
    """The README's floor is pyproject's, and it says that torch.optim.Muon needs torch 2.9."""
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    floor = re.search(r'"torch>=([\d.]+)"', pyproject)
    assert floor is not None
    readme = flat(section((REPO / "README.md").read_text(encoding="utf-8"), "Two commands"))
    assert f"Any `torch>={floor[1]}` works" in readme
    assert "`torch.optim.Muon` (in the examples with several inner optimizers) came with torch 2.9" in readme


# ---------------------------------------------------------------- the contract lives in the repository

#: What the code and the contributors' pages cite: none of them may cite a file the repository lacks.
_CITING = [
    *sorted((REPO / "clipopt").rglob("*.py")),
    REPO / "ARCHITECTURE.md",
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
]
_SPEC = re.compile(r"\bSPEC\b")


def spec_citations(paths: list[Path]) -> list[str]:
    """``name:line`` of every line of ``paths`` that names "SPEC" (a word, as in "SPEC §1", "SPEC.md")."""
    return [
        f"{path.name}:{i}"
        for path in paths
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _SPEC.search(line)
    ]


def test_nothing_cites_a_contract_outside_the_repository() -> None:
    """The code, ARCHITECTURE.md, the README and docs/ cite the repository's own pages (docs/design.md),
    never "SPEC": a contributor who clones the repository has no such file."""
    assert spec_citations(_CITING) == []


def test_the_spec_check_can_fail(tmp_path: Path) -> None:
    """The check reports "SPEC" as a word (``SPEC §1``, ``SPEC.md``) and leaves words that contain it."""
    path = tmp_path / "mod.py"
    path.write_text('"""In SPEC §1\'s order."""\nSPECIAL = 1  # see SPEC.md\nspec = "SPECS"\n')
    assert spec_citations([path]) == ["mod.py:1", "mod.py:2"]


#: A private name cited in backticks, after "see " or in parentheses: ``_window.rollback.UndoPoint``,
#: `_checkpoint.py`, (see _window.guard).
_PRIVATE_CITED = re.compile(
    r"(?:``?|\bsee |\()(_[a-z][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)(?=``?|\)|[\s,;:]|$)"
)
#: torch's own private names that the code and the pages cite.
_TORCH_PRIVATE = {
    "_foreach",
    "_fused_adamw",
    "_local_scalar_dense",
    "_opt_called",
    "_step_supports_amp_scaling",
}


def _package_names() -> set[str]:
    """Every name the package defines or uses: functions, classes, attributes, variables, arguments."""
    names: set[str] = set()
    for path in sorted((REPO / "clipopt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Name):
                names.add(node.id)
    return names


def _resolves(dotted: str) -> bool:
    """Whether ``clipopt.<dotted>`` is a module of the package, or a name reached from one
    (``_window.rollback.InnerBackup.restore_where``); a ``.py`` name is a file at the top level."""
    if dotted.endswith(".py"):
        return (REPO / "clipopt" / dotted).is_file()
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module("clipopt." + ".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def stale_citations(paths: list[Path], names: set[str]) -> list[str]:
    """``name:line: cited`` of every private module or name ``paths`` cite that the package lacks:
    a dotted one must resolve from a module (``_rollback.UndoPoint`` after the move to
    ``_window/rollback.py`` does not), a bare one be a module or one of ``names``."""
    found = []
    for path in paths:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for cited in _PRIVATE_CITED.findall(line):
                dotted = "." in cited
                if cited in _TORCH_PRIVATE or _resolves(cited) or (not dotted and cited in names):
                    continue
                found.append(f"{path.name}:{i}: {cited}")
    return found


def test_no_comment_or_page_cites_a_module_that_moved() -> None:
    """The code's comments and docstrings, ARCHITECTURE.md, the README and docs/ cite private modules
    by the names they have (``_window.decision.SkipSource``, not ``_decision.SkipSource`` from
    before the layout of #23), and private names the package has."""
    assert stale_citations(_CITING, _package_names()) == []


def test_the_stale_citation_check_can_fail(tmp_path: Path) -> None:
    """The check reports a dotted citation of a module that is gone, a bare one that names nothing,
    and a top-level file that is not there; it leaves those that resolve."""
    path = tmp_path / "mod.md"
    path.write_text(
        "See `_rollback.UndoPoint` (see _window_grads) and `_report_rules.py`.\n"
        "See `_window.rollback.UndoPoint`, ``_checkpoint.wrapper_entry``, (see _window.guard), `_state.py`.\n"
        "`_finish_window` and `_foreach`.\n",
        encoding="utf-8",
    )
    assert stale_citations([path], {"_finish_window"}) == [
        "mod.md:1: _rollback.UndoPoint",
        "mod.md:1: _window_grads",
        "mod.md:1: _report_rules.py",
    ]


_DESIGN = REPO / "docs" / "design.md"
#: An item of a numbered list of the stages: ``3. **diagnose** ...``.
_STAGE_ITEM = re.compile(r"^[ \t]*(\d+)\. \*\*(\w+)\*\*", re.M)
#: A citation: ``stage 2``, ``Stages 4-5``, optionally with the names: ``stage 2 (measure)``,
#: ``stages 4-5 (clip, decide)``.
_STAGE_CITED = re.compile(r"\b[Ss]tages? (\d+)(?:-(\d+))?(?: \(([a-z]+(?:, [a-z]+)*)\))?")
#: The old numbering ("Step 5: the inner step"): the window's modules number stages, never steps.
_STEP_NUMBER = re.compile(r"\b[Ss]teps? \d")
_WINDOW_MODULES = [
    "_optimizer.py",
    "_window/stages.py",
    "_window/decision.py",
    "_window/apply.py",
    "_window/diagnose.py",
]


def section(text: str, heading: str) -> str:
    """The text of the ``## heading`` section of a Markdown page, up to the next ``## `` heading."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def design_stages() -> dict[int, str]:
    """The stages of a window's close as docs/design.md, 'Order of operations', numbers them."""
    items = _STAGE_ITEM.findall(section(_DESIGN.read_text(encoding="utf-8"), "Order of operations"))
    return {int(number): name for number, name in items}


def stage_citation_errors(text: str, stages: dict[int, str]) -> list[str]:
    """Every citation in ``text`` of a stage that ``stages`` lacks, or under another name."""
    errors = []
    for match in _STAGE_CITED.finditer(text):
        first = int(match[1])
        numbers = range(first, int(match[2] or first) + 1)
        if not numbers or any(n not in stages for n in numbers):
            errors.append(f"{match[0]!r}: no such stage")
        elif match[3] is not None and match[3].split(", ") != [stages[n] for n in numbers]:
            errors.append(f"{match[0]!r}: named {[stages[n] for n in numbers]} on the design page")
    return errors


def test_the_design_page_numbers_the_stages_once() -> None:
    """docs/design.md numbers the stages of a window's close 1, 2, ... without a gap, each name once."""
    stages = design_stages()
    assert list(stages) == list(range(1, len(stages) + 1)) and len(stages) >= 5
    assert len(set(stages.values())) == len(stages)


def test_stage_numbers_cited_anywhere_are_the_design_pages() -> None:
    """Every "stage N" (or "stages N-M", with or without the names) cited in clipopt/, ARCHITECTURE.md,
    the README or docs/ is a stage of docs/design.md under the same name; the window's modules number
    no "step N" (the numbering the design page replaced)."""
    stages = design_stages()
    errors = [
        f"{path.name}: {error}"
        for path in _CITING
        for error in stage_citation_errors(path.read_text(encoding="utf-8"), stages)
    ]
    for name in _WINDOW_MODULES:
        text = (REPO / "clipopt" / name).read_text(encoding="utf-8")
        errors += [f"{name}: {m[0]!r}: a step number" for m in _STEP_NUMBER.finditer(text)]
    assert errors == []


def test_the_stage_check_can_fail() -> None:
    """The check reports a stage out of range, a range reaching past the last stage, a wrong name,
    and accepts a correct citation."""
    stages = {1: "combine", 2: "measure", 3: "clip"}
    text = "stage 4; Stages 2-4; stage 2 (clip); stages 1-2 (combine, measure); stage 3"
    assert stage_citation_errors(text, stages) == [
        "'stage 4': no such stage",
        "'Stages 2-4': no such stage",
        "'stage 2 (clip)': named ['measure'] on the design page",
    ]


def test_every_list_of_the_stages_is_the_design_pages() -> None:
    """The numbered lists of the stages -- ClippedOptimizer's docstring, ARCHITECTURE.md's 'How a window
    flows', docs/concepts.md's 'Order of operations' -- have the design page's numbers and names."""
    stages = list(design_stages().items())
    architecture = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    concepts = (REPO / "docs" / "concepts.md").read_text(encoding="utf-8")
    lists = {
        "ClippedOptimizer": ClippedOptimizer.__doc__ or "",
        "ARCHITECTURE.md": section(architecture, "How a window flows"),
        "concepts.md": section(concepts, "Order of operations"),
    }
    for where, text in lists.items():
        assert [(int(n), name) for n, name in _STAGE_ITEM.findall(text)] == stages, where
