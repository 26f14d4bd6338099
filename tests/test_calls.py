"""dasktf.cluster.calls: a function called on given workers over the client's own
connections, in their thread pools, at no cost to the scheduler (issue 39)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from distributed import get_worker

from dasktf import testing
from dasktf.cluster import calls
from dasktf.cluster.membership import MembershipWatcher, alive_workers
from dasktf.cluster.waits import RunContext
from dasktf.exceptions import ReplicaError, WorkerLostError


def _where(tag, data=None):
    """Where it ran, and what it was given (a held shard arrives as its data)."""
    worker = get_worker()
    return {"tag": tag, "worker": worker.address, "pid": os.getpid(),
            "thread": threading.current_thread().name,
            "on_loop": threading.current_thread() is threading.main_thread(),
            "sum": None if data is None else float(np.sum(data))}


def _fails(tag):
    raise ValueError(f"no good: {tag}")


def _sleeps(seconds):
    time.sleep(seconds)
    return seconds



def _note(tag, dask_worker=None):
    """On the worker's event loop (tell_workers): what it was told, where."""
    dask_worker.dasktf_test_told = [*getattr(dask_worker, "dasktf_test_told", []), tag]
    return threading.current_thread() is threading.main_thread()


def _told_here(dask_worker=None):
    return getattr(dask_worker, "dasktf_test_told", [])


def _count(dask_scheduler=None):
    """Every message the scheduler handles from now on, by op (wrapped once, the
    coroutine handlers as coroutines: the session cluster's scheduler lives on)."""
    import functools
    import inspect

    if hasattr(dask_scheduler, "dasktf_calls_seen"):
        dask_scheduler.dasktf_calls_seen.clear()
        return
    seen = dask_scheduler.dasktf_calls_seen = []

    def wrap(op, fn):
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def counted_async(*args, **kwargs):
                seen.append(op)
                return await fn(*args, **kwargs)
            return counted_async

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            seen.append(op)
            return fn(*args, **kwargs)
        return counted

    for table in (dask_scheduler.stream_handlers, dask_scheduler.handlers):
        for op, fn in list(table.items()):
            if op != "run_function":
                table[op] = wrap(op, fn)


#: what a task, a ``client.run`` or a gather would send the scheduler (the session
#: cluster's own clients send it other things meanwhile: metadata, ``ncores``)
TASK_OPS = {"update-graph", "task-finished", "task-erred", "long-running",
            "client-releases-keys", "release-worker-data", "broadcast", "who_has",
            "gather", "scatter", "update_data"}


def _seen(dask_scheduler=None):
    return [op for op in dask_scheduler.dasktf_calls_seen if op in TASK_OPS]


def _context(client, workers):
    return RunContext(client, "calls-test", list(workers), 0)


def test_a_call_runs_in_each_worker_s_thread_pool_and_costs_the_scheduler_nothing(client):
    workers = alive_workers(client)
    client.register_plugin(calls.CallsPlugin(), name=calls.PLUGIN_NAME)
    shards = [client.scatter(np.full(4, i, dtype="float32"), workers=[w], direct=True)
              for i, w in enumerate(workers)]
    client.run_on_scheduler(_count)
    results = calls.call_on_workers(
        _context(client, workers), "the test's call", _where,
        [(w, (i, shards[i])) for i, w in enumerate(workers)])
    seen = client.run_on_scheduler(_seen)
    assert seen == [], seen  # a task would be an update-graph, a task-finished, ...
    # (and the counting sees them: the same through a task)
    client.run_on_scheduler(_count)
    client.gather(client.submit(_where, 0, shards[0], workers=[workers[0]], pure=False))
    assert {"update-graph", "task-finished"} <= set(client.run_on_scheduler(_seen))
    assert [r["tag"] for r in results] == list(range(len(workers)))
    assert [r["worker"] for r in results] == workers  # each where it was asked
    assert [r["sum"] for r in results] == [4.0 * i for i in range(len(workers))]
    assert not any(r["on_loop"] for r in results), results  # a thread, not the loop
    assert len({r["pid"] for r in results}) == len(workers)


def test_data_not_held_by_the_worker_called_is_an_error_naming_it(client):
    workers = alive_workers(client)
    client.register_plugin(calls.CallsPlugin(), name=calls.PLUGIN_NAME)
    elsewhere = client.scatter(np.ones(3), workers=[workers[1]], direct=True)
    with pytest.raises(ReplicaError, match=rf"the test's call failed on worker "
                                           rf"{workers[0]}: KeyError.*not held there"):
        calls.call_on_workers(_context(client, workers), "the test's call", _where,
                              [(workers[0], (0, elsewhere))])


def test_what_a_call_raises_is_named_with_its_worker_and_traceback(client):
    workers = alive_workers(client)
    client.register_plugin(calls.CallsPlugin(), name=calls.PLUGIN_NAME)
    with pytest.raises(ReplicaError) as info:
        calls.call_on_workers(_context(client, workers), "the test's call", _fails,
                              [(workers[2], ("x",))])
    message = str(info.value)
    assert f"the test's call failed on worker {workers[2]}: ValueError: no good: x" in message
    assert "in _fails" in message  # the worker's traceback
    assert isinstance(info.value.__cause__, ValueError)


def test_tell_workers_runs_on_their_event_loops_and_ignores_a_failure(client):
    workers = alive_workers(client)
    client.register_plugin(calls.CallsPlugin(), name=calls.PLUGIN_NAME)
    client.run_on_scheduler(_count)
    calls.tell_workers(client, _note, ["hello"], workers, 30)
    calls.tell_workers(client, _fails, ["x"], workers, 30)  # (no dask_worker: fails)
    assert client.run_on_scheduler(_seen) == []
    told = client.run(_told_here, workers=workers)
    assert all(t[-1] == "hello" for t in told.values()), told


def test_a_worker_lost_during_a_call_is_named_at_once():
    with testing.own_cluster(2) as (_, client):
        workers = alive_workers(client)
        client.register_plugin(calls.CallsPlugin(), name=calls.PLUGIN_NAME)
        ctx = _context(client, workers)
        ctx.watcher = MembershipWatcher(client)
        try:
            killer = threading.Timer(1.0, testing.kill_worker, (client, workers[1]))
            killer.start()
            start = time.monotonic()
            with pytest.raises(WorkerLostError, match=workers[1]) as info:
                calls.call_on_workers(ctx, "the test's call", _sleeps,
                                      [(w, (60,)) for w in workers])
            assert "the test's call" in str(info.value)
            assert time.monotonic() - start < 30  # not the call's 60 s
            killer.join()
        finally:
            ctx.watcher.close()


def test_a_worker_without_the_handler_is_named():
    """A worker the plugin never reached (here: a cluster it was not registered on)
    is a clear error naming the worker and the handler, not a bare failure."""
    with testing.own_cluster(1) as (_, client):
        worker = alive_workers(client)[0]
        with pytest.raises(RuntimeError, match=rf"worker {worker} has no dasktf_call"):
            calls.call_on_workers(_context(client, [worker]), "the test's call", _where,
                                  [(worker, (0,))])
