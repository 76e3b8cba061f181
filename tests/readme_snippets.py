"""The README's "Training frameworks" snippets, extracted so the tests run exactly what users read."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_snippet(title: str) -> str:
    """The one fenced Python block of the "Training frameworks" section whose first line is ``# {title}``."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Training frameworks") : text.index("## Host synchronisation")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    found = [b for b in blocks if b.startswith(f"# {title}")]
    assert len(found) == 1, f"expected one README snippet starting with '# {title}', found {len(found)}"
    return found[0]


def run_snippet(title: str, workdir: Path, replace: dict[str, str] | None = None) -> dict[str, Any]:
    """Execute the snippet in ``workdir`` (its output files land there) and return its globals.

    ``replace`` substitutes exact text first (each must occur), e.g. a smaller data set.
    """
    code = readme_snippet(title)
    for old, new in (replace or {}).items():
        assert old in code, f"{old!r} not in the README snippet {title!r}"
        code = code.replace(old, new)
    namespace: dict[str, Any] = {"__name__": f"readme_{title.split(':')[0].lower().replace(' ', '_')}"}
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        exec(compile(code, f"README.md ({title})", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace
