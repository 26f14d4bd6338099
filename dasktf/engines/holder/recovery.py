"""Async and quorum runs losing a worker: its shard moves to a survivor
(:func:`recover_async`); losing a parameter holder's worker rebuilds the holders on
survivors.

An async (or quorum) run's master weights and optimizer state live in one actor, or
with ``num_ps=K`` in K actors, one slice each (:mod:`.sharded`); when the
worker of any of them dies, its part is gone, with every update applied since the
last state the client kept. The engine keeps a *restore point*
(:meth:`AsyncEngine.take_restore_point`): the holder's (the coordinator's, for all K
slices) consistent cut at the start, at every epoch end and with every checkpoint
(``checkpoint_every`` makes it as fresh as the user wants). Each cut names the
``(worker, pass, step)`` batches it contains, so the run can go on as if the
updates after it never happened:

1. every gradient task in flight is void (it read weights that are gone or pushes
   to a holder that is gone): cancel them all, and tell the survivors' in-flight
   calls to any of the run's holders to give up
   (:func:`~dasktf.engines.holder.rpc.abandon_holder_task`) so their threads are free;
2. the lost worker's shards move to survivors as for any lost worker
   (:func:`recover_async`, below);
3. the surviving old holders are let go, and new ones (new actor keys) are built on
   survivors from the restore point, with the budget of the shards' current owners
   and the cut's batches counted against it;
4. each shard's cursor goes back to the cut: the batches not in it (applied after
   it, or never) are computed again, so over the whole run every batch of the
   requested epochs is applied exactly once to the weights that survive;
5. the client's records of the undone updates are dropped (``engine.undone``
   counts them), and the replicas learn of the new holder with their next task
   (its versions restart at the cut's).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf.data.shards import Shard
from dasktf.exceptions import AllWorkersLostError, WorkerLostError

if TYPE_CHECKING:
    from dasktf.engines.holder.engine import AsyncEngine


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


def recover_async(engine: Any, lost: list[str]) -> None:
    """Go on without the workers in ``lost`` (see :class:`~dasktf.engines.holder.engine.AsyncEngine`).

    Their tasks in flight are cancelled; the holder drops their admissions and
    refuses anything they still send, so no gradient of theirs is applied after this
    and nobody waits for one; the updates of theirs it had applied are accounted;
    each lost shard is reloaded on a survivor, whose new replica carries on where the
    lost one was (its unfinished batches first).
    """
    from dasktf.engines.holder.cursors import WorkerCursor
    from dasktf.engines.holder.records import StepResult

    detected = time.time()
    client, ctx = engine.ctx.client, engine.ctx
    timeout = config.get_seconds("step-timeout")
    removals = {c.worker: c for c in ctx.watcher.removed(lost)} if ctx.watcher else {}
    survivors = sorted({a for a in engine.addresses.values() if a not in lost})
    checkpoint = engine.last_checkpoint()
    holder_lost = not set(engine.holder_workers).isdisjoint(lost)  # any of num_ps=K
    if not survivors or (holder_lost and engine.restore_point is None):
        what = ("a parameter holder's worker" if survivors else "every worker of the run")
        raise (WorkerLostError if survivors else AllWorkersLostError)(
            f"{what} was lost ({', '.join(lost)}); the master weights went with it. "
            + (f"Resume from the last checkpoint, {checkpoint}, with resume=True."
               if checkpoint else "Pass checkpoint_dir= to keep checkpoints to resume from."),
            lost,
        )
    if holder_lost:  # its applies went with it: everything in flight is void
        from dasktf.engines.holder.recovery import abandon_holder

        abandon_holder(engine, survivors)
    moved = []
    for i in [i for i, a in engine.addresses.items() if a in lost and engine.cursors[i].active]:
        # every task of i not yet gathered, finished or not: its result may be lost
        items = engine.in_flight.void(client, worker=i)
        new = len(engine.cursors)
        outcomes, applied = (([], []) if holder_lost else
                             engine.holder.release_worker(i, new, items).result(timeout=timeout))
        done = set(map(tuple, applied))
        old = engine.cursors[i]
        old.active = False
        cursor = WorkerCursor(old.steps, old.shard_pass, old.position, 0,
                               old.completed_passes, old.done_in_pass,
                               [it for it in old.retry + items if it not in done],
                               feeds=old.feeds)
        engine.cursors.append(cursor)
        for c in engine.cursors:  # the workers that joined to help i help its successor
            if c.feeds == i:
                c.feeds = new
        engine.dropped[new] = 0
        index = engine.shard_index.get(i, i)
        engine.shard_index[new] = index
        load = {a: sum(1 for j, b in engine.addresses.items()
                       if b == a and engine.cursors[j].active) for a in survivors}
        adopter = min(survivors, key=lambda a: load[a])
        shard, _ = engine.reload(index, adopter)
        # The holder's weights, not the run's initial ones: Dask's memory manager may
        # have left the only copy of those on the lost worker.
        weights = client.scatter(engine.restore_point["weights"] if holder_lost else
                                 engine.holder.weights().result(timeout=timeout),
                                 workers=[adopter], hash=False)
        built = client.submit(adopt_async_task, ctx.run_id, engine.replica_config, index, new,
                              shard, engine.schedule[:, index], weights,
                              engine.shuffle, workers=[adopter], allow_other_workers=False,
                              pure=False)
        ctx.workers = survivors
        engine.building[new] = (built,)  # its step tasks wait for it, not the client
        engine.addresses[new] = adopter
        engine.slots[new] = new
        for outcome in outcomes:  # applied before the loss, never reported: count them now
            engine.account(StepResult(new, -1, -1, outcome), engine.current_epoch, None)
        if not holder_lost:
            engine.submit(new)
        moved.append((index, adopter))
    restored = None
    if holder_lost:  # a new holder on a survivor, from the newest restore point
        from dasktf.engines.holder.recovery import restore_holder

        restored = restore_holder(engine, survivors)
    resumed = time.time()
    since = min((c.seen_time for c in removals.values()), default=detected)
    for w in lost:
        change = removals.get(w)
        engine.publish({
            "run": ctx.run_id, "kind": "worker_lost", "worker_address": w,
            "detect_s": (change.seen_time - change.scheduler_time) if change else None,
            "removed_at": change.scheduler_time if change else None,
            "detected_at": change.seen_time if change else detected, "wall_time": time.time(),
        })
    recovered = {"run": ctx.run_id, "kind": "recovered", "workers": survivors,
                 "lost": list(lost), "moved": [[i, a] for i, a in moved],
                 "steps_lost": 0, "resume_s": resumed - since, "wall_time": time.time()}
    if restored is not None:
        recovered["holder"] = restored
    engine.publish(recovered)
    engine.losses.append(recovered)
    engine.announce(
        f"worker lost: {', '.join(lost)}; async run goes on with {len(survivors)} "
        f"worker(s) in {resumed - since:.2f}s, shard(s) "
        f"{', '.join(f'{i}->{a}' for i, a in moved)} (in-flight gradients dropped)"
        + (f"; parameter holder(s) rebuilt on "
           f"{', '.join(restored.get('workers', [restored['worker']]))} from update "
           f"{restored['version']} ({restored['source']}), {restored['redone']} "
           "update(s) to redo" if restored else "")
    )


def abandon_holder(engine: AsyncEngine, survivors: list[str]) -> None:
    """Void every gradient task in flight: their pulls and pushes went to the lost
    holder (or will), and whatever it applied of them is lost with it."""
    from dasktf.engines.holder.rpc import abandon_holder_task

    client = engine.ctx.client
    try:  # survivors' threads blocked in a call to the lost holder give up at once
        client.run(abandon_holder_task, *engine.holder_ref.keys(), workers=survivors,
                   on_error="ignore")
    except Exception:  # noqa: BLE001 - the calls still fail on their own, later
        pass
    engine.in_flight.void(client)
    for cursor in engine.cursors:
        cursor.queued = 0


def _holder_workers(engine: AsyncEngine, survivors: list[str]) -> list[str]:
    """The new holders' workers: the (first) holder on the survivor with the fewest
    replicas to feed, the other slices' on the survivors after it."""
    from dasktf.engines.holder.options import spread_holders

    load = {a: sum(1 for i, b in engine.addresses.items()
                   if b == a and engine.cursors[i].active) for a in survivors}
    first = survivors.index(min(survivors, key=lambda a: (load[a], survivors.index(a))))
    return spread_holders(survivors[first:] + survivors[:first], len(engine.plan) or 1)


