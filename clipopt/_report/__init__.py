"""``clipopt report`` (offline): a training log in, a verdict out.

* :mod:`.read` — the reader registry; :mod:`.read_csv`, :mod:`.read_trainer`,
  :mod:`.read_tensorboard` — one reader per format; :mod:`.reader` — what a reader registers;
  :mod:`.log` — the one shape every reader produces; :mod:`.names` — the names recognised.
* :mod:`.rules` — the verdict rules; :mod:`.report` — the verdict as text or JSON;
  :mod:`.plot` — ``--plot``.
"""
