"""``clipopt replay`` and ``clipopt inspect`` (offline): anomaly snapshots read and rerun.

* :mod:`.replay` — rerun a snapshot; :mod:`.watch` — the first operator that goes non-finite.
* :mod:`.inspect` — what a snapshot says; :mod:`.growth` — which layer's gradient grew most.
* :mod:`.cli`, :mod:`.text` — the command's work and its output.
"""
