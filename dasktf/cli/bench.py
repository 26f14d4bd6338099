"""dasktf against what users would pick instead, measured side by side in one run.

For each model and worker count, with the same data, global batch, optimizer and
epochs:

* ``keras``: one process, the faster of ``Model.fit`` and a custom ``tf.function``
  loop (the reference; it does not depend on the worker count);
* ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy`` (custom loop: Keras 3
  ``fit`` fails under it) on localhost workers started through
  :func:`dasktf.tf.bridge.run_tf_distributed`;
* ``graph``, ``p2p``, ``collective``: dasktf sync on its three engines (a task graph
  per step; a worker-to-worker all-reduce per step; TensorFlow's ring);
* ``async`` and ``async-k2``: dasktf async, unbounded and with staleness bound 2;
* ``p2p-sharded`` and ``p2p-zero2`` (only when ``--runners`` names them): the p2p
  engine with ``shard_state="optimizer"`` and ``"gradients"`` (docs/sharding.md).

Epoch times include the per-epoch validation, as ``fit(validation_data=...)``
does. Each run reports its start-up (wall time minus training time: replicas, or child
processes and the strategy), examples/s over the epochs after the first (the first
traces), the training time until the validation accuracy first reached the target,
and the final validation accuracy. The distributed runs of one worker count share
one LocalCluster of that many workers, started as ``dasktf fit --workers N`` starts
it (each worker's TensorFlow gets cores // N threads; its workers already import
TensorFlow; MWMS and the collective engine start a TensorFlow child per worker,
which their start-up includes).

Outputs: a table on the terminal, a JSON file and a PNG chart.
Usage: ``python benchmarks/peers.py [--models cnn,mnist-mlp] [--workers 1,2,3]
[--epochs 3] [--train-size 6144] [--out peers]`` (or ``dasktf bench ...``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import click
import numpy as np

from dasktf.cli.common import CONTEXT
from dasktf.cluster.membership import alive_workers

RUNNERS = ("keras", "mwms", "graph", "p2p", "collective", "async", "async-k2",
           "p2p-sharded", "p2p-zero2")
#: what runs unless ``--runners`` says otherwise (the sharded ones are asked for)
DEFAULT_RUNNERS = RUNNERS[:7]
DEFAULT_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                             "mnist.npz")


def fused_train_step(model: Any, optimizer: Any) -> Any:
    """The single-process reference: one ``tf.function`` doing forward, gradient and
    apply (sparse categorical cross-entropy), as a hand-written Keras loop would."""
    import keras
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
        return loss

    return step


def load_data(name: str, train_size: int, test_size: int) -> dict[str, Any]:
    """``mnist`` (the Keras-layout npz, if found) or ``digits``, cut to size."""
    import dasktf
    from dasktf.datasets import load_mnist_npz

    if name == "mnist" and os.path.exists(DEFAULT_MNIST):
        d = load_mnist_npz(DEFAULT_MNIST)
    else:
        d = dasktf.load_dataset("digits" if name == "mnist" else name)
    return {"name": d.name, "x": d.x_train[:train_size], "y": d.y_train[:train_size],
            "x_val": d.x_test[:test_size], "y_val": d.y_test[:test_size]}


def summarize(epoch_seconds: Sequence[float], val_acc: Sequence[float], n: int,
              wall: float, target: float) -> dict[str, Any]:
    """The four figures of one run from its per-epoch times and accuracies."""
    later = list(epoch_seconds[1:]) or list(epoch_seconds)
    reached = next((i for i, a in enumerate(val_acc) if a >= target), None)
    return {
        "startup_s": max(0.0, wall - sum(epoch_seconds)),
        "examples_per_s": n * len(later) / sum(later),
        "time_to_target_s": None if reached is None else float(sum(epoch_seconds[: reached + 1])),
        "final_val_accuracy": float(val_acc[-1]),
    }


# -- plain Keras, one process ----------------------------------------------------
def keras_run(model_name: str, data: dict[str, Any], batch: int, epochs: int, lr: float,
              target: float) -> dict[str, Any]:
    """The faster of ``fit`` and a custom loop (by examples/s), each from the same
    seeded start."""
    best: dict[str, Any] | None = None
    for kind in ("fit", "loop"):
        start = time.perf_counter()
        seconds, acc = _keras_train(kind, model_name, data, batch, epochs, lr)
        row = summarize(seconds, acc, len(data["x"]), time.perf_counter() - start, target)
        row.update(variant=kind, epoch_seconds=seconds, val_accuracy=acc)
        if best is None or row["examples_per_s"] > best["examples_per_s"]:
            best = row
    assert best is not None
    return best


def _keras_train(kind: str, model_name: str, data: dict[str, Any], batch: int,
                 epochs: int, lr: float) -> tuple[list[float], list[float]]:
    import keras

    from dasktf.models import BUILTIN_MODELS

    keras.utils.set_random_seed(0)
    model = BUILTIN_MODELS[model_name](data["x"].shape[1:], 10)
    model.compile(optimizer=keras.optimizers.Adam(lr),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    seconds, acc = [], []
    if kind == "fit":
        for _ in range(epochs):
            t = time.perf_counter()
            model.fit(data["x"], data["y"], batch_size=batch, epochs=1, verbose=0)
            acc.append(model.evaluate(data["x_val"], data["y_val"], verbose=0)[1])
            seconds.append(time.perf_counter() - t)
        return seconds, acc
    step = fused_train_step(model, model.optimizer)
    n = len(data["x"])
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        t = time.perf_counter()
        order = rng.permutation(n)
        for i in range(0, n, batch):
            rows = order[i : i + batch]
            loss = step(data["x"][rows], data["y"][rows])
        loss.numpy()
        acc.append(model.evaluate(data["x_val"], data["y_val"], verbose=0)[1])
        seconds.append(time.perf_counter() - t)
    return seconds, acc


# -- MultiWorkerMirroredStrategy (runs in the bridge's child processes) -----------
def mwms_train(model_name: str, x: np.ndarray, y: np.ndarray, x_val: np.ndarray,
               y_val: np.ndarray, batch: int, epochs: int, lr: float) -> dict[str, Any]:
    """One MWMS worker: the custom loop the issue measured; its shard of every
    global batch, as ``tf.distribute`` users write it."""
    import json as _json

    import keras
    import tensorflow as tf

    from dasktf.models import BUILTIN_MODELS

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = _json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    workers = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = BUILTIN_MODELS[model_name](x.shape[1:], 10)
        opt = keras.optimizers.Adam(lr)
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction="sum")
    evaluator = BUILTIN_MODELS[model_name](x.shape[1:], 10)
    evaluator.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])

    @tf.function
    def step(xb: Any, yb: Any) -> Any:
        def replica_fn(xb: Any, yb: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True)) / batch
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=False))
            return loss

        return strategy.run(replica_fn, args=(xb, yb))

    n = len(x)
    rng = np.random.default_rng(0)
    seconds, acc = [], []
    for _ in range(epochs):
        t = time.perf_counter()
        order = rng.permutation(n)
        for i in range(0, n, batch):
            rows = order[i : i + batch][task::workers]  # this worker's share
            loss = step(x[rows], y[rows])
        strategy.experimental_local_results(loss)[0].numpy()
        evaluator.set_weights([np.asarray(w) for w in model.get_weights()])
        acc.append(float(evaluator.evaluate(x_val, y_val, verbose=0)[1]))
        seconds.append(time.perf_counter() - t)
    return {"epoch_seconds": seconds, "val_accuracy": acc}


def mwms_run(client: Any, workers: list[str], model_name: str, data: dict[str, Any],
             batch: int, epochs: int, lr: float, target: float) -> dict[str, Any]:
    from dasktf.tf.bridge import run_tf_distributed

    start = time.perf_counter()
    # Scattered once to the workers, not embedded in every task's graph.
    arrays = client.scatter([data[k] for k in ("x", "y", "x_val", "y_val")],
                            workers=workers, broadcast=True, hash=False)
    out = run_tf_distributed(client, mwms_train, model_name, *arrays, batch, epochs, lr,
                             workers=workers, timeout=600)
    wall = time.perf_counter() - start
    # The slowest worker's epochs are the run's.
    seconds = [float(s) for s in np.max([o["epoch_seconds"] for o in out], axis=0)]
    row = summarize(seconds, out[0]["val_accuracy"], len(data["x"]), wall, target)
    row.update(epoch_seconds=seconds, val_accuracy=out[0]["val_accuracy"])
    return row


# -- dasktf ------------------------------------------------------------------------
def dasktf_run(client: Any, n_workers: int, runner: str, model_name: str,
               data: dict[str, Any], batch: int, epochs: int, lr: float,
               target: float) -> dict[str, Any]:
    import dasktf

    options: dict[str, Any] = {
        "graph": {"engine": "graph"},
        "p2p": {"engine": "p2p"},
        "collective": {"engine": "collective"},
        "async": {"mode": "async"},
        "async-k2": {"mode": "async", "max_staleness": 2},
        # docs/sharding.md: 1/N of the optimizer a worker (ZeRO-1), and the
        # reduce-scatter bucketed as well (ZeRO-2)
        "p2p-sharded": {"engine": "p2p", "shard_state": "optimizer"},
        "p2p-zero2": {"engine": "p2p", "shard_state": "gradients"},
    }[runner]
    start = time.perf_counter()
    history = dasktf.fit(model_name, data["x"], data["y"], client=client,
                         n_workers=n_workers, epochs=epochs, batch_size=batch,
                         optimizer="adam", learning_rate=lr, metrics=["accuracy"],
                         validation_data=(data["x_val"], data["y_val"]), seed=0,
                         verbose=0, **options)
    wall = time.perf_counter() - start
    h = history.history
    return summarize(h["epoch_seconds"], h["val_accuracy"], len(data["x"]), wall, target)


# -- output ----------------------------------------------------------------------
def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'model':<10} {'workers':>7} {'runner':<11} {'start s':>8} "
              f"{'examples/s':>11} {'vs keras':>8} {'vs mwms':>8} {'to target s':>11} "
              f"{'final acc':>9}")
    print(header)
    print("-" * len(header))
    ref = {(r["model"]): r for r in rows if r["runner"] == "keras"}
    peer = {(r["model"], r["workers"]): r for r in rows if r["runner"] == "mwms"}
    for r in rows:
        k = ref.get(r["model"])
        p = peer.get((r["model"], r["workers"]))
        vs_k = r["examples_per_s"] / k["examples_per_s"] if k else float("nan")
        vs_p = r["examples_per_s"] / p["examples_per_s"] if p else float("nan")
        tt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        print(f"{r['model']:<10} {r['workers']:>7} {r['runner']:<11} {r['startup_s']:>8.1f} "
              f"{r['examples_per_s']:>11,.0f} {vs_k:>8.2f} {vs_p:>8.2f} {tt:>11} "
              f"{r['final_val_accuracy']:>9.3f}")


def write_chart(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        mine = [r for r in rows if r["model"] == model]
        counts = sorted({r["workers"] for r in mine if r["runner"] != "keras"}) or [1]
        runners = [r for r in RUNNERS if any(m["runner"] == r for m in mine)]
        width = 0.8 / max(1, len(runners))
        for j, runner in enumerate(runners):
            values = []
            for c in counts:
                match = [m for m in mine if m["runner"] == runner
                         and (runner == "keras" or m["workers"] == c)]
                values.append(match[0]["examples_per_s"] if match else 0.0)
            ax.bar(np.arange(len(counts)) + j * width, values, width, label=runner)
        ax.set_xticks(np.arange(len(counts)) + 0.4 - width / 2)
        ax.set_xticklabels([f"{c} worker(s)" for c in counts])
        ax.set_ylabel("examples/s")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@click.command("bench", context_settings=CONTEXT)
@click.option("--models", default="mnist-mlp,cnn", show_default=True,
              help="Comma-separated built-in models.")
@click.option("--workers", default="1,2,3", show_default=True, help="Worker counts.")
@click.option("--runners", default=",".join(DEFAULT_RUNNERS), show_default=True,
              help="Which of keras, mwms, graph, p2p, collective, async, async-k2, "
              "p2p-sharded (shard_state='optimizer') and p2p-zero2 "
              "(shard_state='gradients') to run.")
@click.option("--data", default="mnist", show_default=True,
              help="mnist (if found) or digits.")
@click.option("--train-size", type=click.IntRange(min=1), default=6144, show_default=True)
@click.option("--test-size", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=512, show_default=True,
              help="The global batch.")
@click.option("--epochs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True,
              help="Adam's learning rate.")
@click.option("--target", type=float, default=0.9, show_default=True,
              help="Validation accuracy for the time-to-target column.")
@click.option("--out", default="peers", show_default=True,
              help="Writes OUT.json and OUT.png.")
def bench(**options: Any) -> None:
    """Benchmark dasktf against plain Keras and MultiWorkerMirroredStrategy.

    The same as `python benchmarks/peers.py OPTIONS`: a table on the terminal, a
    JSON file and a PNG chart, every runner measured side by side in one run.
    """
    runners = options["runners"].split(",")
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown:
        raise click.BadParameter(f"unknown runner(s) {unknown}; choose from {RUNNERS}",
                                 param_hint="--runners")
    run_benchmark(**options)


def run_benchmark(models: str, workers: str, runners: str, data: str, train_size: int,
                  test_size: int, batch_size: int, epochs: int, lr: float,
                  target: float, out: str) -> list[dict[str, Any]]:
    """Run :func:`bench`'s measurements; the table's rows."""
    args = SimpleNamespace(models=models, workers=workers, runners=runners, data=data,
                           train_size=train_size, test_size=test_size,
                           batch_size=batch_size, epochs=epochs, lr=lr, target=target,
                           out=out)
    from dasktf.cluster import quiet
    from dasktf.cluster.local import QUIET_TF_LOG_LEVEL

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_TF_LOG_LEVEL)
    quiet.install()

    from distributed import Client

    import dasktf

    models = args.models.split(",")
    counts = sorted(int(w) for w in args.workers.split(","))
    runners = args.runners.split(",")
    data = load_data(args.data, args.train_size, args.test_size)
    began = time.perf_counter()
    print(f"machine: {os.cpu_count()} cores, load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; data {data['name']} "
          f"{data['x'].shape}, global batch {args.batch_size}, {args.epochs} epochs")
    rows: list[dict[str, Any]] = []

    def add(model: str, workers: int, runner: str, row: dict[str, Any]) -> None:
        row.update(model=model, workers=workers, runner=runner)
        rows.append(row)
        print(f"  {model} {workers} {runner}: {row['examples_per_s']:,.0f} ex/s, "
              f"start {row['startup_s']:.1f}s", flush=True)

    if "keras" in runners:
        for model in models:
            add(model, 1, "keras", keras_run(model, data, args.batch_size, args.epochs,
                                             args.lr, args.target))
    # A cluster per worker count, as `dasktf fit --workers N` starts one: its workers'
    # TensorFlow threads share the cores (cores // N each), so one worker has every
    # core, as the single process does.
    for n in counts:
        with dasktf.make_local_cluster(n) as cluster, Client(cluster) as client:
            client.wait_for_workers(n, timeout=120)
            workers = alive_workers(client)
            for model in models:
                for runner in runners:
                    if runner == "keras":
                        continue
                    if runner == "mwms":
                        row = mwms_run(client, workers, model, data, args.batch_size,
                                       args.epochs, args.lr, args.target)
                    else:
                        row = dasktf_run(client, n, runner, model, data, args.batch_size,
                                         args.epochs, args.lr, args.target)
                    add(model, n, runner, row)
    total = time.perf_counter() - began
    print()
    print_table(rows)
    print(f"\nbenchmark wall time {total:.0f}s; load average now "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    meta = {"args": vars(args), "cores": os.cpu_count(), "wall_s": total,
            "loadavg_end": os.getloadavg()}
    with open(f"{args.out}.json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    write_chart(rows, f"{args.out}.png")
    print(f"wrote {args.out}.json and {args.out}.png")
    return rows
