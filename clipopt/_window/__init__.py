"""A window's close, run inside ``step()`` (docs/design.md, 'Order of operations').

* :mod:`.stages` — the stages that decide on the device: measure, agree, clip, decide.
* :mod:`.grads` — the parameters a wrapper steps and the gradients one window measures.
* :mod:`.decision` — the window's one decision (:class:`~.decision.WindowDecision`) and its skip signals.
* :mod:`.apply` — applying the decision to the inner optimizer; :mod:`.rollback` — undoing a step.
* :mod:`.loss` — the window's loss; :mod:`.groups` — per-group clipping options.
* :mod:`.guard` — the open window's guard; :mod:`.skip_run` — the warning on a run of skips.
"""
