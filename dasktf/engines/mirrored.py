"""What the engines of mirrored replicas share on the client: :class:`Mirrored`.

The graph engine (:mod:`dasktf.engines.graph.elastic`) and the p2p engine
(:mod:`dasktf.engines.p2p.engine`) keep the whole model on every replica, number
every update and apply each once; so they answer much of the engine contract alike
(checkpoint grid, learning rate, epoch figures), and recovering either from a lost
worker is the same walk once the survivors have stopped (each engine stops its own
steps): fence and reconcile them (:func:`dasktf.runtime.reconcile.reconcile`), give
the lost shards to the survivors carrying the fewest, publish what happened; a
worker lost during that walk starts it again from both losses. Where a lost worker
took state no survivor holds a copy of (sharded parameter servers, a sharded
optimizer with ``redundancy=0``), the survivors rewind to a *restore point* kept in
the epoch instead and compute the updates since again (:meth:`Mirrored.rewinds`). Neither engine
family imports the other; both import this.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from dasktf.cluster.waits import wait_for
from dasktf.diagnostics.events import recovered_record, worker_lost_records
from dasktf.exceptions import AllWorkersLostError, WorkerLostError
from dasktf.runtime import reconcile
from dasktf.runtime.reconcile import adopt_task

if TYPE_CHECKING:
    from dasktf.cluster.waits import RunContext
    from dasktf.engines.base import RunHooks
    from dasktf.runtime.rounds import LocalSpec
    from dasktf.wire.packets import TrafficLog

T = TypeVar("T")


class Mirrored:
    """What the mirrored engines share (mixed into each): the engine contract's
    methods they implement alike and the one recovery walk (see the module), in
    which an engine stops its own steps (:meth:`stop_steps`), starts a new attempt
    (:meth:`regroup`) and may catch the survivors up otherwise (:meth:`catch_up`)."""

    if TYPE_CHECKING:  # the engine's, used here
        ctx: RunContext
        hooks: RunHooks
        policy: str
        carried: dict[str, list[int]]
        schedule: np.ndarray
        examples_per_epoch: int
        losses: list[dict[str, Any]]
        update_base: int
        reform_needed: bool
        local: LocalSpec | None
        keep_every: int | None
        round_log: list[dict[str, Any]]
        traffic: TrafficLog
        n_params: int

        def units(self, steps_per_epoch: int) -> int: ...

    attempt = 0
    #: the newest state a loss rewinds the survivors to (:meth:`keep_restore_point`),
    #: and where it came from (a checkpoint's path; ``None``: a re-form's state)
    restore_point: dict[str, Any] | None = None
    restore_source: str | None = None

    @property
    def units_per_epoch(self) -> int:
        """The updates of an epoch: its steps, or its rounds (``local_steps``)."""
        return self.units(self.ctx.steps_per_epoch)

    def last_step(self, unit: int, steps_per_epoch: int) -> int:
        """A round ends at its last step, which callbacks count in."""
        if self.local is None:
            return unit
        return self.local.round_steps(unit, steps_per_epoch)[-1]

    def set_learning_rate(self, lr: float) -> None:
        """Every replica's optimizer takes ``lr`` (between epochs: nothing in flight)."""
        reconcile.set_learning_rate(self.ctx, lr)

    def set_checkpoint_grid(self, every: int | None) -> None:
        self.keep_every = every

    def checkpoint_due(self, step: int) -> bool:
        """Whether the update of ``step`` (of an epoch) is on the checkpoint grid; an
        epoch's last step is checkpointed at the epoch end."""
        every = self.keep_every
        return every is not None and (step + 1) % every == 0 and (
            step + 1 < self.units_per_epoch)

    def final_state(self) -> dict[str, Any]:
        return self.state()  # type: ignore[attr-defined,no-any-return]

    def epoch_logs(self, seconds: float) -> dict[str, float]:
        """Per worker and update (a step, or a round of local steps): the bytes
        against the allreduce bound (:meth:`dasktf.wire.packets.TrafficLog.logs`);
        with rounds, their number and mean drift (:func:`dasktf.runtime.rounds.drift`)."""
        logs = self.traffic.logs(self.n_params, len(self.ctx.workers),
                                 self.units_per_epoch, self.examples_per_epoch)
        if self.local is not None and self.round_log:
            logs["rounds"] = float(len(self.round_log))
            logs["drift"] = float(np.mean([r["drift"] for r in self.round_log]))
        return logs

    def round_records(self) -> list[dict[str, Any]]:
        return list(self.round_log)

    def take_shards(self, schedule: np.ndarray) -> None:
        """One shard per worker of ``ctx.workers`` now, read with ``schedule``."""
        self.carried = {w: [i] for i, w in enumerate(self.ctx.workers)}
        self.schedule = schedule
        self.examples_per_epoch = int(schedule.sum())

    def reform(self, schedule: np.ndarray) -> None:
        """Go on over ``ctx.workers`` as they are now (the run re-placed its data
        with ``schedule``), one shard each; the caller loads the state."""
        self.take_shards(schedule)
        self.regroup()
        self.reform_needed = False

    def ramp_learning_rate(self, factor: float, steps: int) -> tuple[float, float]:
        return reconcile.ramp_learning_rate(self.ctx, factor, steps)

    def applied_logs(self) -> dict[int, list[int]]:
        """``{replica index: updates it applied, in order}`` over the survivors."""
        return reconcile.applied_logs(self.ctx)

    def recover_epoch(self, epoch: int, train: Callable[[int], T], start: int) -> T:
        """``train(start)``, and again from the step a recovery names each time it
        meets a lost worker; raises under ``on_worker_loss="raise"``. A worker lost
        during a recovery (two killed together are not always noticed together:
        the fence or a shard's reload meets the second) starts it again from both."""
        while True:
            try:
                return train(start)
            except WorkerLostError as exc:
                if self.policy == "raise":
                    self.close()  # type: ignore[attr-defined]
                    raise
                lost = exc.workers
            while True:
                try:
                    start = self.recover(lost, epoch)
                    break
                except AllWorkersLostError:
                    raise
                except WorkerLostError as again:
                    if set(again.workers) <= set(lost):
                        raise
                    lost = sorted(set(lost) | set(again.workers))

    def recover(self, lost: list[str], epoch: int) -> int:
        """Stop the survivors, fence and reconcile them, hand out the lost shards,
        report; the step of the epoch to resume at."""
        detected = time.time()
        ctx = self.ctx
        removals = {c.worker: c for c in ctx.watcher.removed(lost)} if ctx.watcher else {}
        lost = sorted(set(lost) | set(removals))
        survivors = [w for w in ctx.workers if w not in lost]
        self.stop_steps(lost, survivors)
        if not survivors:
            path = self.hooks.last_checkpoint()
            raise AllWorkersLostError(
                f"Every worker of the run was lost ({', '.join(lost)}); the run cannot "
                "go on. " + (f"The last checkpoint is {path}; resume from it with "
                             "resume=True (--resume) once workers are back."
                             if path else "Pass checkpoint_dir= to keep checkpoints."),
                lost)
        self.hooks.workers_changed(survivors)
        self.attempt += 1
        self.regroup()
        applied = reconcile.fence(ctx, survivors, self.attempt)
        target, recomputed, rewound = self.catch_up(lost, survivors, applied)
        moved = self._adopt(lost, survivors)
        self.reform_needed = True
        since = min((c.seen_time for c in removals.values()), default=detected)
        for record in worker_lost_records(ctx.run_id, lost, detected, removals,
                                          epoch=epoch, update=target):
            self.hooks.publish(record)
        recovered = recovered_record(
            ctx.run_id, survivors, lost, since, moved, resumed_at_update=target + 1,
            steps_recomputed=recomputed,
            rewound_to_update=target if rewound is not None else None,
            survivors_applied=None if rewound is not None else list(applied))
        self.hooks.publish(recovered)
        self.hooks.announce(
            f"worker lost: {', '.join(lost)}; recovered in {recovered['resume_s']:.2f}s "
            f"with {len(survivors)} worker(s), shard(s) "
            f"{', '.join(f'{i}->{a}' for i, a in moved)}, "
            + (f"{rewound}, " if rewound is not None else "")
            + f"resuming at update {target + 1} (steps lost: 0, recomputed: {recomputed})"
        )
        self.losses.append(recovered)
        return target + 1 - self.update_base

    def _adopt(self, lost: list[str], survivors: list[str]) -> list[tuple[int, str]]:
        """Reload each shard ``lost`` workers carried on the survivor carrying the
        fewest, which adopts it: its rows join that replica's batches in the order
        the lost worker would have read them, so every global batch stays the same.
        Returns ``(shard index, adopter)`` per shard moved."""
        ctx, carried, moved = self.ctx, self.carried, []
        for w in lost:
            # a shard leaves ``carried[w]`` once adopted: an adopter lost meanwhile
            # leaves it there for a recovery from both losses to hand out again
            while carried.get(w):
                index = carried[w][0]
                adopter = min(survivors, key=lambda s: len(carried[s]))
                shard, val = self.hooks.reload(index, adopter)  # type: ignore[misc]
                f = ctx.client.submit(adopt_task, ctx.run_id, index, shard,
                                      self.schedule[:, index], val, workers=[adopter],
                                      allow_other_workers=False, pure=False)
                wait_for(ctx, [f], f"reloading shard {index} on {adopter}")
                carried[w].pop(0)
                carried[adopter].append(index)
                moved.append((index, adopter))
            carried.pop(w, None)
        return moved

    # -- rewinding to a restore point ----------------------------------------------
    def rewinds(self) -> bool:
        """Whether a lost worker takes state that no survivor holds a copy of (a
        slice of a sharded optimizer), so that the survivors go back to a restore
        point instead of being reconciled: the default, no."""
        return False

    def keep_restore_point(self, state: dict[str, Any] | None = None,
                           source: str | None = None) -> None:
        """Keep ``state`` (a checkpoint's, a resume's, a re-form's: read already)
        to rewind to, in a run that rewinds and recovers from a loss: a run that
        raises never rewinds, and a copy of the state costs the client memory."""
        if state is not None and self.policy == "recover" and self.rewinds():
            self.restore_point, self.restore_source = state, source

    def rewind_point(self) -> dict[str, Any] | None:
        """The restore point if the survivors can go back to it: kept in the current
        epoch (at its start or later), whose batches they redo from there
        alike (an older one would need an older epoch's placement); else ``None``."""
        restore = self.restore_point
        if restore is None or int(restore["applied"]) + 1 < self.update_base:
            return None
        return restore

    def rewound(self, reached: int, what: str) -> tuple[int, int, str]:
        """:meth:`catch_up`'s answer once ``what`` went back to the restore point:
        its update, the updates after it up to ``reached`` (the newest a survivor
        had applied) to compute again, and what was rewound to where."""
        assert self.restore_point is not None
        target = int(self.restore_point["applied"])
        source = f" {self.restore_source}" if self.restore_source else ""
        return (target, max(0, reached - target),
                f"{what} rewound to the restore point{source} (update {target})")

    def stop_steps(self, lost: list[str], survivors: list[str]) -> None:
        """Make sure nothing in flight applies from here on."""

    def regroup(self) -> None:
        """What the survivors' next steps are told apart by (new keys, a new group)."""

    def catch_up(self, lost: list[str], survivors: list[str], applied: list[int]
                 ) -> tuple[int, int, str | None]:
        """Bring the fenced ``survivors`` (their ``applied`` updates) to one state:
        the update they hold, the updates to compute again and what was rewound
        (``None``: they were reconciled to the most advanced one)."""
        return reconcile.reconcile(self.ctx, survivors, applied), 0, None
