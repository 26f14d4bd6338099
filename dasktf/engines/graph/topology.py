"""How a sync step moves gradients: the reduction topology and the placement.

:class:`CommEngine` is the sync engine (:class:`dasktf.engines.graph.steps.SyncEngine`) with every
gradient encoded by the run's codec (:mod:`dasktf.wire.codecs`) and counted at the
codec (:mod:`dasktf.wire.packets`). Its step graph is one of:

``topology="tree"`` (default)
    a tree of reductions, ``dasktf.reduction-fan-in`` gradients each; Dask runs
    each where most of its inputs already are. The reducing worker receives
    ``fan_in - 1`` gradients and sends the sum to every other worker.
``topology="naive"``
    all-to-one: one task, pinned to the first worker (the master), sums all N
    gradients.
``topology="ring"``
    reduce-scatter / all-gather in the graph: each gradient leaves its worker as N
    chunks; worker c sums chunk c of all gradients (pinned there), and every
    worker's next step gathers the N summed chunks. Each worker sends and receives
    ``2 (N-1)/N`` gradients per step, the allreduce lower bound, at the price of
    N^2 + N more (small) tasks per step.
two workers, lossless (``compression="none"``), tree: a *direct exchange*
    no reduction task: each worker's next step takes both gradients and sums them
    itself, in worker order, bitwise as the reduction would. With two workers the
    reduction is a pure extra hop (~7 ms of scheduling per step, see
    benchmarks/RESULTS.md) that moves the same bytes: each worker sends one
    gradient and receives one either way. A lossy codec keeps the reduction (its
    re-encoded sum is what every replica applies).
``placement="ps"``
    sharded parameter servers (:mod:`dasktf.runtime.servers`): chunk s goes to server s, which
    applies the optimizer to its slice and sends the slice's weights back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dasktf.cluster.waits import RunContext
from dasktf.engines.batch import Pending
from dasktf.engines.graph.steps import SyncEngine
from dasktf.runtime.servers import ps_apply_task, server_workers
from dasktf.wire.packets import (
    CommSpec,
    TrafficLog,
    chunk_ranges,
    pick,
    reduce_packets,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from dasktf.runtime.replica import EpochReport


class CommEngine(SyncEngine):
    """Sync steps with a codec, a reduction topology and a placement (see module).

    Parameters
    ----------
    ctx
        The run's workers and id.
    spec
        The run's :class:`~dasktf.wire.packets.CommSpec` (``n_workers`` filled in).
    shapes
        The trainable variables' shapes (chunks and server slices are cut from them).
    """

    def __init__(self, ctx: RunContext, spec: CommSpec, shapes: list[tuple[int, ...]]) -> None:
        super().__init__(ctx)
        self.spec = spec
        self.n_params = int(sum(_size(s) for s in shapes))
        if spec.topology == "naive":
            self.fan_in = max(2, len(ctx.workers))
        self._shapes = shapes
        self.chunks = chunk_ranges(spec, [_size(s) for s in shapes], shapes)
        self.servers = server_workers(ctx.workers, spec.num_ps)
        #: Raised whenever the servers' slices are reloaded (a rewind, a re-form):
        #: server tasks of an older generation still running then do nothing.
        self.generation = 0
        #: rows of an epoch (bytes per example); set by the engine that knows the schedule
        self.examples_per_epoch = 0
        self.traffic = TrafficLog()

    def respec(self, n_workers: int) -> None:
        """The run re-formed on ``n_workers`` (new replicas): cut the ring's chunks
        as theirs are; the servers go to the workers of the run now."""
        import dataclasses

        self.spec = dataclasses.replace(self.spec, n_workers=n_workers)
        self.chunks = chunk_ranges(self.spec, [_size(s) for s in self._shapes], self._shapes)
        self.servers = server_workers(self.ctx.workers, self.spec.num_ps)

    # -- the graph --------------------------------------------------------------
    def _submit_sum(self, parts: list[Any], key: str) -> Pending:
        # all-to-one means one master: pin it (Dask would otherwise move the sum to
        # whichever worker holds most inputs, spreading the load like a tree)
        return self._task(
            reduce_packets, self.ctx.run_id, self.spec.compression, *parts, key=key,
            worker=self.ctx.workers[0] if self.spec.topology == "naive" else None,
        )

    def _combine(self, parts: list[Pending], epoch: int, step: int) -> Any:
        if self.spec.placement == "ps":
            return self._scatter(parts, epoch, step, self.servers, "ps")
        if self.spec.n_chunks > 1:
            # chunk c on worker c; after a loss (until the run re-forms at the epoch
            # boundary) the survivors take the N chunks round the ring
            workers = self.ctx.workers
            targets = [workers[c % len(workers)] for c in range(len(self.chunks))]
            return self._scatter(parts, epoch, step, targets, "ring")
        if self.exchanges(len(parts)):
            return list(parts)  # the next step sums them (dasktf.runtime.channel.receive)
        return self._reduce(parts, epoch, step)

    def exchanges(self, n_workers: int) -> bool:
        """Whether a step of ``n_workers`` is a direct exchange (see the module):
        decided per step, as a lost worker can bring a run down to two."""
        return (
            n_workers == 2
            and self.spec.topology == "tree"
            and self.spec.placement == "mirrored"
            and self.spec.compression == "none"
        )

    def _scatter(
        self, parts: list[Pending], epoch: int, step: int, targets: list[str], what: str
    ) -> list[Pending]:
        """Chunk c of every gradient to ``targets[c]``, reduced (ring) or applied
        (ps) there; returns the N (or K) tasks the next step gathers."""
        run = self.ctx.run_id
        n = len(self.chunks)
        out = []
        for c, target in enumerate(targets):
            if n == 1:
                inputs = parts
            else:
                inputs = [
                    self._task(
                        pick, p, c,
                        key=f"dasktf-take-{run}-{epoch}-{step}-{i}-{c}{self.key_suffix}",
                        # The packets are on worker i: taking one there moves nothing.
                        worker=w,
                    )
                    for i, (p, w) in enumerate(zip(parts, self.ctx.workers, strict=False))
                ]
            key = f"dasktf-{what}-{run}-{epoch}-{step}-{c}{self.key_suffix}"
            if what == "ps":
                future = self._task(
                    ps_apply_task, run, c, self.chunks[c], self.spec.weights_dtype,
                    *inputs, key=key, update=self.update_base + step,
                    keep=self.checkpoint_due(step), generation=self.generation,
                    # The server's master slice and optimizer state live there.
                    worker=target,
                )
            else:
                future = self._task(
                    reduce_packets, run, self.spec.compression, *inputs, key=key,
                    worker=target,
                )
            out.append(future)
        return out

    # -- the figures ------------------------------------------------------------
    def run_epoch(
        self, epoch: int, on_step: Callable[[int], None] | None = None, start: int = 0
    ) -> list[EpochReport]:
        reports = super().run_epoch(epoch, on_step, start)
        # The ledgers ride on the reports: no round trip to the workers per epoch.
        self.traffic.update({r.worker: r.traffic for r in reports if r.traffic is not None},
                            self.ctx.workers)
        return reports



def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
