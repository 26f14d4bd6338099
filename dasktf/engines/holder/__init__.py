"""Async and quorum training around a parameter holder (a Dask actor):
:mod:`.state` (what the client knows of the run, a pure state machine, its
checkpoints' format, and :mod:`.instructions`, what it asks for), :mod:`.engine`
(the client side: their I/O; the quorum engine), :mod:`.recovery` (its losses and
growth), :mod:`.actor` (the holder and its staleness gate), :mod:`.rpc` (fail-fast
calls), :mod:`.tasks` (the workers' step task), :mod:`.cursors` (and the futures in
flight), :mod:`.records`, :mod:`.sharded` (``num_ps=K``), :mod:`.options`.
"""
