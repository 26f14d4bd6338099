"""The segment in flight: one task per member, submitted, followed, read, ended.

What the client does with a segment's tasks (:mod:`dasktf.runtime.p2p.segment`)
besides deciding what they run (:class:`~dasktf.engines.p2p.engine.P2PEngine`): it
submits them pinned, waits for them while hearing of their steps, reads their
results (checked to agree), and on a loss aborts the group on the survivors (a member
may be waiting in it for the lost one) and keeps what they finished. Outside the
task graph it talks to the workers' event loops only (:func:`tell_workers`), which a
segment's task never blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed import wait

from dasktf import config
from dasktf.cluster.waits import RunContext, call_watched, wait_for
from dasktf.engines.batch import TaskBatch
from dasktf.runtime.p2p.links import request_stop
from dasktf.runtime.p2p.plugin import abort_group
from dasktf.runtime.p2p.segment import Segment, SegmentResult, segment_task

if TYPE_CHECKING:
    from distributed import Future

logger = logging.getLogger(__name__)


class Flight:
    """The tasks of the segment in flight (none between two segments)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.members: list[str] = []
        self.futures: list[Future] = []
        self.gid = ""
        #: per worker, the update it had applied when the stop request reached it
        self.stop_heard: dict[str, int | None] = {}

    def run(self, segment: Segment, key: str, tick: Callable[[], None]
            ) -> list[SegmentResult]:
        """Submit ``segment`` on every worker of the run (task ``key-i`` on worker
        ``i``, pinned), wait for it calling ``tick`` meanwhile, and read the results."""
        ctx = self.ctx
        self.members, self.gid = list(ctx.workers), segment.group.gid
        # One update-graph message for the N tasks (N submits were N messages, the
        # scheduler's largest cost per epoch: benchmarks/scale.py); each pinned
        # where its replica and shard live.
        batch = TaskBatch(ctx.client)
        tasks = [batch.add(segment_task, ctx.run_id, segment, key=f"{key}-{i}",
                           workers=[w], resources=ctx.resources)
                 for i, w in enumerate(self.members)]
        batch.want(tasks)
        futures_by_key = batch.flush()
        self.futures = [futures_by_key[t.key] for t in tasks]
        what = (f"steps {segment.first + 1}-{segment.last + 1} of epoch "
                f"{segment.epoch + 1}")
        wait_for(ctx, self.futures, what, tick=tick)
        # (a worker lost since its task ended takes its result along: no waiting
        # for a recomputation that cannot happen; it is a loss like any other)
        futures = self.futures
        results: list[SegmentResult] = call_watched(
            ctx, lambda: ctx.client.gather(futures, asynchronous=True), what)
        self.release()
        return self.agreed(results)

    def agreed(self, results: list[SegmentResult]) -> list[SegmentResult]:
        """``results``, checked to end at the same step (a collective ends them)."""
        reached = {r.last for r in results}
        if len(reached) != 1 or len({r.report is None for r in results}) != 1:
            raise RuntimeError(f"the members of {self.gid} ended the segment at steps "
                               f"{sorted(reached)}; this is a dasktf bug (a collective "
                               "must end them together).")
        for r in results:
            if r.stop_heard_after is not None:
                self.stop_heard[r.worker] = r.stop_heard_after
        return results

    def request_stop(self) -> None:
        """Every member votes to stop in its next collective."""
        tell_workers(self.ctx, request_stop, [self.ctx.run_id], self.members)

    def stop(self, survivors: list[str], reason: str) -> list[SegmentResult] | None:
        """End the segment after a loss: its group aborted on ``survivors``, their
        tasks awaited (bounded), all released. The survivors' results if every one
        of them had ended the epoch (the loss came after), else ``None``."""
        if not self.futures:
            return None
        tell_workers(self.ctx, abort_group, [self.gid, reason], survivors)
        mine = [f for f, w in zip(self.futures, self.members, strict=True)
                if w in survivors]
        try:
            wait(mine, timeout=config.get_seconds("step-timeout"))
        except TimeoutError:
            logger.warning("run %s: a survivor's segment did not end after the abort",
                           self.ctx.run_id)
        ended = None
        if mine and all(f.status == "finished" for f in mine):
            results = self.ctx.client.gather(mine)
            if all(r.report is not None for r in results):
                ended = self.agreed(results)
        self.release()
        return ended

    def abort(self, reason: str) -> None:
        """The run ends with the segment in flight: abort its group, release it."""
        if self.futures:
            tell_workers(self.ctx, abort_group, [self.gid, reason], self.members)
            self.release()

    def release(self) -> None:
        for f in self.futures:
            f.release()
        self.futures = []


def tell_workers(ctx: RunContext, func: Callable[..., Any], args: list[Any],
                 workers: list[str]) -> None:
    """``func(*args)`` on ``workers`` outside the task graph (``client.run``, on their
    event loops: a segment's task may be holding their threads), bounded; a worker
    that does not answer is left to the membership watcher."""
    try:
        ctx.client.run(func, *args, workers=list(workers), on_error="ignore",
                       callback_timeout=config.get_seconds("poll-interval") * 4)
    except Exception:  # lost meanwhile: the recovery hears of it
        logger.debug("%s on %s failed", getattr(func, "__name__", func), workers,
                     exc_info=True)
