"""Redundant optimizer slices (``redundancy=1``) against one copy (``redundancy=0``)
and unsharded p2p, side by side.

On real MNIST (``--model``: ``mnist-mlp`` or ``cnn``, Adam), N workers (default 3), global batch 256, one
cluster: the three runs alternate (``--repeats`` rounds, unsharded first), each for
``--epochs`` epochs; a step's time is an epoch's wall time over its steps, the
epochs after the first (which traces) only. Printed: the median step time of each
and its ratio to unsharded, the bytes of the optimizer variables each replica holds
(its slice's and, with redundancy 1, its copy of its neighbour's: read on the
workers during the run, what TensorFlow holds), the bytes a worker moves a step,
and the load average before and after (on a shared 2-core machine the workers
share the cores).

``--free-apply`` adds a fourth run, ``redundancy=0`` with every slice's apply made free
(no TensorFlow call, no optimizer; training wrong): the floor of a sharded step, its
messages and its gradient call alone.

Usage: ``python benchmarks/shard_redundancy.py [--model mnist-mlp|cnn] [--workers 3] [--rows 15360]
[--epochs 3] [--repeats 2] [--free-apply] [--data /work/shared/data/mnist.npz]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")
#: name: the options of the run
RUNS: dict[str, dict[str, Any]] = {
    "unsharded": {"shard_state": None},
    "redundancy=0": {"shard_state": "optimizer", "redundancy": 0},
    "redundancy=1": {"shard_state": "optimizer", "redundancy": 1},
}


#: ``--free-apply``: the step's floor, ``redundancy=0`` with the slice's apply costing
#: nothing (no TensorFlow call, no optimizer: the slice's values as they were)
FREE_APPLY = "free apply"


def _free_apply(on: bool, dask_worker: Any = None) -> None:
    """Make every slice's apply (``ShardOptimizer.apply_scaled``) return the slice's
    first values at no cost, or put the real one back. Training is then wrong; the
    step's time is what its messages and its one gradient call cost alone."""
    from dasktf.runtime.p2p.sharding import ShardOptimizer

    real = ShardOptimizer.__dict__.get("real_apply_scaled", ShardOptimizer.apply_scaled)

    def free(self: Any, chunk: np.ndarray, count: float, scales: np.ndarray) -> np.ndarray:
        frozen = self.__dict__.get("frozen_values")
        if frozen is None:
            frozen = self.__dict__["frozen_values"] = self.own_values()
        return frozen

    ShardOptimizer.real_apply_scaled = real  # type: ignore[attr-defined]
    ShardOptimizer.apply_scaled = free if on else real  # type: ignore[method-assign]


def _held_bytes(dask_worker: Any = None) -> list[int]:
    from dasktf.runtime.replica import registered_replicas

    def nbytes(variables: Any) -> int:
        return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables))

    out = []
    for r in registered_replicas(dask_worker).values():
        backup = getattr(r.shard_optimizer, "backup", None)
        out.append(nbytes(r.model.optimizer.variables)
                   + (0 if backup is None else nbytes(backup.optimizer.variables)))
    return out


def run(model: str, client: Any, x: np.ndarray, y: np.ndarray, n: int, epochs: int,
        options: dict[str, Any]) -> tuple[list[float], list[int], float]:
    """Seconds per step of each epoch after the first; each replica's optimizer
    bytes; the bytes a worker moved a step (the last epoch's)."""
    import keras

    import dasktf

    steps = -(-len(x) // 256)
    seen: dict[str, Any] = {}

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            seen["begin"] = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            seen.setdefault("epochs", []).append(time.perf_counter() - seen["begin"])
            seen["bytes"] = [b for v in client.run(_held_bytes).values() for b in v]

    history = dasktf.fit(model, x, y, client=client, n_workers=n, epochs=epochs,
                         batch_size=256, optimizer="adam", learning_rate=1e-3,
                         loss="sparse_categorical_crossentropy", shuffle=False, seed=0,
                         verbose=0, engine="p2p", callbacks=[Clock()], **options)
    return ([s / steps for s in seen["epochs"][1:]], seen["bytes"],
            float(history.history["bytes_per_step"][-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mnist-mlp", choices=["mnist-mlp", "cnn"])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rows", type=int, default=15360)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--free-apply", action="store_true",
                        help="also time redundancy=0 with an apply that costs nothing "
                             "(the floor of the sharded step: its messages alone)")
    args = parser.parse_args()
    runs = dict(RUNS)
    if args.free_apply:
        runs[FREE_APPLY] = RUNS["redundancy=0"]
    from distributed import Client

    import dasktf

    with np.load(args.data) as f:
        x = (f["x_train"][:args.rows] / 255.0).astype(np.float32)
        y = f["y_train"][:args.rows].astype(np.int64)
    if args.model == "mnist-mlp":
        x = x.reshape(-1, 784)
    n = args.workers
    load_before = open("/proc/loadavg").read().split()[:3]
    times: dict[str, list[float]] = {name: [] for name in runs}
    held: dict[str, list[int]] = {}
    moved: dict[str, float] = {}
    with dasktf.make_local_cluster(n, tf_threads=1) as cluster, Client(cluster) as client:
        client.wait_for_workers(n, timeout=120)
        for _ in range(args.repeats):
            for name, options in runs.items():
                client.run(_free_apply, name == FREE_APPLY)
                seconds, held[name], moved[name] = run(args.model, client, x, y, n,
                                                       args.epochs, options)
                times[name] += seconds
            client.run(_free_apply, False)
    load_after = open("/proc/loadavg").read().split()[:3]
    base = statistics.median(times["unsharded"])
    print(f"{args.model}, Adam, {n} workers, batch 256, {args.rows} rows, {args.epochs} "
          f"epochs x {args.repeats} repeats (medians of the epochs after the first)")
    for name in runs:
        step = statistics.median(times[name])
        print(f"  {name:13s} {step * 1e3:7.2f} ms/step ({step / base:.2f}x)   optimizer "
              f"bytes per replica {held[name]} "
              f"({max(held[name]) / max(held['unsharded']):.3f}x)   bytes a step "
              f"{moved[name]:,.0f}")
    print(f"  load average before {' '.join(load_before)}, after {' '.join(load_after)}")


if __name__ == "__main__":
    main()
