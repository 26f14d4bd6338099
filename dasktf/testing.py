"""Fault injection for tests of code that trains with dasktf (and dasktf's own).

Kill a worker at a given step, or slow one down, on a real cluster::

    from dasktf.testing import KillWorkerAt, alive_workers, delay_worker

    killer = KillWorkerAt(client, alive_workers(client)[1], step=10)
    trainer.fit(x, y, epochs=4, callbacks=[killer])      # SIGKILLs it at step 10
    assert killer.killed_at is not None

    with delay_worker(client, address, factor=4):        # 4x its compute time
        trainer.fit(x, y)

    kill_worker_at_update(client, address, 40, "allreduce")   # engine="p2p": the
    trainer.fit(x, y, epochs=4)                               # worker kills itself

A kill is a ``SIGKILL`` of the worker process, and of nothing else: by default its
nanny, if it has one, is told first not to restart it and closes itself (a lost
machine). The process that started a worker (a nanny's, which may host a whole
``LocalCluster``, or, without a nanny, a script, a test harness or a job runner) is
never signalled. It needs the worker on this host.

:func:`own_cluster` starts a cluster of one's own (for a test that kills its
workers), :func:`wait_until` is the one bounded poll for an event that has no
hook to wait on, and :func:`alive_workers` lists the workers the scheduler knows now
(``client.scheduler_info()["workers"]`` may list none: the client's periodic refresh,
which asks for no workers, can overwrite its answer before it is returned).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

try:  # a Keras callback when Keras is there (it is wherever dasktf trains)
    from keras.callbacks import Callback as _Callback
except ImportError:  # pragma: no cover
    _Callback = object  # type: ignore[misc,assignment]

from dasktf.cluster.membership import alive_workers

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["KillWorkerAt", "alive_workers", "delay_worker", "kill_worker", "kill_worker_at_update",
           "own_cluster", "wait_until", "worker_pids"]


def _pids() -> tuple[int, int]:
    return os.getpid(), os.getppid()


def _identity() -> tuple[int, str]:
    return os.getpid(), socket.gethostname()


def worker_pids(client: Client, address: str) -> tuple[int, int]:
    """(worker pid, parent pid) of the worker at ``address``. The parent is its
    nanny's process when it has one, else whatever started it (a script, a harness):
    never a process to kill for the worker's sake."""
    return client.run(_pids, workers=[address])[address]  # type: ignore[no-any-return]


def kill_worker(client: Client, address: str, *, restart: bool = False) -> float:
    """SIGKILL the worker at ``address``; return ``time.time()`` of the kill.

    ``restart=False``: its nanny, if the scheduler knows of one, is told first not
    to start a fresh worker and closes itself once the worker is dead (the worker
    stays dead: a lost machine; a ``dask worker`` process exits with its nanny).
    ``restart=True`` leaves the nanny, which starts a fresh worker (a new address: it
    joins the cluster as a new worker). Only the worker process is ever signalled:
    its parent may be a nanny sharing a process with others (a ``LocalCluster``'s,
    in the client's process) or, without a nanny, the program that started it (a
    script, a test harness, a job runner), none of them the worker's to kill.

    Raises
    ------
    ValueError
        The worker runs on another host than the caller (its pid means nothing here).
    """
    pid, host = client.run(_identity, workers=[address])[address]
    if host != socket.gethostname():
        raise ValueError(
            f"The worker at {address} runs on host {host!r}, not on this one "
            f"({socket.gethostname()!r}): kill_worker only kills workers on the "
            "caller's host (as tests start them)."
        )
    if not restart:
        # Sent by the scheduler to the worker's registered nanny only (none: {}).
        client.run(_no_restart, nanny=True, workers=[address])
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    return killed


def _no_restart(dask_worker: Any = None) -> None:
    from distributed.core import Status

    # A nanny closing gracefully closes itself when its worker exits, rather than
    # start a new one: the machine is gone.
    dask_worker.status = Status.closing_gracefully


class KillWorkerAt(_Callback):  # type: ignore[misc]
    """A Keras callback that SIGKILLs worker ``address`` after the ``step``-th
    training step the client sees, counted from 1 from the start of epoch ``epoch``
    (0-based; by default the run's first).

    An async epoch ends once every shard has been consumed once more, so its number
    of updates varies with the workers' speeds (the first one's most: a worker still
    tracing its step lets the others run ahead). A kill meant for a given epoch (one
    after its start's restore point) names it with ``epoch``.

    ``killed_at`` is the kill's ``time.time()``, ``None`` until then.
    """

    def __init__(self, client: Client, address: str, step: int, *, restart: bool = False,
                 epoch: int = 0) -> None:
        super().__init__()
        self.client, self.address, self.step, self.restart = client, address, step, restart
        self.epoch = epoch
        self.seen = 0
        self.killed_at: float | None = None
        self._in_epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._in_epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._in_epoch < self.epoch:
            return
        self.seen += 1
        if self.killed_at is None and self.seen >= self.step:
            self.killed_at = kill_worker(self.client, self.address, restart=self.restart)


