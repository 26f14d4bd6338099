"""A model that only sharding fits: under a Dask worker ``memory_limit``, the
unsharded p2p run loses its workers (Dask's nanny ends a worker past 95% of its
limit) and stops with a ``WorkerLostError``; with ``shard_state="optimizer"`` the
same run trains.

A dense model of 16.8M parameters (64 MiB of float32) with Adam on 4 workers:
unsharded, each worker holds the weights, the optimizer's two slots (128 MiB), its
gradient and the summed one (64 MiB each) and the apply's temporaries; sharded,
a quarter of the slots and of the sum. Measured on a 2-core machine
(``benchmarks/replica_peak.py --fit --workers 4``): workers peaked at 1495-1530 MiB
of resident memory unsharded, 1321-1339 sharded; most of either is TensorFlow
itself (about 660 MiB once imported). ``--memory-limit`` (default 1520 MiB: ends a
worker at 1444 MiB) sits between them; TensorFlow's own size differs from one
build to another, so adjust it to your machine.

``on_worker_loss="raise"`` makes a lost worker an error: by default a run goes
on with the workers left, whose memory then runs out one after another.

Run: ``python examples/sharded_large_model.py [--workers 4] [--memory-limit 1450]``.
"""

from __future__ import annotations

import argparse

import dask
import keras
import numpy as np
from distributed import Client

import dasktf
from dasktf.exceptions import WorkerLostError

#: no spilling or pausing (they act on Dask's data, not on TensorFlow's); the
#: nanny checks often enough to see a step's short peak
MEMORY = {"distributed.worker.memory.target": False,
          "distributed.worker.memory.spill": False,
          "distributed.worker.memory.pause": False,
          "distributed.worker.memory.terminate": 0.95,
          "distributed.worker.memory.monitor-interval": "10ms"}


def model(inputs: int = 2048, units: tuple[int, ...] = (2048,) * 4) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((inputs,))] + [
        keras.layers.Dense(u, activation="relu") for u in units
    ] + [keras.layers.Dense(10, activation="softmax")])


def _watch(dask_worker=None) -> None:
    """Keep this worker's highest resident set (read every 5 ms) on the worker."""
    import threading
    import time

    import psutil

    process = psutil.Process()
    dask_worker.peak_rss = 0

    def watch() -> None:
        while True:
            dask_worker.peak_rss = max(dask_worker.peak_rss, process.memory_info().rss)
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()


def _peak(dask_worker=None) -> int:
    return int(dask_worker.peak_rss)


def train(shard_state: str | None, workers: int, memory_limit: str | None, steps: int = 4
          ) -> str:
    """One run on a fresh cluster; what happened, in a line."""
    rng = np.random.default_rng(0)
    batch = 32 * workers
    x = rng.standard_normal((steps * batch, 2048)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int64)
    with dask.config.set(MEMORY), \
            dasktf.make_local_cluster(workers, tf_threads=1,
                                      memory_limit=memory_limit) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(workers, timeout=300)
        client.run(_watch)
        try:
            history = dasktf.fit(model(), x, y, client=client, n_workers=workers,
                                 epochs=2, batch_size=batch, optimizer="adam",
                                 learning_rate=1e-3, loss="sparse_categorical_crossentropy",
                                 shuffle=False, seed=0, verbose=0, engine="p2p",
                                 shard_state=shard_state, on_worker_loss="raise",
                                 **({} if shard_state is None else {"redundancy": 0}))
        except WorkerLostError as exc:
            return f"stopped: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        peaks = sorted(round(p / 2**20) for p in client.run(_peak).values())
        return f"trained: loss {history.history['loss'][-1]:.4f}; workers' peak RSS {peaks} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--memory-limit", type=int, default=1520, help="MiB per worker (0: none)")
    args = parser.parse_args()
    for shard_state in (None, "gradients"):
        got = train(shard_state, args.workers,
                    f"{args.memory_limit}MiB" if args.memory_limit else None)
        print(f"shard_state={shard_state!r}: {got}")


if __name__ == "__main__":
    main()
