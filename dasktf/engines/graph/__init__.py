"""Sync training as one Dask task graph per step: :mod:`.steps` (the engine: tree,
naive, ring, the two-worker exchange, servers) and :mod:`.elastic` (worker loss
and growth).
"""
