"""A run's context and the waits that never hang.

Every client-side wait on a run's futures goes through :func:`wait_for`: it polls
the membership and the futures, names a lost worker within
``dasktf.poll-interval`` and gives up after ``dasktf.step-timeout``. A client call
that reaches workers itself (a scatter, a worker plugin's registration) is awaited
the same way by :func:`call_watched`; :class:`WatchedClient` gives a run's set-up
both, behind the client's own ``scatter`` and ``gather``. Every other loop that
polls (a holder call, a TensorFlow child, a starting cluster) keeps its time limit
in a :class:`Deadline`, and simple ones wait with :func:`poll_until`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from distributed import wait

from dasktf import compat, config
from dasktf.cluster.broadcast import copy_to_workers
from dasktf.cluster.deadline import Deadline, poll_until
from dasktf.cluster.membership import listed_workers
from dasktf.exceptions import (
    CollectiveAbortedError,
    ReplicaError,
    StepTimeoutError,
    WorkerLostError,
)

if TYPE_CHECKING:
    from distributed import Client, Future

T = TypeVar("T")


@dataclass
class RunContext:
    """What the engines share about a run: who, where, how many steps."""

    client: Client
    run_id: str
    workers: list[str]
    steps_per_epoch: int
    #: Dask resources every pinned task requests: ``{"GPU": 1}`` on GPU runs, so a
    #: step can never run on a worker that has no GPU.
    resources: dict[str, float] | None = None
    #: A :class:`dasktf.cluster.membership.MembershipWatcher`: hears of lost workers from the
    #: scheduler as it happens instead of at the next liveness poll.
    watcher: Any = None


def wait_for(ctx: RunContext, futures: list[Future], what: str,
             tick: Callable[[], None] | None = None, tick_interval: float = 0.05,
             until: Callable[[float], bool] | None = None,
             timeout_key: str = "step-timeout") -> None:
    """Wait for ``futures`` without ever hanging on a dead peer.

    Checks every ``dasktf.poll-interval`` that the run's workers are alive and fails
    after ``dasktf.<timeout_key>`` (passed, not set in the global config around the
    call: runs in other threads read it too), naming the workers that have not
    answered.
    ``tick``: called every ``tick_interval`` seconds while waiting (an engine
    following its long-running tasks' progress). ``until(seconds)``: waits up to
    that long for something else the caller waits for (instead of the futures),
    ``True`` once it came: the wait then ends too, the futures still running.
    """
    poll = config.get_seconds("poll-interval")
    interval = poll if tick is None else min(poll, tick_interval)
    checked = time.monotonic()
    deadline = Deadline(config.get_seconds(timeout_key))
    pending = list(futures)
    while True:
        quiet = came = False
        try:
            if until is None:
                wait(pending, timeout=interval, return_when="FIRST_COMPLETED")
            else:
                came = until(interval)
        except TimeoutError:
            quiet = tick is None
        if tick is not None:
            tick()
        errored = [f for f in pending if f.status == "error"]
        if errored:
            # a collective's members fail together: the one that caused it first
            errored.sort(key=lambda f: isinstance(f.exception(), CollectiveAbortedError))
            error = errored[0].exception()
            if type(error).__name__ == "KilledWorker":
                _await_removal(ctx, poll * 4)  # the scheduler's notice is on its way
            elif isinstance(error, WorkerLostError) and (
                    not error.workers or set(error.workers) & set(ctx.workers)):
                # a peer of a worker-to-worker collective saw its connection close:
                # the scheduler's notice follows (bounded by worker-loss-timeout).
                # Not for a peer the run already went on without (a span's end
                # after a loss at the last epoch's end): no notice of the run's
                # workers would come, and the wait was the whole timeout, 30 s.
                _await_removal(ctx, config.get_seconds("worker-loss-timeout"))
            check_alive(ctx, what)  # a task lost with its worker: say so, by name
            raise_task_error(errored[0], what)
        pending = [f for f in pending if f.status != "finished"]
        if came or not pending:
            return
        # After a quiet poll interval, not each time one of several futures
        # finishes: the check asks the scheduler for every worker's identity
        # (several ms under load), and a two-worker step would pay it every step.
        if quiet or time.monotonic() - checked >= poll:
            check_alive(ctx, what)
            checked = time.monotonic()
        if deadline.passed():
            raise _timed_out(ctx, what, timeout_key)


def _timed_out(ctx: RunContext, what: str, key: str = "step-timeout") -> StepTimeoutError:
    return StepTimeoutError(
        f"{what} did not finish within dasktf.{key} "
        f"({config.get_seconds(key):g}s); workers {ctx.workers} were alive "
        "but did not answer. Check their logs for a stuck task, or raise the timeout "
        f"with DASK_DASKTF__{key.upper().replace('-', '_')}.")


def _await_removal(ctx: RunContext, seconds: float) -> None:
    watcher = ctx.watcher
    if watcher is not None:
        poll_until(lambda: bool(watcher.removed(ctx.workers)), seconds, 0.02)


def lost_workers(ctx: RunContext, wait: float = 0.0, *, ask: bool = False) -> list[str]:
    """The run's workers that left the cluster: those the membership watcher heard
    of, else those the scheduler no longer lists. ``wait``: first give the
    scheduler's notice that long to arrive (a failed call is often the first sign).

    With a watcher, and no ``wait``, the scheduler is asked at most every
    ``dasktf.membership-backstop`` (:meth:`~dasktf.cluster.membership.MembershipWatcher.backstop_due`):
    a waiting client checks every ``poll-interval``, and a question each time was
    most of the messages a short fit sent the scheduler besides its heartbeats
    (issue 39). After a ``wait`` (a failed call), and with ``ask`` (the end of a
    set-up or end phase, which names a worker the scheduler dropped in it with it,
    not with the next one: the removal's event may still be on its way), always."""
    if wait > 0:
        _await_removal(ctx, wait)
    if ctx.watcher is not None:
        lost = sorted({c.worker for c in ctx.watcher.removed(ctx.workers)})
        if lost:
            return lost
        if not ctx.watcher.backstop_due(config.get_seconds("membership-backstop"),
                                        asking=ask or wait > 0):
            return []
    alive = listed_workers(ctx.client, ctx.workers)
    return [w for w in ctx.workers if w not in alive]


def check_alive(ctx: RunContext, what: str) -> None:
    lost = lost_workers(ctx)
    if lost:
        raise WorkerLostError(
            f"Worker(s) {lost} left the cluster during {what}. The surviving replicas "
            "are intact; restart the worker(s) or train with fewer workers.",
            lost,
        )


def call_watched(ctx: RunContext, make: Callable[[], Awaitable[T]], what: str,
                 timeout_key: str = "step-timeout") -> T:
    """Await the client coroutine ``make()`` on the client's event loop, checking
    the run's workers every ``dasktf.poll-interval``.

    A call that reaches workers waits on a dead one for as long as distributed
    retries its connection (``distributed.comm.timeouts.connect``), and a scatter
    to a worker the scheduler dropped waits that long for it to come back: here a
    lost worker of the run ends the wait at the next poll, the call cancelled, with
    a :class:`WorkerLostError` naming it; so does a call that failed because of it
    (a ``CommClosedError``). After ``dasktf.<timeout_key>``
    (``step-timeout``): :class:`StepTimeoutError`.
    """
    async def call() -> T:
        return await make()

    poll = config.get_seconds("poll-interval")
    deadline = Deadline(config.get_seconds(timeout_key))
    pending = asyncio.run_coroutine_threadsafe(call(), ctx.client.loop.asyncio_loop)
    try:
        while True:
            concurrent.futures.wait([pending], timeout=poll)
            if pending.done():
                try:
                    return pending.result()
                except (OSError, TimeoutError) as exc:  # CommClosedError is an OSError
                    lost = lost_workers(ctx, wait=poll * 4)
                    if lost:
                        raise WorkerLostError(
                            f"Worker(s) {lost} left the cluster during {what} "
                            f"({type(exc).__name__}: {exc}).", lost) from exc
                    raise
            check_alive(ctx, what)
            if deadline.passed():
                raise _timed_out(ctx, what, timeout_key)
    finally:
        if not pending.done():
            pending.cancel()


class WatchedClient:
    """A run's client whose ``scatter`` and ``gather`` never wait on a lost worker.

    What a run's set-up hands to code written against a ``Client`` (placing the
    data: :mod:`dasktf.data.sources`): ``scatter`` goes through
    :func:`call_watched`, ``gather`` first waits with :func:`wait_for` (a task
    pinned to a worker that left is never run, so a plain gather of it never
    returns); either raises :class:`WorkerLostError` naming the worker and
    ``what``; a task that failed raises its own error, as with the client. Every
    other attribute is the client's own.
    """

    def __init__(self, ctx: RunContext, what: str) -> None:
        self.ctx = ctx
        self.what = what

    def scatter(self, data: Any, **kwargs: Any) -> Any:
        client = self.ctx.client
        return call_watched(
            self.ctx, lambda: client.scatter(data, asynchronous=True, **kwargs), self.what)

    def scatter_each(self, values: list[Any], workers: list[str]) -> list[Future]:
        """``values[i]`` scattered to ``workers[i]``: one message to the scheduler
        for them all (:func:`dasktf.compat.scatter_each`), watched as ``scatter``."""
        client = self.ctx.client
        return call_watched(
            self.ctx, lambda: compat.scatter_each(client, values, workers), self.what)

    def broadcast(self, value: Any, workers: Sequence[str] | None = None) -> Any:
        """A future of ``value`` on each of ``workers`` (default: the run's), copied
        among them (:mod:`dasktf.cluster.broadcast`), watched as ``scatter``."""
        client, targets = self.ctx.client, list(workers or self.ctx.workers)
        return call_watched(
            self.ctx, lambda: copy_to_workers(client, value, targets), self.what)

    def gather(self, futures: Any, **kwargs: Any) -> Any:
        try:
            wait_for(self.ctx, list(futures), self.what)
        except ReplicaError:
            pass  # a task failed (not for a lost worker): gather raises its own error
        return self.ctx.client.gather(futures, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ctx.client, name)


def raise_task_error(future: Future, what: str) -> None:
    raise_error(future.exception(), future.traceback(), what)


def raise_error(exc: BaseException, tb: Any, what: str, worker: str | None = None
                ) -> None:
    """What a worker raised (``tb``: its traceback there), as a
    :class:`ReplicaError` naming ``what`` (and ``worker``)."""
    import traceback

    detail = "".join(traceback.format_tb(tb)) if tb is not None else ""
    where = "a worker" if worker is None else f"worker {worker}"
    raise ReplicaError(
        f"{what} failed on {where}: {type(exc).__name__}: {exc}\n"
        f"Worker traceback:\n{detail}"
    ) from exc
