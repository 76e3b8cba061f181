"""The extras never replace the user's torch: nothing an extra pulls in asks for a newer torch than
clipopt does.

pip keeps an installed package that satisfies every requirement (its default upgrade strategy is
"only if needed"), so an extra replaces the user's torch only when one of the packages it brings
requires a torch that the installed one does not satisfy. These tests read the requirements of
the packages installed here (``importlib.metadata``), following each extra's requirements through
their own dependencies, and check that every torch requirement met on the way admits the oldest
torch clipopt supports and the one it is tested with.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

OLDEST_TORCH = Version("2.6")
TESTED_TORCH = Version("2.13.0")  # .ci/run's pin


def _requirements(name: str, extras: frozenset[str]) -> list[Requirement]:
    """The installed distribution's requirements that apply with ``extras`` (none when not installed)."""
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        return []
    found = []
    for text in dist.requires or []:
        req = Requirement(text)
        marker: Marker | None = req.marker
        if marker is None or any(marker.evaluate({"extra": extra}) for extra in extras | {""}):
            found.append(req)
    return found


def _torch_requirements(extra: str) -> Iterator[tuple[str, Requirement]]:
    """Every torch requirement reachable from clipopt's ``extra``, with the package that states it."""
    todo = [
        (req, "clipopt")
        for req in _requirements("clipopt", frozenset({extra}))
        if req.marker is not None and req.marker.evaluate({"extra": extra})
    ]
    seen: set[str] = set()
    while todo:
        req, owner = todo.pop()
        name = canonicalize_name(req.name)
        if name == "torch":
            yield owner, req
            continue
        if name == "clipopt":  # an extra naming another extra (test -> integrations)
            todo += [(r, "clipopt") for e in req.extras for r in _requirements("clipopt", frozenset({e}))]
            continue
        if name in seen:
            continue
        seen.add(name)
        todo += [(r, name) for r in _requirements(name, frozenset(req.extras))]


def _extras() -> list[str]:
    """clipopt's extras, from its installed metadata."""
    return sorted(distribution("clipopt").metadata.get_all("Provides-Extra") or [])


def test_the_checks_see_the_installed_extras() -> None:
    """The walk reaches the torch requirements of what the test extra installs (the check is not empty)."""
    owners = {owner for owner, _ in _torch_requirements("test")}
    assert {"lightning", "accelerate", "pytorch-optimizer", "schedulefree"} <= owners


@pytest.mark.parametrize("extra", _extras())
def test_no_extra_asks_for_a_newer_torch(extra: str) -> None:
    """Every torch requirement an extra brings in admits torch 2.6 (our minimum) and 2.13.0 (CI's pin)."""
    too_new = [
        f"{owner} requires {req}"
        for owner, req in _torch_requirements(extra)
        if not (req.specifier.contains(OLDEST_TORCH) and req.specifier.contains(TESTED_TORCH))
    ]
    assert too_new == []
