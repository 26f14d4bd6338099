"""The Dask side of a run: the embedded cluster, devices, membership and the one
way to wait on futures with a deadline (:mod:`.waits`).
"""
