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

An *epoch* ends once every batch of every shard's next pass has been applied.
Workers never wait for it: a fast worker goes on into its next pass over its shard
(reshuffled by pass) while a slow one finishes, so examples/s counts every example
applied.

What the client knows of the run (cursors, identities, what is in flight, records,
the restore point) is :class:`~dasktf.engines.holder.state.AsyncState`, which does
no I/O; this class carries out the instructions its stimuli return (a result, a
loss, a worker that joined, a checkpoint loaded) and talks to the holder.
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

from dasktf import compat, config
from dasktf.cluster.deadline import Deadline
from dasktf.cluster.waits import (
    RunContext,
    raise_task_error,
    wait_for,
)
from dasktf.engines.base import (
    Capabilities,
    Checkpoint,
    Engine,
    Resumed,
    RunHooks,
    RunOutcome,
    Saved,
)
from dasktf.engines.holder.actor import ParameterHolder
from dasktf.engines.holder.cursors import InFlight
from dasktf.engines.holder.instructions import (
    AbandonHolder,
    AddHelper,
    Adopt,
    Cancel,
    Instruction,
    RebuildHolder,
    Release,
    RestoreHolder,
    StepApplied,
    Submit,
)
from dasktf.engines.holder.records import StepResult, updates_frame
from dasktf.engines.holder.recovery import Recovery
from dasktf.engines.holder.rpc import (
    ClientHolder,
    HolderLostError,
    HolderRef,
    abandon_holder_task,
)
from dasktf.engines.holder.sharded import ShardedHolders, byte_logs
from dasktf.engines.holder.state import AsyncState, QuorumState, cut_state, resumable
from dasktf.engines.holder.tasks import async_step_task, flush_events
from dasktf.exceptions import DasktfError, StepTimeoutError
from dasktf.runtime.reconcile import on_every_worker
from dasktf.runtime.replica import EpochReport, ReplicaConfig
from dasktf.runtime.statistics import mean_non_trainable
from dasktf.runtime.tasks import set_non_trainable_task

if TYPE_CHECKING:
    from distributed import Future

    from dasktf.runtime.rounds import LocalSpec

logger = logging.getLogger(__name__)


