"""Faults across hosts, for every engine: how soon a run notices, how soon it trains
again, what it loses, and how far its weights end from the uninterrupted run.

Three worker hosts made of network namespaces (``tests/hosts.py``: a ``dask
worker --no-nanny`` in each, the scheduler on the bridge; root), MNIST MLP, 6,000
rows, global batch 32, Adam, 2 epochs. For each engine, one uninterrupted run, then
one run per fault, brought 0.3 s into the last epoch on host 2 (``--delay``):

- ``stopped``: SIGSTOP of its worker (connections open, nothing answers);
- ``vanished``: every packet to and from it dropped (blackhole routes);
- ``link-down``: its veth pair down;
- ``flap``: vanished for 3 s, then back (must not be a loss);
- ``shaped``: every link 100 Mbit/s each way (and 50 ms one way between hosts
  where the kernel has netem; must not be a loss).

Columns: noticed after (s: the client's ``worker_lost`` record after the fault),
training again after (s: its ``recovered`` record), steps lost, each update applied
once (sync: every survivor's log ``0..N-1``; async: no batch twice), and the
weights' relative difference from the uninterrupted run (async runs differ by
design: ``-``).

Usage: ``sudo python benchmarks/host_faults.py [--engines p2p,graph,async,rounds]
[--faults stopped,vanished,link-down,flap,shaped] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np
from distributed import Client

import dasktf
from dasktf.diagnostics.events import unpack
from tests.hosts import (
    FaultAt,
    HostCluster,
    HostNetwork,
    freeze,
    netem_available,
    unavailable,
)

ENGINES = {"p2p": {}, "graph": {"engine": "graph"}, "async": {"mode": "async"},
           "rounds": {"local_steps": 4}}
FAULTS = ["stopped", "vanished", "link-down", "flap", "shaped"]
ROWS, BATCH, EPOCHS = 6_000, 32, 2


def _data():
    here = os.path.dirname(__file__)
    with np.load(os.path.join(here, "..", "..", "shared", "data", "mnist.npz")) as f:
        x = f["x_train"][:ROWS].reshape(ROWS, -1).astype("float32") / 255.0
        y = f["y_train"][:ROWS].astype("int64")
    return x, y


def _flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--delay", type=float, default=0.3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    reason = unavailable()
    if reason:
        sys.exit(f"cannot build hosts here: {reason}")
    data = _data()
    rows = []
    with HostNetwork(3) as net, tempfile.TemporaryDirectory() as tmp:
        cluster = HostCluster(net, tmp, [])
        try:
            for engine in args.engines.split(","):
                kw = ENGINES[engine]
                reference = None
                for fault_name in ["none", *args.faults.split(",")]:
                    net.unshape()
                    for host in net.hosts:
                        net.restore(host)
                        net.link_up(host)
                    with Client(cluster.address, timeout=30) as client:
                        cluster.ensure_workers(client)
                        client.wait_for_workers(3, timeout=120)
                        while len(cluster.workers(client)) != 3:
                            time.sleep(0.2)
                        rows.append(_one(client, cluster, net, data, engine, kw,
                                         fault_name, reference, args.delay))
                        if fault_name == "none":
                            reference = rows[-1].pop("weights")
                        rows[-1].pop("weights", None)
                        print(json.dumps(rows[-1]), flush=True)
        finally:
            cluster.close()
    print()
    print(f"| engine | fault | noticed after (s) | training again after (s) | steps lost "
          f"| each update once | weights vs uninterrupted |  load {os.getloadavg()[0]:.1f}")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["fault"] == "none":
            continue
        cells = [r["engine"], r["fault"], _f(r["noticed"]), _f(r["again"]),
                 str(r["steps_lost"]), str(r["once"]), _f(r["weights_rel"], "{:.1e}")]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _f(value, form="{:.2f}"):
    return "-" if value is None else form.format(value)


def _one(client, cluster, net, data, engine, kw, fault_name, reference, delay):
    host = net.hosts[2]
    proc = cluster.procs[2]
    def flap() -> None:
        with net.flap(host, 3.0):
            pass

    actions = {"stopped": lambda: freeze(proc), "vanished": lambda: net.vanish(host),
               "link-down": lambda: net.link_down(host), "flap": flap}
    callbacks = []
    fault = None
    if fault_name in actions:
        fault = FaultAt(epoch=EPOCHS - 1, fault=actions[fault_name], delay=delay)
        callbacks.append(fault)
    if fault_name == "shaped":
        net.shape(rate_mbit=100, delay_ms=25 if netem_available() else 0)
    x, y = data
    start = time.time()
    try:
        history = dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3,
                             epochs=EPOCHS, batch_size=BATCH, optimizer="adam",
                             learning_rate=1e-3, seed=5, shuffle=True, verbose=0,
                             callbacks=callbacks, **kw)
    finally:
        net.unshape()
        if fault is not None:
            fault.check()
    wall = time.time() - start
    records = [r for e in client.get_events("dasktf-metrics") for r in unpack(e)
               if r.get("run") == history.run_id]
    lost = [r for r in records if r["kind"] == "worker_lost"]
    again = [r for r in records if r["kind"] == "recovered"]
    weights = history.model.get_weights()
    rel = None
    if reference is not None and engine != "async":
        a, b = _flat(weights), _flat(reference)
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    if engine == "async":
        u = history.updates
        owed = u[u["shard_pass"] < EPOCHS]
        shard = owed["worker"].where(owed["worker"] < 3, 2)
        once = not owed.assign(shard=shard).duplicated(["shard", "shard_pass", "step"]).any()
    else:
        units = EPOCHS * math.ceil(math.ceil(ROWS / BATCH) / kw.get("local_steps", 1))
        once = all(log == list(range(units)) for log in history.applied_updates.values())
    return {
        "engine": engine, "fault": fault_name, "wall_s": round(wall, 2),
        "recoveries": len(history.recoveries),
        "noticed": (lost[0]["detected_at"] - fault.at) if lost and fault else None,
        "again": (again[0]["wall_time"] - fault.at) if again and fault else None,
        "steps_lost": history.recoveries[0]["steps_lost"] if history.recoveries else 0,
        "once": once, "weights_rel": rel, "weights": weights,
    }


if __name__ == "__main__":
    main()
