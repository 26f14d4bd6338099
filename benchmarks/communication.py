"""What communication costs: bytes per step and examples/s per codec, parameter-server
count and reduction topology, side by side in one run (issue 8).

One 3-worker LocalCluster; two models: the built-in ``cnn`` (1.2M parameters) and a
wide MLP (784-2048-2048-10, 5.8M parameters). Every case trains 2 epochs of the same
MNIST subset (global batch 384) from the same initial weights; examples/s is taken
over the second epoch (the first one traces the functions), the best of
``--repeats`` rounds that run every case once, interleaved, so that a burst of load
on the shared machine hits one round, not one case. Bytes are counted at
the codec by dasktf (``history.history``): what each worker sends plus receives per
step, and the busiest worker's busier direction over the allreduce lower bound
``2 (N-1)/N x P x 4 bytes``. Ratios to the first row of each model (``none``, tree
reduction with the default fan-in 4, i.e. all-to-one over 3 workers) are the
figures to read: absolute rates on a shared 2-core machine are noise.

``--async`` runs the async cases instead: one parameter holder, then the parameters
split over ``num_ps`` 2 and 3 holders (:mod:`dasktf.engines.holder.sharded`). Per update (one
worker's step): the MB the worker moves (its push and the weights it pulls), the
busiest holder's MB (the traffic a holder's link carries), and examples/s, each
against the single holder.


Bandwidth-limited mode (``--link-mbit 1000``, root only): the workers listen on
``--worker-ports`` and a Linux ``tc`` qdisc on ``lo`` gives each one its own uplink
and downlink of that many Mbit/s (:mod:`linkshape`, ``match="both"``: what a worker
serves, as Dask's pulls of the graph engine, is limited at the server's uplink; what
is pushed to it, as the p2p engine's all-reduce, at its downlink; nothing else on
``lo`` is shaped; the qdisc is removed afterwards, also on errors and SIGTERM). A list
such as ``--link-mbit 0,1000`` runs every case under each setting (0: no limit),
interleaved within each round, on one cluster. ``--time-limit`` bounds the run.

Usage: ``python benchmarks/communication.py [--samples 3072] [--mnist PATH]
[--link-mbit 0,1000] [--cases none,naive,ring] [--async]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

from dasktf.cluster.membership import alive_workers

GRAPH = {"engine": "graph"}
CASES: list[tuple[str, dict]] = [
    ("none (tree, fan-in 4 = all-to-one)", GRAPH),
    ("fp16", {**GRAPH, "compression": "fp16"}),
    ("bf16", {**GRAPH, "compression": "bf16"}),
    ("int8", {**GRAPH, "compression": "int8"}),
    ("topk:0.01", {**GRAPH, "compression": "topk:0.01"}),
    ("tree, fan-in 2", {**GRAPH, "fan_in": 2}),
    ("naive", {**GRAPH, "topology": "naive"}),
    ("ring", {**GRAPH, "topology": "ring"}),
    ("ring + fp16", {**GRAPH, "topology": "ring", "compression": "fp16"}),
    # the p2p engine: worker to worker, its all-reduce chosen by bytes (docs/p2p.md)
    ("p2p", {"engine": "p2p"}),
    ("p2p + fp16", {"engine": "p2p", "compression": "fp16"}),
    ("ps 1", {"num_ps": 1}),
    ("ps 2", {"num_ps": 2}),
    ("ps 3", {"num_ps": 3}),
    ("ps 3 + bf16 weights", {"num_ps": 3, "weights_dtype": "bf16"}),
]
ASYNC_CASES: list[tuple[str, dict]] = [
    ("async, 1 holder", {"mode": "async"}),
    ("async, num_ps 2", {"mode": "async", "num_ps": 2}),
    ("async, num_ps 3", {"mode": "async", "num_ps": 3}),
]
DEFAULT_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


def wide_mlp():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="wide_mlp",
    )


def run_case(client, model, x, y, batch: int, options: dict) -> dict:
    import dask

    import dasktf

    options = dict(options)
    fan_in = options.pop("fan_in", None)
    cfg = {"dasktf.reduction-fan-in": fan_in} if fan_in else {}
    with dask.config.set(cfg):
        history = dasktf.fit(
            model, x, y, client=client, epochs=2, batch_size=batch, seed=0,
            optimizer="sgd", verbose=0, shuffle=False, **options, loss="sparse_categorical_crossentropy",
        )
    h = history.history
    return {
        "ms_per_step": 1000.0 * batch / h["examples_per_sec"][1],
        "busiest": h["bytes_bound_ratio"][1] * h["bytes_lower_bound"][1],
        "examples_per_sec": h["examples_per_sec"][1],
        "bytes_per_step": h["bytes_per_step"][1],
        "ratio": h["bytes_bound_ratio"][1],
        "bound": h["bytes_lower_bound"][1],
        "loss": h["loss"][1],
        "holder_bytes": h.get("holder_bytes_per_update", [0.0, 0.0])[1],
    }


def print_async_table(label: str, batch: int, rows: list[tuple[str, dict]]) -> None:
    base = rows[0][1]
    print(f"\n### {label}, async, 3 workers, global batch {batch}\n")
    print("| case | MB/update/worker (push+pull) | busiest holder MB/update | vs 1 holder "
          "| examples/s | vs 1 holder |")
    print("|---|---|---|---|---|---|")
    for case, r in rows:
        print(f"| {case} | {r['bytes_per_step'] / 1e6:.3f} | {r['holder_bytes'] / 1e6:.3f} | "
              f"{base['holder_bytes'] / r['holder_bytes']:.2f}x less | "
              f"{r['examples_per_sec']:,.0f} | "
              f"{r['examples_per_sec'] / base['examples_per_sec']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=384)
    parser.add_argument("--mnist", default=DEFAULT_MNIST)
    parser.add_argument("--models", default="cnn,wide")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds (the README figures: 2; about 7 min a round on 2 cores)")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names (the first word of a case: "
                        "none,fp16,naive,ring,'ps 2',...); default: all")
    parser.add_argument("--link-mbit", default=None,
                        help="per-worker uplink limit(s) in Mbit/s via tc on lo, e.g. "
                        "1000 or 0,1000 (0: unlimited); needs root")
    parser.add_argument("--worker-ports", default=None,
                        help="worker listening ports FIRST:LAST (with --link-mbit; "
                        "default 61100:61115, above the ephemeral range)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds before the run is stopped (default: none, or "
                        "3600 with --link-mbit)")
    parser.add_argument("--async", dest="async_", action="store_true",
                        help="the async cases: 1, 2 and 3 parameter holders")
    args = parser.parse_args()
    every = ASYNC_CASES if args.async_ else CASES
    cases = every
    if args.cases:
        wanted = [c.strip() for c in args.cases.split(",")]
        cases = [c for c in every if c[0] in wanted or c[0].split(" (")[0] in wanted]
        if not cases or cases[0][0] != every[0][0]:
            cases = [every[0], *cases]  # ratios are to the first case
    links = [0.0]
    cluster_kwargs = {}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import linkshape

    if args.link_mbit is not None:
        links = [float(v) for v in args.link_mbit.split(",")]
        cluster_kwargs["worker_port"] = args.worker_ports or linkshape.DEFAULT_PORTS
        ports = linkshape.parse_ports(cluster_kwargs["worker_port"])
        if len(ports) < 3:
            raise SystemExit("--worker-ports: need a port for each of the 3 workers")
        if args.time_limit is None:
            args.time_limit = 3600
    if args.time_limit:
        signal.signal(signal.SIGALRM, _time_is_up)
        signal.alarm(int(args.time_limit))

    def link(mbit: float):
        if not mbit:
            return contextlib.nullcontext()
        # "both": what a worker serves (the graph's pulls) is limited at its uplink,
        # what is pushed to it (the p2p all-reduce) at its downlink
        return linkshape.LinkShaper(mbit, ports, match="both")

    import dask
    from distributed import Client

    import dasktf
    from dasktf.datasets import load_mnist_npz

    d = load_mnist_npz(args.mnist) if os.path.exists(args.mnist) else None
    if d is None:
        raise SystemExit(f"{args.mnist} not found (this benchmark needs MNIST's 28x28 inputs)")
    x, y = d.x_train[: args.samples], d.y_train[: args.samples]
    if x.ndim == 3:
        x = x[..., None]
    started = time.perf_counter()
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with dasktf.make_local_cluster(3, **cluster_kwargs) as cluster, \
                Client(cluster) as client:
            client.wait_for_workers(3, timeout=120)
            if args.link_mbit is not None:
                addresses = alive_workers(client)
                outside = [a for a in addresses if int(a.rsplit(":", 1)[1]) not in ports]
                if outside:
                    raise SystemExit(f"workers {outside} are not on --worker-ports")
            loads: dict[tuple[str, float], float] = {}
            for name in args.models.split(","):
                label = "cnn (1.2M params)" if name == "cnn" else "wide MLP (5.8M params)"
                best: dict[tuple[float, str], dict] = {}
                for round_ in range(args.repeats):
                    for mbit in links:
                        where = f"{mbit:g} Mbit/s per worker" if mbit else "no limit"
                        with link(mbit):
                            for case, options in cases:
                                # a fresh model per case: a keras.Model is trained in place
                                model = "cnn" if name == "cnn" else wide_mlp()
                                r = run_case(client, model, x, y, args.batch, options)
                                if (mbit, case) not in best or (
                                    r["examples_per_sec"]
                                    > best[(mbit, case)]["examples_per_sec"]
                                ):
                                    best[(mbit, case)] = r
                                print(f"  {label} {case} ({where}, round {round_ + 1}): "
                                      f"{r['examples_per_sec']:,.0f} examples/s, "
                                      f"{r['ms_per_step']:,.0f} ms/step", flush=True)
                        loads[(name, mbit)] = os.getloadavg()[0]
                for mbit in links:
                    rows = [(case, best[(mbit, case)]) for case, _ in cases]
                    if args.async_:
                        print_async_table(label, args.batch, rows)
                    else:
                        _print_table(label, args.batch, mbit, rows, loads[(name, mbit)])
    if args.link_mbit is not None:
        print(f"\n{linkshape.TC} qdisc show dev lo, after the run: "
              f"{linkshape.LinkShaper(1, []).show().strip()}")
    load = os.getloadavg()
    print(f"\nwall {time.perf_counter() - started:.0f}s; load average "
          f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min)")


def _print_table(
    label: str, batch: int, mbit: float, rows: list[tuple[str, dict]], load: float
) -> None:
    base = rows[0][1]
    where = (f"{mbit:g} Mbit/s up and down per worker (tc)" if mbit
             else "loopback, no limit")
    print(f"\n### {label}, 3 workers, global batch {batch}, {where}; "
          f"allreduce bound {base['bound'] / 1e6:.2f} MB/worker/step each way; "
          f"1-min load average {load:.1f} after the last round\n")
    print("| case | MB/step/worker (sent+received) | vs none | busiest worker MB/step "
          "| busiest / bound | ms/step | examples/s | vs none |")
    print("|---|---|---|---|---|---|---|---|")
    for case, r in rows:
        print(f"| {case} | {r['bytes_per_step'] / 1e6:.3f} | "
              f"{base['bytes_per_step'] / r['bytes_per_step']:.1f}x less | "
              f"{r['busiest'] / 1e6:.2f} | {r['ratio']:.2f} | {r['ms_per_step']:,.0f} | "
              f"{r['examples_per_sec']:,.0f} | "
              f"{r['examples_per_sec'] / base['examples_per_sec']:.2f} |", flush=True)


def _time_is_up(signum: int, frame: object) -> None:
    raise TimeoutError("communication benchmark: --time-limit reached")


if __name__ == "__main__":
    main()
