"""The p2p engine: exact sync steps with no scheduler task per step.

An epoch is one or more *segments*: its steps up to the next checkpoint on
``checkpoint_every``'s grid, or its end. For each, the client submits one task per
worker, pinned where its replica and shard live
(:func:`~dasktf.runtime.p2p.segment.segment_task`), and waits: the workers run the
segment's steps in a loop, each step's gradient (or round's change) summed with
their peers over the workers' own Dask comms (:mod:`dasktf.runtime.p2p`), and every
replica applies the same sum. So the scheduler sees N tasks a segment, whatever
the steps; the client sees the steps through replica 0's loss records
(``RunHooks.heard``) and calls ``on_step`` for each as it hears of it, the last one
of a segment once the segment is over (a checkpoint there reads the replicas as
they stand).

Segments span epochs (``dasktf.p2p.span-epochs``, on by default): a fit with no
``checkpoint_every`` grid inside its epochs submits one task per worker for all its
epochs, or for each stretch between two re-forms (:meth:`P2PEngine._spanned`). The
workers end each epoch as an epoch's last segment does (moving statistics averaged,
validation, the report) and wait there: the client reads their results straight
from them and starts the next epoch with a word to each, over its own connections
to the workers (:mod:`dasktf.runtime.p2p.span`): nothing per epoch reaches the
scheduler. Why they wait rather than run ahead while the client hears of the epoch:
everything the client does at an epoch end (the callbacks: a learning rate they
set, ``stop_training``, EarlyStopping's weights; a checkpoint; a re-form) then
meets the replicas exactly where a per-epoch segment left them, so every such run
stays exact with no list of callbacks known to be harmless to keep up; the wait is
one round trip to each worker, which a per-epoch segment also paid (its submission
through the scheduler, and more). A stop voted mid-epoch ends the spanning segment
there as it ends a per-epoch one; a re-form, the fit's end or a loss ends it too.

A callback's ``stop_training`` reaches the workers as one ``client.run`` that sets
their stop vote; the vote rides on the next step's collective, so every replica
stops after the same update and the epoch ends there.

A lost worker (:class:`~dasktf.exceptions.PeerLostError` from the survivors'
segments, or the membership watcher): the survivors' group is aborted, they are
fenced and reconciled to the newest update any of them applied (they differ by one
at most: the collective whose last messages reached some and not others), the lost
shards are reloaded on survivors (:mod:`dasktf.engines.mirrored`) and the epoch goes
on from the next update over a new group: the same global batches, every update
applied once. The run re-forms at the epoch's end (a new group again).

A sharded run with ``redundancy=0`` holds the only copy of each slice of the
optimizer on its owner, so a lost worker's slice is gone: the survivors go back to
the newest checkpoint this run kept in the current epoch (its state, the whole
optimizer, is the restore point, :meth:`~dasktf.engines.mirrored.Mirrored.keep_restore_point`;
a resume's and a re-form's state are too), the lost shards are reloaded as above,
and the updates after it are trained again (``steps_recomputed``,
``rewound_to_update``): the same global batches, so the same final state. So does
a ``redundancy=1`` run that loses both copies of a slice (two neighbouring ranks at
once). With no such checkpoint the run stops with a
:class:`~dasktf.exceptions.ShardingError`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import compat, config
from dasktf.cluster.plugins import register_once
from dasktf.cluster.waits import RunContext, call_watched
from dasktf.engines.base import Capabilities, Engine, RunHooks
from dasktf.engines.mirrored import Mirrored
from dasktf.engines.p2p import shards
from dasktf.engines.p2p.flight import Flight
from dasktf.engines.p2p.options import group_spec
from dasktf.runtime import reconcile
from dasktf.runtime.p2p.plugin import PLUGIN_NAME, P2PPlugin
from dasktf.runtime.p2p.segment import Segment, SegmentResult
from dasktf.wire.packets import TrafficLog

if TYPE_CHECKING:
    from dasktf.runtime.replica import EpochReport
    from dasktf.runtime.rounds import LocalSpec
    from dasktf.wire.packets import CommSpec

logger = logging.getLogger(__name__)


class P2PEngine(Mirrored, Engine):
    """Sync training over worker-to-worker all-reduces (see the module).

    Parameters
    ----------
    ctx
        The run (its ``watcher`` reports removals).
    spec
        The run's :class:`~dasktf.wire.packets.CommSpec` (its codec applies).
    shapes
        The trainable variables' shapes.
    schedule
        The run's ``steps x workers`` local batch sizes.
    hooks
        What the run provides (:class:`~dasktf.engines.base.RunHooks`).
    batch_size
        The global batch (lossy codecs scale each gradient by its inverse).
    average_stats
        The model has moving statistics to average at each epoch's end.
    local
        Rounds of local steps, or ``None``.
    shard_state
        ``"optimizer"``: each worker keeps and applies its slice of the optimizer
        (:mod:`dasktf.runtime.p2p.sharding`); ``None``: every replica all of it.
    redundancy
        With ``shard_state``: ``1`` keeps each slice on a second worker too, so a
        lost worker costs nothing (:mod:`dasktf.runtime.p2p.redundancy`); ``0``: a
        lost worker sends the survivors back to the run's newest checkpoint in the
        epoch, or stops the run with a :class:`~dasktf.exceptions.ShardingError`
        when there is none (see the module).
    """

    mode = "sync"
    engine = "p2p"
    capabilities = Capabilities(checkpoints="steps", resume=True, reforms=True)

    def __init__(self, ctx: RunContext, spec: CommSpec, shapes: list[tuple[int, ...]],
                 schedule: np.ndarray, hooks: RunHooks, *, batch_size: int,
                 average_stats: bool = False, local: LocalSpec | None = None,
                 shard_state: str | None = None, redundancy: int = 0) -> None:
        self.ctx = ctx
        self.spec = spec
        self.n_params = int(sum(int(np.prod(s)) for s in shapes))
        self.hooks = hooks
        self.policy = hooks.on_worker_loss
        self.batch_size = int(batch_size)
        self.average_stats = average_stats
        self.local = local
        self.shard_state = shard_state
        self.redundancy = int(redundancy) if shard_state is not None else 0
        self.shapes = [tuple(s) for s in shapes]
        self.losses: list[dict[str, Any]] = []
        self.update_base = 0
        self.take_shards(schedule)  # the shards each worker trains on
        #: a new group id for every membership (a loss, a re-form)
        self.generation = 0
        self.keep_every: int | None = None
        self.traffic = TrafficLog()
        self.round_log: list[dict[str, Any]] = []
        #: the segment in flight: its members and their tasks
        self.flight = Flight(ctx)
        #: the last unit of the epoch ``on_step`` was called for
        self._told = -1
        self._stop_sent = False
        #: the survivors' results of an epoch they had ended, found by this
        #: recovery's first try (:meth:`~dasktf.engines.mirrored.Mirrored.recover_epoch`)
        self._ended: list[SegmentResult] | None = None

    # -- the contract -------------------------------------------------------------
    @property
    def gid(self) -> str:
        return f"dasktf-p2p-{self.ctx.run_id}-{self.generation}"

    def prepare(self) -> None:
        """Put the collective handlers on every worker (idempotent: the first one
        registered stays; the scheduler gives it to workers that join), once per
        client and scheduler connection (:mod:`dasktf.cluster.plugins`)."""
        client = self.ctx.client
        register_once(client, PLUGIN_NAME, lambda: call_watched(
            self.ctx, lambda: compat.register_worker_plugin(
                client, P2PPlugin(), PLUGIN_NAME, True), "registering the p2p handlers"))

    def run_epoch(self, epoch: int, on_step: Callable[[int], None] | None = None,
                  start: int = 0) -> list[EpochReport]:
        self._told = start - 1

        def train(start: int) -> list[EpochReport]:
            ended, self._ended = self._ended, None
            if ended is not None:  # the survivors had ended the epoch: theirs
                self._tell(on_step, ended[0].last)
                return self._end_epoch(self._weighed(ended))
            return self._epoch(epoch, on_step, start)

        return self.recover_epoch(epoch, train, start)

    def _epoch(self, epoch: int, on_step: Callable[[int], None] | None, start: int
               ) -> list[EpochReport]:
        if (self.keep_every is None and not self.reform_needed
                and not self.stop_requested and config.get("p2p.span-epochs")):
            return self._spanned(epoch, on_step, start)
        self.flight.end_span()
        units = self.units_per_epoch
        step = start
        while True:
            last = self._segment_end(step, units)
            ends = last == units - 1
            if self.stop_requested:  # between two segments: end the epoch here
                last, ends = step - 1, True
            results = self._segment(epoch, step, last, ends, on_step)
            done = results[0].last
            why = results[0].stopped or (
                "a stop request" if self.stop_requested and last < step else None)
            if why is not None:
                self._stopped(done, why)
            self._tell(on_step, done)
            if results[0].report is not None:
                return self._end_epoch(results)
            step = done + 1

    def _spanned(self, epoch: int, on_step: Callable[[int], None] | None, start: int
                 ) -> list[EpochReport]:
        """Epoch ``epoch`` (from step ``start``) of the segment spanning epochs:
        the one in flight goes on, waiting after the previous epoch, or a new one
        starts here (see the module)."""
        units, flight = self.units_per_epoch, self.flight
        if flight.spanning == epoch - 1 and start == 0:
            flight.go(epoch)
        else:
            flight.end_span()
            segment = self._plan(epoch, start, units - 1, True, spans=True)
            flight.span(segment, f"dasktf-segment-{self.ctx.run_id}-{epoch}-{start}-"
                                 f"{self.generation}-span")
        results = flight.epoch_results(self._ticker(on_step, units - 1))
        done = results[0].last
        if results[0].stopped is not None:
            self._stopped(done, results[0].stopped)
        self._tell(on_step, done)
        return self._end_epoch(results)

    def _weighed(self, results: list[SegmentResult]) -> list[SegmentResult]:
        """The survivors' results of an epoch they ended, the first one carrying the
        weights: the group's rank 0 reports them, and a rank 0 lost after the epoch's
        last collective (its validation, its report) took them along; any
        survivor's are the same (the client's model keeps its own seed streams)."""
        report = results[0].report
        if report is None or report.weights is not None:
            return results
        weights = reconcile.read_state(self.ctx)["weights"]
        first = dataclasses.replace(results[0],
                                    report=dataclasses.replace(report, weights=weights))
        return [first, *results[1:]]

    def _end_epoch(self, results: list[SegmentResult]) -> list[EpochReport]:
        """The epoch's reports (one per replica that ended it)."""
        reports = [r.report for r in results]
        assert all(r is not None for r in reports)
        self.update_base += self.units_per_epoch
        self.traffic.update({r.worker: r.traffic for r in reports  # type: ignore[union-attr]
                             if r.traffic is not None}, self.ctx.workers)  # type: ignore[union-attr]
        self.round_log = list(reports[0].rounds or [])  # type: ignore[union-attr]
        return reports  # type: ignore[return-value]

    def _segment_end(self, step: int, units: int) -> int:
        """The last step of the segment starting at ``step``: the next grid point
        of ``checkpoint_every``, or the epoch's last step."""
        every = self.keep_every
        if every is None:
            return units - 1
        return min(units - 1, (step // every + 1) * every - 1)

    def _segment(self, epoch: int, first: int, last: int, ends: bool,
                 on_step: Callable[[int], None] | None) -> list[SegmentResult]:
        """Run steps ``first..last`` on every worker; their results."""
        segment = self._plan(epoch, first, last, ends)
        key = f"dasktf-segment-{self.ctx.run_id}-{epoch}-{first}-{self.generation}"
        return self.flight.run(segment, key, self._ticker(on_step, last))

    def _plan(self, epoch: int, first: int, last: int, ends: bool, spans: bool = False
              ) -> Segment:
        return Segment(group_spec(self.gid, self.ctx.workers, self.spec.compression),
                       epoch, first, last, self.update_base, ends,
                       scale=1.0 / max(1, self.batch_size),
                       average_stats=self.average_stats,
                       stop_on_nonfinite=self.hooks.stop_on_nonfinite,
                       shard_state=self.shard_state, redundancy=self.redundancy,
                       spans=spans)

    def _ticker(self, on_step: Callable[[int], None] | None, last: int
                ) -> Callable[[], None]:
        """What a wait for steps up to ``last`` calls meanwhile: ``on_step`` for
        the steps the client heard of (not ``last``: it is told with the results),
        and a stop requested passed on."""
        def tick() -> None:
            heard = self.hooks.heard()
            if heard is not None:
                self._tell(on_step, min(heard - self.update_base, last - 1))
            if self.stop_requested and not self._stop_sent:
                self._stop_sent = True
                self.flight.request_stop()

        return tick

    def _stopped(self, done: int, why: str) -> None:
        """The record of an epoch the workers ended after step ``done``: the update,
        why, and the newest update any worker had applied when the client's stop
        request reached it (``requested_after``)."""
        heard = [u for u in self.flight.stop_heard.values() if u is not None]
        self.hooks.publish({
            "run": self.ctx.run_id, "kind": "stopped", "update": self.update_base + done,
            "reason": why, "requested_after": min(heard) if heard else None,
            "wall_time": time.time()})

    def _tell(self, on_step: Callable[[int], None] | None, unit: int) -> None:
        """``on_step`` for every unit up to ``unit`` not told yet."""
        while self._told < unit:
            self._told += 1
            if on_step is not None:
                on_step(self._told)

    # -- a lost worker (Mirrored's walk) ------------------------------------
    def stop_steps(self, lost: list[str], survivors: list[str]) -> None:
        """Stop the survivors' segments; keep their results if they had ended the
        epoch (the loss came between their last collective and the client's
        reading: the epoch's logs then lack the lost worker's part; see the
        module). None are left to stop when a first try of this recovery did."""
        ended = self.flight.stop(survivors, f"worker(s) {', '.join(lost)} lost")
        self._ended = ended if ended is not None else self._ended
        if self.rewinds() and not self.redundancy and self.rewind_point() is None:
            assert self.shard_state is not None
            raise shards.lost_slices(lost, self.shard_state, self.hooks.last_checkpoint())

    def reform(self, schedule: np.ndarray) -> None:
        self.flight.end_span()  # its replicas are about to be rebuilt
        super().reform(schedule)

    def catch_up(self, lost: list[str], survivors: list[str], applied: list[int]
                 ) -> tuple[int, int, str | None]:
        """Sharded: the whole optimizer put together from one copy of each slice
        at the newest update a survivor applied (those one behind complete it
        first), loaded into every survivor, to be cut again over them by their next
        step (:mod:`dasktf.runtime.p2p.redundancy`). Where a slice has no copy
        left (``redundancy=0``, or both of its workers lost), every survivor goes
        back to the restore point instead (:meth:`stop_steps` saw there is one),
        and the epoch's results they may have filed are dropped: the epoch is
        trained again from there."""
        if self.shard_state is None:
            return super().catch_up(lost, survivors, applied)
        if self.redundancy and shards.recover(self.ctx, survivors, max(applied), self.shapes,
                                              self.rewind_point() is not None):
            return max(applied), 0, None
        restore = self.rewind_point()
        assert restore is not None
        self._ended = None
        shards.load_whole(self.ctx, survivors, restore, rewind=True)
        return self.rewound(max(applied), "the replicas")

    def rewinds(self) -> bool:
        """Sharded: a lost worker may take a slice of the optimizer that no
        survivor holds (its only copy, or with its neighbour both)."""
        return self.shard_state is not None

    def regroup(self) -> None:
        self.generation += 1
        self._stop_sent = False  # a stop asked for goes to the new group again

    # -- state, checkpoints, re-forms ------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The replicas' (identical) training state, read from the first one
        between segments; rounds: with every replica's inner optimizer state."""
        if self.local is not None:
            return reconcile.round_state(self.ctx, None, [None] * len(self.ctx.workers))
        if self.shard_state is not None:
            return shards.gathered_state(self.ctx, self.shapes)
        return reconcile.read_state(self.ctx)

    def load_state(self, state: dict[str, Any]) -> None:
        """Load ``state`` into every replica; sharded: each cuts its slices of the
        whole optimizer again at its next step."""
        if self.shard_state is not None:
            shards.load_whole(self.ctx, self.ctx.workers, state)
        else:
            reconcile.load_state(self.ctx, state)

    # -- the end ------------------------------------------------------------------------
    def finish(self) -> None:
        """End a segment spanning epochs, waiting after the fit's last one."""
        self.flight.end_span()

    def applied_logs(self) -> dict[int, list[int]]:
        """The updates each replica applied: from the ended span's results when
        every worker of the run handed them back (no task per worker to read them:
        N tasks were about 30 of a short fit's 190 messages to the scheduler at
        N=8), else read from the replicas."""
        logs = self.flight.applied_logs
        if len(logs) == len(self.ctx.workers):
            return dict(logs)
        return super().applied_logs()

    def close(self) -> None:
        """A segment still running (the run failed): abort its group, release it."""
        self.flight.abort("the run ended")
