"""Seed 000: learn y = e^x single-process and data-parallel, with the same seed.

Fits seed 000's small MLP (one hidden layer of 16 sigmoid units) to ``y = e^x``
twice from the same initial weights: once with plain Keras in this process, once
with dasktf sync on Dask workers (``shuffle=False``, so both see the same global
batches). Prints both final losses and saves a PNG of the two loss curves, which
overlap, as the seed's blue and red curves nearly did.

Run: ``python examples/exp_regression.py --workers 2 --out exp_loss.png``.
"""

from __future__ import annotations

import argparse

import keras
from distributed import Client

import dasktf
from dasktf.models import exp_mlp


def main(client: Client, workers: int, epochs: int, out: str) -> tuple[float, float]:
    data = dasktf.load_dataset("exp")
    keras.utils.set_random_seed(0)
    single = exp_mlp((1,), 1)
    parallel = keras.models.clone_model(single)
    parallel.set_weights(single.get_weights())

    single.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    single_loss = single.fit(data.x_train, data.y_train, batch_size=50, epochs=epochs,
                             shuffle=False, verbose=0).history["loss"]
    # dasktf: the same model, optimizer and global batch, over `workers` replicas.
    history = dasktf.fit(parallel, data.x_train, data.y_train, client=client,
                         n_workers=workers, epochs=epochs, batch_size=50,
                         optimizer=keras.optimizers.Adam(0.01), loss="mse",
                         shuffle=False, verbose=0)
    parallel_loss = history.history["loss"]
    print(f"final loss, single process:          {single_loss[-1]:.6f}")
    print(f"final loss, data-parallel ({workers} workers): {parallel_loss[-1]:.6f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, epochs + 1), single_loss, "b-", label="single process")
    ax.plot(range(1, epochs + 1), parallel_loss, "r--", label=f"dasktf sync, {workers} workers")
    ax.set(xlabel="epoch", ylabel="MSE", yscale="log", title="y = e^x")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"loss curves saved to {out}")
    return single_loss[-1], parallel_loss[-1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", default="exp_loss.png")
    args = parser.parse_args()
    with dasktf.make_local_cluster(args.workers) as cluster, Client(cluster) as c:
        main(c, args.workers, args.epochs, args.out)
