"""How dasktf's per-step costs grow with the number of workers (issue 17).

For every N in ``--workers`` a cluster is started the way users start theirs: one
``dask scheduler`` process and ``dask worker --nworkers N --nthreads 1`` (a nanny
and a worker process each), all on 127.0.0.1. A tiny model (16 features, 16
hidden units, 10 classes; 16 rows per worker per step, so every worker's share of
a step stays the same as N grows) is trained for three epochs in each mode:

* ``p2p``: sync on the p2p engine (one task per worker per epoch, each step's
  gradients all-reduced worker to worker: the scheduler sees no per-step task),
* ``tree``: sync on the graph engine, the default reduction tree (two workers: the
  direct exchange),
* ``ring``: sync, reduce-scatter / all-gather in the graph,
* ``ps2``: sync, two sharded parameter servers (``num_ps=2``),
* ``local8``: sync rounds of ``local_steps=8`` (figures per step = per round / 8),
  on the graph engine; ``p2p-local8`` the same rounds on the p2p engine,
* ``quorum``: ``sync_quorum = N - 1`` (the holder engine),
* ``async`` and ``async-ps2``: the parameter holder, one or two of them.

Epoch 0 warms up (TensorFlow traces). Over epoch 1 the script reads, before and
after:

* the scheduler process's CPU seconds and the bytes it read and wrote on its
  sockets (``psutil`` on its pid: reading them costs the scheduler nothing),
* the messages it handled (a counting wrapper on every stream and RPC handler),
  the messages it sent (its batched streams' counters), the tasks it was given
  (a scheduler plugin's ``update_graph``) and the metrics records that reached it,
* the client process's CPU seconds.

Over epoch 2 the same plugin notes, per task, when the scheduler got it
(``submitted``), and from the workers' reports when it started and stopped
computing. A step ``k`` is then:

* ``ready``: the later of its submit and the end of step ``k-1`` (its inputs),
* ``dispatch``: from ``ready`` to the last of its N step tasks started (the
  scheduler's and the comms' share of a step: what the issue calls submit to
  started, measured from when the step *can* start, since the client submits
  ``submit-ahead`` steps early on purpose),
* ``critical path``: from ``ready`` to its last task's end (its reduction's root).

``--whole-fit ROWS``: the window is a whole ``dasktf.fit`` instead (its set-up, every
epoch end, its clean-up) of ROWS rows for ``--epochs`` epochs at 32 rows per worker a
step (4,096 rows: 64 steps an epoch at N=2, 16 at N=8): short epochs, where what an
epoch and a fit cost the scheduler shows, ``p2p`` (segments spanning epochs) beside
``p2p-per-epoch`` (a segment per epoch) in one run.

Usage::

    python benchmarks/scale.py --workers 2 4 8 16 32 --modes tree ring ps2 local8 \
        quorum async async-ps2 --json scale.json

``--fit`` reads a JSON file (or several) and prints the cost model: per mode and
quantity a least-squares ``a + b·N`` over all points but ``--holdout N``, its
residuals, the held-out point's error and the predictions for 100, 256, 1000.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import cloudpickle
import dask
import numpy as np
import scheduler_probe
from scale_report import fit_model, format_row, header
from scheduler_probe import (
    CliCluster,
    idle_rate,
    install_probe,
    process_cpu,
    read_probe,
    worker_rss,
)

# The probe runs on the scheduler, which cannot import this directory's modules
cloudpickle.register_pickle_by_value(scheduler_probe)

MODES = {
    "p2p": {"engine": "p2p"},
    "tree": {"engine": "graph"},
    "ring": {"engine": "graph", "topology": "ring"},
    "ps2": {"num_ps": 2},
    "local8": {"engine": "graph", "local_steps": 8},
    "p2p-local8": {"engine": "p2p", "local_steps": 8},
    "quorum": {"sync_quorum": -1},  # -1: N - 1
    "async": {"mode": "async"},
    "async-ps2": {"mode": "async", "num_ps": 2},
    # variations of tree, for the cuts
    "tree-fan8": {"engine": "graph", "config": {"reduction-fan-in": 8}},
    "tree-fan16": {"engine": "graph", "config": {"reduction-fan-in": 16}},
    "tree-window1": {"engine": "graph", "config": {"submit-window": 1}},
    "tree-nometrics": {"engine": "graph", "config": {"metrics": False}},
    "p2p-nometrics": {"engine": "p2p", "config": {"metrics": False}},
    # the p2p engine as it was: one segment task per worker per epoch
    "p2p-per-epoch": {"engine": "p2p", "config": {"p2p.span-epochs": False}},
}
ROWS_PER_WORKER = 16
STEPS = 32
FEATURES = 16
KEY = re.compile(r"^dasktf-(?P<kind>[a-z-]+?)-(?P<run>[0-9a-f]{10})-(?P<rest>[0-9g-]+)$")


# -- one run ------------------------------------------------------------------------
def tiny_model(hidden: int = 16, layers: int = 1) -> Any:
    """16 features, ``layers`` hidden layers of ``hidden`` units, 10 classes: 442
    parameters by default; ``--model wide`` (2 x 1024, 1.07M parameters) makes the
    holder's apply, not its per-message cost, what an async update pays for."""
    import keras

    return keras.Sequential([keras.Input((FEATURES,)),
                             *[keras.layers.Dense(hidden, activation="relu")
                               for _ in range(layers)],
                             keras.layers.Dense(10, activation="softmax")])


