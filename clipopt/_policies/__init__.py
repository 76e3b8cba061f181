"""Clipping policies (``max_norm=AutoClip() | ZClip() | AGC() | AdaGC() | StableSPAM()``), one module each.

* :mod:`.builtin` — the base (:class:`~.builtin.ClipPolicy`, :class:`~.builtin.TensorPolicy`) and the
  global and unit-wise policies (AutoClip, ZClip, AGC).
* :mod:`.kinds` — the three kinds of policy and what an in-place policy sees of a window
  (:class:`~.kinds.PolicyWindow`).
* :mod:`.adagc`, :mod:`.stable_spam` — the per-tensor policies.

A new policy is one module here plus its export from ``clipopt/__init__.py`` (ARCHITECTURE.md,
'Extension points').
"""
