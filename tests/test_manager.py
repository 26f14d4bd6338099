"""Each worker's dasktf state has one owner, its RunManager (issue 37, step 3).

Two workers in one process (``processes=False``) show what a per-process registry
got wrong: a slow-down armed on one worker slowed the other, and releasing a run on
one dropped the other's replicas (and parameter-server slices). Closing a worker
closes its manager.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from distributed import Client, LocalCluster

from dasktf.cluster.membership import alive_workers
from dasktf.testing import delay_worker


def _straggle_seconds() -> float:
    """On a worker (a task): how long one step's slow-down takes there."""
    from dasktf.runtime.replica import straggle

    start = time.perf_counter()
    straggle(SimpleNamespace(slow_factor=1.0, traced=True), 0.0)  # type: ignore[arg-type]
    return time.perf_counter() - start


def _hold_replica(run_id: str) -> None:
    from dasktf.runtime.replica import register_replica

    register_replica(run_id, SimpleNamespace(shard=None, adopted=[]))  # type: ignore[arg-type]


def _hold_slice(run_id: str) -> None:
    from dasktf.runtime.manager import run_manager

    run_manager().shards[(run_id, 0)] = SimpleNamespace(lock=threading.Lock())


def _slices(run_id: str, dask_worker=None) -> list[int]:
    from dasktf.runtime.manager import run_manager

    return [s for r, s in run_manager(dask_worker).shards if r == run_id]


def _held(run_id: str, dask_worker=None) -> int:
    from dasktf.runtime.replica import replicas_of

    return len(replicas_of(run_id, dask_worker))


def _timed(client: Client, workers: list[str]) -> list[float]:
    return client.gather([client.submit(_straggle_seconds, pure=False, workers=[w],
                                        allow_other_workers=False) for w in workers])


@pytest.mark.timeout(120)
def test_a_workers_state_is_its_own_and_closes_with_it():
    from dasktf.runtime.tasks import release_replicas

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        slow, other = alive_workers(client)
        with delay_worker(client, slow, seconds=0.5):
            on_slow, on_other = _timed(client, [slow, other])
        assert on_slow >= 0.5 and on_other < 0.25, (on_slow, on_other)
        assert max(_timed(client, [slow, other])) < 0.25  # the block restored it

        client.gather([client.submit(f, "run-a", pure=False, workers=[w],
                                     allow_other_workers=False)
                       for w in (slow, other) for f in (_hold_replica, _hold_slice)])
        assert client.run(release_replicas, "run-a", workers=[slow]) == {slow: 1}
        assert client.run(_held, "run-a") == {slow: 0, other: 1}
        assert client.run(_slices, "run-a") == {slow: [], other: [0]}
        workers = list(cluster.workers.values())
    # the worker's close released what its manager held
    assert [w.extensions["dasktf"].replicas for w in workers] == [{}, {}]
    assert [w.extensions["dasktf"].shards for w in workers] == [{}, {}]