MODELS = {"tiny": {}, "wide": {"hidden": 1024, "layers": 2}}


def measure(client: Any, n: int, mode: str, sched_pid: int,
            model: str = "tiny") -> dict[str, Any]:
    import keras
    import psutil

    import dasktf

    rng = np.random.default_rng(0)
    rows = n * ROWS_PER_WORKER * STEPS
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = rng.integers(0, 10, size=rows)
    sched = psutil.Process(sched_pid)
    marks: dict[int, dict[str, Any]] = {}

    def mark(timing: bool | None) -> dict[str, Any]:
        cpu = sched.cpu_times()
        me = os.times()
        snap = client.run_on_scheduler(read_probe, timing=timing)
        return {**snap, "wall": time.perf_counter(), "sched_cpu": cpu.user + cpu.system,
                "client_cpu": me.user + me.system}

    submit_cpu = [0.0]
    undo = time_submits(submit_cpu)

    class Probe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if epoch == 1:
                submit_cpu[0] = 0.0
            marks[epoch] = mark(True if epoch == 2 else None)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            marks[100 + epoch] = mark(False if epoch == 2 else None)
            if epoch == 1:
                marks[100 + epoch]["submit_cpu"] = submit_cpu[0]

    options = dict(MODES[mode])
    settings = {f"dasktf.{k}": v for k, v in options.pop("config", {}).items()}
    if options.get("sync_quorum") == -1:
        options["sync_quorum"] = max(1, n - 1)
    keras.utils.set_random_seed(0)
    pids = client.run(os.getpid)
    workers = sorted(pids)[:n]
    procs = {w: psutil.Process(pids[w]) for w in workers}
    holder_cpu: dict[str, float] = {}

    class HolderProbe(keras.callbacks.Callback):
        # every worker process's CPU over epoch 1: the holder's worker (workers[0],
        # and workers[1] with num_ps=2) against the median of the others
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if epoch == 1:
                holder_cpu.update({w: -sum(p.cpu_times()[:2]) for w, p in procs.items()})

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == 1:
                for w, p in procs.items():
                    holder_cpu[w] += sum(p.cpu_times()[:2])

    try:
        with dask.config.set(settings):
            history = dasktf.fit(tiny_model(**MODELS[model]), x, y, client=client,
                                 n_workers=n, epochs=3, batch_size=ROWS_PER_WORKER * n,
                                 optimizer="sgd", loss="sparse_categorical_crossentropy",
                                 verbose=0, callbacks=[Probe(), HolderProbe()], **options)
    finally:
        undo()
    a, b = marks[1], marks[101]
    # sync: steps (a round of local steps counts its steps); holder engines: updates
    updates = getattr(history, "updates", None)
    updates = 0 if updates is None else int((updates["epoch"] == 1).sum())
    units = updates or STEPS
    per = options.get("local_steps", 1)
    units_name = "update" if updates else "step"
    out = {
        "n": n, "mode": mode if model == "tiny" else f"{mode} ({model})",
        "unit": units_name, "units": units,
        "wall_ms": (b["wall"] - a["wall"]) * 1e3 / units,
        "sched_cpu_ms": (b["sched_cpu"] - a["sched_cpu"]) * 1e3 / units,
        "client_cpu_ms": (b["client_cpu"] - a["client_cpu"]) * 1e3 / units,
        "submit_cpu_ms": b.get("submit_cpu", 0.0) * 1e3 / units,
        "sched_tasks": (b["tasks"] - a["tasks"]) / units,
        "sched_msgs_in": (b["in"] - a["in"]) / units,
        "sched_msgs_out": (b["out"] - a["out"]) / units,
        # what the scheduler sends on its batched streams (to workers and clients)
        "sched_kb": (b["out_bytes"] - a["out_bytes"]) / 1e3 / units,
        "records": (b["records"] - a["records"]) / units,
        "ops": {k: (v - a["in_ops"].get(k, 0)) / units for k, v in b["in_ops"].items()
                if v - a["in_ops"].get(k, 0)},
        "per": per,
        "epoch_loss": float(history.history["loss"][-1]),
    }
    if options.get("mode") == "async":
        k = options.get("num_ps", 1)
        cpu = [holder_cpu[w] for w in history.workers]  # the holders: the first k
        others = float(np.median(cpu[k:])) if n > k else 0.0
        out["holder_cpu_ms"] = sum(c - others for c in cpu[:k]) * 1e3 / units
        # what one worker spends on one of its own updates (gradient, push, pull):
        # with a core each, N workers saturate holders that need holder_cpu_ms / k
        # each per update at N* = worker_cpu_ms / (holder_cpu_ms / k): the knee
        out["worker_cpu_ms"] = others * 1e3 / (units / n)
        out["knee_n"] = out["worker_cpu_ms"] / max(out["holder_cpu_ms"] / k, 1e-9)
        out["updates_per_s"] = 1e3 / out["wall_ms"]
    out.update(step_times(marks[102].get("times", {}), units_name))
    return out


