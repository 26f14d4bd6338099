"""An async run's training state as a checkpoint holds it: the holder's consistent
cut (its state and which ``(pass, step)`` batches of every shard it applied), and
loading one back into the holder, the cursors and the replicas' statistics.

The files and the manifest are the run's (:mod:`dasktf.run.async_checkpoint`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dasktf import config
from dasktf.cluster.waits import wait_for
from dasktf.runtime.tasks import set_non_trainable_task

if TYPE_CHECKING:
    import numpy as np

    from dasktf.engines.holder.engine import AsyncEngine


class HolderCut:
    """A consistent cut of the holder: ``state`` (weights, optimizer, ``applied``)
    and ``progress`` (``version`` and the applied batches per shard)."""

    def __init__(self, engine: AsyncEngine) -> None:
        engine.send_non_trainable()
        self._engine = engine
        self._snapshot = engine.holder.snapshot(engine.known_through()).result(
            timeout=config.get_seconds("step-timeout"))
        snap = self._snapshot
        done: dict[str, list[list[int]]] = {}
        for worker, shard_pass, step in snap["items"]:
            shard = engine.shard_index.get(worker, worker)  # a lost worker's successor
            done.setdefault(str(shard), []).append([int(shard_pass), int(step)])
        self.state = {"weights": snap["weights"], "optimizer": snap["optimizer"],
                      "applied": snap["version"] - 1}
        self.progress = {"version": snap["version"], "done": done}

    def keep(self, where: str) -> None:
        """The cut was saved at ``where``: the newest state a lost holder is rebuilt from."""
        self._engine.take_restore_point(self._snapshot, where)


def load_cut(engine: AsyncEngine, state: dict[str, Any], progress: dict[str, Any],
             statistics: list[np.ndarray] | None) -> int:
    """Load a cut into the holder and the cursors, and the model's moving
    ``statistics`` into every replica; the epoch to go on with."""
    done = {int(k): [tuple(item) for item in v] for k, v in progress["done"].items()}
    timeout = config.get_seconds("step-timeout")
    engine.holder.restore(state["weights"], state["optimizer"], int(progress["version"]),
                          done).result(timeout=timeout)
    for i, cursor in enumerate(engine.cursors):
        cursor.restore(set(done.get(i, [])))
    engine.applied = int(progress["version"])
    if statistics is not None:
        # The workers' replicas were built from the initial weights: their moving
        # statistics, whose mean the holder takes at each epoch end, go on from the
        # checkpoint's too.
        ctx = engine.ctx
        futures = [ctx.client.submit(set_non_trainable_task, ctx.run_id, statistics,
                                     workers=[w], allow_other_workers=False, pure=False)
                   for w in ctx.workers]
        wait_for(ctx, futures, "loading the checkpoint's moving statistics")
    return min(c.completed_passes for c in engine.cursors)