def kill_worker_at_update(client: Client, address: str, update: int,
                          where: str = "step", sig: int = signal.SIGKILL) -> None:
    """Arm the worker at ``address`` to SIGKILL itself at global update ``update`` of
    the next ``engine="p2p"`` run there (its nanny told first not to restart it):
    ``where="step"`` as that update's step begins, ``"allreduce"`` in the middle of
    its all-reduce, once its first message reached the peer's end of the connection,
    ``"allgather"`` likewise with its first message of a sharded step's all-gather
    (``shard_state``: every member has applied its slice by then), ``"ready"`` with
    its first message of the exchange that follows the reduce-scatter (with
    ``redundancy=1`` and no clipping, the round that tells the others it can apply).
    Deterministic, where a client-side :class:`KillWorkerAt` hears of steps late.
    ``sig=signal.SIGSTOP`` freezes it there instead: its connections stay open and
    nothing answers (the caller SIGKILLs it once done: :func:`worker_pids` first)."""
    phases = {"allreduce": None, "allgather": "zg", "ready": "zn"}
    if where != "step" and where not in phases:
        raise ValueError("where must be 'step', 'allreduce', 'allgather' or 'ready'; "
                         f"got {where!r}.")
    try:
        client.run(_no_restart, nanny=True, workers=[address])
    except Exception:  # noqa: BLE001 - no nanny: nothing restarts it anyway
        pass
    client.run(_arm_kill, int(update), where, phases.get(where), int(sig),
               workers=[address])


def _arm_kill(update: int, where: str, phase: str | None, sig: int = signal.SIGKILL,
              dask_worker: Any = None) -> None:
    from dasktf.runtime.manager import run_manager

    def die() -> None:
        os.kill(os.getpid(), sig)

    def at_step(replica: Any, u: int) -> None:
        if u == update:
            die()

    def at_send(g: Any, dest: int, key: Any, acknowledged: Any) -> None:
        if key.step == update and phase in (None, key.phase):
            acknowledged.result(timeout=60)  # the peer's kernel holds the message
            die()

    manager = run_manager(dask_worker)
    if where == "step":
        manager.step_hooks.append(at_step)
    else:
        manager.send_hooks.append(at_send)


def _set_delay(delay: dict[str, float], dask_worker: Any = None) -> dict[str, float]:
    from dasktf.runtime.manager import run_manager

    manager = run_manager(dask_worker)
    old = dict(manager.delay)
    manager.delay.update(delay)
    return old


@contextmanager
def delay_worker(client: Client, address: str, factor: float = 1.0, *,
                 seconds: float = 0.0) -> Iterator[None]:
    """Within the block, each step of the worker at ``address`` after its first
    takes ``factor`` x its compute time, and at least ``seconds`` (it sleeps,
    freeing its core, as a worker on a busy node or a slow device would)."""
    if not factor >= 1:
        raise ValueError(f"factor must be >= 1; got {factor!r}.")
    if not seconds >= 0:
        raise ValueError(f"seconds must be >= 0; got {seconds!r}.")
    delay = {"factor": float(factor), "seconds": float(seconds)}
    old = client.run(_set_delay, delay, workers=[address])[address]
    try:
        yield
    finally:
        try:
            client.run(_set_delay, old, workers=[address], on_error="ignore")
        except Exception:  # noqa: BLE001 - the worker may be gone by now
            pass


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.05) -> Any:
    """Call ``predicate`` every ``interval`` seconds until it returns something
    true, and return that; after ``timeout`` seconds, an ``AssertionError`` naming
    ``what`` was waited for (never a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextmanager
def own_cluster(n_workers: int, *, timeout: float = 120, tf_threads: int | None = 1,
                **kwargs: Any) -> Iterator[tuple[Any, Client]]:
    """A local cluster of ``n_workers`` worker processes of one's own (a test that
    kills workers must not kill the shared one) and a client on it, once all
    ``n_workers`` are up (``timeout``); both closed at the end. ``kwargs`` go to
    :func:`dasktf.make_local_cluster`."""
    from distributed import Client

    from dasktf.cluster.local import make_local_cluster

    with make_local_cluster(n_workers, tf_threads=tf_threads, **kwargs) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(n_workers, timeout=timeout)
        yield cluster, client