def measure_fit(client: Any, n: int, mode: str, sched_pid: int, rows: int,
                epochs: int) -> dict[str, Any]:
    """The scheduler's (and the client's) CPU over one whole ``dasktf.fit`` of
    ``rows`` rows for ``epochs`` epochs, per step: short epochs, the fit's set-up
    and end in the window."""
    import dasktf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = rng.integers(0, 10, size=rows)
    batch = 32 * n
    units = epochs * -(-rows // batch)
    options = dict(MODES[mode])
    settings = {f"dasktf.{k}": v for k, v in options.pop("config", {}).items()}

    def mark() -> dict[str, Any]:
        cpu, me = process_cpu(sched_pid), os.times()
        return {**client.run_on_scheduler(read_probe), "wall": time.perf_counter(),
                "sched_cpu": cpu, "client_cpu": me.user + me.system}

    with dask.config.set(settings):
        a = mark()
        history = dasktf.fit(tiny_model(), x, y, client=client, n_workers=n,
                             epochs=epochs, batch_size=batch, optimizer="sgd",
                             loss="sparse_categorical_crossentropy", verbose=0,
                             **options)
        b = mark()
    return {
        "n": n, "mode": f"{mode} (fit)", "unit": "step", "units": units,
        "wall_ms": (b["wall"] - a["wall"]) * 1e3 / units,
        "sched_cpu_ms": (b["sched_cpu"] - a["sched_cpu"]) * 1e3 / units,
        "client_cpu_ms": (b["client_cpu"] - a["client_cpu"]) * 1e3 / units,
        "sched_tasks": (b["tasks"] - a["tasks"]) / units,
        "sched_msgs_in": (b["in"] - a["in"]) / units,
        "sched_msgs_out": (b["out"] - a["out"]) / units,
        "sched_kb": (b["out_bytes"] - a["out_bytes"]) / 1e3 / units,
        "records": (b["records"] - a["records"]) / units,
        "fit_tasks": b["tasks"] - a["tasks"],
        "ops": {k: v - a["in_ops"].get(k, 0) for k, v in b["in_ops"].items()
                if v - a["in_ops"].get(k, 0)},
        "epoch_loss": float(history.history["loss"][-1]),
    }


def time_submits(total: list[float]) -> Any:
    """Count the client's CPU in building and sending task graphs (the submit):
    wraps the engines' submit methods for the benchmark; returns the undo."""
    from dasktf.cluster.batch import TaskBatch
    from dasktf.engines.graph.steps import SyncEngine
    from dasktf.engines.holder.engine import AsyncEngine

    undo = []
    for cls, name in ((SyncEngine, "submit_step"), (TaskBatch, "flush"),
                      (AsyncEngine, "submit")):  # (SyncEngine also sends its epoch end)
        original = getattr(cls, name)

        def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                total[0] += time.thread_time() - t0
        setattr(cls, name, timed)
        undo.append((cls, name, original))

    def restore() -> None:
        for cls, name, original in undo:
            setattr(cls, name, original)
    return restore


def step_times(times: dict[str, dict[str, float]], unit: str) -> dict[str, Any]:
    """Dispatch and critical path per step (sync), dispatch per task (async)."""
    steps: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for key, t in times.items():
        m = KEY.match(key)
        if m is None or "start" not in t:
            continue
        kind, rest = m["kind"], m["rest"].split("-")
        if kind == "async-step":
            step = len(steps)
        elif kind in ("step", "sum", "take", "ring", "ps"):
            step = int(rest[1])
        else:
            continue
        s = steps[step]
        s["submitted"].append(t.get("submitted", t["start"]))
        s["stop"].append(t["stop"])
        s["memory_at"].append(t.get("memory_at", t["stop"]))
        if kind in ("step", "async-step"):
            s["started"].append(t["start"])
            s["processing_at"].append(t.get("processing_at", t["start"]))
    if not steps:
        return {}
    if unit == "update":
        waits = [s["started"][0] - s["submitted"][0] for s in steps.values()]
        return {"submit_to_started_ms": float(np.median(waits) * 1e3)}
    dispatch, critical, raw, scheduled = [], [], [], []
    order = sorted(steps)
    for prev, k in itertools.pairwise(order):
        s, p = steps[k], steps[prev]
        if not s["started"]:
            continue
        ready = max(min(s["submitted"]), max(p["stop"]))
        dispatch.append(max(s["started"]) - ready)
        critical.append(max(s["stop"]) - ready)
        raw.append(max(s["started"]) - min(s["submitted"]))
        # the scheduler's own share: from learning that step k-1 ended (or getting
        # step k, if later) to sending the last of step k's tasks to its worker
        known = max(min(s["submitted"]), max(p["memory_at"]))
        scheduled.append(max(s["processing_at"]) - known)
    return {"dispatch_ms": float(np.median(dispatch) * 1e3),
            "dispatch_p90_ms": float(np.percentile(dispatch, 90) * 1e3),
            "critical_ms": float(np.median(critical) * 1e3),
            "submit_to_started_ms": float(np.median(raw) * 1e3),
            "scheduler_dispatch_ms": float(np.median(scheduled) * 1e3)}


# (a task: defined here, pickled with the script, not by a module name the
# workers cannot import)
def _noop(i: int) -> int:
    return i


def calibrate(client: Any, sched_pid: int, n_tasks: int = 2000) -> float:
    """The scheduler's CPU ms per independent no-op task on this machine (what Dask's
    documentation puts at 200 us to 1 ms): the unit that makes this machine's
    figures comparable with another's."""
    import psutil
    from distributed import wait

    sched = psutil.Process(sched_pid)
    client.gather(client.map(_noop, range(50), pure=False))  # warm
    c0 = sum(sched.cpu_times()[:2])
    futures = client.map(_noop, range(n_tasks), pure=False)
    wait(futures)
    del futures
    time.sleep(0.5)  # the releases
    return (sum(sched.cpu_times()[:2]) - c0) * 1e3 / n_tasks


def cli_run(n: int) -> str:
    """``dasktf fit --scheduler ADDRESS --workers N`` against a cluster started with
    ``dask scheduler`` / ``dask worker --nworkers N``: the user's path, end to end."""
    cluster = CliCluster(n)
    try:
        address = json.load(open(cluster.file))["address"]
        bindir = os.path.dirname(sys.executable)
        t0 = time.perf_counter()
        out = subprocess.run(
            [f"{bindir}/dasktf", "fit", "--scheduler", address, "--workers", str(n),
             "--epochs", "2"], capture_output=True, text=True, timeout=600)
        took = time.perf_counter() - t0
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-6:])
        return f"dasktf fit --scheduler {address} --workers {n}: exit {out.returncode} " \
               f"in {took:.1f} s\n{tail}"
    finally:
        cluster.close()