class AsyncEngine(Recovery, Engine):
    """Runs asynchronous epochs: workers loop freely, the holder applies on arrival.

    The holder (on ``holder_worker``) is built from ``replica_config``, ``weights``,
    ``probe`` and ``val_shards``: futures that move worker to worker, never through
    the client. A worker cycles over the non-empty batches of its column of
    ``schedule``. The holder stops admitting gradients once ``epochs`` are done, so
    no update is applied past the last epoch (an early stop lets the gradients
    already admitted, at most one per worker, complete). With
    ``hooks.on_worker_loss="recover"`` a lost worker's shard is reloaded on a
    survivor, a lost holder rebuilt from ``hooks.holder_inputs``, and an async run
    takes in workers that join.
    """

    mode = "async"
    engine = "graph"
    capabilities = Capabilities(checkpoints="updates", resume=True)
    #: takes in the workers that join the run (quorum runs keep theirs)
    grows = True

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
        # what rebuilding a lost worker's replica takes (_adopt)
        self.replica_config, self.schedule = replica_config, schedule
        self.shuffle = hooks.shuffle
        self.reload = hooks.reload
        self.policy = hooks.on_worker_loss
        self.publish = hooks.publish
        self.announce = hooks.announce
        self.workers_changed = hooks.workers_changed
        self.last_checkpoint = hooks.last_checkpoint
        #: (probe, validation shards) for a new holder on a worker (the RunGuard's)
        self.holder_inputs = hooks.holder_inputs
        self.epochs = epochs
        #: num_ps=K: the flat-buffer ranges of each holder's slice (dasktf.engines.holder.sharded)
        self.plan = plan or []
        #: num_ps=K: the client's handle on the K holders (dasktf.engines.holder.sharded)
        self.sharded: ShardedHolders | None = None
        # an item is a step, or with local_steps a round of steps (its first index
        # counts the round: the replica reads the round's steps itself)
        self.run_state = self._new_state(
            run_id=ctx.run_id, workers=list(ctx.workers),
            items=[self._items(schedule[:, i]) for i in range(len(ctx.workers))],
            ahead=max(1, int(config.get("async.submit-ahead"))), epochs=epochs,
            holders=holders or [holder_worker], n_holders=len(self.plan) or 1)
        #: the gradient tasks' futures not yet gathered (a loss voids them)
        self.in_flight = InFlight(ctx.client.loop)
        #: The task building a successor's or helper's replica: its step tasks
        #: depend on it, so the client never blocks on it. (A worker thread may wait
        #: in the holder for the others' gradients, quorum or bounded staleness;
        #: a client waiting for a replica queued behind it would stop feeding them.)
        self.building: dict[int, tuple[Future]] = {}
        self.losses: list[dict[str, Any]] = []
        self._started = False
        #: elastic growth: the last look for workers that joined
        self.grow_since = time.time()
        self.final_weights: list[np.ndarray] | None = None
        # Rounds: the holder applies each round's change with the outer optimizer.
        holder_config = replica_config if local is None else dataclasses.replace(
            replica_config, local=None,
            recipe=dataclasses.replace(replica_config.recipe, optimizer=local.outer))
        self._holder_args = (holder_config, max_staleness, staleness_lr, quorum)
        self.start_holder(self.run_state.holder_workers, weights, probe, val_shards,
                          self.run_state.next_generation())

    def _new_state(self, **kwargs: Any) -> AsyncState:
        return AsyncState(**kwargs)

    def _items(self, column: np.ndarray) -> list[int]:
        """The non-empty items of one worker's pass: steps, or rounds."""
        if self.local is None:
            return [s for s in range(len(column)) if column[s] > 0]
        return [r for r in range(self.local.rounds(len(column)))
                if column[list(self.local.round_steps(r, len(column)))].sum() > 0]

    @property
    def holder_worker(self) -> str:
        """The (coordinating) holder's worker."""
        return self.run_state.holder_workers[0]

    def start_holder(
        self, workers: list[str], weights: Any, probe: Any, val_shards: list[Any],
        generation: int,
    ) -> None:
        """Build the run's holders: a :class:`ParameterHolder` on ``workers[0]``, or
        with ``num_ps=K`` holder ``s`` on ``workers[s]`` (dasktf.engines.holder.sharded)."""
        cfg, max_staleness, staleness_lr, quorum = self._holder_args
        args = (cfg, weights, probe, val_shards, max_staleness, staleness_lr, quorum,
                config.get_seconds("step-timeout"), *self.run_state.budget())
        # a rebuilt holder's actor must not be mistaken for the lost one's
        key = f"dasktf-holder-{self.ctx.run_id}" + (f"-{generation}" if generation else "")
        if len(self.plan) > 1:
            self.sharded = ShardedHolders(self.ctx, workers, self.plan, args, key)
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
        self.run_state.set_learning_rate(lr)
        try:
            self.holder.set_learning_rate(lr).result(
                timeout=config.get_seconds("step-timeout"))
        except HolderLostError:  # the rebuilt holder takes it (RestoreHolder)
            pass

    def take_restore_point(self, snapshot: dict[str, Any] | None = None,
                           source: str = "the last epoch end") -> None:
        """Keep the holder's state (or ``snapshot`` of it) to rebuild it from."""
        if snapshot is None:
            if self.policy != "recover":
                return
            snapshot = self.holder.snapshot(self.run_state.tally.known_through()).result(
                timeout=config.get_seconds("step-timeout"))
        self.run_state.keep_restore_point(snapshot, source)

    # -- carrying out the state's instructions ----------------------------------------
    def _carry_out(self, instructions: list[Instruction],
                   on_step: Callable[[int], None] | None = None) -> None:
        """Do what the state asks (dasktf.engines.holder.state), in order."""
        timeout = config.get_seconds("step-timeout")
        for ins in instructions:
            if isinstance(ins, Submit):
                self.submit(ins)
            elif isinstance(ins, StepApplied):
                if on_step is not None:
                    on_step(ins.unit)
            elif isinstance(ins, Cancel):
                self.in_flight.void(self.ctx.client, ins.keys)
            elif isinstance(ins, Release):
                outcomes, applied = self.holder.release_worker(
                    ins.identity, ins.successor, list(ins.batches)).result(timeout=timeout)
                self._carry_out(self.run_state.worker_released(ins, outcomes, applied))
            elif isinstance(ins, Adopt):
                self._adopt(ins)
            elif isinstance(ins, AddHelper):
                self.holder.add_helper(ins.identity, ins.owner).result(timeout=timeout)
            elif isinstance(ins, AbandonHolder):
                self._abandon_holders(list(ins.survivors))
            elif isinstance(ins, RebuildHolder):
                self._rebuild(ins)
            elif isinstance(ins, RestoreHolder):
                self.holder.restore(ins.weights, ins.optimizer, ins.version,
                                    ins.done).result(timeout=timeout)
                if ins.learning_rate is not None:  # set by the client after the cut
                    self.holder.set_learning_rate(ins.learning_rate).result(timeout=timeout)
            else:
                raise TypeError(f"unknown instruction {ins!r}; this is a dasktf bug.")

    def submit(self, task: Submit) -> None:
        """Send one gradient task to its identity's worker."""
        i = task.identity
        future = self.ctx.client.submit(
            async_step_task, self.ctx.run_id, self.holder_ref, task.shard_pass, task.step,
            self.run_state.slots.get(i), *self.building.get(i, ()), key=task.key,
            # The replica and its shard live on this worker alone.
            workers=[self.run_state.addresses[i]], allow_other_workers=False,
            pure=False, resources=self.ctx.resources,
        )
        self.in_flight.add(future)

    # -- gathering results --------------------------------------------------------
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
                        compat.gather(client, done), client.loop.asyncio_loop)
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

    # -- the loop -----------------------------------------------------------------
    def run_epoch(self, epoch: int, on_step: Callable[[int], None] | None = None,
                  start: int = 0) -> list[EpochReport]:
        """Train until every batch of every shard's next pass is applied; evaluate.
        ``start`` is unused: after a resume the cursors know what is left."""
        state = self.run_state
        if not self._started:  # epoch 0, or the first epoch of a resumed run
            self._started = True
            # from prepare()'s restore point (the run's start, or the resumed cut)
            self._carry_out(state.start())
        state.begin_epoch(epoch)
        what = f"epoch {epoch + 1}"
        while not state.epoch_done(epoch):
            for result in self._next_results(what):
                self._carry_out(state.step_done(result), on_step)
            if self.grows and self.policy == "recover":
                self._grow()
            if state.epoch_done(epoch):
                try:
                    return [self._end_epoch(epoch)]
                except HolderLostError:  # rebuilt from its restore point: go on
                    self._wait_and_recover(what)
        return [self._end_epoch(epoch)]

    def prepare(self) -> None:
        """The first restore point (the run's start, or the resumed cut), taken while
        setting up: a holder lost from then on is rebuilt from it."""
        self.take_restore_point(source="the start of the run")

    def send_non_trainable(self) -> None:
        """Give the holder the mean of the workers' latest moving statistics, before
        it evaluates, hands out its weights or is snapshotted (models without
        such state: nothing to send, no call)."""
        values = self.run_state.statistics()
        if values:
            self.holder.set_non_trainable(mean_non_trainable(values)).result(
                timeout=config.get_seconds("step-timeout"))

    def _end_epoch(self, epoch: int) -> EpochReport:
        timeout = config.get_seconds("step-timeout")
        self.send_non_trainable()
        _, val_states, weights = self.holder.evaluate().result(timeout=timeout)
        self.take_restore_point()
        return EpochReport(self.holder_worker, self.run_state.tally.take_epoch_states(epoch),
                           val_states, weights)

    def epoch_logs(self, seconds: float) -> dict[str, float]:
        """Per-epoch summaries for ``history.history`` (and the epoch line)."""
        logs = self.run_state.epoch_logs(seconds)
        task_bytes = self.run_state.tally.take_epoch_bytes()
        if self.plan:  # bytes per update, counted at the codec (dasktf.engines.holder.sharded)
            logs.update(byte_logs(self.plan, task_bytes))
        return logs

    # -- checkpoints (the format: dasktf.engines.holder.state) ----------------------
    def _snapshot(self) -> dict[str, Any]:
        """The holder's consistent cut, taken between two applies."""
        self.send_non_trainable()
        return self.holder.snapshot(self.run_state.tally.known_through()).result(  # type: ignore[no-any-return]
            timeout=config.get_seconds("step-timeout"))

    def checkpoint(self, epoch: int, epoch_end: bool = False) -> Checkpoint:
        """The holder's consistent cut: its state and the batches of every shard it
        applied; once saved, the newest state a lost holder is rebuilt from."""
        snapshot = self._snapshot()
        fields = {"next_epoch": epoch + 1 if epoch_end else epoch,
                  "n_shards": int(self.schedule.shape[1]),
                  "async": {"version": snapshot["version"],
                            "done": self.run_state.progress(snapshot["items"])}}
        return Checkpoint(cut_state(snapshot), fields,
                          kept=lambda where: self.take_restore_point(snapshot, where),
                          model_optimizer=self.local is None)  # rounds: the outer one

    def resume(self, saved: Saved) -> Resumed:
        """Load an async run's cut into the holder and the cursors, and the model's
        moving statistics into every replica; each shard's unapplied batches (the
        gaps left by gradients in flight at the cut) go first."""
        version, done = resumable(saved, int(self.schedule.shape[1]))
        state = saved.state
        self._carry_out(self.run_state.restored(state["weights"], state["optimizer"],
                                                version, done))
        if saved.statistics is not None:
            # The workers' replicas were built from the initial weights: their moving
            # statistics, whose mean the holder takes at each epoch end, go on from the
            # checkpoint's too.
            on_every_worker(self.ctx, "loading the checkpoint's moving statistics",
                            set_non_trainable_task, self.ctx.run_id, saved.statistics)
        epoch = self.run_state.first_epoch()
        applied = sum(len(v) for v in done.values())
        return Resumed(
            epoch if self.epochs is None else min(epoch, self.epochs), 0,
            f"resumed from {saved.path} at epoch {epoch + 1} (async, update "
            f"{version + 1}, {applied} batches already applied)")

    def final_state(self) -> dict[str, Any] | None:
        """The holder's optimizer state (with rounds it is the outer one, and the
        inner optimizers' states stay each worker's own: none)."""
        if self.local is not None:
            return None
        try:
            return cut_state(self._snapshot())
        except Exception:  # the weights are back; the optimizer state is a bonus
            logger.warning("reading the parameter holder's optimizer state failed; "
                           "history.model's optimizer starts fresh", exc_info=True)
            return None

    # -- the end ----------------------------------------------------------------------
    def finish(self) -> RunOutcome:
        """Stop the workers' loops, drain the queued tasks, check the accounting;
        the final weights and the run's records."""
        state = self.run_state
        if not state.stopped:
            state.stop()
            self._drain()
        return RunOutcome(
            final_weights=self.final_weights or [], updates=updates_frame(state.tally.updates),
            dropped=dict(state.tally.dropped),
            gradient_tasks=dict(state.tally.tasks, discarded=state.tally.discarded),
            holder_traffic=self.sharded.traffic(self.holder) if self.sharded is not None
            else None,
        )

    def _drain(self) -> None:
        timeout = config.get_seconds("step-timeout")
        self.holder.stop().result(timeout=timeout)
        while self.in_flight:
            for result in self._next_results("the end of training"):
                self._carry_out(self.run_state.step_done(result))
        self.run_state.drained(self.holder.counters().result(timeout=timeout))
        self.send_non_trainable()
        self.final_weights = self.holder.weights().result(timeout=timeout)
        self.ctx.client.run(flush_events, self.ctx.run_id, workers=self.run_state.workers())

    def close(self) -> None:
        try:
            if not self.run_state.stopped:
                self.holder.stop().result(timeout=config.get_seconds("poll-interval") * 4)
            self.holder.close().result(timeout=config.get_seconds("poll-interval") * 4)
        except Exception:
            logger.debug("closing the holder of %s failed", self.ctx.run_id, exc_info=True)
        self.in_flight.cancel_all()
        self._abandon_lost_holders()
        self.release_holders()

    def _abandon_lost_holders(self) -> None:
        """A run ending with workers lost (raising, or stopped): the gradient tasks
        still running on the others give up their calls to its holders at once.
        A call to a holder whose worker is gone otherwise holds the worker's one
        thread while Dask retries the connection (``distributed.comm.timeouts.connect``,
        30 s), and the next run's set-up on that worker waited for it."""
        lost = set(self._lost_now())
        if lost:
            self._abandon_holders([w for w in self.run_state.workers() if w not in lost])

    def _abandon_holders(self, survivors: list[str]) -> None:
        """The threads of ``survivors`` blocked in a call to this run's holders
        give up (one of them was lost)."""
        try:
            self.ctx.client.run(abandon_holder_task, *self.holder_ref.keys(),
                                workers=survivors, on_error="ignore")
        except Exception:  # the calls still end on their own, later
            logger.debug("abandoning the holders of %s failed", self.ctx.run_id,
                         exc_info=True)


