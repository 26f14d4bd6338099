"""What communication costs: bytes per step and examples/s per codec, parameter-server
count and reduction topology, side by side in one run (issue 8).

One 3-worker LocalCluster; two models: the built-in ``cnn`` (1.2M parameters) and a
wide MLP (784-2048-2048-10, 5.8M parameters). Every case trains 2 epochs of the same
MNIST subset (global batch 384) from the same initial weights; examples/s is taken
over the second epoch (the first one traces the functions), the best of
``--repeats`` rounds that run every case once, interleaved, so that a burst of load
on the shared machine hits one round, not one case. Bytes are counted at
the codec by dasktf (``history.history``): what each worker sends plus receives per
step, and the busiest worker's busier direction over the allreduce lower bound
``2 (N-1)/N x P x 4 bytes``. Ratios to the first row of each model (``none``, tree
reduction with the default fan-in 4, i.e. all-to-one over 3 workers) are the
figures to read: absolute rates on a shared 2-core machine are noise.

``--async`` runs the async cases instead: one parameter holder, then the parameters
split over ``num_ps`` 2 and 3 holders (:mod:`dasktf.async_ps`). Per update (one
worker's step): the MB the worker moves (its push and the weights it pulls), the
busiest holder's MB (the traffic a holder's link carries), and examples/s, each
against the single holder.

Usage: ``python benchmarks/communication.py [--samples 3072] [--mnist PATH] [--async]``.
"""

from __future__ import annotations

import argparse
import os
import time

CASES: list[tuple[str, dict]] = [
    ("none (tree, fan-in 4 = all-to-one)", {}),
    ("fp16", {"compression": "fp16"}),
    ("bf16", {"compression": "bf16"}),
    ("int8", {"compression": "int8"}),
    ("topk:0.01", {"compression": "topk:0.01"}),
    ("tree, fan-in 2", {"fan_in": 2}),
    ("naive", {"topology": "naive"}),
    ("ring", {"topology": "ring"}),
    ("ring + fp16", {"topology": "ring", "compression": "fp16"}),
    ("ps 1", {"num_ps": 1}),
    ("ps 2", {"num_ps": 2}),
    ("ps 3", {"num_ps": 3}),
    ("ps 3 + bf16 weights", {"num_ps": 3, "weights_dtype": "bf16"}),
]
ASYNC_CASES: list[tuple[str, dict]] = [
    ("async, 1 holder", {"mode": "async"}),
    ("async, num_ps 2", {"mode": "async", "num_ps": 2}),
    ("async, num_ps 3", {"mode": "async", "num_ps": 3}),
]
DEFAULT_MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


def wide_mlp():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="wide_mlp",
    )


def run_case(client, model, x, y, batch: int, options: dict) -> dict:
    import dask

    import dasktf

    options = dict(options)
    fan_in = options.pop("fan_in", None)
    cfg = {"dasktf.reduction-fan-in": fan_in} if fan_in else {}
    with dask.config.set(cfg):
        history = dasktf.fit(
            model, x, y, client=client, epochs=2, batch_size=batch, seed=0,
            optimizer="sgd", verbose=0, shuffle=False, **options,
        )
    h = history.history
    return {
        "examples_per_sec": h["examples_per_sec"][1],
        "bytes_per_step": h["bytes_per_step"][1],
        "ratio": h["bytes_bound_ratio"][1],
        "bound": h["bytes_lower_bound"][1],
        "loss": h["loss"][1],
        "holder_bytes": h.get("holder_bytes_per_update", [0.0, 0.0])[1],
    }


def print_async_table(label: str, batch: int, rows: list[tuple[str, dict]]) -> None:
    base = rows[0][1]
    print(f"\n### {label}, async, 3 workers, global batch {batch}\n")
    print("| case | MB/update/worker (push+pull) | busiest holder MB/update | vs 1 holder "
          "| examples/s | vs 1 holder |")
    print("|---|---|---|---|---|---|")
    for case, r in rows:
        print(f"| {case} | {r['bytes_per_step'] / 1e6:.3f} | {r['holder_bytes'] / 1e6:.3f} | "
              f"{base['holder_bytes'] / r['holder_bytes']:.2f}x less | "
              f"{r['examples_per_sec']:,.0f} | "
              f"{r['examples_per_sec'] / base['examples_per_sec']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=384)
    parser.add_argument("--mnist", default=DEFAULT_MNIST)
    parser.add_argument("--models", default="cnn,wide")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds (the README figures: 2; about 7 min a round on 2 cores)")
    parser.add_argument("--async", dest="async_", action="store_true",
                        help="the async cases: 1, 2 and 3 parameter holders")
    args = parser.parse_args()
    cases = ASYNC_CASES if args.async_ else CASES

    import dask
    from distributed import Client

    import dasktf
    from dasktf.datasets import load_mnist_npz

    d = load_mnist_npz(args.mnist) if os.path.exists(args.mnist) else None
    if d is None:
        raise SystemExit(f"{args.mnist} not found (this benchmark needs MNIST's 28x28 inputs)")
    x, y = d.x_train[: args.samples], d.y_train[: args.samples]
    if x.ndim == 3:
        x = x[..., None]
    started = time.perf_counter()
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with dasktf.make_local_cluster(3) as cluster, Client(cluster) as client:
            client.wait_for_workers(3, timeout=120)
            for name in args.models.split(","):
                label = "cnn (1.2M params)" if name == "cnn" else "wide MLP (5.8M params)"
                best: dict[str, dict] = {}
                for round_ in range(args.repeats):
                    for case, options in cases:
                        # a fresh model per case: a keras.Model is trained in place
                        model = "cnn" if name == "cnn" else wide_mlp()
                        r = run_case(client, model, x, y, args.batch, options)
                        if case not in best or (
                            r["examples_per_sec"] > best[case]["examples_per_sec"]
                        ):
                            best[case] = r
                        print(f"  {label} {case} (round {round_ + 1}): "
                              f"{r['examples_per_sec']:,.0f} examples/s", flush=True)
                rows = [(case, best[case]) for case, _ in cases]
                base = rows[0][1]
                if args.async_:
                    print_async_table(label, args.batch, rows)
                    continue
                print(f"\n### {label}, 3 workers, global batch {args.batch}; "
                      f"allreduce bound {base['bound'] / 1e6:.2f} MB/worker/step each way\n")
                print("| case | MB/step/worker (sent+received) | vs none | busiest / bound "
                      "| examples/s | vs none |")
                print("|---|---|---|---|---|---|")
                for case, r in rows:
                    print(f"| {case} | {r['bytes_per_step'] / 1e6:.3f} | "
                          f"{base['bytes_per_step'] / r['bytes_per_step']:.1f}x less | "
                          f"{r['ratio']:.2f} | {r['examples_per_sec']:,.0f} | "
                          f"{r['examples_per_sec'] / base['examples_per_sec']:.2f} |", flush=True)
    load = os.getloadavg()
    print(f"\nwall {time.perf_counter() - started:.0f}s; load average "
          f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min)")


if __name__ == "__main__":
    main()
