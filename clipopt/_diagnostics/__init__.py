"""What a window records, run inside ``step()``.

* :mod:`.stats` — :class:`~clipopt.StepStats`, on the device until read.
* :mod:`.diagnose` — a window's diagnostics; :mod:`.layers` — per-layer statistics;
  :mod:`.badrow` — the per-layer row of a window that went bad.
* :mod:`.snapshot` — anomaly snapshots.
* :mod:`.loggers`, :mod:`.tensorboard` — where statistics go; :mod:`.log_names` — their column
  and tag names; :mod:`.files` — safe file writing.
"""
