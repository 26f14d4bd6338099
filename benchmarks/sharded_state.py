"""Sharded optimizer state (``shard_state="optimizer"``, ZeRO-1) against unsharded p2p,
side by side.

On real MNIST (``mnist-mlp``, Adam), 3 workers, global batch 256, one cluster: the
two runs alternate (``--repeats`` pairs, unsharded first), each for ``--epochs``
epochs; a step's time is an epoch's wall time over its steps, the epochs after the
first (which traces) only. Printed: the median step time of each, their ratio,
and the bytes of the optimizer's variables each replica holds (read on the workers
during the run: what TensorFlow holds), with the load average before and after (on
a shared 2-core machine the 3 workers share the cores).

Usage: ``python benchmarks/sharded_state.py [--rows 30720] [--epochs 3]
[--repeats 2] [--data /work/shared/data/mnist.npz]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


def _slot_bytes(dask_worker: Any = None) -> list[int]:
    from dasktf.runtime.replica import registered_replicas

    return [int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                    for v in r.model.optimizer.variables))
            for r in registered_replicas(dask_worker).values()]


def run(client: Any, x: np.ndarray, y: np.ndarray, epochs: int,
        shard_state: str | None) -> tuple[list[float], list[int]]:
    """Seconds per step of each epoch after the first; each replica's slot bytes."""
    import keras

    import dasktf

    steps = -(-len(x) // 256)
    seen: dict[str, Any] = {}

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            seen["begin"] = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            seen.setdefault("epochs", []).append(time.perf_counter() - seen["begin"])
            seen["bytes"] = [b for v in client.run(_slot_bytes).values() for b in v]

    dasktf.fit("mnist-mlp", x, y, client=client, n_workers=3, epochs=epochs,
               batch_size=256, optimizer="adam", learning_rate=1e-3,
               loss="sparse_categorical_crossentropy", shuffle=False, seed=0,
               verbose=0, engine="p2p", shard_state=shard_state, callbacks=[Clock()])
    return [s / steps for s in seen["epochs"][1:]], seen["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=30720)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--data", default=DATA)
    args = parser.parse_args()
    from distributed import Client

    import dasktf

    with np.load(args.data) as f:
        x = (f["x_train"][:args.rows].reshape(-1, 784) / 255.0).astype(np.float32)
        y = f["y_train"][:args.rows].astype(np.int64)
    load_before = open("/proc/loadavg").read().split()[:3]
    times: dict[str | None, list[float]] = {None: [], "optimizer": []}
    held: dict[str | None, list[int]] = {}
    with dasktf.make_local_cluster(3, tf_threads=1) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=120)
        for _ in range(args.repeats):
            for shard_state in (None, "optimizer"):
                seconds, held[shard_state] = run(client, x, y, args.epochs, shard_state)
                times[shard_state] += seconds
    load_after = open("/proc/loadavg").read().split()[:3]
    plain, sharded = (statistics.median(times[k]) for k in (None, "optimizer"))
    print(f"mnist-mlp, Adam, 3 workers, batch 256, {args.rows} rows, {args.epochs} "
          f"epochs x {args.repeats} repeats (medians of the epochs after the first)")
    print(f"  unsharded p2p: {plain * 1e3:7.2f} ms/step   optimizer bytes per replica "
          f"{held[None]}")
    print(f"  sharded p2p:   {sharded * 1e3:7.2f} ms/step   optimizer bytes per replica "
          f"{held['optimizer']}")
    print(f"  sharded / unsharded: step time {sharded / plain:.2f}x, optimizer bytes "
          f"{max(held['optimizer']) / max(held[None]):.3f}x per replica")
    print(f"  load average before {' '.join(load_before)}, after {' '.join(load_after)}")


if __name__ == "__main__":
    main()
