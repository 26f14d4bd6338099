"""The client's side of a sharded run's state (``shard_state``): the whole optimizer
gathered from its slices, recovered from the copies a lost worker's slice had, and
loaded whole into the replicas, each of which cuts its slice again at its next step
(:mod:`dasktf.runtime.p2p.sharding`, :mod:`dasktf.runtime.p2p.redundancy`).

Every task is pinned: each replica (and its slices) lives on its own worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dasktf.cluster.broadcast import broadcast
from dasktf.cluster.waits import RunContext, WatchedClient, wait_for
from dasktf.exceptions import ShardingError
from dasktf.runtime.p2p.redundancy import recovered_state, reshard_task, slices_task
from dasktf.runtime.p2p.sharding import assemble_optimizer, shard_state_task
from dasktf.runtime.reconcile import pinned_each


def _on_each(ctx: RunContext, workers: list[str], task: Callable[..., Any], what: str,
             *args: Any) -> list[Any]:
    futures = pinned_each(ctx, task, *args, workers=workers)
    wait_for(ctx, futures, what)
    return ctx.client.gather(futures)  # type: ignore[no-any-return]


def gathered_state(ctx: RunContext, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """The training state with the whole optimizer, its slices gathered from every
    replica (:func:`~dasktf.runtime.p2p.sharding.assemble_optimizer`)."""
    states = _on_each(ctx, ctx.workers, shard_state_task,
                      "gathering the optimizer's slices", ctx.run_id)
    return {"weights": states[0]["weights"], "applied": states[0]["applied"],
            "index": states[0]["index"], "optimizer": assemble_optimizer(states, shapes)}


def recover(ctx: RunContext, survivors: list[str], target: int,
            shapes: list[tuple[int, ...]], can_rewind: bool = False) -> bool:
    """The whole optimizer put together from one copy of each slice at update
    ``target`` (survivors one behind complete it first), loaded into every survivor.
    ``False`` when a slice has no copy left (two neighbouring ranks lost) and the
    run ``can_rewind`` to a restore point instead; else that raises
    :class:`ShardingError`."""
    slices = _on_each(ctx, survivors, slices_task, "reading the optimizer's slices",
                      ctx.run_id, target)
    try:
        state, flat = recovered_state(slices, target, shapes)
    except ShardingError:
        if can_rewind:
            return False
        raise
    load_whole(ctx, survivors, state, flat)
    return True


def load_whole(ctx: RunContext, workers: list[str], state: dict[str, Any],
               flat: np.ndarray | None = None, rewind: bool = False) -> None:
    """Load ``state`` into the replicas on ``workers``, the optimizer whole: the next
    step cuts it over them (:func:`~dasktf.runtime.p2p.redundancy.reshard_task`);
    ``rewind``: an older state than theirs (a restore point), the updates after it
    forgotten."""
    what = ("rewinding the replicas to the restore point" if rewind
            else "loading the state into the replicas")
    client = WatchedClient(ctx, what)
    big = broadcast(client, state, workers)
    flat_f = None if flat is None else broadcast(client, flat, workers)
    _on_each(ctx, workers, reshard_task, what, ctx.run_id, big, flat_f, True, rewind)


def lost_slices(lost: list[str], shard_state: str, checkpoint: str | None
                ) -> ShardingError:
    """Why a run with ``redundancy=0`` and no checkpoint in its current epoch to go
    back to cannot go on from a lost worker, and what to do."""
    return ShardingError(
        f"worker(s) {', '.join(lost)} lost with shard_state={shard_state!r} and "
        "redundancy=0: their slice of the optimizer state had no other copy, and "
        "the run kept no checkpoint in this epoch to go back to, so it cannot go on "
        "exactly. "
        + (f"Resume from the last checkpoint, {checkpoint}, with resume=True; "
           if checkpoint else
           "Keep checkpoints (checkpoint_dir=, and checkpoint_every= for some within "
           "an epoch): a lost worker then sends the run back to the newest one, "
           "whose later steps it trains again; ")
        + "or train with redundancy=1 (each slice on two workers) to go on "
        "from a lost worker with nothing to train again.")
