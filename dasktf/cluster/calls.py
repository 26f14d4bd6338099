"""A function called on given workers over the client's own connections to them,
not as a task: what a run asks of each of its workers and needs back at once.

Every task costs the scheduler about 1 ms of CPU (the ``update-graph``, the
``compute-task``, ``task-finished``, the result's ``key-in-memory``, the releases:
8 pinned tasks took it 8.6 ms on a 2-core machine, issue 39), and a short fit's
fixed set-up and end were mostly such tasks: a replica's build on each worker, the
trained state read from one. Here the client calls ``dasktf_call`` on each worker
through ``client.rpc`` (a handler :class:`CallsPlugin` puts on every worker, as
Dask's P2P shuffle adds its own), which runs the function in the worker's thread
pool, where its tasks run (or, ``thread=False``, on its event loop, for what never
blocks: ``Client.run`` would route that through the scheduler, a message in and
out per worker). Nothing of it reaches the scheduler.

What a task would have given and a call does not, and why that is safe here: the
scheduler does not count the thread busy (these calls run where the run's own
tasks run, none of which overlaps them), no resources are claimed (the run's tasks
claim them), no result is kept on the worker (the caller takes it), and the
scheduler retries nothing (a lost worker is the run's: :func:`call_on_workers`
names it, as a task's wait would). Arguments that are futures of data held on the
worker called (a shard placed there) go by key and are read from its memory there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed.core import clean_exception, error_message
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize
from distributed.protocol.pickle import dumps, loads

from dasktf import compat
from dasktf.cluster.waits import call_watched, raise_error

if TYPE_CHECKING:
    from distributed import Worker

    from dasktf.cluster.waits import RunContext

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dasktf-calls"
HANDLER = "dasktf_call"


@dataclass(frozen=True)
class Held:
    """An argument that is the data of ``key``, held by the worker called."""

    key: str


class CallsPlugin(WorkerPlugin):
    """Puts the ``dasktf_call`` handler on a worker (see the module)."""

    name = PLUGIN_NAME
    idempotent = True  # every run registers it; the first one stays

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        worker.handlers[HANDLER] = self.call

    async def call(self, function: bytes, args: bytes, thread: bool = True
                   ) -> dict[str, Any]:
        """``function(*args)`` here: ``{"status": "OK", "result": ...}``, or what it
        raised as distributed sends a task's error (the caller names it)."""
        try:
            func, values = loads(function), loads(args)
            missing = [v.key for v in values
                       if isinstance(v, Held) and v.key not in self.worker.data]
            if missing:
                raise KeyError(f"{getattr(func, '__name__', func)} on "
                               f"{self.worker.address}: its data {missing} is not "
                               "held there")
            values = [self.worker.data[v.key] if isinstance(v, Held) else v
                      for v in values]
            if thread:
                result = await compat.run_in_worker_thread(self.worker, func, *values)
            else:
                result = func(*values, dask_worker=self.worker)
        except Exception as exc:  # noqa: BLE001 - the caller's to raise, by name
            return error_message(exc)
        return {"status": "OK", "result": to_serialize(result)}


def _wire(args: Sequence[Any]) -> bytes:
    from distributed import Future

    return dumps([Held(str(a.key)) if isinstance(a, Future) else a for a in args])


async def call_each(client: Any, func: Callable[..., Any],
                    calls: Sequence[tuple[str, Sequence[Any]]], thread: bool = True
                    ) -> list[dict[str, Any]]:
    """``func(*args)`` on each ``(worker, args)`` of ``calls``, all at once, on the
    client's event loop: each one's answer (see :meth:`CallsPlugin.call`)."""
    function = dumps(func)
    return list(await asyncio.gather(*[
        getattr(client.rpc(worker), HANDLER)(function=function, args=_wire(args),
                                             thread=thread)
        for worker, args in calls]))


def call_on_workers(ctx: RunContext, what: str, func: Callable[..., Any],
                    calls: Sequence[tuple[str, Sequence[Any]]], *,
                    timeout_key: str = "step-timeout") -> list[Any]:
    """``func(*args)`` in the thread pool of each ``(worker, args)`` of ``calls``;
    their results, in order. What ``func`` raised on a worker is a
    :class:`~dasktf.exceptions.ReplicaError` with its traceback there, as a task's
    error is (:func:`~dasktf.cluster.waits.raise_task_error`); a worker of the run
    lost meanwhile a :class:`~dasktf.exceptions.WorkerLostError` naming it and
    ``what``; none answering within ``dasktf.<timeout_key>`` a
    :class:`~dasktf.exceptions.StepTimeoutError`
    (:func:`~dasktf.cluster.waits.call_watched`). The run registered
    :class:`CallsPlugin` when it set up."""
    answers = call_watched(ctx, lambda: call_each(ctx.client, func, calls), what,
                           timeout_key)
    for (worker, _), answer in zip(calls, answers, strict=True):
        if not isinstance(answer, dict):  # the worker has no such handler
            raise RuntimeError(
                f"{what}: worker {worker} has no {HANDLER} handler (answered "
                f"{answer!r}); dasktf registers {PLUGIN_NAME} when a run sets up: "
                "was it unregistered, or is the worker's dasktf older?")
        if answer.get("status") != "OK":
            _, exc, tb = clean_exception(**answer)
            raise_error(exc, tb, what, worker)
    return [answer["result"] for answer in answers]


def tell_workers(client: Any, func: Callable[..., Any], args: Sequence[Any],
                 workers: Sequence[str], timeout: float | None) -> None:
    """``func(*args, dask_worker=worker)`` on the event loop of each of ``workers``
    (which a task holding their threads never blocks), as ``client.run(...,
    on_error="ignore", callback_timeout=timeout)`` would through the scheduler;
    waits ``timeout`` seconds at most (``None``: until all answered). A worker that
    fails or does not answer is ignored: a lost one is the run's to notice."""
    if not workers:
        return
    pending = asyncio.run_coroutine_threadsafe(
        call_each(client, func, [(w, args) for w in workers], thread=False),
        client.loop.asyncio_loop)
    try:
        pending.result(timeout)
    except Exception:  # lost meanwhile: the run hears of it
        pending.cancel()
        logger.debug("%s on %s failed", getattr(func, "__name__", func), workers,
                     exc_info=True)
