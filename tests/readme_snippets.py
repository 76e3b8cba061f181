"""The framework snippets of docs/integrations.md, extracted so the tests run exactly what users read.

(The module kept its name from when the snippets were in the README.)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"


def readme_snippet(title: str) -> str:
    """The one fenced Python block of docs/integrations.md whose first line is ``# {title}``."""
    text = PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    found = [b for b in blocks if b.startswith(f"# {title}")]
    assert len(found) == 1, f"expected one snippet starting with '# {title}' in {PAGE}, found {len(found)}"
    return found[0]


def run_snippet(title: str, workdir: Path, replace: dict[str, str] | None = None) -> dict[str, Any]:
    """Execute the snippet in ``workdir`` (its output files land there) and return its globals.

    ``replace`` substitutes exact text first (each must occur), e.g. a smaller data set.
    """
    code = readme_snippet(title)
    for old, new in (replace or {}).items():
        assert old in code, f"{old!r} not in the docs snippet {title!r}"
        code = code.replace(old, new)
    namespace: dict[str, Any] = {"__name__": f"docs_{title.split(':')[0].lower().replace(' ', '_')}"}
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        exec(compile(code, f"docs/integrations.md ({title})", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace
