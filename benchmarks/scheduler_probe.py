"""The scheduler's side of ``scale.py`` and ``fit_overhead.py``: a probe installed on
the scheduler (messages in and out, tasks, per-task timings), the CPU a process
runs (to the nanosecond), and a cluster started as a user starts one (``dask
scheduler`` / ``dask worker``).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from typing import Any

import numpy as np


# -- the scheduler side (run there with client.run_on_scheduler) ---------------------
def install_probe(dask_scheduler: Any = None) -> int:
    """Counters and a timing plugin on the scheduler; returns its pid."""
    import inspect

    from distributed.diagnostics.plugin import SchedulerPlugin

    s = dask_scheduler
    if getattr(s, "scale_probe", None) is not None:
        return os.getpid()
    probe: dict[str, Any] = {"in": Counter(), "records": 0, "tasks": 0,
                             "timing": False, "t": defaultdict(dict)}

    def wrap(op: str, fn: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def counted_async(*args: Any, **kwargs: Any) -> Any:
                probe["in"][op] += 1
                return await fn(*args, **kwargs)
            return counted_async

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            probe["in"][op] += 1
            if op in ("log-event", "log_event"):  # a worker's, the client's (issue 39)
                msg = kwargs.get("msg")
                if isinstance(msg, dict):
                    probe["records"] += len(msg.get("records", ())) + sum(
                        t["n"] for t in msg.get("tables", ()))
            return fn(*args, **kwargs)
        return counted

    for table in (s.stream_handlers, s.handlers):
        for op, fn in list(table.items()):
            table[op] = wrap(op, fn)

    class Timing(SchedulerPlugin):
        name = "dasktf-scale-probe"

        def update_graph(self, scheduler: Any, *, tasks: Any = (), keys: Any = (),
                         **kwargs: Any) -> None:
            if probe["timing"]:
                now = time.time()
                for k in tasks or keys:
                    probe["t"][k].setdefault("submitted", now)

        def transition(self, key: Any, start: str, finish: str, *args: Any,
                       **kwargs: Any) -> None:
            if start == "processing" and finish == "memory":
                probe["tasks"] += 1  # a task computed
            if not probe["timing"]:
                return
            if finish == "processing":  # the scheduler sends it to its worker now
                probe["t"][key]["processing_at"] = time.time()
                return
            if finish != "memory" or start != "processing":
                return
            probe["t"][key]["memory_at"] = time.time()  # the scheduler knows it is done
            for ss in kwargs.get("startstops") or ():
                if ss.get("action") == "compute":
                    probe["t"][key].update(start=ss["start"], stop=ss["stop"])

    s.add_plugin(Timing())
    s.scale_probe = probe
    return os.getpid()


def read_probe(dask_scheduler: Any = None, timing: bool | None = None) -> dict[str, Any]:
    s = dask_scheduler
    probe = s.scale_probe
    streams = [*s.stream_comms.values(), *s.client_comms.values()]
    out_msgs = sum(getattr(b, "message_count", 0) for b in streams)
    out_bytes = sum(getattr(b, "byte_count", 0) for b in streams)
    snap = {"in": sum(probe["in"].values()), "in_ops": dict(probe["in"]),
            "out": out_msgs, "out_bytes": out_bytes, "records": probe["records"], "tasks": probe["tasks"]}
    if timing is not None:
        if not timing:
            snap["times"] = {str(k): v for k, v in probe["t"].items()}
        probe["t"] = defaultdict(dict)
        probe["timing"] = timing
    return snap


# -- the cluster -----------------------------------------------------------------------
class CliCluster:
    """``dask scheduler`` + ``dask worker --nworkers N --nthreads 1`` on loopback."""

    def __init__(self, n: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="dasktf-scale-")
        self.file = os.path.join(self.dir, "scheduler.json")
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "OMP_NUM_THREADS": "1"}
        log = open(os.path.join(self.dir, "log"), "w")
        bindir = os.path.dirname(sys.executable)
        self.scheduler = subprocess.Popen(
            [f"{bindir}/dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
             "--no-dashboard", "--scheduler-file", self.file],
            env=env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.time() + 60
        while not os.path.exists(self.file):
            if time.time() > deadline:
                raise TimeoutError("dask scheduler did not start")
            time.sleep(0.2)
        self.workers = subprocess.Popen(
            [f"{bindir}/dask", "worker", "--scheduler-file", self.file,
             "--nworkers", str(n), "--nthreads", "1", "--host", "127.0.0.1",
             "--no-dashboard", "--memory-limit", "0", "--death-timeout", "60"],
            env=env, stdout=log, stderr=log, start_new_session=True)

    def close(self) -> None:
        for p in (self.workers, self.scheduler):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in (self.workers, self.scheduler):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def process_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` has run, all its threads, to the nanosecond
    (``/proc/PID/task/*/schedstat``; its ``utime`` + ``stime``, which psutil reads,
    count 10 ms ticks: one fit of a short-epoch run is a few ticks, and a tick was
    0.01 of the 0.05 ms per step per worker the figures are held to). Falls back
    to psutil where there is no schedstat. A thread that ended is no longer
    counted: the scheduler's are its event loop and pools, which last."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        import psutil

        return float(sum(psutil.Process(pid).cpu_times()[:2]))
    return total / 1e9


def idle_rate(sched_pid: int, seconds: float = 6.0) -> float:
    """The scheduler's CPU seconds per second with its workers connected and idle."""
    c0 = process_cpu(sched_pid)
    time.sleep(seconds)
    return (process_cpu(sched_pid) - c0) / seconds


def worker_rss(client: Any) -> float:
    """Mean resident memory of a worker process with TensorFlow and a replica, GB."""
    def rss() -> int:
        import psutil

        return psutil.Process().memory_info().rss
    sizes = list(client.run(rss).values())
    return float(np.mean(sizes) / 1e9)
