"""dasktf.cluster.broadcast: one value on every worker, copied among them, never
through the scheduler's replicate (whose one lock a copy to a lost worker holds
for 30 s: tests/test_setup_loss.py has the run that paid it)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dasktf.cluster.broadcast import broadcast, copy_to_workers
from dasktf.cluster.membership import alive_workers


def _digest(value) -> str:
    import hashlib

    return hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()


def _held(key, dask_worker=None):
    value = dask_worker.data.get(key)
    return None if value is None else _digest(value)


@pytest.fixture
def no_memory_manager(client):
    """Dask's active memory manager drops spare copies within seconds (as it drops
    ``replicate``'s): stopped, so the copies can be counted."""
    client.amm.stop()
    try:
        yield client
    finally:
        client.amm.start()


@pytest.mark.parametrize("how_many", [1, 2, 3])
def test_every_worker_holds_the_value_the_scheduler_knows_and_frees_it(
        no_memory_manager, how_many):
    client = no_memory_manager
    workers = alive_workers(client)[:how_many]
    value = np.arange(100_000, dtype=np.float32)
    future = broadcast(client, value, workers)
    key = future.key
    assert sorted(client.who_has([future])[key]) == sorted(workers)
    held = client.run(_held, key)
    for worker in workers:
        assert held[worker] == _digest(value)
    assert np.array_equal(future.result(), value)
    future.release()  # every copy freed: none the scheduler did not know of
    deadline = time.monotonic() + 10
    while any(h is not None for h in client.run(_held, key).values()):
        assert time.monotonic() < deadline, client.run(_held, key)
        time.sleep(0.05)


def test_to_no_worker_is_refused(client):
    with pytest.raises(ValueError, match="no worker"):
        client.sync(copy_to_workers, client, 1, [])


def test_a_plain_clients_broadcast_leaves_out_a_worker_a_copy_failed_on(no_memory_manager):
    """For a plain client's inference the others hold the value and the scheduler
    knows of them only (a run's watched broadcast raises instead, for its watch to
    name the lost worker). The scheduler's address stands for a worker that
    answers the copy with an error."""
    client = no_memory_manager
    workers = alive_workers(client)[:2]
    not_a_worker = client.scheduler.address
    future = client.sync(copy_to_workers, client, np.ones(10), [*workers, not_a_worker],
                         strict=False)
    assert sorted(client.who_has([future])[future.key]) == sorted(workers)
    with pytest.raises(Exception):  # noqa: B017 (whatever the scheduler answers)
        client.sync(copy_to_workers, client, np.ones(10), [*workers, not_a_worker])
