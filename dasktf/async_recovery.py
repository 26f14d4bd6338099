"""Losing a parameter holder's worker: rebuild the holders on survivors.

An async (or quorum) run's master weights and optimizer state live in one actor, or
with ``num_ps=K`` in K actors, one slice each (:mod:`dasktf.async_ps`); when the
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
   (:func:`~dasktf.asynchronous.abandon_holder_task`) so their threads are free;
2. the lost worker's shards move to survivors as for any lost worker
   (:func:`dasktf.elastic.recover_async`);
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

from dasktf import config

if TYPE_CHECKING:
    from dasktf.asynchronous import AsyncEngine


def abandon_holder(engine: AsyncEngine, survivors: list[str]) -> None:
    """Void every gradient task in flight: their pulls and pushes went to the lost
    holder (or will), and whatever it applied of them is lost with it."""
    from dasktf.asynchronous import abandon_holder_task

    client = engine.ctx.client
    try:  # survivors' threads blocked in a call to the lost holder give up at once
        client.run(abandon_holder_task, *engine.holder_ref.keys(), workers=survivors,
                   on_error="ignore")
    except Exception:  # noqa: BLE001 - the calls still fail on their own, later
        pass
    futures = [v[3] for v in engine._items.values()]
    engine._items.clear()
    client.cancel(futures, force=True)
    for f in futures:
        engine._outstanding.discard(f)
        engine._dead.add(f.key)
    for cursor in engine.cursors:
        cursor.queued = 0


def _holder_workers(engine: AsyncEngine, survivors: list[str]) -> list[str]:
    """The new holders' workers: the (first) holder on the survivor with the fewest
    replicas to feed, the other slices' on the survivors after it."""
    from dasktf.asynchronous import spread_holders

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
    seen = [r.update for r in engine.updates] + [r.update for r in engine._epoch_records]
    undone = max(0, max(seen, default=0) - version)
    engine.undone += undone
    engine.applied = version
    engine.updates = [r for r in engine.updates if r.update <= version]
    engine._epoch_records = [r for r in engine._epoch_records if r.update <= version]
    # applied before the cut, but their results never reached the client
    known = {r.update for r in engine.updates} | {r.update for r in engine._epoch_records}
    for record in point.get("records", []):
        if record.update not in known:
            record.epoch = engine._epoch
            engine._epoch_records.append(record)
    engine._dropped_base = dict(engine.dropped)
    for identity, cursor in enumerate(engine.cursors):
        if cursor.active:
            engine._submit(identity)
    event = {"worker": worker, "version": version, "redone": undone,
             "source": point.get("source", "restore point"),
             "restore_s": time.time() - started}
    if engine.sharded is not None:
        event["workers"] = workers
    return event
