"""What it costs to get a model onto the workers (issue 27), before and after.

*Before*: the client sent a Keras config and broadcast ``get_weights()``; each
worker deserialized the config and ``set_weights`` (which never finalizes an
adapted ``Normalization`` and drops lookup vocabularies). *After*: the client
saves the model as Keras does, in memory (:class:`dasktf.transport.ModelPackage`),
broadcasts it once, and each worker runs Keras' loader. A third case ships a
model whose trained Adam state continues (about three times the bytes).

Per model (the ``cnn`` built-in on 28x28x1, 1.2M parameters; the wide MLP of
``benchmarks/communication.py``, 784-2048-2048-10, 5.8M), interleaved, ``--repeats``
rounds on one LocalCluster of ``--workers`` processes: the client's serialisation,
the broadcast, and one worker's build (measured inside a task, after a warm-up
build). The compile and optimizer build that follow are the same in every case
and left out. Medians (min) in ms.

Usage: ``python benchmarks/model_transport.py [--workers 2] [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from dasktf.cluster.membership import alive_workers

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def wide_mlp():
    import keras

    return keras.Sequential([
        keras.Input((28, 28, 1)), keras.layers.Flatten(),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(10)], name="wide_mlp")


def old_build(config, weights) -> float:
    """The pre-issue-27 worker side: a model from its config, then set_weights."""
    import copy

    import keras

    start = time.perf_counter()
    model = keras.saving.deserialize_keras_object(copy.deepcopy(config))
    model.set_weights(weights)
    return time.perf_counter() - start


def new_build(ref) -> float:
    start = time.perf_counter()
    ref.build()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import keras
    from distributed import Client

    import dasktf
    from dasktf.models import cnn
    from dasktf.transport import ModelPackage, share_model

    keras.utils.set_random_seed(0)
    models = {"cnn (1.2M params)": cnn((28, 28, 1), 10), "wide MLP (5.8M params)": wide_mlp()}
    for model in models.values():
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with dasktf.make_local_cluster(args.workers, tf_threads=1) as cluster, \
            Client(cluster) as client:
        worker = alive_workers(client)[0]
        rows = []
        for name, model in models.items():
            trained = keras.models.clone_model(model)
            trained.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
            trained.optimizer.build(trained.trainable_variables)
            times: dict[str, dict[str, list[float]]] = {
                case: {"client": [], "broadcast": [], "worker": []}
                for case in ("before", "after", "after, Adam continued")}
            sizes: dict[str, int] = {}
            for rep in range(args.repeats + 1):  # the first round warms up
                for case, times_of in times.items():
                    start = time.perf_counter()
                    if case == "before":
                        config = keras.saving.serialize_keras_object(model)
                        config.pop("compile_config", None)
                        weights = [np.asarray(w) for w in model.get_weights()]
                        client_s = time.perf_counter() - start
                        start = time.perf_counter()
                        shipped = client.scatter(weights, broadcast=True, hash=False)
                        broadcast_s = time.perf_counter() - start
                        built = client.submit(old_build, config, shipped, workers=[worker],
                                              pure=False)
                        sizes[case] = sum(w.nbytes for w in weights)
                    else:
                        source = trained if "Adam" in case else model
                        optimizer = (keras.optimizers.serialize(source.optimizer)
                                     if "Adam" in case else None)
                        package = ModelPackage.pack(source, optimizer=optimizer)
                        client_s = time.perf_counter() - start
                        start = time.perf_counter()
                        shipped = share_model(client, package)
                        broadcast_s = time.perf_counter() - start
                        built = client.submit(new_build, shipped.ref, workers=[worker],
                                              pure=False)
                        sizes[case] = package.nbytes
                    worker_s = built.result()
                    if rep:
                        times_of["client"].append(client_s)
                        times_of["broadcast"].append(broadcast_s)
                        times_of["worker"].append(worker_s)
                    if case == "before":
                        del shipped
                    else:
                        shipped.release()
            for case, times_of in times.items():
                cells = [f"{1000 * np.median(v):7.0f} ({1000 * min(v):.0f})"
                         for v in times_of.values()]
                total = 1000 * sum(np.median(v) for v in times_of.values())
                rows.append(f"| {name} | {case} | {sizes[case] / 2**20:.1f} | "
                            + " | ".join(cells) + f" | {total:.0f} |")
    print(f"{args.workers} workers, {args.repeats} interleaved rounds, ms median (min); "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| model | transport | MiB sent per worker | client | broadcast | worker build "
          "| sum of medians |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
