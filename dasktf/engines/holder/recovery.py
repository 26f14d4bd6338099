"""How an async engine goes on when workers are lost or join: its I/O (the rules
are :class:`~dasktf.engines.holder.state.AsyncState`'s).

:class:`Recovery` is part of :class:`~dasktf.engines.holder.engine.AsyncEngine`
(a mixin, so the engine's module stays readable); its methods hear of a loss from
the scheduler, carry out what the state decides and report it.

A lost worker (:meth:`AsyncState.worker_lost`): its tasks in flight are cancelled;
the holder drops its admissions and refuses anything it still sends, so no gradient
of its is applied after that and nobody waits for one; the updates of its that the
holder had applied are accounted; its shard is reloaded on the least loaded
survivor, whose new replica carries on where the lost one was (its unfinished
batches first).

A lost holder. An async (or quorum) run's master weights and optimizer state live
in one actor, or with ``num_ps=K`` in K actors, one slice each
(:mod:`.sharded`); when the worker of any of them dies, its part is gone, with
every update applied since the last state the client kept. The engine keeps a
*restore point* (:meth:`AsyncEngine.take_restore_point`): the holder's (the
coordinator's, for all K slices) consistent cut at the start, at every epoch end
and with every checkpoint (``checkpoint_every`` makes it as fresh as the user
wants). Each cut names the ``(worker, pass, step)`` batches it contains, so the run
can go on as if the updates after it never happened:

1. every gradient task in flight is void (it read weights that are gone or pushes
   to a holder that is gone): cancel them all, and tell the survivors' in-flight
   calls to any of the run's holders to give up
   (:func:`~dasktf.engines.holder.rpc.abandon_holder_task`) so their threads are free;
2. the lost worker's shards move to survivors as for any lost worker;
3. the surviving old holders are let go, and new ones (new actor keys) are built on
   survivors from the restore point, with the budget of the shards' current owners
   and the cut's batches counted against it;
4. each shard's cursor goes back to the cut: the batches not in it (applied after
   it, or never) are computed again, so over the whole run every batch of the
   requested epochs is applied exactly once to the weights that survive;
5. the client's records of the undone updates are dropped (``undone`` counts them),
   and the replicas learn of the new holder with their next task (its versions
   restart at the cut's).

A worker that joins (:meth:`AsyncState.worker_joined`). An async run has no step
to wait for, so a new worker need not wait for an epoch boundary either. It
*helps* the shard with the most work left: it gets a replica of that shard
(reloaded from the run's source onto it, with the holder's current weights) and
takes its batches from the same cursor as the shard's own worker, under an
identity of its own (its updates show in ``history.updates`` as that worker),
which the holder counts against the shard's budget
(:meth:`~dasktf.engines.holder.actor.ParameterHolder.add_helper`). The shard is
consumed by two workers, and the epoch ends sooner.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf.cluster.deadline import Deadline
from dasktf.cluster.waits import check_alive
from dasktf.data.shards import Shard
from dasktf.diagnostics.events import (
    recovered_record,
    worker_joined_record,
    worker_lost_records,
)
from dasktf.engines.holder.instructions import AddHelper, Adopt, RebuildHolder
from dasktf.engines.holder.rpc import HolderLostError
from dasktf.exceptions import AllWorkersLostError, WorkerLostError

if TYPE_CHECKING:
    from collections.abc import Callable

    from distributed import Future

    from dasktf.cluster.waits import RunContext
    from dasktf.engines.holder.instructions import Instruction
    from dasktf.engines.holder.sharded import ShardedHolders
    from dasktf.engines.holder.state import AsyncState
    from dasktf.runtime.replica import ReplicaConfig


def adopt_async_task(
    run_id: str, config: Any, index: int, identity: int, shard: Shard,
    column: np.ndarray, weights: list[np.ndarray], shuffle: bool,
) -> int:
    """Build a replica of shard ``index`` on this worker for a lost one; it speaks to
    the parameter holder as ``identity`` (the holder refuses the lost one's)."""

    from dasktf.runtime.replica import Replica, register_replica

    replica = Replica(config, index, shard, column, weights, None, shuffle)
    replica.run_id = run_id
    replica.identity = identity
    register_replica(run_id, replica, slot=identity)
    return len(shard)


class Recovery:
    """:class:`~dasktf.engines.holder.engine.AsyncEngine`'s losses and growth."""

    if TYPE_CHECKING:  # the engine's, used here
        ctx: RunContext
        run_state: AsyncState
        holder: Any
        holder_worker: str
        sharded: ShardedHolders | None
        policy: str
        replica_config: ReplicaConfig
        schedule: np.ndarray
        shuffle: bool
        reload: Callable[[int, str], tuple[Any, Any]] | None
        holder_inputs: Callable[[str], tuple[Any, list[Any]]] | None
        publish: Callable[[dict[str, Any]], None]
        announce: Callable[[str], None]
        workers_changed: Callable[[list[str]], None]
        last_checkpoint: Callable[[], str | None]
        building: dict[int, tuple[Future]]
        losses: list[dict[str, Any]]
        grow_since: float

        def _carry_out(self, instructions: list[Instruction]) -> None: ...
        def release_holders(self) -> None: ...
        def start_holder(self, workers: list[str], weights: Any, probe: Any,
                         val_shards: list[Any], generation: int) -> None: ...

    _rebuilt_at = 0.0

    # -- hearing of a loss --------------------------------------------------------
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
        report its worker gone, and recover (:meth:`_recover`)."""
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

    def _lost_now(self) -> list[str]:
        """Active workers the scheduler has reported removed (no round trip)."""
        watcher = self.ctx.watcher
        if watcher is None:
            return []
        return sorted({c.worker for c in watcher.removed(self.run_state.workers())})

    def _recover_lost(self, what: str) -> bool:
        """Recover from the loss of any worker of the run; ``False`` if none was
        lost. Raises :class:`WorkerLostError` under ``on_worker_loss="raise"``."""
        workers = self.run_state.workers()
        lost = self._lost_now()
        if not lost or self.policy == "raise":
            self.workers_changed(workers)
            check_alive(self.ctx, what)
        if not lost:
            return False
        self._recover(lost)  # raises, naming the last checkpoint, if the holder went
        return True

    # -- worker loss and growth ---------------------------------------------------
    def _recover(self, lost: list[str]) -> None:
        """Go on without the workers in ``lost``: their shards move to survivors,
        and a lost holder is rebuilt from the restore point
        (:meth:`~dasktf.engines.holder.state.AsyncState.worker_lost`)."""
        detected = time.time()
        ctx, state = self.ctx, self.run_state
        removals = {c.worker: c for c in ctx.watcher.removed(lost)} if ctx.watcher else {}
        survivors = state.survivors(lost)
        holder_lost = not set(state.holder_workers).isdisjoint(lost)  # any of num_ps=K
        if not survivors or (holder_lost and state.restore_point is None):
            checkpoint = self.last_checkpoint()
            what = ("a parameter holder's worker" if survivors else "every worker of the run")
            raise (WorkerLostError if survivors else AllWorkersLostError)(
                f"{what} was lost ({', '.join(lost)}); the master weights went with it. "
                + (f"Resume from the last checkpoint, {checkpoint}, with resume=True."
                   if checkpoint else "Pass checkpoint_dir= to keep checkpoints to resume from."),
                lost,
            )
        first = len(state.cursors)
        self.workers_changed(survivors)
        instructions = state.worker_lost(lost)
        self._carry_out(instructions)
        moved = [(state.shard_index[i], state.addresses[i]) for i in range(first, len(state.cursors))]
        restored: dict[str, Any] | None = None
        for ins in instructions:
            if isinstance(ins, RebuildHolder):
                restored = {"worker": ins.workers[0], "version": ins.version,
                            "redone": ins.redone, "source": ins.source,
                            "restore_s": time.time() - self._rebuilt_at}
                if self.sharded is not None:
                    restored["workers"] = list(ins.workers)
        since = min((c.seen_time for c in removals.values()), default=detected)
        for record in worker_lost_records(ctx.run_id, lost, detected, removals):
            self.publish(record)
        recovered = recovered_record(ctx.run_id, survivors, lost, since, moved,
                                     **({"holder": restored} if restored else {}))
        self.publish(recovered)
        self.losses.append(recovered)
        self.announce(
            f"worker lost: {', '.join(lost)}; async run goes on with {len(survivors)} "
            f"worker(s) in {recovered['resume_s']:.2f}s, shard(s) "
            f"{', '.join(f'{i}->{a}' for i, a in moved)} (in-flight gradients dropped)"
            + (f"; parameter holder(s) rebuilt on "
               f"{', '.join(restored.get('workers', [restored['worker']]))} from update "
               f"{restored['version']} ({restored['source']}), {restored['redone']} "
               "update(s) to redo" if restored else "")
        )

    def _grow(self) -> None:
        """Give every worker that joined since the last look a shard to help
        (:meth:`~dasktf.engines.holder.state.AsyncState.worker_joined`)."""
        from dasktf.cluster.membership import alive_workers

        ctx, state = self.ctx, self.run_state
        if ctx.watcher is None or state.stopped:
            return
        joined = ctx.watcher.added_since(self.grow_since, sorted(set(state.addresses.values())))
        if not joined:
            return
        alive = set(alive_workers(ctx.client))
        for worker in [w for w in joined if w in alive]:
            started = time.time()
            left = state.batches_left()
            instructions = state.worker_joined(worker)
            (adopt,) = [i for i in instructions if isinstance(i, Adopt)]
            (helps,) = [i.owner for i in instructions if isinstance(i, AddHelper)]
            self.workers_changed(sorted(set(ctx.workers) | {worker}))
            self._carry_out(instructions)
            record = worker_joined_record(ctx.run_id, worker, started, worker=adopt.identity,
                                          shard=adopt.shard, helps=helps, left=left)
            self.publish(record)
            self.losses.append(record)
            self.announce(f"worker joined: {worker} helps shard {adopt.shard} as worker "
                          f"{adopt.identity} (async, at once: its tasks queued "
                          f"{record['join_s']:.2f}s after it was seen, behind its "
                          "replica's build)")
        self.grow_since = time.time()

    def _adopt(self, ins: Adopt) -> None:
        """Build ``ins.identity``'s replica of its shard on its worker (a lost one's
        successor, or a worker that joined); its tasks depend on the build."""
        client, timeout = self.ctx.client, config.get_seconds("step-timeout")
        shard, _ = self.reload(ins.shard, ins.worker)  # type: ignore[misc]
        # The holder's weights, not the run's initial ones: Dask's memory manager may
        # have left the only copy of those on a lost worker.
        point = self.run_state.restore_point
        weights = client.scatter(
            point["weights"] if ins.from_restore_point and point is not None
            else self.holder.weights().result(timeout=timeout),
            workers=[ins.worker], hash=False)
        built = client.submit(adopt_async_task, self.ctx.run_id, self.replica_config,
                              ins.shard, ins.identity, shard, self.schedule[:, ins.shard],
                              weights, self.shuffle, workers=[ins.worker],
                              allow_other_workers=False, pure=False)
        self.building[ins.identity] = (built,)

    def _rebuild(self, ins: RebuildHolder) -> None:
        """New holders on ``ins.workers`` from the restore point (its state follows,
        :class:`RestoreHolder`); the surviving old ones are let go."""
        self._rebuilt_at = time.time()
        point = self.run_state.restore_point
        assert point is not None and self.holder_inputs is not None
        worker = ins.workers[0]
        probe, val = self.holder_inputs(worker)
        weights = self.ctx.client.scatter(point["weights"], workers=[worker], hash=False)
        self.release_holders()  # survivors among them must not keep old slices
        self.start_holder(list(ins.workers), weights, probe, val, ins.generation)

