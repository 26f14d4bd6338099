"""Async and quorum training around a parameter holder (a Dask actor):
:mod:`.engine` (the client side), :mod:`.actor` (the holder and its staleness
gate), :mod:`.rpc` (fail-fast calls), :mod:`.tasks` (the workers' step task),
:mod:`.cursors` (and the in-flight ledger), :mod:`.records`, :mod:`.sharded`
(``num_ps=K``), :mod:`.recovery`, :mod:`.growth`, :mod:`.checkpoint` (the holder's
cut), :mod:`.quorum`, :mod:`.options`.
"""
