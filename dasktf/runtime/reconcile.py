"""What recovering, checkpointing and re-forming a run of mirrored replicas takes
of the replicas (every replica holds the whole model and applies the same updates:
the graph and the p2p engines).

Worker side: read a replica's training state (:func:`replica_state_task`), load one
(:func:`set_state_task`), fence a replica so it applies nothing more
(:func:`fence_task`), adopt a lost worker's shard (:func:`adopt_task`), ramp the
learning rate, read the log of applied updates. Client side, over a run's workers:
:func:`fence` and :func:`reconcile` (every survivor to the newest update one of
them holds), :func:`read_state`, :func:`load_state`, :func:`round_state`,
:func:`applied_logs`, :func:`set_learning_rate` and :func:`ramp_learning_rate`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dasktf.cluster.batch import TaskBatch
from dasktf.cluster.broadcast import broadcast
from dasktf.cluster.calls import call_on_workers
from dasktf.cluster.waits import RunContext, WatchedClient, wait_for
from dasktf.data.shards import Shard
from dasktf.runtime.replica import get_replica, take_kept
from dasktf.runtime.tasks import set_learning_rate_task
from dasktf.transport import built_optimizer


# -- the worker side ---------------------------------------------------------------
def replica_state_task(run_id: str, update: int | None = None, after: Any = None) -> dict[str, Any]:
    """The replica's full training state: weights, optimizer variables, counters;
    with ``update``, the state kept right after that update if this replica kept it
    (``after`` is the step task that kept it: a dependency, never read)."""
    replica = get_replica(run_id)
    with replica.apply_lock:
        kept = take_kept(replica.kept, update)
    return kept if kept is not None else replica.training_state()


def set_state_task(
    run_id: str, state: dict[str, Any], unfence: bool = True, rewind: bool = False
) -> int:
    """Load a state from :func:`replica_state_task` (or a checkpoint) into the
    replica. ``rewind``: an older state than the replica's (a sharded run's restore
    point): the updates after it are forgotten, to be applied again, and the
    epoch's metric totals start over; the learning rate stays the replica's (the
    epoch's, which a callback may have set after an epoch-end restore point was
    kept: the updates are trained again at the rate they were first trained at)."""
    replica = get_replica(run_id)
    with replica.apply_lock:
        replica.model.set_weights(state["weights"])
        if replica.rounds is not None:  # inner optimizer states are each worker's own
            replica.rounds.load(state)
        else:
            optimizer = built_optimizer(replica.model)
            rate = learning_rate_of(optimizer) if rewind else None
            for v, value in zip(optimizer.variables, state["optimizer"], strict=False):
                v.assign(value)
            if rate is not None:
                optimizer.learning_rate = rate
        applied = int(state["applied"])
        if rewind:
            replica.applied_log = [u for u in replica.applied_log if u <= applied]
            replica.kept = {}
            replica.model.reset_metrics()
        # The updates this state holds count as applied here, once each.
        replica.applied_log.extend(range(replica.applied + 1, applied + 1))
        replica.applied = applied
        if unfence:
            replica.fenced = False
        return replica.applied


def learning_rate_of(optimizer: Any) -> float | None:
    """``optimizer``'s learning rate when it is a variable (a callback's to set);
    ``None`` when a schedule computes it."""
    import keras

    rate = optimizer.learning_rate
    return float(rate.numpy()) if isinstance(rate, keras.Variable) else None


def fence_task(run_id: str) -> int:
    """Stop this replica applying anything (cancelled steps may still be running);
    return the last update it applied."""
    replica = get_replica(run_id)
    with replica.apply_lock:
        replica.fenced = True
        return replica.applied


def unfence_task(run_id: str) -> int:
    replica = get_replica(run_id)
    with replica.apply_lock:
        replica.fenced = False
        return replica.applied


def adopt_task(
    run_id: str, index: int, shard: Shard, column: np.ndarray, val: Shard | None
) -> int:
    """Take over a lost worker's shard (and validation piece); returns rows held."""
    replica = get_replica(run_id)
    with replica.apply_lock:
        replica.adopted.append((index, shard, np.asarray(column)))
        if val is not None and len(val):
            mine = replica.val_shard
            replica.val_shard = val if mine is None else Shard.concat([mine, val])
    return len(replica.shard) + sum(len(s) for _, s, _ in replica.adopted)


def ramp_lr_task(run_id: str, factor: float, steps: int) -> tuple[float, float]:
    """Scale the learning rate by ``factor``, linearly over the next ``steps`` updates
    (the warm-up of Goyal et al., 2017); returns (old, new)."""
    from dasktf.runtime.servers import ramp_shards_learning_rate

    replica = get_replica(run_id)
    with replica.apply_lock:
        old = float(replica.model.optimizer.learning_rate.numpy())
        new = old * float(factor)
        replica.lr_ramp = (replica.applied + 1, max(1, int(steps)), old, new)
    ramp_shards_learning_rate(run_id, float(factor), steps)  # placement="ps": they train
    return old, new


def ramp_learning_rate(ctx: RunContext, factor: float, steps: int) -> tuple[float, float]:
    """Every replica (and server) of the run scales its learning rate by ``factor``
    over the next ``steps`` updates; the rates before and after."""
    futures = on_every_worker(ctx, "rescaling the learning rate", ramp_lr_task,
                              ctx.run_id, factor, steps)
    return ctx.client.gather(futures)[0]  # type: ignore[no-any-return]


def set_learning_rate(ctx: RunContext, lr: float) -> None:
    """Every replica's optimizer takes ``lr`` (between epochs: nothing in flight)."""
    on_every_worker(ctx, "setting the learning rate", set_learning_rate_task, ctx.run_id, lr)


