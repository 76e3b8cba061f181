"""Every fenced ```python block of the documentation runs: each docs/*.md page, and the README.

The blocks of one page run in order in one namespace (a page builds on its earlier blocks), in a
temporary working directory, on the CPU (``torch.cuda.is_available()`` reads False while they run).
Pages are found with a glob, so a new page is tested without being listed here. Blocks that must not
run are fenced as ```text or ```bash.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from clipopt import ClippedOptimizer

REPO = Path(__file__).resolve().parent.parent
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
            "tests/test_docs.py::test_block_extraction",
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
