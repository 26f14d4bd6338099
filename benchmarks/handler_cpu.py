"""The scheduler's event-loop CPU per handler over whole fits (issue 39).

``scale.py --whole-fit`` reads the scheduler process's CPU in 10 ms ticks and takes
out an idle rate (heartbeats, the periodic callbacks) times the wall time: on a
shared machine both move by more than a change of a few ms a fit. Here every
stream and RPC handler of the scheduler is wrapped to add the thread CPU
(``time.thread_time``) of each of its steps (a coroutine's too, step by step), so
what a fit's messages cost their handlers is read without the load or the idle
rate entering; the event loop's CPU in all is printed beside it (what no handler
accounts for: reading and writing the messages, the periodic callbacks).

For ``N`` workers (a CLI-started cluster, as ``scale.py``'s), after one untimed
1-epoch fit, ``K`` whole fits of ``EPOCHS`` epochs of ``MODE`` (a ``scale.py``
mode: ``p2p``, ``p2p-nometrics``, ...) of 4,096 rows; prints one JSON line, then
per handler its ms a fit and its calls a fit::

    python benchmarks/handler_cpu.py 8 4 1 p2p
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale

cloudpickle.register_pickle_by_value(scale)

IDLE_OPS = ("heartbeat_worker", "heartbeat-client", "keep-alive")


def install(dask_scheduler: Any = None) -> None:
    """Wrap the scheduler's handlers to add up their thread CPU by op (there)."""
    import functools
    import inspect
    import time
    import types
    from collections import Counter

    s = dask_scheduler
    cpu = s.dasktf_handler_cpu = Counter()
    calls = s.dasktf_handler_calls = Counter()

    @types.coroutine
    def drive(coro: Any, op: str) -> Any:
        send: Any = None
        throw: BaseException | None = None
        while True:
            t = time.thread_time()
            try:
                y = coro.throw(throw) if throw is not None else coro.send(send)
            except StopIteration as stop:
                cpu[op] += time.thread_time() - t
                return stop.value
            cpu[op] += time.thread_time() - t
            send, throw = None, None
            try:
                send = yield y
            except BaseException as exc:  # noqa: BLE001 - handed to the coroutine
                throw = exc

    def wrap(op: str, fn: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                calls[op] += 1
                return await drive(fn(*args, **kwargs), op)
            return timed_async

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            calls[op] += 1
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[op] += time.thread_time() - t
        return timed

    for table in (s.stream_handlers, s.handlers):
        for op, fn in list(table.items()):
            if op != "run_function":  # the probe's own reads
                table[op] = wrap(op, fn)


def read(dask_scheduler: Any = None) -> tuple[dict[str, float], dict[str, int], float]:
    """The sums since the last read, and the event loop thread's CPU now."""
    import time

    s = dask_scheduler
    out = dict(s.dasktf_handler_cpu), dict(s.dasktf_handler_calls), time.thread_time()
    s.dasktf_handler_cpu.clear()
    s.dasktf_handler_calls.clear()
    return out


def main(n: int, k: int, epochs: int, mode: str) -> None:
    from distributed import Client

    cluster = scale.CliCluster(n)
    try:
        client = Client(scheduler_file=cluster.file, timeout="60s")
        client.wait_for_workers(n, timeout=300)
        pid = client.run_on_scheduler(scale.install_probe)
        client.run_on_scheduler(install)
        scale.measure_fit(client, n, "p2p", pid, 4096, 1)  # imports and traces, untimed
        _, _, t0 = client.run_on_scheduler(read)
        runs = [scale.measure_fit(client, n, mode, pid, 4096, epochs) for _ in range(k)]
        cpu, calls, t1 = client.run_on_scheduler(read)
        units = sum(r["units"] for r in runs)
        work = sum(v for op, v in cpu.items() if op not in IDLE_OPS)
        print(json.dumps({
            "n": n, "epochs": epochs, "mode": mode, "fits": k,
            "load": open("/proc/loadavg").read().split()[:3],
            "loop_thread_ms_per_fit": round((t1 - t0) * 1e3 / k, 1),
            "handlers_ms_per_fit": round(work * 1e3 / k, 2),
            "heartbeats_ms_per_fit": round(sum(cpu.get(o, 0) for o in IDLE_OPS) * 1e3 / k, 2),
            "handlers_ms_per_step_per_worker": round(work * 1e3 / units / n, 4),
            "gross_ms_per_fit": round(sum(r["sched_cpu_ms"] * r["units"] for r in runs) / k, 1),
        }), flush=True)
        print("   ms/fit, calls/fit", {op: (round(v * 1e3 / k, 2), round(calls[op] / k, 1))
                                       for op, v in sorted(cpu.items(), key=lambda kv: -kv[1])})
        client.close()
    finally:
        cluster.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
