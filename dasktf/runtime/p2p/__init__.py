"""Worker-to-worker all-reduce over the workers' own Dask comms (issue 28).

:func:`dasktf.runtime.p2p.plugin.register` puts the handlers on every worker; a
long-running task on each member forms a :class:`~dasktf.runtime.p2p.group.Group`
and calls :meth:`~dasktf.runtime.p2p.group.Group.allreduce` once per update
(:mod:`dasktf.runtime.p2p.algorithms`: recursive doubling, or a direct or ring
reduce-scatter + all-gather; the same bits on every member);
:func:`~dasktf.runtime.p2p.gradients.allreduce_gradient` sums a
:class:`~dasktf.wire.messages.GradientSum`. See docs/p2p.md.
"""
