"""dasktf.predict against single-process Keras and the map_blocks workaround.

One run, side by side, on the same rows (issue 29):

* **throughput**: ``--rows`` MNIST-shaped rows (28x28 uint8: the real digits,
  tiled, from ``../shared/data/mnist.npz``, else random) in a Dask array persisted
  on ``--workers`` workers, in blocks of ``--block`` rows; the ``mnist-mlp``
  built-in. Examples/s of ``model.predict(x)`` in this process (all of its cores,
  ``batch_size`` 1024), of ``dasktf.predict(model, X)`` (persisted on the
  workers, default batch 1024), and of the workaround
  ``X.map_blocks(lambda b: model.predict(b))`` as users write it (the model
  pickled into every task, Keras' batch of 32 and its progress bar), plus the
  same workaround with ``batch_size=1024, verbose=0``. ``--rounds`` interleaved
  rounds on workers that have imported TensorFlow; the first includes each
  method's start-up (tracing, dasktf's model builds on the workers).
* **client memory**: this process's RSS before and after ``dasktf.predict``
  (sampled every 50 ms in between: the peak too).
* **scheduler memory**: the scheduler's RSS and the bytes of the task specs it
  holds after a graph of 10 and of 1,000 partitions is submitted (100,000 rows,
  results kept on the workers), for dasktf.predict, for the workaround, and for a
  ``map_blocks`` with no model (what any Dask task costs the scheduler).

Usage: ``python benchmarks/predict.py [--rows 2000000] [--workers 2] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


def digits() -> np.ndarray:
    """70,000 real digits where the file is there, else random bytes."""
    if os.path.exists(MNIST):
        with np.load(MNIST, allow_pickle=False) as f:
            return np.concatenate([f["x_train"], f["x_test"]])
    return np.random.default_rng(0).integers(0, 256, (70_000, 28, 28), dtype=np.uint8)


def tiled_block(block_info: dict | None = None) -> np.ndarray:
    """Rows ``start..stop`` of the digits tiled to any length (a worker makes its own)."""
    start, stop = block_info[None]["array-location"][0]
    base = digits()
    return base[np.arange(start, stop) % len(base)]


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class PeakRSS:
    """This process's RSS, sampled every 50 ms while in the block."""

    def __enter__(self) -> PeakRSS:
        self.before = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = rss()
        self.peak = max(self.peak, self.after)


def scheduler_state(dask_scheduler) -> tuple[int, int, int]:
    """The scheduler's RSS, task count and the pickled bytes of its task specs."""
    import psutil
    from distributed.protocol.pickle import dumps

    spec = sum(len(dumps(ts.run_spec)) for ts in dask_scheduler.tasks.values()
               if ts.run_spec is not None)
    return psutil.Process().memory_info().rss, len(dask_scheduler.tasks), spec


def _import_tensorflow() -> None:
    import tensorflow  # noqa: F401


def plain(block: np.ndarray) -> np.ndarray:
    """A task with no model at all: Dask's own cost per partition."""
    return block.reshape(len(block), -1)[:, :10].astype(np.float32)


