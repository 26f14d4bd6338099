""":class:`dasktf.cluster.batch.TaskBatch`: many tasks as one update-graph message,
each the task ``submit`` would have made (its key, its arguments, its placement)."""

from __future__ import annotations

import gc

from distributed import get_worker

from dasktf.cluster.batch import TaskBatch
from dasktf.cluster.membership import alive_workers


def _where(*args, **kwargs):
    return get_worker().address, args, kwargs


def _one(offset):
    return 1 + offset


def test_a_batch_keeps_its_tasks_keys_arguments_and_placement(client):
    workers = alive_workers(client)
    batch = TaskBatch(client)
    first = batch.add(_where, ("a-tuple", 1), "dasktf-test-a", key="dasktf-test-a",
                      workers=[workers[0]])
    second = batch.add(_where, first, [first, 2], named=first, workers=[workers[1]])
    a, b = batch.send([first, second])
    assert a.key == "dasktf-test-a" and b.key.startswith("_where-")  # submit's pure=False
    # a tuple and a string equal to a key stay values; a task's own result, in a
    # list or a keyword too, is a dependency
    assert a.result() == (workers[0], (("a-tuple", 1), "dasktf-test-a"), {})
    assert b.result() == (workers[1], (a.result(), [a.result(), 2]), {"named": a.result()})
    where = client.run_on_scheduler(lambda dask_scheduler, keys=(a.key, b.key): {
        k: (sorted(dask_scheduler.tasks[k].worker_restrictions),
            dask_scheduler.tasks[k].loose_restrictions) for k in keys})
    assert where == {a.key: ([workers[0]], False), b.key: ([workers[1]], False)}


def test_a_batch_holds_its_arguments_futures_until_it_is_sent(client):
    """A future only an argument of a queued task holds is not released before the
    graph goes (the task would be cancelled for "lost dependencies")."""
    batch = TaskBatch(client)
    pending = batch.add(sum, [client.submit(_one, 0, pure=False),
                              client.submit(_one, 1, pure=False)])
    gc.collect()
    client.sync(client.scheduler.ncores)  # a round trip: the releases, if any, went
    (future,) = batch.send([pending])
    assert future.result(timeout=30) == 3