class QuorumEngine(AsyncEngine):
    """First-k-of-n synchronous training ("backup workers").

    Each step ``s`` applies the sum of the first ``k`` gradients computed on the
    weights of version ``s``; a gradient that arrives after its step was applied is
    *dropped* and counted for its worker (``history.history["dropped"]`` per epoch,
    ``history.dropped`` per worker, ``"dropped": True`` records on the metrics
    stream). The weights live in the same holder as in async mode, in quorum mode:
    a worker's pull waits for the first step it has not contributed to, so no
    worker contributes twice to a step and no gradient counts twice; a worker whose
    gradient was dropped starts its next one from the newest weights, so it never
    lags behind by more than the step it was computing. Steps thus complete at the
    pace of the k-th fastest worker; an epoch is ``steps_per_epoch`` applied steps.

    What differs from an async run is overridden here and in
    :class:`~dasktf.engines.holder.state.QuorumState` (when an epoch ends, the
    budget, drops, no rewind after a holder restore): a quorum run keeps its
    workers (a joined one would change every step's k of N) and saves only its
    final model."""

    mode = "quorum"
    #: the master weights and a step's applied updates are never in one piece
    #: between two steps: only the final model is saved
    capabilities = Capabilities(checkpoints="final", resume=False)
    grows = False

    def __init__(self, *args: Any, quorum: int, **kwargs: Any) -> None:
        super().__init__(*args, quorum=quorum, **kwargs)
        self.quorum = quorum

    def _new_state(self, **kwargs: Any) -> QuorumState:
        return QuorumState(steps_per_epoch=self.ctx.steps_per_epoch, **kwargs)

    def final_state(self) -> None:
        return None
