"""Data-parallel and sharded training, run inside ``step()``.

* :mod:`.collectives` — norms of sharded gradients over the mesh.
* :mod:`.replicas` — one skip decision on every replica; replica divergence.
* :mod:`.rank_check` — what the ranks compare each window, in a reduction that already runs.
* :mod:`.no_sync` — the open window's gradient synchronisation (``opt.no_sync(model)``).
"""
