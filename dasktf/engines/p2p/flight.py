"""The segment in flight: one task per member, submitted, followed, read, ended.

What the client does with a segment's tasks (:mod:`dasktf.runtime.p2p.segment`)
besides deciding what they run (:class:`~dasktf.engines.p2p.engine.P2PEngine`): it
submits them pinned, waits for them while hearing of their steps, reads their
results (checked to agree), and on a loss aborts the group on the survivors (a member
may be waiting in it for the lost one) and keeps what they finished. Outside the
task graph it talks to the workers' event loops only (:func:`tell_workers`), which a
segment's task never blocks.

A segment that spans epochs (:mod:`dasktf.runtime.p2p.span`) is submitted once
(:meth:`Flight.span`); each epoch's results are read from the members' gates and
the next epoch started with a word to each (:meth:`Flight.epoch_results`,
:meth:`Flight.go`), over the client's own connections to the workers: nothing of
it reaches the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed import wait

from dasktf import config
from dasktf.cluster import calls
from dasktf.cluster.batch import TaskBatch
from dasktf.cluster.waits import RunContext, call_watched, wait_for
from dasktf.exceptions import CollectiveAbortedError, ReplicaError, WorkerLostError
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
        #: the epoch a spanning segment in flight is in (``None``: none in flight)
        self.spanning: int | None = None
        #: that epoch's results read so far, by member
        self._got: dict[str, SegmentResult] = {}
        #: ``{replica index: updates applied}`` from the results of the spanning
        #: segment the client's word ended (every member's), else empty
        self.applied_logs: dict[int, list[int]] = {}

    def run(self, segment: Segment, key: str, tick: Callable[[], None]
            ) -> list[SegmentResult]:
        """Submit ``segment`` on every worker of the run (task ``key-i`` on worker
        ``i``, pinned), wait for it calling ``tick`` meanwhile, and read the results."""
        self.submit(segment, key)
        ctx = self.ctx
        what = (f"steps {segment.first + 1}-{segment.last + 1} of epoch "
                f"{segment.epoch + 1}")
        wait_for(ctx, self.futures, what, tick=tick)
        # (a worker lost since its task ended takes its result along: no waiting
        # for a recomputation that cannot happen; it is a loss like any other)
        futures = self.futures
        results: list[SegmentResult] = call_watched(
            ctx, lambda: ctx.client.gather(futures, direct=True, asynchronous=True), what)
        self.release()
        return self.agreed(results)

    def submit(self, segment: Segment, key: str) -> None:
        """Submit ``segment``'s tasks (task ``key-i`` on worker ``i``, pinned)."""
        ctx = self.ctx
        self.members, self.gid = list(ctx.workers), segment.group.gid
        self.applied_logs = {}  # a segment's updates follow: those are old now
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

    # -- a segment that spans epochs ------------------------------------------------
    def span(self, segment: Segment, key: str) -> None:
        """Submit ``segment`` (``spans``), which starts with epoch ``segment.epoch``."""
        self.submit(segment, key)
        self.spanning, self._got = segment.epoch, {}

    def go(self, epoch: int) -> None:
        """The spanning segment goes on with epoch ``epoch`` (the one after its
        last); a member that does not hear of it is left to the waits."""
        assert self.spanning == epoch - 1, (self.spanning, epoch)
        self._ask(self.members, "dasktf_p2p_word", config.get_seconds("poll-interval") * 4,
                  run=self.ctx.run_id, epoch=epoch - 1, go=True)
        self.spanning, self._got = epoch, {}

    def epoch_results(self, tick: Callable[[], None]) -> list[SegmentResult]:
        """The members' results of the spanning segment's epoch, read from their
        gates as they come (``tick`` called meanwhile); the segment is over (its
        tasks released) when a vote ended the epoch."""
        ctx, got, epoch = self.ctx, self._got, self.spanning
        assert epoch is not None

        def until(seconds: float) -> bool:
            missing = [w for w in self.members if w not in got]
            answers = self._ask(missing, "dasktf_p2p_epoch",
                                seconds + config.get_seconds("poll-interval") * 4,
                                run=ctx.run_id, epoch=epoch, wait=seconds)
            got.update({w: r for w, r in answers.items()
                        if r is not None and not isinstance(r, BaseException)})
            return len(got) == len(self.members)

        wait_for(ctx, self.futures, f"epoch {epoch + 1}", tick=tick, until=until)
        if not until(0.0):  # the tasks returned (a vote): their results are filed
            raise RuntimeError(f"the members of {self.gid} ended epoch {epoch + 1} "
                               "without filing its results; this is a dasktf bug.")
        results = self.agreed([got[w] for w in self.members])
        if results[0].stopped is not None:
            wait_for(ctx, self.futures, f"the end of epoch {epoch + 1}")
            self.release()
        return results

    def end_span(self) -> None:
        """End the spanning segment waiting after its epoch (none: nothing)."""
        if self.spanning is None or not self.futures:
            self.spanning = None
            return
        self._ask(self.members, "dasktf_p2p_word", config.get_seconds("poll-interval") * 4,
                  run=self.ctx.run_id, epoch=self.spanning, go=False)
        # (a member the run went on without since, at its end, is not waited for)
        mine = [f for f, w in zip(self.futures, self.members, strict=True)
                if w in self.ctx.workers]
        what = f"the end of epoch {self.spanning + 1}"
        try:
            wait_for(self.ctx, mine, what)
        except (WorkerLostError, CollectiveAbortedError, ReplicaError) as exc:
            # Once the client read the last epoch, a task only waits for its word,
            # and fails only with its group (a member lost since, which took nothing
            # trained along: the caller's own checks name it, as after a per-epoch
            # segment); the others' tasks are let go.
            logger.debug("run %s: the span's end: %s", self.ctx.run_id, exc)
            tell_workers(self.ctx, abort_group, [self.gid, "the span ended"],
                         self.members)
        else:
            self.applied_logs = self._applied_logs(mine, what)
        finally:
            self.release()

    def _applied_logs(self, mine: list[Future], what: str) -> dict[int, list[int]]:
        """``{replica index: updates applied}`` from the ended span's results, if
        every member's task handed them back; else empty (the run's end reads them
        from the replicas, and names a worker lost meanwhile there)."""
        if len(mine) != len(self.futures):
            return {}
        try:
            results: list[SegmentResult] = call_watched(
                self.ctx, lambda: self.ctx.client.gather(mine, direct=True, asynchronous=True), what)
        except Exception:  # read from the replicas instead
            logger.debug("run %s: the span's results", self.ctx.run_id, exc_info=True)
            return {}
        logs = [r.applied_log for r in results]
        return dict(log for log in logs if log is not None) if all(logs) else {}

    def _ask(self, workers: list[str], op: str, timeout: float, **kwargs: Any
             ) -> dict[str, Any]:
        """``op(**kwargs)`` on each of ``workers`` over the client's own
        connections to them (not the scheduler); per worker, its answer or the
        exception it raised (a lost one: the waits name it)."""
        client = self.ctx.client

        async def every() -> list[Any]:
            return await asyncio.gather(
                *[getattr(client.rpc(w), op)(**kwargs) for w in workers],
                return_exceptions=True)

        if not workers:
            return {}
        pending = asyncio.run_coroutine_threadsafe(every(), client.loop.asyncio_loop)
        try:
            answers = pending.result(timeout)
        except Exception as exc:  # noqa: BLE001 - a timeout: the waits name who
            pending.cancel()
            answers = [exc] * len(workers)
        return dict(zip(workers, answers, strict=True))

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
        if self.spanning is not None:  # the epoch's results the survivors filed
            got = {w: r for w, r in self._got.items() if w in survivors}
            got.update({w: r for w, r in self._ask(
                [w for w in survivors if w not in got], "dasktf_p2p_epoch",
                config.get_seconds("poll-interval") * 4, run=self.ctx.run_id,
                epoch=self.spanning, wait=0.0).items()
                if r is not None and not isinstance(r, BaseException)})
            if survivors and all(w in got and got[w].report is not None
                                 for w in survivors):
                ended = self.agreed([got[w] for w in survivors])
        elif mine and all(f.status == "finished" for f in mine):
            results = self.ctx.client.gather(mine, direct=True)
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
        self.spanning, self._got = None, {}


def tell_workers(ctx: RunContext, func: Callable[..., Any], args: list[Any],
                 workers: list[str]) -> None:
    """``func(*args)`` on ``workers`` outside the task graph (on their event loops: a
    segment's task may be holding their threads), bounded; a worker that does not
    answer is left to the membership watcher."""
    calls.tell_workers(ctx.client, func, args, workers,
                       config.get_seconds("poll-interval") * 4)
