"""A run's context and the waits that never hang.

Every client-side wait on a run's futures goes through :func:`wait_for`: it polls
the membership and the futures, names a lost worker within
``dasktf.poll-interval`` and gives up after ``dasktf.step-timeout``. Every other
loop that polls (a holder call, a TensorFlow child, a starting cluster) keeps its
time limit in a :class:`Deadline`, and simple ones wait with :func:`poll_until`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed import wait

from dasktf import config
from dasktf.cluster.deadline import Deadline, poll_until
from dasktf.cluster.local import alive_workers
from dasktf.exceptions import ReplicaError, StepTimeoutError, WorkerLostError

if TYPE_CHECKING:
    from distributed import Client, Future


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


def wait_for(ctx: RunContext, futures: list[Future], what: str) -> None:
    """Wait for ``futures`` without ever hanging on a dead peer.

    Checks every ``dasktf.poll-interval`` that the run's workers are alive and fails
    after ``dasktf.step-timeout``, naming the workers that have not answered.
    """
    poll = config.get_seconds("poll-interval")
    checked = time.monotonic()
    deadline = Deadline(config.get_seconds("step-timeout"))
    pending = list(futures)
    while True:
        quiet = False
        try:
            wait(pending, timeout=poll, return_when="FIRST_COMPLETED")
        except TimeoutError:
            quiet = True
        errored = [f for f in pending if f.status == "error"]
        if errored:
            if type(errored[0].exception()).__name__ == "KilledWorker":
                _await_removal(ctx, poll * 4)  # the scheduler's notice is on its way
            check_alive(ctx, what)  # a task lost with its worker: say so, by name
            raise_task_error(errored[0], what)
        pending = [f for f in pending if f.status != "finished"]
        if not pending:
            return
        # After a quiet poll interval, not each time one of several futures
        # finishes: the check asks the scheduler for every worker's identity
        # (several ms under load), and a two-worker step would pay it every step.
        if quiet or time.monotonic() - checked >= poll:
            check_alive(ctx, what)
            checked = time.monotonic()
        if deadline.passed():
            raise StepTimeoutError(
                f"{what} did not finish within dasktf.step-timeout "
                f"({config.get_seconds('step-timeout'):g}s); workers {ctx.workers} "
                "were alive but did not answer. Check their logs for a stuck task, "
                "or raise the timeout with DASK_DASKTF__STEP_TIMEOUT."
            )


def _await_removal(ctx: RunContext, seconds: float) -> None:
    watcher = ctx.watcher
    if watcher is not None:
        poll_until(lambda: bool(watcher.removed(ctx.workers)), seconds, 0.02)


def check_alive(ctx: RunContext, what: str) -> None:
    if ctx.watcher is not None:
        lost = sorted({c.worker for c in ctx.watcher.removed(ctx.workers)})
    else:
        lost = []
    if not lost:
        alive = set(alive_workers(ctx.client))
        lost = [w for w in ctx.workers if w not in alive]
    if lost:
        raise WorkerLostError(
            f"Worker(s) {lost} left the cluster during {what}. The surviving replicas "
            "are intact; restart the worker(s) or train with fewer workers.",
            lost,
        )


def raise_task_error(future: Future, what: str) -> None:
    exc = future.exception()
    tb = future.traceback()
    import traceback

    detail = "".join(traceback.format_tb(tb)) if tb is not None else ""
    raise ReplicaError(
        f"{what} failed on a worker: {type(exc).__name__}: {exc}\n"
        f"Worker traceback:\n{detail}"
    ) from exc
