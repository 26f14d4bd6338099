"""Calls to a holder that fail fast when its worker is gone (Dask never completes
a call to an actor whose worker died).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dasktf import config
from dasktf.cluster.deadline import Deadline
from dasktf.engines.base import StateLostError
from dasktf.exceptions import StepTimeoutError

#: Keys of holders the client declared lost (:func:`abandon_holder_task`): a call to
#: one of them gives up at once instead of waiting for a worker that is gone.
_LOST_HOLDERS: set[str] = set()


async def actor_call(
    rpc: Any, address: str, key: str, method: str, args: tuple[Any, ...], timeout: float,
    lost: Callable[[], bool] | None = None,
) -> Any:
    """``actor.method(*args)`` on ``address`` through ``rpc`` (from a worker or the
    client), awaited on its loop: gives up within a poll once that holder is
    declared lost (``_LOST_HOLDERS`` or ``lost()``: HolderLostError, also when its
    worker is unreachable) and after ``timeout`` (StepTimeoutError)."""
    from distributed.protocol import to_serialize

    request = asyncio.ensure_future(rpc.actor_execute(
        function=method, actor=key, args=[to_serialize(a) for a in args], kwargs={},
    ))
    poll = min(0.1, config.get_seconds("poll-interval"))
    deadline = Deadline(timeout)
    while True:
        done, _ = await asyncio.wait({request}, timeout=poll)
        if done:
            break
        gone = key in _LOST_HOLDERS or (lost is not None and lost())
        if gone or deadline.passed():
            request.cancel()
            if gone:
                raise HolderLostError(f"the parameter holder on {address} was lost")
            raise StepTimeoutError(
                f"The parameter holder on {address} did not answer {method} within "
                f"{timeout:g}s (dasktf.step-timeout); check that worker's log."
            )
    try:
        response = request.result()
    except Exception as exc:
        # its worker is gone (connection refused or closed; through the scheduler's
        # proxy, whatever the proxy raises while the worker is reported lost)
        if isinstance(exc, OSError) or (lost is not None and lost()):
            raise HolderLostError(
                f"the parameter holder on {address} is unreachable: {exc}") from exc
        raise
    if response["status"] != "OK":
        raise response["exception"]
    return response["result"]


class HolderLostError(StateLostError):
    """The parameter holder a gradient task talks to was lost (the client restores
    it on a survivor and recomputes what was not applied)."""


@dataclass(frozen=True)
class HolderRef:
    """Where a run's :class:`ParameterHolder` lives: what the gradient tasks get
    instead of the :class:`~distributed.actor.Actor`.

    An Actor argument makes the holder's task a *dependency* of every gradient task,
    so losing the holder's worker sends them all into the scheduler's recomputation
    of a task pinned to a worker that is gone; and a call to a dead actor waits for
    the actor's future forever. A call through this reference fails within a poll
    interval once the client has declared the holder lost, and within ``timeout``
    otherwise.
    """

    address: str
    key: str

    def keys(self) -> tuple[str, ...]:
        """Every holder actor a call through this reference may wait on."""
        return (self.key,)

    def call(self, method: str, *args: Any, timeout: float) -> Any:
        """``holder.method(*args)`` from a task on a worker (blocking)."""
        from distributed import get_worker
        from distributed.utils import sync

        worker = get_worker()
        return sync(worker.loop, actor_call, worker.rpc(self.address), self.address,
                    self.key, method, args, timeout)


class ClientHolder:
    """The client's handle on a holder: ``holder.method(*args).result(timeout)`` as
    with an :class:`~distributed.actor.Actor`, but failing fast like
    :meth:`HolderRef.call` (an Actor call to a lost worker waits on the actor's
    future, which a task pinned to a dead worker never completes): it gives up
    with :class:`HolderLostError` once ``lost()`` says the holder's worker is gone
    or it cannot be reached."""

    def __init__(self, client: Any, ref: HolderRef, lost: Callable[[], bool]) -> None:
        self._client, self._ref, self._lost = client, ref, lost

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*args: Any) -> _PendingCall:
            return _PendingCall(lambda timeout: self._client.sync(
                actor_call, self._rpc(), self._ref.address, self._ref.key, method,
                args, timeout, self._lost))
        return call

    def _rpc(self) -> Any:
        # as distributed's Actor does: through the scheduler unless the client
        # talks to workers directly
        if self._client.direct_to_workers:
            return self._client.rpc(self._ref.address)
        from distributed.actor import ProxyRPC

        return ProxyRPC(self._client.scheduler, self._ref.address)


@dataclass
class _PendingCall:
    run: Callable[[float], Any]

    def result(self, timeout: float | None = None) -> Any:
        return self.run(config.get_seconds("step-timeout") if timeout is None else timeout)


def abandon_holder_task(*keys: str) -> None:
    """Run on the survivors (``Client.run``) when a holder was lost: calls to the
    run's holders (all of them: a surviving one may itself wait on the lost one) stop
    waiting, so the threads blocked in them are free for the new holders."""
    _LOST_HOLDERS.update(keys)