def restore_holder(engine: AsyncEngine, survivors: list[str]) -> dict[str, Any]:
    """Build new holders on survivors from ``engine.restore_point``, rewind the
    cursors to it and start the workers again; return what was done (an event)."""
    started = time.time()
    ctx = engine.ctx
    client = ctx.client
    timeout = config.get_seconds("step-timeout")
    point = engine.restore_point
    assert point is not None and engine.holder_inputs is not None
    version = int(point["version"])
    workers = _holder_workers(engine, survivors)
    worker = workers[0]
    probe, val = engine.holder_inputs(worker)
    weights = client.scatter(point["weights"], workers=[worker], hash=False)
    engine.release_holders()  # survivors among them must not keep old slices
    engine.start_holder(workers, weights, probe, val)

    # The cut's batches by shard, then by the identity that now owns each shard.
    owners = {engine.shard_index.get(i, i): i for i, c in enumerate(engine.cursors)
              if c.active and c.feeds is None}
    by_shard: dict[int, set[tuple[int, int]]] = {s: set() for s in owners}
    for identity, shard_pass, step in point["items"]:
        by_shard.setdefault(engine.shard_index.get(identity, identity), set()).add(
            (int(shard_pass), int(step)))
    done = {owners[s]: sorted(items) for s, items in by_shard.items() if s in owners}
    engine.holder.restore(point["weights"], point["optimizer"], version,
                          done).result(timeout=timeout)
    if engine.learning_rate is not None:  # set by the client after the cut
        engine.holder.set_learning_rate(engine.learning_rate).result(timeout=timeout)
    for identity, cursor in enumerate(engine.cursors):
        if not cursor.active:
            continue
        if cursor.feeds is not None:  # a joined helper takes its owner's batches again
            cursor.retry = []
            engine.holder.add_helper(identity, cursor.feeds).result(timeout=timeout)
        elif engine.mode == "async":  # quorum steps never owed every batch
            cursor.restore(set(done.get(identity, [])))

    # The updates after the cut went with the holder: forget their records.
    # updates the client knew of past the cut (the cut may also hold a few it had
    # not heard of yet: their records come back below)
    seen = [r.update for r in engine.updates] + [r.update for r in engine.epoch_records]
    undone = max(0, max(seen, default=0) - version)
    engine.undone += undone
    engine.applied = version
    engine.updates = [r for r in engine.updates if r.update <= version]
    engine.epoch_records = [r for r in engine.epoch_records if r.update <= version]
    # applied before the cut, but their results never reached the client
    known = {r.update for r in engine.updates} | {r.update for r in engine.epoch_records}
    for record in point.get("records", []):
        if record.update not in known:
            record.epoch = engine.current_epoch
            engine.epoch_records.append(record)
    engine.dropped_base = dict(engine.dropped)
    for identity, cursor in enumerate(engine.cursors):
        if cursor.active:
            engine.submit(identity)
    event = {"worker": worker, "version": version, "redone": undone,
             "source": point.get("source", "restore point"),
             "restore_s": time.time() - started}
    if engine.sharded is not None:
        event["workers"] = workers
    return event
