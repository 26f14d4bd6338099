"""One value on many workers, copied among them: a model package, a recovery's
state.

``client.scatter(value, broadcast=True)`` places one copy and has the scheduler
``replicate`` it, and every replicate holds the same lock of the scheduler's: one
copying to a worker that was lost meanwhile waits on it for distributed's connect
timeout (30 s), and so does the next broadcast, however healthy its workers. A
worker frozen while a run built its replicas so cost the run 30 s after the
liveness detector had removed it (tests/test_setup_loss.py). Here the client
scatters one copy and asks the other workers to copy it from those that hold it,
doubling the holders each round (the worker's own ``gather``, as ``replicate``
asks it, :func:`dasktf.compat.copy_on_worker`), then tells the scheduler who
holds it, as a scatter does: no lock, the value never through the scheduler,
``log2 N`` rounds. (Dask's active memory manager then drops the spare copies, as
it drops those ``replicate`` makes; a worker keeps what it read of them.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from dask.sizeof import sizeof

from dasktf import compat
from dasktf.cluster.membership import alive_workers


async def copy_to_workers(client: Any, value: Any, workers: Sequence[str],
                          strict: bool = True) -> Any:
    """A future of ``value``, held by each of ``workers`` (a coroutine on the
    client's loop). Raises ``OSError`` naming the workers a copy failed on (a
    holder lost mid-copy); a caller watching the run names the lost worker. Not
    ``strict``: those workers are left out (they read the value through the
    scheduler if they need it, as when Dask's memory manager dropped their copy)."""
    if not workers:
        raise ValueError("broadcast to no worker")
    [future] = await client.scatter([value], workers=[workers[0]], direct=True, hash=False,
                                    asynchronous=True)
    holders, rest = [workers[0]], list(workers[1:])
    while rest:
        now, rest = rest[:len(holders)], rest[len(holders):]
        answers = await asyncio.gather(*(
            compat.copy_on_worker(client, worker, {future.key: [holders[i]]})
            for i, worker in enumerate(now)), return_exceptions=not strict)
        failed = [w for w, a in zip(now, answers, strict=True)
                  if not isinstance(a, dict) or a.get("status") != "OK"]
        if failed and strict:
            raise OSError(f"{future.key} could not be copied to {failed} from the "
                          f"workers holding it, {holders}")
        holders += [w for w in now if w not in failed]
    nbytes = sizeof(value)
    try:
        await compat.tell_scheduler_held(client, future.key, holders[1:], nbytes)
    except Exception as exc:  # a holder the scheduler removed meanwhile
        # the others told one by one: a copy the scheduler does not know of is
        # never freed
        for worker in holders[1:]:
            with contextlib.suppress(Exception):
                await compat.tell_scheduler_held(client, future.key, [worker], nbytes)
        if strict:
            raise OSError(f"the scheduler could not record the copies of {future.key} "
                          f"on {holders[1:]}: {exc}") from exc
    return future


def broadcast(client: Any, value: Any, workers: Sequence[str] | None = None) -> Any:
    """A future of ``value`` held by each of ``workers`` (default: every worker
    alive now). A run's :class:`~dasktf.cluster.waits.WatchedClient` copies it
    watched: a lost worker ends the wait, named; a plain client's leaves out a
    worker a copy failed on (inference: it reads the value when it needs it)."""
    watched = getattr(client, "broadcast", None)
    if watched is not None:
        return watched(value, workers)
    targets = list(workers) if workers else alive_workers(client)
    return client.sync(copy_to_workers, client, value, targets, strict=False)
