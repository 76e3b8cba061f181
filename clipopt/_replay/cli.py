"""``clipopt replay SNAPSHOT --model pkg.mod:factory --loss pkg.mod:fn``: the work behind the command.

``--model`` and ``--loss`` name Python objects as ``module:attribute`` (a
dotted module path importable from the current directory, or a ``.py`` file),
as uvicorn and gunicorn do: ``factory()`` builds the model that was trained (not
wrapped in DDP), ``fn(model, attached)`` returns the loss of the snapshot's
attached batch.  A ``.py`` file runs once (for both options) with its folder importable,
as ``python file.py`` would.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from torch import nn

__all__ = ["ReplayCommandError", "resolve", "run"]


class ReplayCommandError(Exception):
    """A problem with the command's arguments; the message is one line meant for the user."""


def resolve(spec: str, option: str) -> Any:
    """The object ``spec`` (``pkg.mod:name`` or ``path/file.py:name``) names; ``option`` is for messages."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ReplayCommandError(
            f"{option} {spec!r} is not module:name; pass e.g. {option} mypkg.models:build"
        )
    try:
        module = _import(module_name)
    except ImportError as exc:
        if not _is_the_module(exc, module_name):
            raise  # raised by the user's module as it ran (a dependency it lacks): its traceback
        raise ReplayCommandError(f"{option} {spec!r}: cannot import {module_name} ({exc})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ReplayCommandError(f"{option} {spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ReplayCommandError(f"{option} {spec!r} is not callable (it is {type(obj).__name__})")
    return obj


#: The ``.py`` files loaded, by real path: ``--model`` and ``--loss`` naming one file run it once.
_FILES: dict[str, Any] = {}


def _is_the_module(exc: ImportError, name: str) -> bool:
    """Whether ``exc`` says that module ``name`` itself (or a package above it) cannot be found,
    as against an import that failed inside it."""
    missing = exc.name
    return missing is not None and (missing == name or name.startswith(missing + "."))


def _import(name: str) -> Any:
    if name.endswith(".py"):
        if not os.path.isfile(name):
            raise ImportError(f"no such file {name}", name=name)
        path = os.path.realpath(name)
        if path in _FILES:
            return _FILES[path]
        spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], name)
        if spec is None or spec.loader is None:
            raise ImportError(f"{name} is not a Python file", name=name)
        module = importlib.util.module_from_spec(spec)
        folder = os.path.dirname(path)
        if folder not in sys.path:  # as `python file.py` does: the file imports its neighbours
            sys.path.insert(0, folder)
        spec.loader.exec_module(module)
        _FILES[path] = module
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does for the current folder
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(name)


def run(file: str, model_spec: str, loss_spec: str, repeats: int, as_json: bool) -> str:
    """Replay ``file`` and return the account (text or JSON); :class:`ReplayCommandError` for bad input."""
    from .inspect import InspectError, inspect_file
    from .replay import ReplayInputError, replay
    from .text import format_json, format_text

    try:
        inspect_file(file)  # the same one-line messages as `clipopt inspect` for missing or damaged files
    except InspectError as exc:
        raise ReplayCommandError(str(exc)) from None
    factory = resolve(model_spec, "--model")
    loss_fn = resolve(loss_spec, "--loss")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ReplayCommandError(
            f"--model {model_spec!r} returned {type(model).__name__}; it must return the torch.nn.Module "
            "that was trained"
        )
    try:
        result = replay(file, model, loss_fn, repeats=repeats)
    except ReplayInputError as exc:  # the snapshot does not fit the model, loss_fn returned no loss ...
        raise ReplayCommandError(str(exc)) from None  # (an error of the user's own code keeps its traceback)
    return format_json(result) if as_json else format_text(result)