def applied_log_task(run_id: str) -> tuple[int, list[int]]:
    replica = get_replica(run_id)
    return replica.index, list(replica.applied_log)


# -- the client side -----------------------------------------------------------------
def _pinned(ctx: RunContext, func: Any, *args: Any, worker: str, key: str | None = None
            ) -> Any:
    kw = {} if key is None else {"key": key}
    return ctx.client.submit(func, *args, workers=[worker], allow_other_workers=False,
                             pure=False, **kw)


def on_every_worker(ctx: RunContext, what: str, func: Any, *args: Any) -> list[Any]:
    """``func(*args)`` pinned to each of the run's workers, waited for (``what``:
    named if a worker is lost meanwhile); the futures, in the workers' order."""
    futures = pinned_each(ctx, func, *args, workers=ctx.workers)
    wait_for(ctx, futures, what)
    return futures


def pinned_each(ctx: RunContext, func: Any, *args: Any, workers: list[str],
                keys: list[str] | None = None) -> list[Any]:
    """``func(*args)`` pinned to each of ``workers`` (task ``keys[i]`` on worker
    ``i`` if given), sent as one ``update-graph`` message: N submits were N
    messages to the scheduler (:mod:`dasktf.cluster.batch`)."""
    batch = TaskBatch(ctx.client)
    return batch.send([batch.add(func, *args, workers=[w],
                                 key=None if keys is None else keys[i])
                       for i, w in enumerate(workers)])


def fence(ctx: RunContext, survivors: list[str], attempt: int) -> list[int]:
    """Stop ``survivors`` applying anything (what still runs of the steps in flight
    then changes nothing); the update each had applied, in their order."""
    fences = pinned_each(ctx, fence_task, ctx.run_id, workers=survivors,
                         keys=[f"dasktf-fence-{ctx.run_id}-{attempt}-{i}"
                               for i in range(len(survivors))])
    wait_for(ctx, fences, "fencing the surviving replicas")
    return ctx.client.gather(fences)  # type: ignore[no-any-return]


def reconcile(ctx: RunContext, survivors: list[str], applied: list[int]) -> int:
    """Bring every fenced survivor to the most advanced one's state and unfence
    them all (all replicas are identical after an update, so this is exactly the
    newest update one of them applied, ``max(applied)``, which it returns)."""
    target = max(applied)
    source = survivors[applied.index(target)]
    state = _pinned(ctx, replica_state_task, ctx.run_id, worker=source)
    sets = [_pinned(ctx, set_state_task, ctx.run_id, state, worker=w)
            for w, a in zip(survivors, applied, strict=True) if a < target]
    unfences = [_pinned(ctx, unfence_task, ctx.run_id, worker=w)
                for w, a in zip(survivors, applied, strict=True) if a == target]
    wait_for(ctx, [state, *sets, *unfences], "reconciling the surviving replicas")
    return target


def read_state(ctx: RunContext, update: int | None = None, after: Any = None
               ) -> dict[str, Any]:
    """The run's training state, read from its first replica (see
    :func:`replica_state_task`): a task after ``after``, else a call that costs
    the scheduler nothing (:mod:`dasktf.cluster.calls`: the state a run's end
    reads into ``history.model``)."""
    what = "reading the training state"
    if after is None:
        return call_on_workers(ctx, what, replica_state_task,  # type: ignore[no-any-return]
                               [(ctx.workers[0], (ctx.run_id, update))])[0]
    f = _pinned(ctx, replica_state_task, ctx.run_id, update, after, worker=ctx.workers[0])
    wait_for(ctx, [f], what)
    return ctx.client.gather(f, direct=True)  # type: ignore[no-any-return]


def load_state(ctx: RunContext, state: dict[str, Any]) -> None:
    """Load ``state`` (a checkpoint's, or the run's at a re-form) into every replica."""
    what = "loading the checkpoint into the replicas"
    big = broadcast(WatchedClient(ctx, what), state)
    on_every_worker(ctx, what, set_state_task, ctx.run_id, big)


def applied_logs(ctx: RunContext) -> dict[int, list[int]]:
    """``{replica index: updates it applied, in order}`` over the run's workers."""
    futures = on_every_worker(ctx, "reading the applied updates", applied_log_task,
                              ctx.run_id)
    return dict(ctx.client.gather(futures))


def round_state(ctx: RunContext, update: int | None, kept_by: list[Any]) -> dict[str, Any]:
    """Rounds of local steps: the first replica's state (weights, outer optimizer)
    with every replica's inner optimizer state, ``{index: variables}``, and change
    its sparse codec has not sent, ``{index: flat}``, all at the same round start
    (``update``: the one each kept, ``kept_by`` its step tasks)."""
    client = ctx.client
    batch = TaskBatch(client)  # one message (see pinned_each)
    futures = batch.send([batch.add(replica_state_task, ctx.run_id, update, after,
                                    workers=[w])
                          for w, after in zip(ctx.workers, kept_by, strict=True)])
    wait_for(ctx, futures, "reading the replicas' training states")
    states = client.gather(futures, direct=True)
    applied = {s["applied"] for s in states}
    if len(applied) != 1:
        raise RuntimeError(f"replicas read at updates {sorted(applied)}; this is a "
                           "dasktf bug (a round-start cut must be one update).")
    unsent: dict[int, Any] = {}
    for s in states:
        unsent.update(s.get("unsent") or {})
    return {**states[0], "inner": {int(s["index"]): s["optimizer"] for s in states},
            "unsent": unsent}
