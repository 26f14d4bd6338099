"""The worker-to-worker all-reduce (dasktf.runtime.p2p): ring vs recursive doubling,
and the graph engine's per-step reduction beside them, side by side in one run.

One long-running task per worker forms a group and, for every buffer size, runs
the two algorithms alternately (``--reps`` each, interleaved so the machine's load
hits both alike), a tiny all-reduce before each as a barrier. An all-reduce's time
is the slowest worker's call (each worker times its own); the figure is the median
over the reps. Bytes are what each worker sent, against the allreduce bound
``2 (N-1)/N x buffer``.

``graph`` is what the graph engine pays to sum a step's gradients through the
scheduler: a chain of steps, each N tasks pinned to the workers (returning the
buffer, after the previous step's sum) and one reduction task (the tree with
fan-in 4 is one task for N <= 4), all submitted at once; time per step = wall /
steps. It is the hop, not compute: the same buffers, no model.

``--link-mbit R`` (root; ``benchmarks/linkshape.py``) limits each worker's
*downlink* to R Mbit/s with ``tc`` on ``lo`` (the p2p messages are pushed to the
receiver's listening port, so they are matched by destination port): on loopback
alone the two cores, not the links, are the bottleneck, and no algorithm can win
by moving fewer bytes.

Usage: ``python benchmarks/p2p_allreduce.py [--workers 3] [--reps 30]
[--graph-steps 30] [--link-mbit 200 --max-bytes 5e6]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid

import numpy as np

from dasktf.cluster.membership import alive_workers

#: (label, float32 values): 4 B to ~20 MB, the MLP's 101,770 (~400 KB) and the
#: cnn's 1,199,882 (4.8 MB) among them.
SIZES = [("4 B", 1), ("64 B", 16), ("1 KiB", 256), ("16 KiB", 4096),
         ("64 KiB", 16384), ("128 KiB", 32768), ("256 KiB", 65536),
         ("MLP 407 KB", 101_770), ("1 MiB", 262_144), ("2 MiB", 524_288),
         ("cnn 4.8 MB", 1_199_882), ("20 MB", 5_000_000)]


ALGORITHMS = ("ring", "direct", "doubling")


def _reps(size: int, reps: int) -> int:
    return max(5, reps // 3) if size * 4 >= 4_000_000 else reps


def sweep_task(gid, members, sizes, reps, codec):
    """On each worker: every size, both algorithms interleaved; per call timings."""
    from distributed import get_worker

    from dasktf.runtime.p2p.group import Group

    rank = members.index(get_worker().address)
    out = {}
    step = 0
    with Group(gid, members, codec=codec, timeout=120) as group:
        tick = np.zeros(1, np.float32)
        for _, size in sizes:
            x = np.random.default_rng(rank).standard_normal(size).astype(np.float32)
            for algorithm in ALGORITHMS:  # warm the connections and caches
                group.allreduce(x, step, algorithm=algorithm)
                step += 1
            times = {a: [] for a in ALGORITHMS}
            sent = {}
            for _ in range(_reps(size, reps)):
                for algorithm in ALGORITHMS:
                    group.allreduce(tick, step, algorithm="doubling")  # a barrier
                    step += 1
                    start = time.perf_counter()
                    group.allreduce(x, step, algorithm=algorithm)
                    times[algorithm].append(time.perf_counter() - start)
                    sent[algorithm] = group.last.bytes_sent
                    step += 1
            out[size] = {"times": times, "sent": sent}
    return out


def make_buffer(size: int, seed: int, previous=None) -> np.ndarray:
    """A gradient task of the graph comparison (after the previous step's sum)."""
    return np.full(size, np.float32(seed), np.float32)


def reduce_buffers(*parts):
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total


def graph_step_ms(client, members, size: int, steps: int) -> float:
    """Per-step time of N pinned tasks + one reduction, chained, submitted at once."""
    def chain(tag: str, n_steps: int) -> float:
        start = time.perf_counter()
        previous = None
        for s in range(n_steps):
            parts = [client.submit(make_buffer, size, i, previous, workers=[w],
                                   key=f"grad-{tag}-{s}-{i}") for i, w in enumerate(members)]
            previous = client.submit(reduce_buffers, *parts, key=f"sum-{tag}-{s}")
        previous.result()
        return time.perf_counter() - start

    chain(uuid.uuid4().hex, 3)  # warm up
    return 1000 * chain(uuid.uuid4().hex, steps) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--graph-steps", type=int, default=30)
    parser.add_argument("--codec", default=None)
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="limit each worker's downlink (tc on lo; needs root)")
    parser.add_argument("--max-bytes", type=float, default=None,
                        help="leave out larger buffers (shaped links are slow)")
    args = parser.parse_args()
    sizes = [s for s in SIZES if args.max_bytes is None or s[1] * 4 <= args.max_bytes]
    cluster_kwargs = {}
    shaper = contextlib.nullcontext()
    if args.link_mbit is not None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import linkshape

        cluster_kwargs["worker_port"] = linkshape.DEFAULT_PORTS
        shaper = linkshape.LinkShaper(args.link_mbit,
                                      linkshape.parse_ports(linkshape.DEFAULT_PORTS),
                                      match="dport")

    from distributed import Client

    import dasktf
    from dasktf.runtime.p2p.plugin import register

    print("load before:", os.getloadavg())
    started = time.perf_counter()
    with dasktf.make_local_cluster(args.workers, tf_threads=1, **cluster_kwargs) as cluster, \
            Client(cluster) as client, shaper:
        client.wait_for_workers(args.workers)
        register(client)
        members = alive_workers(client)
        gid = f"bench-{uuid.uuid4().hex}"
        futures = [client.submit(sweep_task, gid, members, sizes, args.reps, args.codec,
                                 workers=[w], pure=False) for w in members]
        results = client.gather(futures)
        # (not under tc: the graph's transfers leave from the workers' ports, which
        # the downlink filter does not see)
        graph = {} if args.link_mbit else {
            size: graph_step_ms(client, members, size, args.graph_steps)
            for _, size in sizes if size in (1, 101_770, 1_199_882, 5_000_000)}
    n = args.workers
    link = f"{args.link_mbit:g} Mbit/s downlink per worker" if args.link_mbit else "loopback"
    print(f"{n} workers, {link}, codec {args.codec or 'none'}, {args.reps} reps "
          f"({time.perf_counter() - started:.0f} s)")
    print("ms: median over reps of the slowest worker's call; sent: the busiest "
          "worker's bytes; bound: 2 (N-1)/N x buffer")
    print(f"{'buffer':>12} {'ring':>7} {'direct':>7} {'doubl':>7} {'fastest':>9} "
          f"{'ring sent':>11} {'direct sent':>11} {'doubl sent':>11} {'bound':>11} "
          f"{'graph':>7}")
    for label, size in sizes:
        row = {}
        for algorithm in ALGORITHMS:
            per_rep = zip(*(r[size]["times"][algorithm] for r in results), strict=True)
            row[algorithm] = 1000 * statistics.median(max(t) for t in per_rep)
        sent = {a: max(r[size]["sent"][a] for r in results) for a in row}
        bound = 2 * (n - 1) / n * size * 4
        fastest = min(row, key=row.get)
        g = f"{graph[size]:7.2f}" if size in graph else f"{'':>7}"
        print(f"{label:>12} {row['ring']:7.2f} {row['direct']:7.2f} {row['doubling']:7.2f} "
              f"{fastest:>9} {sent['ring']:>11,} {sent['direct']:>11,} "
              f"{sent['doubling']:>11,} {bound:>11,.0f} {g}")
    print("load after:", os.getloadavg())


if __name__ == "__main__":  # LocalCluster workers re-import the main module
    main()
