"""What the sync step graph costs: dasktf on 1, 2 and 3 workers vs one process.

For each model and global batch, measured side by side in one run:

* the single-process reference: the faster of ``keras.Model.fit`` and a custom
  ``tf.function`` training step, using every core;
* dasktf sync on 1, 2 and 3 worker processes (TensorFlow threads = cores // workers),
  timed over a second epoch (the first one traces the functions).

A step's time is split into the slowest worker's compute (apply + gradient), the
reduction's compute, the worker-to-worker transfers (from Dask's task stream) and
what is left: scheduling hops and waiting.

With ``--metrics``, it measures instead what publishing the metrics stream costs
(issue 5: under 2% of the sync step): every case trains with ``dasktf.metrics`` off
and on, interleaved, and the worker-side cost of one step record (building it,
splitting the step's time, batching it into ``Worker.log_event``) is timed on a
worker in a loop, with the scheduler's MetricsStore ingesting what it sends.

Usage: ``python benchmarks/sync_overhead.py [--steps 12] [--mnist PATH] [--metrics]``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

CASES = [("cnn", 512), ("mnist-mlp", 128), ("mnist-mlp", 1024)]
DEFAULT_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


def load_data(path: str):
    import dasktf
    from dasktf.datasets import load_mnist_npz

    if os.path.exists(path):
        d = load_mnist_npz(path)
    else:
        print(f"({path} not found: using the digits data set)")
        d = dasktf.load_dataset("digits")
    return d.x_train, d.y_train


def single_process(model_name: str, x, y, batch: int, steps: int) -> float:
    """Examples/s of the faster of Keras fit and a custom tf.function loop."""
    import keras
    import tensorflow as tf

    from dasktf.cli.bench import fused_train_step
    from dasktf.models import BUILTIN_MODELS

    n = batch * steps
    keras.utils.set_random_seed(0)
    model = BUILTIN_MODELS[model_name](x.shape[1:], 10)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x[:batch * 2], y[:batch * 2], batch_size=batch, epochs=1, verbose=0)
    t = time.perf_counter()
    model.fit(x[:n], y[:n], batch_size=batch, epochs=1, verbose=0, shuffle=False)
    fit_rate = n / (time.perf_counter() - t)

    step = fused_train_step(model, keras.optimizers.SGD())

    batches = [(tf.constant(x[i:i + batch]), tf.constant(y[i:i + batch])) for i in range(0, n, batch)]
    step(*batches[0]).numpy()
    t = time.perf_counter()
    for xb, yb in batches:
        loss = step(xb, yb)
    loss.numpy()
    loop_rate = n / (time.perf_counter() - t)
    return max(fit_rate, loop_rate)


def dasktf_rate(client, model_name: str, x, y, batch: int, steps: int, workers: int):
    """Examples/s over the second epoch, and the per-step breakdown (ms)."""
    import dasktf

    n = batch * steps
    trainer = dasktf.Trainer(model_name, client=client, n_workers=workers, seed=0)
    trainer.fit(x[:batch * 2], y[:batch * 2], epochs=1, batch_size=batch, verbose=0)
    from distributed import get_task_stream

    with get_task_stream(client) as ts:
        history = trainer.fit(x[:n], y[:n], epochs=2, batch_size=batch, verbose=0, shuffle=False)
    seconds = history.history["epoch_seconds"][1]
    run = history.run_id
    records = [r for r in ts.data if run in str(r["key"]) and "-1-" in str(r["key"])]
    step_ms = 1000 * seconds / steps
    compute = _per_step(records, "dasktf-step", "compute", steps, slowest=True)
    reduce_ = _per_step(records, "dasktf-sum", "compute", steps, slowest=True)
    transfer = _per_step(records, "", "transfer", steps, slowest=False)
    other = step_ms - compute - reduce_ - transfer
    return n / seconds, dict(step=step_ms, compute=compute, reduce=reduce_, transfer=transfer, hops=other)


def _per_step(records, prefix: str, action: str, steps: int, slowest: bool) -> float:
    """Mean ms per step of ``action`` in tasks whose key starts with ``prefix``."""
    by_step: dict[str, list[float]] = {}
    for r in records:
        key = str(r["key"])
        if not key.startswith(prefix):
            continue
        step_id = key.split("-")[4] if key.startswith(("dasktf-step", "dasktf-sum")) else key
        for ss in r["startstops"]:
            if ss["action"] == action:
                by_step.setdefault(step_id, []).append(ss["stop"] - ss["start"])
    if not by_step:
        return 0.0
    agg = [max(v) if slowest else sum(v) for v in by_step.values()]
    return 1000 * float(np.sum(agg)) / steps


def metrics_overhead(client, x, y, steps: int, workers: int, reps: int = 3,
                     models: tuple[str, ...] = ("cnn", "mnist-mlp")) -> list[tuple]:
    """Step ms with metrics off / on (best of ``reps`` interleaved runs) per case."""
    import dask

    from dasktf.diagnostics.metrics import ensure_store
    from dasktf.runtime.cost import publishing_cost

    ensure_store(client)
    per_record = publishing_cost(client, workers)
    rows = []
    for case in [c for c in CASES if c[0] in models]:
        best = {False: float("inf"), True: float("inf")}
        for _ in range(reps):
            for enabled in (False, True):
                with dask.config.set({"dasktf.metrics": enabled}):
                    _, parts = dasktf_rate(client, case[0], x, y, case[1], steps, workers)
                best[enabled] = min(best[enabled], parts["step"])
        rows.append((case, best[False], best[True], per_record))
    return rows


def print_metrics_overhead(rows: list[tuple], workers: int) -> None:
    # record us: one worker's cost per step record (build, time split, batch into
    # log_event) plus the scheduler's MetricsStore ingesting every worker's record.
    header = (f"{'model':<10} {'batch':>5} {'workers':>7} {'step ms off':>11} "
              f"{'step ms on':>10} {'on/off':>7} {'record us':>9} {'record/step':>11}")
    print(header)
    print("-" * len(header))
    for case, off, on, per_record in rows:
        print(f"{case[0]:<10} {case[1]:>5} {workers:>7} {off:>11.2f} {on:>10.2f} "
              f"{on / off:>7.3f} {1e6 * per_record:>9.1f} "
              f"{100 * per_record / (off / 1000):>10.3f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per case")
    parser.add_argument("--mnist", default=DEFAULT_MNIST)
    parser.add_argument("--workers", default="1,2,3")
    parser.add_argument("--metrics", action="store_true",
                        help="measure what publishing the metrics stream costs")
    parser.add_argument("--reps", type=int, default=3,
                        help="--metrics: interleaved off/on runs per case (best of)")
    parser.add_argument("--models", default="cnn,mnist-mlp",
                        help="--metrics: the models to measure")
    args = parser.parse_args()

    from distributed import Client

    import dasktf

    x, y = load_data(args.mnist)
    counts = [int(w) for w in args.workers.split(",")]
    cores = os.cpu_count() or 1
    print(f"machine: {cores} cores; data {x.shape}; {args.steps} timed steps per case\n")
    if args.metrics:
        for w in counts:
            with dasktf.make_local_cluster(w) as cluster, Client(cluster) as client:
                client.wait_for_workers(w)
                rows = metrics_overhead(client, x, y, args.steps, w, args.reps,
                                        tuple(args.models.split(",")))
                print_metrics_overhead(rows, w)
        return
    reference = {case: single_process(case[0], x, y, case[1], args.steps) for case in CASES}
    rows = []
    for w in counts:
        with dasktf.make_local_cluster(w) as cluster, Client(cluster) as client:
            client.wait_for_workers(w)
            for case in CASES:
                rate, parts = dasktf_rate(client, case[0], x, y, case[1], args.steps, w)
                rows.append((case, w, rate, parts))
    header = (f"{'model':<10} {'batch':>5} {'workers':>7} {'examples/s':>11} {'ratio':>6} "
              f"{'step ms':>8} {'compute':>8} {'reduce':>7} {'transfer':>8} {'hops+wait':>9}")
    print(header)
    print("-" * len(header))
    for case in CASES:
        print(f"{case[0]:<10} {case[1]:>5} {'1 proc':>7} {reference[case]:>11,.0f} {1.0:>6.2f}")
        for (c, w, rate, p) in rows:
            if c != case:
                continue
            print(f"{c[0]:<10} {c[1]:>5} {w:>7} {rate:>11,.0f} {rate / reference[case]:>6.2f} "
                  f"{p['step']:>8.1f} {p['compute']:>8.1f} {p['reduce']:>7.1f} "
                  f"{p['transfer']:>8.1f} {p['hops']:>9.1f}")


if __name__ == "__main__":
    main()
