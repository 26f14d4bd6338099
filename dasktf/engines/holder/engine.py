"""Asynchronous training: a parameter holder applies each gradient as it arrives.

The master weights and the optimizer state live in one :class:`ParameterHolder`, a
Dask actor on one worker (the *holder*; a worker that is not slowed down). Every
worker loops on its own, one Dask task per update::

    async_step_task on worker i (pinned)
      pull   ── actor call ──► holder: newest weights (version v), unless i has them
      gradient of i's next local batch at version v
      push   ── actor call ──► holder: apply at once (version V → V+1),
                               record staleness = V - v
      return a small StepResult (the record and the batch's metric states)

Gradients and weights travel worker ↔ holder directly; the scheduler is not on
the per-update path and the client only sees the small records. The holder applies
on its event loop, not on its task thread, so a holder that also trains never makes
the others wait for its gradient. The client keeps ``dasktf.async.submit-ahead`` tasks queued per worker and
reacts to their completion (``distributed.as_completed``): it submits that worker's
next batch, accounts the epoch and, at an epoch end, evaluates the holder's current
weights, while the queued tasks keep every worker busy.

*Bounded staleness* (``max_staleness=K``) is enforced where the versions are known,
on the holder, by :class:`StalenessGate`: a pull waits until starting a gradient
cannot let any gradient in flight be applied more than K updates late.

An *epoch* ends once every shard has been consumed once more. Workers never wait for
it: a fast worker goes on into its next pass over its shard (reshuffled by pass)
while a slow one finishes, so examples/s counts every example applied.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf.cluster.deadline import Deadline
from dasktf.cluster.waits import (
    RunContext,
    check_alive,
    raise_task_error,
    wait_for,
)
from dasktf.engines.base import Capabilities, Engine, RunHooks, RunOutcome
from dasktf.engines.holder.actor import ParameterHolder
from dasktf.engines.holder.cursors import InFlight, WorkerCursor
from dasktf.engines.holder.growth import grow_async
from dasktf.engines.holder.records import StepResult, UpdateRecord, updates_frame
from dasktf.engines.holder.rpc import ClientHolder, HolderLostError, HolderRef
from dasktf.engines.holder.tasks import async_step_task, flush_events
from dasktf.exceptions import DasktfError, StepTimeoutError
from dasktf.runtime.replica import (
    EpochReport,
    ReplicaConfig,
    mean_non_trainable,
)

if TYPE_CHECKING:
    from distributed import Future

    from dasktf.runtime.rounds import LocalSpec

logger = logging.getLogger(__name__)


class AsyncEngine(Engine):
    """Runs asynchronous epochs: workers loop freely, the holder applies on arrival.

    Parameters
    ----------
    ctx
        The run's workers and id.
    holder_worker
        Address of the worker that holds the :class:`ParameterHolder`.
    replica_config, weights, probe, val_shards
        What the holder builds its model from (futures of the initial weights, the
        holder worker's shard and the validation shards: they move worker to
        worker, never through the client).
    schedule
        The run's ``steps x workers`` local batch sizes; a worker cycles over the
        non-empty ones of its column.
    max_staleness
        ``K``: no applied update is more than ``K`` updates stale (None: unbounded).
    staleness_lr
        ``"inverse"``: the holder scales an update's learning rate by
        ``1 / max(1, staleness)``.
    epochs
        The run's epochs: the holder stops admitting gradients once they are done,
        so no update is applied past the last epoch (an early stop by a callback
        lets the gradients already admitted, at most one per worker, complete).
    hooks
        What the run provides (:class:`~dasktf.engines.base.RunHooks`): with
        ``on_worker_loss="recover"`` a lost worker's shard is reloaded on a
        survivor, a lost holder rebuilt from its ``holder_inputs``, and an async
        run takes in workers that join.
    """

    mode = "async"
    engine = "graph"
    capabilities = Capabilities(checkpoints="holder", resume=True)

    def __init__(
        self,
        ctx: RunContext,
        holder_worker: str,
        replica_config: ReplicaConfig,
        weights: Any,
        probe: Any,
        val_shards: list[Any],
        schedule: np.ndarray,
        *,
        max_staleness: int | None = None,
        staleness_lr: str | None = None,
        quorum: int | None = None,
        epochs: int | None = None,
        holders: list[str] | None = None,
        plan: list[list[tuple[int, int]]] | None = None,
        hooks: RunHooks | None = None,
        local: LocalSpec | None = None,
    ) -> None:
        hooks = hooks or RunHooks(on_worker_loss="raise")
        self.local = local
        self.ctx = ctx
        self.holder_worker = holder_worker
        self.ahead = max(1, int(config.get("async.submit-ahead")))
        # what rebuilding a lost worker's replica takes (dasktf.engines.holder.recovery.recover_async)
        self.replica_config, self.schedule = replica_config, schedule
        self.shard_index: dict[int, int] = {}
        self.shuffle = hooks.shuffle
        self.reload = hooks.reload
        # an item is a step, or with local_steps a round of steps (its first index
        # counts the round: the replica reads the round's steps itself)
        self.cursors = [WorkerCursor(self._items(schedule[:, i]))
                        for i in range(len(ctx.workers))]
        self.updates: list[UpdateRecord] = []
        self.dropped: dict[int, int] = {i: 0 for i in range(len(ctx.workers))}
        self.applied = 0  # updates the client has seen applied
        self.epoch_records: list[UpdateRecord] = []
        self._epoch_dropped = 0
        self._epoch_states: list[np.ndarray] | None = None
        #: each worker's latest moving statistics (StepResult.non_trainable)
        self._non_trainable: dict[int, list[np.ndarray]] = {}
        #: the gradient tasks not yet gathered (a loss voids them)
        self.in_flight = InFlight(ctx.client.loop)
        #: Fault tolerance (:meth:`_recover`): each cursor's worker address and
        #: replica slot, the item every outstanding task computes, lost futures.
        self.addresses: dict[int, str] = dict(enumerate(ctx.workers))
        self.slots: dict[int, int | None] = {}
        #: The task building a successor's or helper's replica: its step tasks
        #: depend on it, so the client never blocks on it. (A worker thread may wait
        #: in the holder for the others' gradients, quorum or bounded staleness;
        #: a client waiting for a replica queued behind it would stop feeding them.)
        self.building: dict[int, tuple[Future]] = {}
        self.losses: list[dict[str, Any]] = []
        self.policy = hooks.on_worker_loss
        self.publish = hooks.publish
        self.announce = hooks.announce
        self.last_checkpoint = hooks.last_checkpoint
        self.stopped = False
        self._started = False
        #: Elastic growth: called between results, takes in the workers that joined
        #: (async runs that recover; quorum runs keep their workers).
        self.grow: Callable[[AsyncEngine], None] | None = (
            grow_async if self.policy == "recover" and self.mode == "async" else None)
        self.grow_since = time.time()
        self.current_epoch = 0
        self.discarded = 0
        self.final_weights: list[np.ndarray] | None = None
        #: Gradient tasks that computed (and pushed) a gradient, and those that
        #: found the run stopped: ``computed == applied contributions + dropped +
        #: discarded`` (checked by the tests).
        self.tasks = {"computed": 0, "stopped": 0}
        self.epochs = epochs
        # Rounds: the holder applies each round's change with the outer optimizer.
        holder_config = replica_config if local is None else dataclasses.replace(
            replica_config, local=None,
            recipe=dataclasses.replace(replica_config.recipe, optimizer=local.outer))
        self._holder_args = (holder_config, max_staleness, staleness_lr, quorum)
        #: The last learning rate the client set: a holder rebuilt from an older cut
        #: takes it again (dasktf.engines.holder.recovery).
        self.learning_rate: float | None = None
        #: Holders built so far (a lost holder is rebuilt on a survivor:
        #: dasktf.engines.holder.recovery), and the newest state to rebuild it from: a
        #: snapshot taken at the start, at every epoch end and with every checkpoint.
        self.generation = 0
        self.restore_point: dict[str, Any] | None = None
        #: Applied updates undone by a holder restore (they went with the holder).
        self.undone = 0
        self.dropped_base: dict[int, int] = {}
        #: (probe, validation shards) for a new holder on a worker (the RunGuard's).
        self.holder_inputs = hooks.holder_inputs
        #: num_ps=K: the flat-buffer ranges of each holder's slice (dasktf.engines.holder.sharded)
        self.plan = plan or []
        #: num_ps=K: the client's handle on the K holders (dasktf.engines.holder.sharded)
        self.sharded: Any = None
        self._epoch_bytes: list[list[int]] = []
        self.start_holder(holders or [holder_worker], weights, probe, val_shards)

    def _items(self, column: np.ndarray) -> list[int]:
        """The non-empty items of one worker's pass: steps, or rounds."""
        if self.local is None:
            return [s for s in range(len(column)) if column[s] > 0]
        return [r for r in range(self.local.rounds(len(column)))
                if column[list(self.local.round_steps(r, len(column)))].sum() > 0]

    def start_holder(
        self, workers: list[str], weights: Any, probe: Any, val_shards: list[Any]
    ) -> None:
        """Build the run's holders: a :class:`ParameterHolder` on ``workers[0]``, or
        with ``num_ps=K`` holder ``s`` on ``workers[s]`` (dasktf.engines.holder.sharded)."""
        cfg, max_staleness, staleness_lr, quorum = self._holder_args
        args = (cfg, weights, probe, val_shards, max_staleness, staleness_lr, quorum,
                config.get_seconds("step-timeout"), *self._budget(self.epochs))
        # a rebuilt holder's actor must not be mistaken for the lost one's
        key = f"dasktf-holder-{self.ctx.run_id}" + (
            f"-{self.generation}" if self.generation else "")
        if len(self.plan) > 1:
            from dasktf.engines.holder.sharded import ShardedHolders

            self.sharded = ShardedHolders(self, workers, self.plan, args, key)
            holder, ref = self.sharded.coordinator, self.sharded.ref
        else:
            holder = self.ctx.client.submit(
                ParameterHolder, *args, key=key,
                # The holder's state lives on this worker for the whole run.
                workers=workers[:1], allow_other_workers=False, actor=True,
            )
            wait_for(self.ctx, [holder],
                     f"building the parameter holder on {workers[0]}")
            ref = HolderRef(workers[0], holder.key)
        self.generation += 1
        self.holder_worker, self.holder_workers = workers[0], list(workers)
        self._holder_future, self.holder_ref = holder, ref
        # any holder's loss: the coordinator may be waiting on a lost slice's
        self.holder: Any = ClientHolder(
            self.ctx.client, ref, lambda: not set(workers).isdisjoint(self._lost_now()))

    def release_holders(self) -> None:
        """Let go of the holders' actors (never waits: their workers may be gone)."""
        self._holder_future.release()
        if self.sharded is not None:
            self.sharded.close()

    def set_learning_rate(self, lr: float) -> None:
        """The holders apply the next updates with ``lr`` (gradients in flight too:
        the learning rate is the holder's, read when it applies)."""
        self.learning_rate = lr
        try:
            self.holder.set_learning_rate(lr).result(
                timeout=config.get_seconds("step-timeout"))
        except HolderLostError:  # the rebuilt holder takes it (restore_holder)
            pass

    def known_through(self) -> int:
        """The last update ``u`` such that the client has the records of 1..u."""
        known = {r.update for r in self.updates} | {r.update for r in self.epoch_records}
        last = 0
        while last + 1 in known:
            last += 1
        return last

    def take_restore_point(self, snapshot: dict[str, Any] | None = None,
                           source: str = "the last epoch end") -> None:
        """Keep the holder's state (or ``snapshot`` of it) to rebuild it from."""
        if snapshot is None:
            if self.policy != "recover":
                return
            snapshot = self.holder.snapshot(self.known_through()).result(
                timeout=config.get_seconds("step-timeout"))
        if self.restore_point is None or snapshot["version"] >= self.restore_point["version"]:
            self.restore_point = {**snapshot, "source": source}

    def _budget(self, epochs: int | None) -> tuple[dict[int, int] | None, int | None]:
        """The holder stops by itself after the last epoch's updates (not one more)."""
        if epochs is None:
            return None, None
        return {i: len(c.steps) * epochs for i, c in enumerate(self.cursors)
                if c.active and c.feeds is None}, epochs

    # -- submission ---------------------------------------------------------------
    def submit(self, i: int) -> None:
        cursor = self.cursors[i]
        source = cursor if cursor.feeds is None else self.cursors[cursor.feeds]
        while cursor.queued < self.ahead and cursor.steps:
            # a helper's own retries (of a lost helper) first, then its owner's batches
            shard_pass, step = cursor.take() if cursor.retry else source.take()
            future = self.ctx.client.submit(
                async_step_task, self.ctx.run_id, self.holder_ref, shard_pass, step,
                self.slots.get(i), *self.building.get(i, ()),
                # a restored holder recomputes items: a key of its own generation
                key=f"dasktf-async-step-{self.ctx.run_id}-{i}-{shard_pass}-{step}"
                    f"-g{self.generation}",
                # The replica and its shard live on this worker alone.
                workers=[self.addresses[i]], allow_other_workers=False,
                pure=False, resources=self.ctx.resources,
            )
            self.in_flight.add(i, shard_pass, step, future)
            cursor.queued += 1

    def _next_results(self, what: str) -> list[StepResult]:
        """Completed tasks' results; waits bounded, checking the workers' liveness."""
        poll = config.get_seconds("poll-interval")
        deadline = Deadline(config.get_seconds("step-timeout"))
        completed = self.in_flight.completed
        while not completed.has_ready():
            if not self.in_flight:
                raise DasktfError(f"{what}: no update in flight; this is a dasktf bug.")
            # as_completed notifies this condition after queueing a finished future;
            # checking under it loses no wake-up. (distributed.wait would run on the
            # default client's loop, which need not be this run's client.)
            with completed.thread_condition:
                if not completed.has_ready():
                    completed.thread_condition.wait(timeout=poll)
            if not completed.has_ready():
                if self._recover_lost(what):
                    continue
                if deadline.passed():
                    raise StepTimeoutError(
                        f"No update of {what} finished within dasktf.step-timeout; "
                        f"workers {self.ctx.workers} were alive. Check their logs."
                    ) from None
        done = self.in_flight.live(completed.next_batch(block=False))
        # A finished task's result may have died with its worker: gathering it would
        # wait forever. Recover first; the holder says which of them were applied.
        if self._lost_now() or any(f.status != "finished" for f in done):
            self._recover_lost(what)
            done = self.in_flight.live(done)
        if any(f.status == "error" for f in done) and self._await_holder_loss(done, what):
            done = self.in_flight.live(done)
        for f in done:
            self.in_flight.settled(f)
            if f.status == "error":
                raise_task_error(f, what)
        return self._gather(done, what)

    def _await_holder_loss(self, done: list[Future], what: str) -> bool:
        """A task that found the holder unreachable may report it before the
        scheduler reports its worker removed: wait (bounded) for that, and recover.
        ``False`` if no task failed that way."""
        if not any(f.status == "error" and isinstance(f.exception(), HolderLostError)
                   for f in done):
            return False
        self._wait_and_recover(what)
        return True

    def _wait_and_recover(self, what: str) -> None:
        """The holder could not be reached: wait (bounded) for the scheduler to
        report its worker gone, and recover (dasktf.engines.holder.recovery)."""
        poll = config.get_seconds("poll-interval")
        deadline = Deadline(config.get_seconds("worker-loss-timeout"))
        while not self._recover_lost(what):
            if deadline.passed():
                raise HolderLostError(
                    f"During {what} the workers could not reach the parameter holder on "
                    f"{self.holder_worker}, yet the scheduler still lists that worker "
                    "(dasktf.worker-loss-timeout). Check its log and the network "
                    "between the workers."
                )
            time.sleep(poll / 5)

    def _gather(self, done: list[Future], what: str) -> list[StepResult]:
        """Gather finished tasks' results, never waiting on one that died with its
        worker (the scheduler cannot recompute a task pinned to a lost worker)."""
        client = self.ctx.client
        poll = config.get_seconds("poll-interval")
        deadline = Deadline(config.get_seconds("step-timeout"))
        # One gather on the client's loop, awaited a poll at a time. Not a new gather
        # each poll (sync() with a callback_timeout): that leaves the old one running
        # on the loop, so on a loaded machine, once one gather outlasts a poll, every
        # retry starts over behind the abandoned ones and none ever finishes.
        pending: concurrent.futures.Future[Any] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.run_coroutine_threadsafe(
                        client._gather(done), client.loop.asyncio_loop)
                try:
                    results = pending.result(timeout=poll)
                except concurrent.futures.TimeoutError:
                    if self._recover_lost(what):
                        pending.cancel()  # it may wait on a result that died
                        pending = None
                        done = self.in_flight.live(done)
                    elif deadline.passed():
                        raise StepTimeoutError(
                            f"Fetching the results of {what} took longer than "
                            "dasktf.step-timeout; check the workers' logs."
                        ) from None
                    continue
                self.in_flight.gathered(done)
                return results  # type: ignore[no-any-return]
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def _lost_now(self) -> list[str]:
        """Active workers the scheduler has reported removed (no round trip)."""
        watcher = self.ctx.watcher
        if watcher is None:
            return []
        active = [a for i, a in self.addresses.items() if self.cursors[i].active]
        return sorted({c.worker for c in watcher.removed(active)})

    def _recover_lost(self, what: str) -> bool:
        """Recover from the loss of any worker of the run; ``False`` if none was
        lost. Raises :class:`WorkerLostError` under ``on_worker_loss="raise"``."""
        from dasktf.engines.holder.recovery import recover_async

        workers = sorted({a for i, a in self.addresses.items() if self.cursors[i].active})
        lost = self._lost_now()
        if not lost:
            self.ctx.workers = workers
            check_alive(self.ctx, what)
            return False
        if self.policy == "raise":
            self.ctx.workers = workers
            check_alive(self.ctx, what)
        recover_async(self, lost)  # raises, naming the last checkpoint, if the holder went
        return True

    # -- the loop -----------------------------------------------------------------
    def run_epoch(
        self, epoch: int, on_step: Callable[[int], None] | None = None
    ) -> list[EpochReport]:
        """Train until every shard has been consumed once more; evaluate."""
        if not self._started:  # epoch 0, or the first epoch of a resumed run
            self._started = True
            for i in range(len(self.cursors)):  # from prepare()'s restore point
                self.submit(i)
        self.current_epoch = epoch
        what = f"epoch {epoch + 1}"
        while not self._epoch_done(epoch):
            for result in self._next_results(what):
                self.account(result, epoch, on_step)
                self.cursors[result.worker].queued -= 1
                if not self.stopped and result.outcome is not None:
                    self.submit(result.worker)
            if self.grow is not None:
                self.grow(self)
            if self._epoch_done(epoch):
                try:
                    return [self._end_epoch(epoch)]
                except HolderLostError:  # rebuilt from its restore point: go on
                    self._wait_and_recover(what)
        return [self._end_epoch(epoch)]

    def prepare(self) -> None:
        """The first restore point (the run's start, or the resumed cut), taken while
        setting up: a holder lost from then on is rebuilt from it."""
        self.take_restore_point(source="the start of the run")

    def _epoch_done(self, epoch: int) -> bool:
        return min(c.completed_passes for c in self.cursors
                   if c.active and c.feeds is None) > epoch

    def account(
        self, result: StepResult, epoch: int, on_step: Callable[[int], None] | None
    ) -> None:
        if result.outcome is None:
            self.tasks["stopped"] += 1
            return
        self.tasks["computed"] += 1
        if result.non_trainable is not None:  # a dropped gradient's batch counts too
            self._non_trainable[result.worker] = result.non_trainable
        if result.nbytes:  # not a result recovery made up for a lost worker
            self._epoch_bytes.append(result.nbytes)
        cursor = self.cursors[result.worker]
        if cursor.feeds is not None:  # a helper advances the shard it helps
            cursor = self.cursors[cursor.feeds]
        cursor.done_in_pass += 1
        if cursor.done_in_pass == len(cursor.steps):
            cursor.completed_passes, cursor.done_in_pass = cursor.completed_passes + 1, 0
        if result.outcome.status == "dropped":
            self.dropped[result.worker] += 1
            self._epoch_dropped += 1
            return
        if result.metric_states is not None and result.outcome.status != "dropped":
            self._add_states(result.metric_states)
        for record in result.outcome.records:
            record.epoch = epoch
            self.epoch_records.append(record)
        if result.outcome.status == "applied":
            self.applied += 1
            if on_step is not None:
                on_step(self.applied - 1)

    def _add_states(self, states: list[np.ndarray]) -> None:
        if self._epoch_states is None:
            self._epoch_states = [np.array(s, copy=True) for s in states]
        else:
            for total, s in zip(self._epoch_states, states, strict=False):
                total += s

    def send_non_trainable(self) -> None:
        """Give the holder the mean of the workers' latest moving statistics, before
        it evaluates, hands out its weights or is snapshotted (models without
        such state: nothing to send, no call)."""
        active = [v for i, v in self._non_trainable.items() if self.cursors[i].active]
        values = active or list(self._non_trainable.values())
        if values:
            self.holder.set_non_trainable(mean_non_trainable(values)).result(
                timeout=config.get_seconds("step-timeout"))

    def _end_epoch(self, epoch: int) -> EpochReport:
        timeout = config.get_seconds("step-timeout")
        self.send_non_trainable()
        _, val_states, weights = self.holder.evaluate().result(timeout=timeout)
        self.take_restore_point()
        train = self._epoch_states or []
        self._epoch_states = None
        return EpochReport(self.holder_worker, train, val_states, weights)

    def epoch_logs(self, seconds: float) -> dict[str, float]:
        """Per-epoch summaries for ``history.history`` (and the epoch line)."""
        records, self.epoch_records = self.epoch_records, []
        self.updates.extend(records)
        staleness = [r.staleness for r in records]
        examples = sum(r.batch_size for r in records)
        logs = {
            "updates": float(len({r.update for r in records})),
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness_max": float(max(staleness, default=0)),
            "examples_per_sec": examples / seconds if seconds > 0 else 0.0,
        }
        if self.mode == "quorum":
            logs["dropped"] = float(self._epoch_dropped)
        self._epoch_dropped = 0
        if self.plan:  # bytes per update, counted at the codec (dasktf.engines.holder.sharded)
            from dasktf.engines.holder.sharded import byte_logs

            logs.update(byte_logs(self.plan, self._epoch_bytes))
        self._epoch_bytes = []
        return logs

    def finish(self) -> RunOutcome:
        """Stop the workers' loops, drain the queued tasks, check the accounting;
        the final weights and the run's records."""
        if not self.stopped:
            self.stopped = True
            self._drain()
        return RunOutcome(
            final_weights=self.final_weights or [], updates=updates_frame(self.updates),
            dropped=dict(self.dropped),
            gradient_tasks=dict(self.tasks, discarded=self.discarded),
            holder_traffic=self.sharded.traffic(self) if self.sharded is not None else None,
        )

    def _drain(self) -> None:
        timeout = config.get_seconds("step-timeout")
        self.holder.stop().result(timeout=timeout)
        while self.in_flight:
            for result in self._next_results("the end of training"):
                self.account(result, self.current_epoch, None)
                self.cursors[result.worker].queued -= 1
        counters = self.holder.counters().result(timeout=timeout)
        late = self.epoch_records
        self.epoch_records = []
        self.updates.extend(late)
        self.updates.sort(key=lambda r: (r.update, r.worker))
        # A lost worker's last pushes may have been dropped after it died: the
        # holder's count is the only one.
        for i, cursor in enumerate(self.cursors):
            if not cursor.active:
                self.dropped[i] = self.dropped_base.get(i, 0) + counters["dropped"].get(i, 0)
        # drops counted by this holder (a restored holder starts from zero)
        dropped = {i: n - self.dropped_base.get(i, 0) for i, n in self.dropped.items()}
        if counters["version"] != self.applied or dropped != {
            **{i: 0 for i in self.dropped}, **counters["dropped"]
        }:
            raise DasktfError(
                f"Update accounting mismatch: the holder applied {counters['version']} "
                f"updates and dropped {counters['dropped']}, the client saw "
                f"{self.applied} and {self.dropped}. This is a dasktf bug."
            )
        self.discarded = int(counters["discarded"])
        self.send_non_trainable()
        self.final_weights = self.holder.weights().result(timeout=timeout)
        self.ctx.client.run(flush_events, self.ctx.run_id, workers=sorted(
            {a for i, a in self.addresses.items() if self.cursors[i].active}))

    def close(self) -> None:
        try:
            if not self.stopped:
                self.holder.stop().result(timeout=config.get_seconds("poll-interval") * 4)
            self.holder.close().result(timeout=config.get_seconds("poll-interval") * 4)
        except Exception:
            logger.debug("closing the holder of %s failed", self.ctx.run_id, exc_info=True)
        self.in_flight.cancel_all()
        self.release_holders()
