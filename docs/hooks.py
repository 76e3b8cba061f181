"""MkDocs hook: show the docstrings' Sphinx roles (:class:`X`, :func:`~a.b.f`) as plain code.

The docstrings are written for ``help()`` and Sphinx-style readers; mkdocstrings renders the
backticked part as code and leaves the role name in front of it. This drops the role name, and a
leading ``~`` (Sphinx's "show the last part only") together with the dotted prefix.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|data|attr|meth|mod|exc|obj|py:\w+):(<code>)(~?)([^<]*)(</code>)")


def _plain(match: re.Match[str]) -> str:
    opening, tilde, name, closing = match.groups()
    return f"{opening}{name.rsplit('.', 1)[-1] if tilde else name}{closing}"


def on_page_content(html: str, **kwargs: Any) -> str:
    """Rewrite the roles of one rendered page."""
    return _ROLE.sub(_plain, html)
