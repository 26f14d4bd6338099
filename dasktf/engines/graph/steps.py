"""The synchronous step engine: one Dask task graph per training step.

Per step ``k`` the graph is::

    step(k, w0) ─┐
    step(k, w1) ─┼─► sum ─► step(k+1, w0), step(k+1, w1), ...
    step(k, w2) ─┘

``step`` runs pinned on the worker that holds the shard and replica: it applies the
previous step's summed gradient, then computes this step's gradient (one fused task,
one flat buffer). ``sum`` is a tree of ``dasktf.reduction-fan-in``-ary additions. So a
step costs two dependent task hops and two buffer moves (workers → sum → workers);
with one worker the sum is skipped and a step is one hop, and so it is with two
(lossless): each step sums the pair itself (a direct exchange, below).
Gradients go worker to worker, never through the client, and the client keeps
``dasktf.submit-ahead`` steps in flight, sending ``dasktf.submit-window`` of them to
the scheduler as one graph (:mod:`dasktf.cluster.batch`).

Every gradient is encoded by the run's codec (:mod:`dasktf.wire.codecs`) and counted
at the codec (:mod:`dasktf.wire.packets`). The step graph is one of:

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

import dataclasses
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dasktf import config
from dasktf.cluster.batch import Pending, TaskBatch, resolve
from dasktf.cluster.waits import RunContext, wait_for
from dasktf.engines.base import Capabilities, Engine
from dasktf.engines.mirrored import Mirrored
from dasktf.runtime.replica import EpochReport
from dasktf.runtime.servers import ps_apply_task, server_workers
from dasktf.runtime.tasks import end_epoch_task, epoch_stats_task, step_task
from dasktf.wire.packets import (
    CommSpec,
    TrafficLog,
    chunk_ranges,
    pick,
    reduce_packets,
)

if TYPE_CHECKING:
    from distributed import Future

logger = logging.getLogger(__name__)


class SyncEngine(Mirrored, Engine):
    """Runs epochs of synchronous data-parallel steps as Dask task graphs, with the
    codec, reduction topology and placement of ``spec`` (see the module); chunks and
    server slices are cut from the trainable variables' ``shapes``."""

    mode = "sync"
    engine = "graph"
    capabilities = Capabilities(checkpoints="steps", resume=True)

    def __init__(self, ctx: RunContext, spec: CommSpec, shapes: list[tuple[int, ...]]) -> None:
        self.ctx = ctx
        self.spec = spec
        self._shapes = shapes
        self.chunks = chunk_ranges(spec, self._sizes(), shapes)
        self.n_params = sum(self._sizes())
        self.servers = server_workers(ctx.workers, spec.num_ps)
        #: Raised whenever the servers' slices are reloaded (a rewind, a re-form):
        #: server tasks of an older generation still running then do nothing.
        self.generation = 0
        #: rows of an epoch (bytes per example); set by the engine that knows the schedule
        self.examples_per_epoch = 0
        self.traffic = TrafficLog()
        # all-to-one: one reduction of every gradient
        self.fan_in = (max(2, len(ctx.workers)) if spec.topology == "naive"
                       else max(2, int(config.get("reduction-fan-in"))))
        self.ahead = max(1, int(config.get("submit-ahead")))
        #: Steps sent to the scheduler in one graph (one ``update-graph`` message);
        #: the client waits for as many before it sends the next window.
        self.steps_per_graph = min(self.ahead, max(1, int(config.get("submit-window"))))
        self.batch = TaskBatch(ctx.client)
        #: Global updates applied before the current epoch (steps are numbered from it).
        self.update_base = 0
        #: Appended to task keys after a recovery, whose cancelled keys may linger.
        self.key_suffix = ""
        #: This epoch's steps: ``step -> (gradient parts, their sum)``, futures once
        #: sent. The client asks the scheduler only for what it reads: the sums
        #: (the next window's inputs, which it waits on), and a step's parts when
        #: one of them keeps a checkpoint's state; the rest stay :class:`Pending`
        #: (the scheduler releases them once used, with no message to the client).
        self.in_flight: dict[int, tuple[list[Any], Any]] = {}
        #: The last step of this epoch whose sum the client saw complete.
        self.retired: int | None = None
        #: Checkpoint after every this many steps of an epoch (set by the run's
        #: :class:`~dasktf.run.guard.RunGuard`): the first replica keeps its state after
        #: those updates, so a checkpoint holds exactly them however far ahead it ran.
        self.keep_every: int | None = None
        #: The model has non-trainable float state (BatchNormalization's moving
        #: statistics): every replica updates it from its own batches, so the epoch
        #: end averages it over the replicas (tf.distribute's MEAN aggregation).
        self.average_stats = False
        self.losses: list[dict[str, Any]] = []
        #: The first replica's outer updates of the last epoch (rounds of local steps).
        self.round_log: list[dict[str, Any]] = []

    def respec(self, n_workers: int) -> None:
        """The run re-formed on ``n_workers`` (new replicas): cut the ring's chunks
        as theirs are; the servers go to the workers of the run now."""
        self.spec = dataclasses.replace(self.spec, n_workers=n_workers)
        self.chunks = chunk_ranges(self.spec, self._sizes(), self._shapes)
        self.servers = server_workers(self.ctx.workers, self.spec.num_ps)

    def _sizes(self) -> list[int]:
        return [int(math.prod(shape)) for shape in self._shapes]

    def _reduce(self, parts: list[Any], epoch: int, step: int) -> Pending:
        level, depth = parts, 0
        while len(level) > 1:
            level = [
                self._submit_sum(
                    level[j : j + self.fan_in],
                    f"dasktf-sum-{self.ctx.run_id}-{epoch}-{step}-{depth}-{j}{self.key_suffix}",
                )
                for j in range(0, len(level), self.fan_in)
            ]
            depth += 1
        return level[0]

    def _submit_sum(self, parts: list[Any], key: str) -> Pending:
        # all-to-one means one master: pin it (Dask would otherwise move the sum to
        # whichever worker holds most inputs, spreading the load like a tree)
        return self._task(
            reduce_packets, self.ctx.run_id, self.spec.compression, *parts, key=key,
            worker=self.ctx.workers[0] if self.spec.topology == "naive" else None,
        )

    def submit_step(self, epoch: int, step: int, previous: Any) -> Any:
        parts = self._step_parts(epoch, step, previous)
        total = self._combine(parts, epoch, step)
        self.in_flight[step] = (parts, total)
        self.batch.want(total)
        if step > 0 and self.checkpoint_due(step - 1):  # read by kept_request
            self.batch.want(parts)
        return total

    def _combine(self, parts: list[Pending], epoch: int, step: int) -> Any:
        """What the next step receives: the summed gradient (a future), or several
        futures for a ring or sharded step or a direct exchange."""
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

    def _step_parts(self, epoch: int, step: int, previous: Any) -> list[Pending]:
        """Every worker's step task of this step (their gradients, not yet summed)."""
        return [
            self._task(
                step_task,
                self.ctx.run_id,
                epoch,
                step,
                previous,
                self.update_base + step,
                # rounds: every replica keeps its own inner optimizer state too
                (i == 0 or self.local is not None) and step > 0
                and self.checkpoint_due(step - 1),
                key=f"dasktf-step-{self.ctx.run_id}-{epoch}-{step}-{i}{self.key_suffix}",
                # The replica and shard live on this worker alone: never move the task.
                worker=w,
                resources=self.ctx.resources,
            )
            for i, w in enumerate(self.ctx.workers)
        ]

    def run_epoch(
        self, epoch: int, on_step: Callable[[int], None] | None = None, start: int = 0
    ) -> list[EpochReport]:
        """Train one epoch (from step ``start``); return every replica's report
        (metric states, weights)."""
        window: deque[tuple[int, Any]] = deque()
        previous: Any = None
        self.in_flight, self.retired = {}, None
        step, units = start, self.units_per_epoch
        self.batch = TaskBatch(self.ctx.client)  # nothing left of an interrupted epoch
        while step < units or window:
            # Fill up to ``submit-ahead`` steps in flight, ``submit-window`` of them
            # (at most) in one graph, then wait for as many of the oldest.
            while len(window) < self.ahead and step < units and not self.stop_requested:
                previous = self.submit_step(epoch, step, previous)
                window.append((step, previous))
                step += 1
            if self.stop_requested:  # the steps in flight finish; no new one starts
                step = units
            previous = self._flush(window, previous)
            keep = self.ahead - self.steps_per_graph if step < units else 0
            while len(window) > keep:
                self._retire(window.popleft(), epoch, on_step)
        stats: list[Any] = []
        if self.average_stats:
            # Two phases, submitted at once: every replica's statistics go worker to
            # worker into every end task, which averages them itself (no round trip
            # through the client). A model without them keeps the single task.
            stats = [
                self._task(epoch_stats_task, self.ctx.run_id, previous,
                           key=f"dasktf-epoch-stats-{self.ctx.run_id}-{epoch}-{i}"
                               f"{self.key_suffix}",
                           worker=w, resources=self.ctx.resources)
                for i, w in enumerate(self.ctx.workers)
            ]
            previous = None  # applied by the stats tasks
        ends = [
            self._task(end_epoch_task, self.ctx.run_id, previous, i == 0, *stats,
                       key=f"dasktf-end-epoch-{self.ctx.run_id}-{epoch}-{i}{self.key_suffix}",
                       worker=w, resources=self.ctx.resources)
            for i, w in enumerate(self.ctx.workers)
        ]
        self.batch.want(ends)
        ends = resolve(ends, self.batch.flush())
        wait_for(self.ctx, ends, f"the end of epoch {epoch + 1}")
        self.update_base += self.units_per_epoch
        self.in_flight, self.retired = {}, None
        reports: list[EpochReport] = self.ctx.client.gather(ends)
        self.round_log = list(reports[0].rounds or [])
        # The ledgers ride on the reports: no round trip to the workers per epoch.
        self.traffic.update({r.worker: r.traffic for r in reports if r.traffic is not None},
                            self.ctx.workers)
        return reports

    def _task(self, func: Callable[..., Any], *args: Any, key: str, worker: str | None = None,
              resources: dict[str, float] | None = None, **kwargs: Any) -> Pending:
        """Queue one task of the window being built; ``worker``: pinned there, never
        moved (the replica, shard or server slice it needs lives there alone)."""
        return self.batch.add(func, *args, key=key, resources=resources,
                              workers=None if worker is None else [worker], **kwargs)

    def _flush(self, window: deque[tuple[int, Any]], previous: Any) -> Any:
        """Send the window's tasks (one graph); from here on everything the engine
        holds of them is a future. Returns ``previous`` resolved."""
        futures = self.batch.flush()
        if not futures:
            return previous
        for s, (parts, total) in self.in_flight.items():
            self.in_flight[s] = (resolve(parts, futures), resolve(total, futures))
        for i, (s, item) in enumerate(window):
            window[i] = (s, resolve(item, futures))
        return resolve(previous, futures)

    def kept_request(self) -> tuple[int | None, Any]:
        """``(update, the step task that kept the state after it)`` for the state
        of the last retired step when it is due a checkpoint; ``(None, None)``
        otherwise (the first replica's current state is read)."""
        step = self.retired
        if step is None or not self.checkpoint_due(step) or step + 1 not in self.in_flight:
            return None, None
        return self.update_base + step, self.in_flight[step + 1][0][0]

    def _retire(
        self, item: tuple[int, Future], epoch: int, on_step: Callable[[int], None] | None
    ) -> None:
        step, future = item
        # A ring, sharded or exchange step ends in several futures.
        futures = future if isinstance(future, list) else [future]
        wait_for(self.ctx, futures, f"step {step + 1} of epoch {epoch + 1}")
        for old in [s for s in self.in_flight if s < step - 1]:
            del self.in_flight[old]  # applied everywhere: never needed again
        self.retired = step
        if on_step is not None:
            on_step(step)
