"""Clipping policies: ``max_norm=AutoClip() | ZClip() | AGC()``, one module per kind of policy.

* :mod:`.builtin` — the interface (:class:`~.builtin.ClipPolicy`) and the built-in policies.

A new policy is one module here plus its export from ``clipopt/__init__.py`` (ARCHITECTURE.md,
'Extension points').
"""