def run_all(ns: list[int], modes: list[str], out_path: str | None,
            model: str = "tiny", whole_fit: int | None = None,
            epochs: int = 8) -> list[dict[str, Any]]:
    from distributed import Client

    results: list[dict[str, Any]] = []
    for n in ns:
        cluster = CliCluster(n)
        try:
            client = Client(scheduler_file=cluster.file, timeout="60s")
            client.wait_for_workers(n, timeout=300)
            pid = client.run_on_scheduler(install_probe)
            noop = calibrate(client, pid)
            idle = idle_rate(pid)
            print(f"N={n}: a no-op task costs the scheduler {noop:.3f} ms of CPU; idle, "
                  f"it spends {idle * 1e3:.1f} ms a second (heartbeats); load average "
                  f"{open('/proc/loadavg').read().split()[:3]}", flush=True)
            first = True
            if whole_fit:  # the workers import TensorFlow and trace once, untimed
                measure_fit(client, n, modes[0], pid, whole_fit, 1)
            for mode in modes:
                if (mode.endswith("ps2") and n < 3) or (mode == "quorum" and n < 3):
                    continue
                if mode == "ring" and n > 16:  # N^2 + N tasks a step: minutes a run
                    continue
                t0 = time.perf_counter()
                if whole_fit:
                    r = measure_fit(client, n, mode, pid, whole_fit, epochs)
                else:
                    r = measure(client, n, mode, pid, model)
                r["rss_gb"] = worker_rss(client)
                r["noop_task_ms"] = noop
                # what the scheduler spends per second whatever runs (heartbeats),
                # taken out: on 2 cores a step's wall time grows with N, and so
                # would a per-second cost counted per step. Sampled on either side
                # of the mode's run: the one sample taken as the workers settled read
                # up to 45 ms a second against 28-30 after a run, and moved a
                # 32-worker figure by 0.01 between runs of one commit (the first mode
                # has no sample before it but that one: its sample after only)
                after = idle_rate(pid, 4.0)
                before = after if first else idle
                r["idle_ms_per_s"] = [before * 1e3, after * 1e3]
                r["sched_net_ms"] = r["sched_cpu_ms"] - (before + after) / 2 * r["wall_ms"]
                idle, first = after, False
                r["sched_net_per_worker"] = r["sched_net_ms"] / r["n"]
                r["run_s"] = time.perf_counter() - t0
                results.append(r)
                print(format_row(r), flush=True)
                if out_path:
                    with open(out_path, "w") as f:
                        json.dump(results, f, indent=1)
            client.close()
        finally:
            cluster.close()
    return results


