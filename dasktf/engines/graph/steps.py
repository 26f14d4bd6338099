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
(lossless): each step sums the pair itself (a direct exchange, dasktf.engines.graph.topology).
Gradients go worker to worker, never through the client, and the client keeps
``dasktf.submit-ahead`` steps in flight, sending ``dasktf.submit-window`` of them to
the scheduler as one graph (:mod:`dasktf.engines.batch`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dasktf import config
from dasktf.cluster.waits import RunContext, wait_for
from dasktf.engines.base import Capabilities, Engine
from dasktf.engines.batch import Pending, TaskBatch, resolve
from dasktf.engines.mirrored import Mirrored
from dasktf.runtime.replica import EpochReport
from dasktf.runtime.tasks import end_epoch_task, epoch_stats_task, step_task
from dasktf.wire.messages import sum_gradients

if TYPE_CHECKING:
    from distributed import Future

logger = logging.getLogger(__name__)


class SyncEngine(Mirrored, Engine):
    """Runs epochs of synchronous data-parallel steps as Dask task graphs."""

    mode = "sync"
    engine = "graph"
    capabilities = Capabilities(checkpoints="steps", resume=True)

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.fan_in = max(2, int(config.get("reduction-fan-in")))
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
        """One reduction task (dasktf.engines.graph.topology's engine sums encoded packets)."""
        return self._task(sum_gradients, *parts, key=key)

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
        futures for a ring or sharded step or a direct exchange
        (:class:`dasktf.engines.graph.topology.CommEngine`)."""
        return self._reduce(parts, epoch, step)

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
        # A ring, sharded or exchange step ends in several futures (dasktf.engines.graph.topology).
        futures = future if isinstance(future, list) else [future]
        wait_for(self.ctx, futures, f"step {step + 1} of epoch {epoch + 1}")
        for old in [s for s in self.in_flight if s < step - 1]:
            del self.in_flight[old]  # applied everywhere: never needed again
        self.retired = step
        if on_step is not None:
            on_step(step)
