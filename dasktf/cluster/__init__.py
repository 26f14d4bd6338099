"""The Dask side of a run: the embedded cluster, devices, membership and the one
way to wait on futures (:mod:`.waits`) or poll with a time limit
(:mod:`.deadline`).
"""