def main() -> None:
    global STEPS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--json", help="write the figures here as they come")
    p.add_argument("--model", choices=list(MODELS), default="tiny")
    p.add_argument("--cli", type=int, metavar="N",
                   help="run `dasktf fit --scheduler` on a CLI-started cluster of N workers")
    p.add_argument("--fit", nargs="*", help="fit the cost model to these JSON files")
    p.add_argument("--holdout", type=int, default=None,
                   help="a worker count left out of the fit and predicted")
    p.add_argument("--steps", type=int, default=32,
                   help="steps an epoch (the measured window is one epoch): the "
                        "scheduler's CPU is read in clock ticks (10 ms), so a mode "
                        "that costs it little per step needs a window of seconds")
    p.add_argument("--whole-fit", type=int, metavar="ROWS", default=None,
                   help="the window is a whole fit of ROWS rows (4096: short epochs)")
    p.add_argument("--epochs", type=int, default=8, help="--whole-fit's epochs")
    args = p.parse_args()
    STEPS = args.steps
    if args.cli:
        print(cli_run(args.cli))
        return
    if args.fit:
        results = [r for path in args.fit for r in json.load(open(path))]
        print(header())
        for r in results:
            print(format_row(r))
        print()
        print(fit_model(results, args.holdout))
        return
    print(header(), flush=True)
    results = run_all(args.workers, args.modes, args.json, args.model, args.whole_fit,
                      args.epochs)
    print()
    print(fit_model(results, args.holdout))


if __name__ == "__main__":
    main()
