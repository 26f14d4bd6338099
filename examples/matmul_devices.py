"""Time a matrix product on the CPU and on the GPU of every Dask worker.

Seed 001's device check, made distributed: every worker multiplies two random
``size x size`` float32 matrices on each device it sees (its CPU, and its one GPU
when dasktf pinned it to one) and the client prints a table. On a GPU machine each
worker should list exactly one GPU, its own.

The timing uses TensorFlow. Where a worker has no TensorFlow (a CUDA image without
it, say) it falls back to NumPy on the CPU and CuPy on the GPU, and the table's
``backend`` column says so: those figures time the hardware, not TensorFlow.

Run it as a script (``python examples/matmul_devices.py --size 4096``) or call
:func:`main` with a client of your own cluster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from distributed import Client

import dasktf


def _timed(run: Any, repeats: int) -> float:
    run()  # warm-up: kernel selection, allocations, first-call compilation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _tensorflow_timings(size: int, repeats: int) -> list[dict[str, Any]]:
    import tensorflow as tf

    out = []
    devices = ["/CPU:0"] + [d.name for d in tf.config.list_logical_devices("GPU")]
    for device in devices:
        with tf.device(device):
            a = tf.random.uniform((size, size), seed=1)
            b = tf.random.uniform((size, size), seed=2)

            # Reducing to a scalar waits for the product without copying it back.
            def run(a: Any = a, b: Any = b) -> None:
                tf.reduce_sum(tf.linalg.matmul(a, b)).numpy()

            seconds = _timed(run, repeats)
        out.append({"device": device.replace("/job:localhost/replica:0/task:0/device:", ""),
                    "backend": "tensorflow", "seconds": seconds})
    return out


def _fallback_timings(size: int, repeats: int) -> list[dict[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(1)
    a, b = rng.random((size, size), np.float32), rng.random((size, size), np.float32)
    out = [{"device": "CPU:0", "backend": "numpy (no TensorFlow)",
            "seconds": _timed(lambda: float((a @ b).sum()), repeats)}]
    try:
        import cupy as cp

        n_gpus = cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy or no CUDA device: CPU figures only
        return out
    for i in range(n_gpus):
        with cp.cuda.Device(i):
            ga, gb = cp.asarray(a), cp.asarray(b)
            name = cp.cuda.runtime.getDeviceProperties(i)["name"].decode()
            seconds = _timed(lambda ga=ga, gb=gb: float((ga @ gb).sum()), repeats)
            out.append({"device": f"GPU:{i} ({name})", "backend": "cupy (no TensorFlow)",
                        "seconds": seconds})
    return out


def time_matmul(size: int, repeats: int = 5) -> dict[str, Any]:
    """Runs on a worker: median seconds of one product on each device it sees."""
    try:
        timings = _tensorflow_timings(size, repeats)
    except ImportError:
        timings = _fallback_timings(size, repeats)
    for t in timings:
        t["gflops"] = 2 * size**3 / t["seconds"] / 1e9
    return {"pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "timings": timings}


def main(client: Client, size: int = 1024, repeats: int = 5) -> list[dict[str, Any]]:
    """Time a ``size x size`` product on every device of every worker; print a table."""
    # dasktf: one call runs the probe in every worker process, each on its own devices.
    results = client.run(time_matmul, size, repeats)
    rows = []
    for address, r in sorted(results.items()):
        for t in r["timings"]:
            rows.append({"worker": address, "CUDA_VISIBLE_DEVICES": r["cuda_visible_devices"],
                         **t})
    print(f"float32 matmul {size}x{size}, median of {repeats}")
    print(f"{'worker':24} {'CUDA_VISIBLE_DEVICES':>20}  {'device':28} {'backend':24} "
          f"{'ms':>9} {'GFLOP/s':>10}")
    for row in rows:
        cvd = "(unset)" if row["CUDA_VISIBLE_DEVICES"] is None else repr(
            row["CUDA_VISIBLE_DEVICES"])
        print(f"{row['worker']:24} {cvd:>20}  {row['device']:28} {row['backend']:24} "
              f"{row['seconds'] * 1e3:9.2f} {row['gflops']:10.1f}")
    return rows


if __name__ == "__main__":  # workers re-import this module when they spawn
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None,
                        help="CPU workers where there is no GPU (default 2)")
    parser.add_argument("--gpus", default=None, help="all, none, N or 0,2,3")
    args = parser.parse_args()
    from dasktf.cluster.devices import parse_gpus

    # dasktf: one worker per GPU (each pinned through CUDA_VISIBLE_DEVICES), else CPUs.
    # On a real cluster, replace these two lines with `client = Client("tcp://...")`.
    with dasktf.make_local_cluster(args.workers, gpus=parse_gpus(args.gpus)) as cluster:
        with Client(cluster) as client:
            main(client, args.size, args.repeats)
