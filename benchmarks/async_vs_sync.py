"""Sync vs sync with a quorum vs async vs bounded staleness, with and without a straggler.

In one run on one 3-worker LocalCluster (1 thread each), side by side:

* ``sync``: every step averages the 3 workers' gradients;
* ``quorum 2/3``: every step applies the first 2 of 3 gradients, drops the late one;
* ``async``: every worker loops on its own, the holder applies on arrival;
* ``async K=2``: async with bounded staleness 2;

each without and with worker 2 slowed 4x (it sleeps 3x its compute time after each
gradient). Printed per run: examples/s (applied examples over the epochs after the
first, which traces), updates, mean/max staleness, dropped gradients and the wall
time until the validation accuracy first reaches the target (checked at epoch ends).

The model is a small CNN (35k parameters): tens of ms of compute per local batch
for 140 KB of gradients, so compute, not messaging, dominates a step, as it does for
the models people distribute.

Usage: ``python benchmarks/async_vs_sync.py [--train 6000] [--epochs 4] [--target 0.93]``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

DEFAULT_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")
MODES = [
    ("sync", {}),
    ("quorum 2/3", {"sync_quorum": 2}),
    ("async", {"mode": "async"}),
    ("async K=2", {"mode": "async", "max_staleness": 2}),
]


def small_cnn(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((28, 28)),
        keras.layers.Reshape((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="softmax"),
    ])


def load(path: str, n_train: int, n_val: int):
    import dasktf
    from dasktf.datasets import load_mnist_npz

    if os.path.exists(path):
        d = load_mnist_npz(path)
    else:
        print(f"({path} not found: using the digits data set, upsampled to 28x28)")
        d = dasktf.load_dataset("digits")
        d.x_train = np.kron(d.x_train, np.ones((1, 4, 4)))[:, 2:30, 2:30].astype("float32")
        d.x_test = np.kron(d.x_test, np.ones((1, 4, 4)))[:, 2:30, 2:30].astype("float32")
    return (d.x_train[:n_train], d.y_train[:n_train]), (d.x_test[:n_val], d.y_test[:n_val])


def run(client, train, val, extra: dict, slow: bool, epochs: int, batch: int, target: float):
    import dasktf

    kwargs = dict(extra)
    if slow:
        kwargs["slow_workers"] = {2: 4}
    start = time.perf_counter()
    history = dasktf.fit(
        small_cnn(), *train, client=client, n_workers=3, epochs=epochs, batch_size=batch,
        optimizer="adam", learning_rate=2e-3, metrics=["accuracy"], validation_data=val,
        seed=0, verbose=0, **kwargs, loss="sparse_categorical_crossentropy",
    )
    h = history.history
    seconds = np.asarray(h["epoch_seconds"])
    examples = np.asarray(h["examples_per_sec"]) * seconds
    rate = examples[1:].sum() / seconds[1:].sum() if epochs > 1 else examples.sum() / seconds.sum()
    reached = [i for i, a in enumerate(h["val_accuracy"]) if a >= target]
    to_target = float(np.cumsum(seconds)[reached[0]]) if reached else float("nan")
    u = history.updates
    return {
        "examples/s": rate,
        "updates": int(u["update"].nunique()) if u is not None else len(train[0]) // batch * epochs
        + (epochs if len(train[0]) % batch else 0),
        "staleness": (u["staleness"].mean(), int(u["staleness"].max())) if u is not None else (0.0, 0),
        "dropped": sum(history.dropped.values()) if u is not None else 0,
        "to_target": to_target,
        "val_acc": h["val_accuracy"][-1],
        "wall": time.perf_counter() - start,
        "slow_staleness": (
            float(u[u.worker == 2]["staleness"].mean()) if u is not None and slow else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist", default=DEFAULT_MNIST)
    parser.add_argument("--train", type=int, default=6000)
    parser.add_argument("--val", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=192, help="global batch (64 per worker)")
    parser.add_argument("--target", type=float, default=0.93)
    args = parser.parse_args()

    import dask
    from distributed import Client

    import dasktf

    train, val = load(args.mnist, args.train, args.val)
    results = {}
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with dasktf.make_local_cluster(3, tf_threads=1) as cluster, Client(cluster) as client:
            client.wait_for_workers(3, timeout=120)
            for slow in (False, True):
                for name, extra in MODES:
                    r = run(client, train, val, extra, slow, args.epochs, args.batch, args.target)
                    results[name, slow] = r
                    print(f"  done: {name:<11} straggler={slow!s:<5} {r['wall']:.1f}s", flush=True)

    print(f"\n{args.train:,} MNIST examples, global batch {args.batch} (local "
          f"{args.batch // 3}), {args.epochs} epochs, 3 workers; straggler: worker 2 "
          f"slowed 4x; target val accuracy {args.target}\n")
    head = ("| mode | straggler | examples/s | updates | staleness mean / max | dropped "
            f"| time to val acc {args.target} | final val acc |")
    print(head)
    print("|" + "---|" * 8)
    for (name, slow), r in results.items():
        tt = f"{r['to_target']:.1f} s" if np.isfinite(r["to_target"]) else "not reached"
        print(f"| {name} | {'4x' if slow else '-'} | {r['examples/s']:,.0f} | {r['updates']} "
              f"| {r['staleness'][0]:.2f} / {r['staleness'][1]} | {r['dropped']} | {tt} "
              f"| {r['val_acc']:.3f} |")
    print()
    for name, _ in MODES[1:]:
        for slow in (False, True):
            a, s = results[name, slow], results["sync", slow]
            speed = a["examples/s"] / s["examples/s"]
            ttt = s["to_target"] / a["to_target"]
            print(f"{name:<11} / sync, straggler={'4x' if slow else 'no':<3}: examples/s "
                  f"{speed:.2f}x, time to target {ttt:.2f}x faster")
    a = results["async", True]
    print(f"\nasync with the straggler: worker 2's mean staleness {a['slow_staleness']:.2f} "
          f"vs {a['staleness'][0]:.2f} over all updates")


if __name__ == "__main__":
    main()