def workaround(model, x, **kwargs):
    """The map_blocks workaround: the model goes into every task's arguments."""
    return x.map_blocks(lambda b: model.predict(b, **kwargs), dtype=np.float32,
                        chunks=(x.chunks[0], (10,)), drop_axis=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--block", type=int, default=50_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-workaround32", action="store_true",
                        help="leave out the workaround with Keras' batch of 32 (slow)")
    args = parser.parse_args()

    import dask.array as da
    from distributed import Client, wait
    from distributed.protocol.pickle import dumps

    import dasktf
    from dasktf.models import mnist_mlp

    load_before = os.getloadavg()
    model = mnist_mlp((28, 28), 10)
    local = tiled_block({None: {"array-location": [(0, args.rows)]}})
    with dasktf.make_local_cluster(args.workers, tf_threads=1) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(args.workers)
        shape = (args.rows, 28, 28)
        x = da.map_blocks(tiled_block, dtype=np.uint8, chunks=(
            da.core.normalize_chunks((args.block, 28, 28), shape)), meta=np.empty((0, 28, 28),
                                                                                   np.uint8))
        x = client.persist(x)
        wait(x)
        client.run(_import_tensorflow)  # a cluster that has run TensorFlow before
        methods = {
            "keras model.predict (this process, batch 1024)":
                lambda: model.predict(local, batch_size=1024, verbose=0),
            "dasktf.predict (batch 1024)":
                lambda: wait(client.persist(dasktf.predict(model, x, client=client))),
            "map_blocks(model.predict(b, batch_size=1024, verbose=0))":
                lambda: wait(client.persist(workaround(model, x, batch_size=1024, verbose=0))),
        }
        if not args.skip_workaround32:
            methods["map_blocks(model.predict(b)) as written"] = lambda: wait(
                client.persist(workaround(model, x)))
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        client_rss: list[tuple[int, int, int]] = []
        for _ in range(args.rounds):
            for name, run in methods.items():
                if name.startswith("dasktf"):
                    with PeakRSS() as mem:
                        start = time.perf_counter()
                        run()
                        seconds[name].append(time.perf_counter() - start)
                    client_rss.append((mem.before, mem.after, mem.peak))
                else:
                    start = time.perf_counter()
                    run()
                    seconds[name].append(time.perf_counter() - start)
        check = dasktf.predict(model, x[:4096], client=client).compute()
        np.testing.assert_allclose(check, model.predict(local[:4096], verbose=0), atol=1e-5)

        sched = []
        small = da.zeros((100_000, 28, 28), dtype=np.uint8, chunks=(10_000, 28, 28))
        for parts in (10, 1000):
            xs = small.rechunk((100_000 // parts, 28, 28))
            for name, make in (
                    ("map_blocks, no model (Dask's own cost)", lambda xs=xs: xs.map_blocks(
                        plain, dtype=np.float32, chunks=(xs.chunks[0], (10,)), drop_axis=2)),
                    ("dasktf.predict", lambda xs=xs: dasktf.predict(model, xs, client=client)),
                    ("map_blocks workaround", lambda xs=xs: workaround(model, xs, verbose=0))):
                before = client.run_on_scheduler(scheduler_state)
                held = client.persist(make())
                wait(held)
                after = client.run_on_scheduler(scheduler_state)
                graph = len(dumps(dict(make().__dask_graph__())))
                sched.append((name, parts, after[0] - before[0], after[2], graph))
                del held
                while client.run_on_scheduler(scheduler_state)[1] > before[1]:
                    time.sleep(0.1)
    load_after = os.getloadavg()

    keras_name = next(iter(methods))
    print(f"{args.rows:,} rows of 28x28 uint8, blocks of {args.block:,}, {args.workers} "
          f"workers x 1 thread, mnist-mlp; {os.cpu_count()} cores; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print("| method | round | seconds | examples/s | vs keras | vs dasktf |")
    print("|---|---|---|---|---|---|")
    for name, values in seconds.items():
        for r, s in enumerate(values):
            k = seconds[keras_name][r]
            d = seconds["dasktf.predict (batch 1024)"][r]
            print(f"| {name} | {r + 1} | {s:.2f} | {args.rows / s:,.0f} | {k / s:.2f}x "
                  f"| {d / s:.2f}x |")
    print("\nclient RSS around dasktf.predict (MiB): before, after, peak, growth")
    for before, after, peak in client_rss:
        print(f"  {before / 2**20:.0f}, {after / 2**20:.0f}, {peak / 2**20:.0f}, "
              f"{(peak - before) / 2**20:+.1f}")
    print("\n| graph | partitions | scheduler RSS growth (MiB) | task specs held (KiB) "
          "| graph pickled (KiB) |")
    print("|---|---|---|---|---|")
    for name, parts, grow, spec, graph in sched:
        print(f"| {name} | {parts} | {grow / 2**20:+.1f} | {spec / 1024:,.0f} | "
              f"{graph / 1024:,.0f} |")


if __name__ == "__main__":
    main()
