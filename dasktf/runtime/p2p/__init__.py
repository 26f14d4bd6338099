"""Worker-to-worker all-reduce over the workers' own Dask comms (issue 28).

:func:`register` puts the handlers on every worker (:mod:`.plugin`); a long-running
task on each member forms a :class:`~dasktf.runtime.p2p.group.Group` and calls
:meth:`~dasktf.runtime.p2p.group.Group.allreduce` once per update
(:mod:`.algorithms`: a ring or recursive doubling, the same bits on every member);
:func:`~dasktf.runtime.p2p.gradients.allreduce_gradient` sums a
:class:`~dasktf.wire.messages.GradientSum`. See docs/p2p.md.
"""
