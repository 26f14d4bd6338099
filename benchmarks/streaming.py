"""Training on data 5x larger than a worker's memory limit, streamed from local files.

The benchmark writes MNIST-shaped rows (784 float32 pixels and a label; the real
MNIST images repeated, each copy with a little noise) as ``.npy`` files, one pair
per partition, until the data set is ``--times`` x the workers' ``memory_limit``.
A lazy Dask array reads each file with ``np.load`` when its partition is needed.
Then, on one LocalCluster of 2 workers (1 thread each, ``memory_limit`` each), side
by side:

* ``streamed``: ``dasktf.fit(..., stream=True)`` on the whole data set: each worker
  reads its files one partition at a time (``dasktf.data.prefetch`` ahead);
* ``in memory``: the same model on a slice that fits (a fifth of each worker's
  limit), NumPy arrays held resident (the path every other benchmark measures).

Printed per run: rows, data size against the limit, examples/s of the training
epochs (after the read that counts and checks the rows), the peak RSS of each
worker process (sampled every 0.2 s with psutil) against ``memory_limit``, and the
final training loss.

Usage: ``python benchmarks/streaming.py [--memory-limit 1.5GiB] [--times 5]``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import threading
import time

import numpy as np

DEFAULT_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")
ROW_BYTES = 784 * 4 + 8


def write_files(directory: pathlib.Path, total_bytes: int, part_rows: int,
                mnist: str) -> tuple[list[tuple[str, str]], int]:
    """``(x file, y file)`` per partition, ``total_bytes`` in all; returns them and
    the row count."""
    with np.load(mnist) as f:
        images = f["x_train"].reshape(-1, 784).astype(np.float32) / 255.0
        labels = f["y_train"].astype(np.int64)
    rng = np.random.default_rng(0)
    files, rows, j = [], 0, 0
    while rows * ROW_BYTES < total_bytes:
        pick = rng.integers(0, len(images), part_rows)
        x = images[pick] + rng.normal(0, 0.05, (part_rows, 784)).astype(np.float32)
        xf, yf = directory / f"x{j:04d}.npy", directory / f"y{j:04d}.npy"
        np.save(xf, x)
        np.save(yf, labels[pick])
        files.append((str(xf), str(yf)))
        rows += part_rows
        j += 1
    return files, rows


def lazy_arrays(files: list[tuple[str, str]], part_rows: int) -> tuple:
    import dask
    import dask.array as da

    load = dask.delayed(np.load, pure=True)
    x = da.concatenate([da.from_delayed(load(xf), (part_rows, 784), np.float32)
                        for xf, _ in files])
    y = da.concatenate([da.from_delayed(load(yf), (part_rows,), np.int64)
                        for _, yf in files])
    return x, y


class PeakRSS:
    """The peak RSS of each worker process, sampled while a run trains."""

    def __init__(self, client) -> None:
        import psutil

        pids = client.run(os.getpid)
        self.procs = {w: psutil.Process(pid) for w, pid in pids.items()}
        self.peak = dict.fromkeys(self.procs, 0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stop.is_set():
            for w, proc in self.procs.items():
                try:
                    self.peak[w] = max(self.peak[w], proc.memory_info().rss)
                except Exception:  # noqa: BLE001 - a worker restarting; keep sampling
                    continue
            time.sleep(0.2)

    def __enter__(self) -> PeakRSS:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def model():
    import keras

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                            keras.layers.Dense(10, activation="softmax")])
    net.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    return net


def run(client, label: str, x, y, rows: int, limit: int, epochs: int, batch: int,
        **options) -> dict:
    import dasktf

    with PeakRSS(client) as rss:
        started = time.perf_counter()
        history = dasktf.fit(model(), x, y, client=client, epochs=epochs, batch_size=batch,
                             verbose=0, seed=0, shuffle=True, **options)
        wall = time.perf_counter() - started
    seconds = sum(history.history["epoch_seconds"])
    peaks = sorted(rss.peak.values())
    print(f"{label:<10} {rows:>9,} rows {rows * ROW_BYTES / 2**30:6.2f} GiB "
          f"({rows * ROW_BYTES / limit:4.1f}x the limit)  "
          f"{rows * epochs / seconds:8,.0f} examples/s  peak worker RSS "
          f"{', '.join(f'{p / 2**30:.2f}' for p in peaks)} GiB "
          f"(limit {limit / 2**30:.2f}: {max(peaks) / limit:.0%})  "
          f"loss {history.history['loss'][-1]:.4f}  wall {wall:.0f} s", flush=True)
    return {"examples_per_s": rows * epochs / seconds, "peak": max(peaks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-limit", default="1.5GiB")
    parser.add_argument("--times", type=float, default=5.0,
                        help="data size as a multiple of one worker's memory_limit")
    parser.add_argument("--part-rows", type=int, default=16384)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--mnist", default=DEFAULT_MNIST)
    parser.add_argument("--dir", default=None, help="where to write the files (a temp dir)")
    args = parser.parse_args()

    import dask
    from distributed import Client, LocalCluster

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    limit = dask.utils.parse_bytes(args.memory_limit)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        started = time.perf_counter()
        files, rows = write_files(pathlib.Path(tmp), int(args.times * limit), args.part_rows,
                                  args.mnist)
        print(f"wrote {len(files)} partitions, {rows:,} rows, "
              f"{rows * ROW_BYTES / 2**30:.2f} GiB in {time.perf_counter() - started:.0f} s",
              flush=True)
        x, y = lazy_arrays(files, args.part_rows)
        with LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=limit,
                          host="127.0.0.1", dashboard_address=None) as cluster, \
                Client(cluster) as client:
            streamed = run(client, "streamed", x, y, rows, limit, args.epochs,
                           args.batch_size, stream=True)
            # The resident path on what fits: a fifth of each worker's limit, as
            # NumPy arrays scattered once (ArraySource).
            parts = max(1, int(0.2 * limit / ROW_BYTES) // args.part_rows) * 2
            x_mem = np.concatenate([np.load(xf) for xf, _ in files[:parts]])
            y_mem = np.concatenate([np.load(yf) for _, yf in files[:parts]])
            resident = run(client, "in memory", x_mem, y_mem, len(x_mem), limit,
                           args.epochs, args.batch_size)
        print(f"streamed / in memory: {streamed['examples_per_s'] / resident['examples_per_s']:.2f}x "
              "the examples/s")


if __name__ == "__main__":
    main()
