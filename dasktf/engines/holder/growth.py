"""Elastic growth of asynchronous runs: a worker that joins starts pushing at once.

An async run has no step to wait for, so a new worker need not wait for an epoch
boundary either. It *helps* the shard with the most work left: it gets a replica of
that shard (reloaded from the run's source onto it, with the holder's current
weights) and takes its batches from the same cursor as the shard's own worker. Every
``(pass, step)`` of the shard is still handed out once, so every batch is applied
exactly once; the shard is consumed by two workers, and the epoch ends sooner.

The helper talks to the holder under an identity of its own (its updates show in
``history.updates`` as that worker), which the holder counts against the shard's
budget (:meth:`~dasktf.engines.holder.actor.ParameterHolder.add_helper`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dasktf import config

if TYPE_CHECKING:
    from dasktf.engines.holder.engine import AsyncEngine


def grow_async(engine: AsyncEngine) -> None:
    """Give every worker that joined the run since the last look a shard to help."""
    from dasktf.cluster.local import alive_workers
    from dasktf.engines.holder.cursors import WorkerCursor
    from dasktf.engines.holder.recovery import adopt_async_task

    ctx = engine.ctx
    watcher = ctx.watcher
    if watcher is None or engine.stopped:
        return
    known = sorted(set(engine.addresses.values()))
    joined = watcher.added_since(engine.grow_since, known)
    if not joined:
        return
    client = ctx.client
    alive = set(alive_workers(client))
    timeout = config.get_seconds("step-timeout")
    for worker in [w for w in joined if w in alive]:
        started = time.time()
        owners = [i for i, c in enumerate(engine.cursors) if c.active and c.feeds is None]
        # the shard with the most batches still to hand out in the run's passes
        left = {i: _batches_left(engine, i) for i in owners}
        donor = max(owners, key=lambda i: (left[i], -sum(c.feeds == i for c in engine.cursors)))
        index = engine.shard_index.get(donor, donor)
        identity = len(engine.cursors)
        shard, _ = engine.reload(index, worker)  # type: ignore[misc]
        weights = client.scatter(engine.holder.weights().result(timeout=timeout),
                                 workers=[worker], hash=False)
        built = client.submit(adopt_async_task, ctx.run_id, engine.replica_config, index,
                              identity, shard, engine.schedule[:, index], weights,
                              engine.shuffle, workers=[worker], allow_other_workers=False,
                              pure=False)
        engine.building[identity] = (built,)  # its step tasks wait for it, not the client
        engine.holder.add_helper(identity, donor).result(timeout=timeout)
        owner = engine.cursors[donor]
        engine.cursors.append(WorkerCursor(owner.steps, feeds=donor))
        engine.dropped[identity] = 0
        engine.shard_index[identity] = index
        engine.addresses[identity] = worker
        engine.slots[identity] = identity
        ctx.workers = sorted(set(ctx.workers) | {worker})
        engine.submit(identity)
        record = {"run": ctx.run_id, "kind": "worker_joined", "worker_address": worker,
                  "worker": identity, "shard": index, "helps": donor, "left": left,
                  "join_s": time.time() - started, "wall_time": time.time()}
        engine.publish(record)
        engine.losses.append(record)
        engine.announce(f"worker joined: {worker} helps shard {index} as worker "
                        f"{identity} (async, at once: its tasks queued {record['join_s']:.2f}s after "
                        "it was seen, behind its replica's build)")
    engine.grow_since = time.time()


def _batches_left(engine: AsyncEngine, owner: int) -> int:
    """Batches of ``owner``'s shard not handed out yet in the run's passes."""
    cursor = engine.cursors[owner]
    passes = engine.epochs if engine.epochs is not None else cursor.shard_pass + 1
    ahead = max(0, passes - cursor.shard_pass) * len(cursor.steps) - cursor.position
    return max(0, ahead) + len(cursor.retry)
