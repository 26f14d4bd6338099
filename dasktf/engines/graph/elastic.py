"""Worker loss and growth in a sync run: recover without losing or repeating a step.

Every sync step carries its global update number, and a replica applies each update
at most once (:meth:`dasktf.runtime.replica.Replica.apply`). When a worker is lost
(:class:`~dasktf.cluster.membership.MembershipWatcher` hears it from the scheduler):

1. the client cancels the steps in flight and *fences* the survivors (no replica
   applies anything more), then reads how far each one got;
2. the survivors are reconciled to the most advanced one: it hands its weights and
   optimizer state to those behind (all replicas are identical after an applied
   update, so this is exactly the last applied state);
3. the lost shard is reloaded from its source on the survivor carrying the fewest
   shards (the run's ``RunHooks.reload``; :mod:`dasktf.engines.mirrored` and
   :mod:`dasktf.runtime.reconcile`, which the p2p engine shares), which *adopts* it: its rows join that replica's
   batches, in the order the lost worker would have read them, so the global batch
   and every later update are unchanged;
4. the epoch resumes at the first update no survivor applied, with N-1 workers. No
   update is applied twice, none is skipped (``steps_lost`` is 0 by construction;
   the tests check every replica's log of applied updates); ``steps_recomputed``
   counts updates whose sum was complete but reached no survivor.

Sharded parameter servers (``placement="ps"``) hold the only copy of their slice
of the optimizer state, so a loss there *rewinds* instead: the client keeps a
restore point (the merged state of the replicas and servers at the start, at every
epoch end and with every checkpoint); the survivors and a new set of servers on
them load it, the lost shard is adopted as above, and the updates after the restore
point are computed again (``steps_recomputed``). Every update in the final weights
is still applied exactly once; the replicas' logs are cut back to the restore point.

At the next epoch boundary the run re-forms (:meth:`ElasticSyncEngine.pending_reform`):
data re-placed over the workers alive then (the adopter's double share goes away, and
a worker that joined gets a replica and a share), state copied from a replica.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed import Future

from dasktf.cluster.broadcast import broadcast
from dasktf.cluster.waits import RunContext, WatchedClient, wait_for
from dasktf.engines.base import Capabilities, RunHooks
from dasktf.engines.graph.steps import SyncEngine
from dasktf.exceptions import WorkerLostError
from dasktf.runtime import reconcile
from dasktf.runtime.reconcile import round_state, set_state_task
from dasktf.runtime.replica import EpochReport
from dasktf.runtime.servers import (
    merge_server_states,
    ps_load_task,
    ps_state_task,
    server_workers,
    split_server_states,
)
from dasktf.wire.packets import CommSpec

if TYPE_CHECKING:
    from distributed import Future

    from dasktf.runtime.rounds import LocalSpec

logger = logging.getLogger(__name__)


# -- the client side ------------------------------------------------------------------
class ElasticSyncEngine(SyncEngine):
    """A :class:`~dasktf.engines.graph.steps.SyncEngine` that survives losing
    workers (see the module): any reduction and codec go on from the most advanced
    survivor (the survivors take a lost worker's ring chunks until the run
    re-forms), the sharded servers' placement rewinds to its restore point.

    ``hooks`` reload a lost shard on a survivor and name the last checkpoint when
    every worker is gone; ``average_stats``: the model has moving statistics to
    average over the replicas at each epoch end; ``ps_layout`` (``placement="ps"``):
    ``(OptimizerLayout, positions of the trainable variables among the model's
    weights)``, to merge the servers' slices into one state.
    """

    capabilities = Capabilities(checkpoints="steps", resume=True, reforms=True)

    def __init__(
        self,
        ctx: RunContext,
        spec: CommSpec,
        shapes: list[tuple[int, ...]],
        schedule: np.ndarray,
        hooks: RunHooks,
        average_stats: bool = False,
        ps_layout: tuple[Any, list[int]] | None = None,
        local: LocalSpec | None = None,
    ) -> None:
        super().__init__(ctx, spec, shapes)
        self.take_shards(schedule)
        self.local = local
        self.hooks = hooks
        self._finished: int | None = None
        #: ``"recover"`` or ``"raise"`` (the trainer's ``on_worker_loss``)
        self.policy = hooks.on_worker_loss
        self.average_stats = average_stats
        self.reform_needed = False
        self.ps_layout = ps_layout

    def run_epoch(
        self, epoch: int, on_step: Callable[[int], None] | None = None, start: int = 0
    ) -> list[EpochReport]:
        return self.recover_epoch(
            epoch, lambda s: super(ElasticSyncEngine, self).run_epoch(epoch, on_step, s),
            start)

    def stop_steps(self, lost: list[str], survivors: list[str]) -> None:
        """Release the steps in flight (not cancelled: a cancel must reach only keys
        the client wants, and the steps' inner tasks are the scheduler's alone;
        unwanted, they are dropped, and a fenced replica applies nothing of what
        still runs); the last of them whose sum was complete is kept for
        :meth:`catch_up`."""
        finished = [s for s, (_, total) in sorted(self.in_flight.items())
                    if all(f.status == "finished" for f in _futures(total))]
        self._finished = finished[-1] if finished else None
        for _, (parts, total) in self.in_flight.items():
            for f in [*parts, *_futures(total)]:
                if isinstance(f, Future):
                    f.release()
        self.in_flight = {}

    def regroup(self) -> None:
        self.key_suffix = f"-r{self.attempt}"  # the cancelled keys may linger

    def catch_up(self, lost: list[str], survivors: list[str], applied: list[int]
                 ) -> tuple[int, int, str | None]:
        """Everyone to the most advanced survivor's state; updates whose sum was
        complete but that no survivor had applied are computed again (never
        skipped: numbering goes on from the survivors' last update). Sharded
        servers rewind instead (:meth:`_rewind`)."""
        if self.rewinds():
            return self._rewind(lost, max(applied))
        target = reconcile.reconcile(self.ctx, survivors, applied)
        last_finished = (self.update_base + self._finished if self._finished is not None
                         else target)
        return target, max(0, last_finished - target), None

    def _rewind(self, lost: list[str], reached: int) -> tuple[int, int, str]:
        """Sharded servers: every survivor and a new set of servers on them go back
        to the restore point (see the module)."""
        ctx = self.ctx
        restore = self.rewind_point()
        if restore is None:
            raise WorkerLostError(
                f"Lost {', '.join(lost)}, and this sharded-server run has no restore "
                "point in the current epoch; this is a dasktf bug.", lost,
            )
        self.servers = server_workers(ctx.workers, self.spec.num_ps)
        self.load_servers(restore)
        what = "rewinding the surviving replicas to the restore point"
        state = broadcast(WatchedClient(ctx, what), restore)
        reconcile.on_every_worker(ctx, what, set_state_task, ctx.run_id, state, True, True)
        return self.rewound(reached, f"servers on {', '.join(self.servers)}")

    def state(self) -> dict[str, Any]:
        """The run's training state: the replicas' (identical) state, read from the
        first one; with sharded servers, their master weights and optimizer slices
        merged into it (the mirrored placement's format)."""
        client, ctx = self.ctx.client, self.ctx
        update, after = self.kept_request()
        if self.local is not None:
            parts = (self.in_flight[self.retired + 1][0]  # type: ignore[operator]
                     if update is not None else [None] * len(ctx.workers))
            return round_state(ctx, update, parts)
        if self.spec.placement != "ps":
            return reconcile.read_state(ctx, update, after)
        f = client.submit(reconcile.replica_state_task, ctx.run_id, update, after,
                          workers=[ctx.workers[0]], allow_other_workers=False, pure=False)
        assert self.ps_layout is not None, "the factory gives the servers' layout"
        kept_by = self.in_flight[self.retired][1] if update is not None else None
        slices = [client.submit(ps_state_task, ctx.run_id, s, self.chunks[s],
                                self.generation, update,
                                kept_by[s] if kept_by is not None else None,
                                workers=[w], allow_other_workers=False, pure=False)
                  for s, w in enumerate(self.servers)]
        wait_for(ctx, [f, *slices], "reading the training state and the servers' slices")
        layout, trainable = self.ps_layout
        return merge_server_states(f.result(), client.gather(slices), self.chunks,
                                   layout, trainable)

    def load_servers(self, state: dict[str, Any]) -> None:
        """Sharded servers: make ``self.servers`` hold ``state``'s slices (a newer
        generation: older server tasks still running do nothing)."""
        if self.spec.placement != "ps":
            return
        assert self.ps_layout is not None, "the factory gives the servers' layout"
        client, ctx = self.ctx.client, self.ctx
        self.generation += 1
        parts = split_server_states(state, self.chunks, *self.ps_layout)
        mine: dict[str, dict[int, Any]] = {w: {} for w in ctx.workers}
        for s, w in enumerate(self.servers):
            mine[w][s] = parts[s]
        loads = [client.submit(ps_load_task, ctx.run_id, slices, int(state["applied"]),
                               self.generation, workers=[w], allow_other_workers=False,
                               pure=False)
                 for w, slices in mine.items()]
        wait_for(ctx, loads, "loading the parameter servers' slices")

    def rewinds(self) -> bool:
        """Sharded servers hold the only copy of their slice of the optimizer."""
        return self.spec.placement == "ps"

    def keep_restore_point(self, state: dict[str, Any] | None = None,
                           source: str | None = None) -> None:
        """Sharded servers: keep ``state`` to rewind to, read now if not given (the
        start and every epoch end, checkpointed or not: a run keeps no other copy
        of their slices)."""
        if state is None and self.policy == "recover" and self.rewinds():
            state = self.state()
        super().keep_restore_point(state, source)

    def load_state(self, state: dict[str, Any]) -> None:
        """Load ``state`` into every replica and the sharded servers, if any."""
        reconcile.load_state(self.ctx, state)
        self.load_servers(state)

    def reform(self, schedule: np.ndarray) -> None:
        self.respec(len(self.ctx.workers))
        super().reform(schedule)


def _futures(total: Any) -> list[Any]:
    """A step's result: one future, or several (ring, sharded servers)."""
    return total if isinstance(total, list) else [total]
