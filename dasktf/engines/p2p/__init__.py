"""Exact sync training with no scheduler task per step: one long-running task per
worker per segment, each step's gradients summed worker to worker over the workers'
own Dask comms (:mod:`dasktf.runtime.p2p`): :mod:`.engine` (the client side, its
recovery from a lost worker) and :mod:`.options` (which runs it takes). See
docs/p2p.md.
"""
