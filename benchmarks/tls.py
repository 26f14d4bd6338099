"""The p2p engine under TLS against plain TCP, side by side in one run (issue 35).

Two embedded clusters of ``--workers`` worker processes are up at once, one plain
(``tcp://``) and one TLS (``Security.temporary()``, ``tls://``), started as
``dasktf fit --workers N`` starts one. The MNIST MLP is trained on each in turn
(``--repeats`` rounds, the variants interleaved in every round, so that the
machine's load hits them alike) with the same data, global batch, seed and epochs.
A variant is a cluster and a ``dasktf.p2p.transport`` (set on its workers for the
run): ``plain`` and ``tls`` (``auto``: the training threads' own sockets, TLS
included) and ``tls-loop`` (the workers' event loops, what TLS used before).

Figures: examples/s over the epochs after the first (the first traces), the median
of the repeats, each variant's ratio to ``plain``; the workers' CPU seconds per step
over the whole fit (what the transport costs, less at the mercy of whatever else
the machine runs than wall time); which transport each worker's collectives took
(the groups' stats), and the load average before and after.

Usage: ``python benchmarks/tls.py [--workers 3] [--train-size 30000]
[--batch-size 256] [--epochs 3] [--repeats 3] [--variants plain,tls,tls-loop]
[--out tls]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

VARIANTS = ("plain", "tls", "tls-loop")


def set_transport(transport: str) -> str:
    """On a worker: ``dasktf.p2p.transport`` from now on; the old value."""
    import dask

    old = str(dask.config.get("dasktf.p2p.transport"))
    dask.config.set({"dasktf.p2p.transport": transport})
    return old


def transports_used() -> dict[str, int]:
    """On a worker: how many collectives took each transport so far."""
    from dasktf.runtime.p2p import group

    return dict(getattr(group, "collectives_by_transport", {}))  # (older: none)


def cpu_seconds() -> float:
    """On a worker: its process's CPU seconds so far (user and system)."""
    import psutil

    t = psutil.Process().cpu_times()
    return float(t.user + t.system)


def run_one(client: Any, n: int, transport: str, data: dict[str, Any], batch: int,
            epochs: int) -> dict[str, Any]:
    import dasktf
    from dasktf.cli.bench import summarize

    client.run(set_transport, transport)
    cpu_before = client.run(cpu_seconds)
    used_before = client.run(transports_used)
    start = time.perf_counter()
    history = dasktf.fit("mnist-mlp", data["x"], data["y"], client=client, n_workers=n,
                         epochs=epochs, batch_size=batch, optimizer="adam",
                         learning_rate=2e-3, seed=0, verbose=0, engine="p2p")
    wall = time.perf_counter() - start
    cpu_after = client.run(cpu_seconds)
    h = history.history
    row = summarize(h["epoch_seconds"], [0.0] * len(h["epoch_seconds"]), len(data["x"]),
                    wall, 1.0)
    row["epoch_seconds"] = list(h["epoch_seconds"])
    steps = epochs * -(-len(data["x"]) // batch)
    # the workers' CPU per step, the whole fit (tracing included, the same for all):
    # what the transport costs, whatever else the machine runs
    row["worker_cpu_ms_per_step"] = 1000 * sum(
        cpu_after[w] - cpu_before[w] for w in cpu_before) / steps
    row["loss"] = float(h["loss"][-1])
    used = client.run(transports_used)
    row["transports"] = sorted({t for w, ts in used.items() for t, k in ts.items()
                                if k > used_before[w].get(t, 0)})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=30_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--data", default=os.path.join(
        os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz"),
        help="the Keras-layout mnist.npz")
    parser.add_argument("--out", default="tls")
    args = parser.parse_args()

    from dasktf.cluster import quiet
    from dasktf.cluster.local import QUIET_TF_LOG_LEVEL

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_TF_LOG_LEVEL)
    quiet.install()
    from distributed import Client
    from distributed.security import Security

    import dasktf
    from dasktf.datasets import load_mnist_npz

    variants = args.variants.split(",")
    d = load_mnist_npz(args.data)
    data = {"name": d.name, "x": d.x_train[:args.train_size],
            "y": d.y_train[:args.train_size]}
    n = args.workers
    load_start = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average "
          f"{' '.join(f'{v:.2f}' for v in load_start)}; data {data['name']} "
          f"{data['x'].shape}, {n} workers, global batch {args.batch_size}, "
          f"{args.epochs} epochs, {args.repeats} repeats", flush=True)
    security = Security.temporary()
    clusters = {"plain": dasktf.make_local_cluster(n),
                "tls": dasktf.make_local_cluster(n, security=security)}
    clients = {"plain": Client(clusters["plain"]),
               "tls": Client(clusters["tls"], security=security)}
    rows: list[dict[str, Any]] = []
    try:
        for c in clients.values():
            c.wait_for_workers(n, timeout=120)
        for rep in range(args.repeats):
            for variant in variants:
                kind = "plain" if variant == "plain" else "tls"
                transport = "loop" if variant.endswith("-loop") else "auto"
                row = run_one(clients[kind], n, transport, data, args.batch_size,
                              args.epochs)
                row.update(variant=variant, repeat=rep, loadavg=os.getloadavg())
                rows.append(row)
                print(f"  {rep} {variant:<9} {row['examples_per_s']:8,.0f} ex/s  "
                      f"workers' CPU {row['worker_cpu_ms_per_step']:6.2f} ms/step  "
                      f"transports {row['transports']}  loss {row['loss']:.4f}  "
                      f"load {row['loadavg'][0]:.2f}", flush=True)
    finally:
        for c in clients.values():
            c.close()
        for cl in clusters.values():
            cl.close()
    def median(v: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["variant"] == v)

    medians = {v: median(v, "examples_per_s") for v in variants}
    cpu = {v: median(v, "worker_cpu_ms_per_step") for v in variants}
    print(f"\n{'variant':<10} {'median ex/s':>12} {'vs plain':>9} {'CPU ms/step':>12} "
          f"{'vs plain':>9}  repeats (ex/s)")
    for v in variants:
        each = ", ".join(f"{r['examples_per_s']:,.0f}" for r in rows if r["variant"] == v)
        ratio = medians[v] / medians["plain"] if "plain" in medians else float("nan")
        cratio = cpu[v] / cpu["plain"] if "plain" in cpu else float("nan")
        print(f"{v:<10} {medians[v]:12,.0f} {ratio:9.2f} {cpu[v]:12.2f} {cratio:9.2f}  {each}")
    load_end = os.getloadavg()
    print(f"load average before {' '.join(f'{x:.2f}' for x in load_start)}, after "
          f"{' '.join(f'{x:.2f}' for x in load_end)}")
    with open(f"{args.out}.json", "w") as f:
        json.dump({"args": vars(args), "cores": os.cpu_count(), "loadavg_start": load_start,
                   "loadavg_end": load_end, "medians": medians, "cpu_ms_per_step": cpu,
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
