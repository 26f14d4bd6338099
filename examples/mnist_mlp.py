"""Seed 001's distributed MNIST MLP, on dasktf.

The seed trained a 784-100-10 sigmoid MLP with plain gradient descent (batch 100,
20 epochs) across parameter-server and worker processes, printing the cost and the
average step time every ``frequency`` steps, then the test accuracy, the total time
and the final cost. Here the same model trains data-parallel over Dask workers, on
the built-in digits (or on MNIST: ``--data mnist`` / ``--data path/to/mnist.npz``).

The seed's learning rate (0.0005) suited its unscaled N(0, 1) weights; with Keras'
Glorot initialisation plain SGD needs a larger step, so ``--lr`` defaults to 0.5.

Run: ``python examples/mnist_mlp.py --workers 2``.
"""

from __future__ import annotations

import argparse
import time

import keras
from distributed import Client

import dasktf


class SeedReport(keras.callbacks.Callback):
    """Print the seed's progress line every ``frequency`` steps."""

    def __init__(self, frequency: int) -> None:
        super().__init__()
        self.frequency = frequency
        self.step = 0
        self.last = time.perf_counter()
        self.cost = float("nan")

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if logs and logs.get("loss") is not None:
            self.cost = logs["loss"]
        steps = self.params["steps"]
        if (batch + 1) % self.frequency == 0 or batch + 1 == steps:
            elapsed = time.perf_counter() - self.last
            self.last = time.perf_counter()
            count = (batch % self.frequency) + 1
            print(f"Step: {self.step},  Epoch: {self.epoch + 1:2d},  Batch: {batch + 1:3d} of "
                  f"{steps:3d},  Cost: {self.cost:.4f},  AvgTime: {elapsed * 1000 / count:3.2f}ms")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


def main(client: Client, args: argparse.Namespace) -> float:
    data = dasktf.load_dataset(args.data)
    begin = time.perf_counter()
    # dasktf: the seed's model, optimizer and batch; every worker holds a replica.
    trainer = dasktf.Trainer("mnist-mlp", client=client, optimizer="sgd",
                             learning_rate=args.lr, metrics=["accuracy"], seed=1)
    history = trainer.fit(data.x_train, data.y_train, epochs=args.epochs,
                          batch_size=args.batch_size, verbose=0,
                          callbacks=[SeedReport(args.frequency)])
    accuracy = trainer.evaluate(data.x_test, data.y_test)["accuracy"]
    print(f"Test-Accuracy: {accuracy:2.2f}")
    print(f"Total Time: {time.perf_counter() - begin:3.2f}s")
    print(f"Final Cost: {history.history['loss'][-1]:.4f}")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Seed 001's MNIST MLP on dasktf")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", default="digits")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--frequency", type=int, default=5)
    arguments = parser.parse_args()
    # dasktf: swap this line for Client("tcp://scheduler:8786") to use a real cluster.
    with dasktf.make_local_cluster(arguments.workers) as cluster, Client(cluster) as c:
        main(c, arguments)
