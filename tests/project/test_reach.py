"""How far each optional feature's name reaches into the runtime (#32): the modules whose code names it.

A feature is a part (clipopt/_part.py) whose contract lives in its own module; the wrapper's face
(``_optimizer.py``: the constructor keyword of SPEC) and that module name it, and as few others as
possible.  A module *names* an option when its code holds the option's name as an identifier (a
variable, attribute, keyword argument or parameter) or inside a string literal; comments,
docstrings and import lines are not counted (a module named after a feature is imported, not
threaded through).  The runtime is every module a training process loads: the package but the
offline tools (``_report/``, ``_replay/``, ``_cli.py``, ``_demo.py``), whose advice names the keyword
a user types.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "clipopt"

#: The options of #32 and the most runtime modules that may name each.
REACH = {
    "update_clip": 4,
    "update_stats": 4,
    "rewind": 4,
    "spike_guard": 4,
    "layer_stats": 4,
    "snapshot_dir": 4,
    "loggers": 4,
}

#: The offline tools: not loaded by a training process.
OFFLINE = ("_report", "_replay", "_cli.py", "_demo.py")


def names_in(source: str) -> set[str]:
    """The options of :data:`REACH` that ``source``'s code names (see the module's docstring)."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skipped |= {id(sub) for sub in ast.walk(node)}
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skipped.add(id(node.value))  # a docstring or a bare string
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        words: list[str] = []
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, (ast.keyword, ast.arg)):
            words = [node.arg or ""]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words = [node.name]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words = [name for name in REACH if re.search(rf"\b{name}\b", node.value)]
        found |= {w for w in words if w in REACH}
    return found


def reach(runtime_only: bool = True) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name in REACH}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if runtime_only and rel.startswith(OFFLINE):
            continue
        for name in names_in(path.read_text(encoding="utf-8")):
            out[name].append(rel)
    return out


def test_the_counter_sees_code_and_not_prose() -> None:
    """Identifiers and string literals count; comments, docstrings and imports do not."""
    source = (
        '"""update_clip in a docstring."""\n'
        "from ._window.update_clip import UpdateClip  # rewind in a comment\n"
        "def f(spike_guard):\n"
        '    """layer_stats here too."""\n'
        "    x.loggers = 1\n"
        "    g(update_stats=True)\n"
        '    return "pass snapshot_dir=..."\n'
    )
    assert names_in(source) == {"spike_guard", "loggers", "update_stats", "snapshot_dir"}


def test_each_option_reaches_few_runtime_modules() -> None:
    """Each option is named by at most its budget of runtime modules (the wrapper's face, its part, ...)."""
    found = reach()
    over = {name: modules for name, modules in found.items() if len(modules) > REACH[name]}
    assert over == {}, over
