"""What the engines of mirrored replicas share on the client when a worker is lost.

The graph engine (:mod:`dasktf.engines.graph.elastic`) and the p2p engine
(:mod:`dasktf.engines.p2p.engine`) keep the whole model on every replica, number
every update and apply each once; recovering either from a lost worker is the same
walk once the survivors have stopped (each engine stops its own steps): fence and
reconcile them (:func:`dasktf.runtime.reconcile.reconcile`), give the lost shards to
the survivors carrying the fewest (:func:`adopt_shards`), publish what happened
(:func:`report_recovery`); a worker lost during that walk starts it again from
both losses (:func:`recover_again`). Neither engine family imports the other; both import this.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from dasktf.cluster.waits import wait_for
from dasktf.exceptions import AllWorkersLostError, WorkerLostError
from dasktf.runtime.reconcile import adopt_task

if TYPE_CHECKING:
    from dasktf.cluster.waits import RunContext
    from dasktf.engines.base import RunHooks
    from dasktf.wire.packets import TrafficLog

T = TypeVar("T")


def all_lost(hooks: RunHooks, lost: list[str]) -> AllWorkersLostError:
    """The error of a run whose every worker was lost, naming the last checkpoint."""
    path = hooks.last_checkpoint()
    return AllWorkersLostError(
        f"Every worker of the run was lost ({', '.join(lost)}); the run cannot "
        "go on. " + (f"The last checkpoint is {path}; resume from it with "
                     "resume=True (--resume) once workers are back."
                     if path else "Pass checkpoint_dir= to keep checkpoints."),
        lost,
    )


def recover_again(recover: Callable[[list[str]], T], lost: list[str]) -> T:
    """``recover(lost)``, done again from every loss so far when another worker of
    the run is lost during it (two workers killed together are not always noticed
    together: the survivors' fence or a shard's reload then meets the second)."""
    while True:
        try:
            return recover(lost)
        except AllWorkersLostError:
            raise
        except WorkerLostError as again:
            if set(again.workers) <= set(lost):
                raise
            lost = sorted(set(lost) | set(again.workers))


def adopt_shards(ctx: RunContext, hooks: RunHooks, carried: dict[str, list[int]],
                 schedule: np.ndarray, lost: list[str], survivors: list[str]
                 ) -> list[tuple[int, str]]:
    """Reload each shard ``lost`` workers carried on the survivor carrying the fewest
    (``carried``, updated), which adopts it: its rows join that replica's batches in
    the order the lost worker would have read them, so every global batch stays the
    same. Returns ``(shard index, adopter)`` per shard moved."""
    moved: list[tuple[int, str]] = []
    for w in lost:
        # a shard leaves ``carried[w]`` once adopted: an adopter lost meanwhile
        # leaves it there for a recovery from both losses to hand out again
        while carried.get(w):
            index = carried[w][0]
            adopter = min(survivors, key=lambda s: len(carried[s]))
            shard, val = hooks.reload(index, adopter)  # type: ignore[misc]
            f = ctx.client.submit(adopt_task, ctx.run_id, index, shard, schedule[:, index],
                                  val, workers=[adopter], allow_other_workers=False,
                                  pure=False)
            wait_for(ctx, [f], f"reloading shard {index} on {adopter}")
            carried[w].pop(0)
            carried[adopter].append(index)
            moved.append((index, adopter))
        carried.pop(w, None)
    return moved


def report_recovery(ctx: RunContext, hooks: RunHooks, lost: list[str], epoch: int,
                    removals: dict[str, Any], detected: float,
                    moved: list[tuple[int, str]], target: int, recomputed: int,
                    rewound: str | None = None, applied: list[int] | None = None
                    ) -> dict[str, Any]:
    """Publish the ``worker_lost`` records and the ``recovered`` one (returned), and
    say the one line. ``rewound``: where the run went back to instead (sharded
    servers), for the line; ``applied``: the update each survivor had applied when
    fenced (they may differ by one: the reconciled ones)."""
    survivors = list(ctx.workers)
    resumed = time.time()
    for w in lost:
        change = removals.get(w)
        hooks.publish({
            "run": ctx.run_id, "kind": "worker_lost", "worker_address": w,
            "epoch": epoch, "update": target,
            "detect_s": (change.seen_time - change.scheduler_time) if change else None,
            "removed_at": change.scheduler_time if change else None,
            "detected_at": change.seen_time if change else detected,
            "wall_time": time.time(),
        })
    since = min((c.seen_time for c in removals.values()), default=detected)
    recovered = {
        "run": ctx.run_id, "kind": "recovered", "workers": survivors,
        "lost": list(lost), "moved": [[i, a] for i, a in moved],
        "resumed_at_update": target + 1, "steps_lost": 0,
        "steps_recomputed": recomputed,
        "rewound_to_update": target if rewound is not None else None,
        "survivors_applied": list(applied) if applied is not None else None,
        "resume_s": resumed - since, "wall_time": time.time(),
    }
    hooks.publish(recovered)
    hooks.announce(
        f"worker lost: {', '.join(lost)}; recovered in {resumed - since:.2f}s with "
        f"{len(survivors)} worker(s), shard(s) "
        f"{', '.join(f'{i}->{a}' for i, a in moved)}, "
        + (f"{rewound}, " if rewound is not None else "")
        + f"resuming at update {target + 1} (steps lost: 0, recomputed: {recomputed})"
    )
    return recovered


def mirrored_epoch_logs(traffic: TrafficLog, n_params: int, n_workers: int, units: int,
                        examples: int, round_log: list[dict[str, Any]] | None
                        ) -> dict[str, float]:
    """What a mirrored engine adds to an epoch's logs: per worker and update (a step,
    or a round of local steps) the bytes against the allreduce bound
    (:meth:`dasktf.wire.packets.TrafficLog.logs`); with rounds (``round_log``, the
    epoch's), their number and mean drift (:func:`dasktf.runtime.rounds.drift`)."""
    logs = traffic.logs(n_params, n_workers, units, examples)
    if round_log:
        logs["rounds"] = float(len(round_log))
        logs["drift"] = float(np.mean([r["drift"] for r in round_log]))
    return logs
