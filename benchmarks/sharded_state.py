"""Sharded training state (``shard_state="optimizer"``, ZeRO-1; ``"gradients"``,
ZeRO-2) against unsharded p2p, side by side.

Two parts (``--part``; both by default):

``time``: on real MNIST, 3 workers, global batch 256, Adam, one cluster: the
``mnist-mlp`` and the ``cnn``, each unsharded, ``"optimizer"`` and ``"gradients"``
alternating (``--repeats`` rounds, unsharded first), each run ``--epochs`` epochs; a
step's time is an epoch's wall time over its steps, the epochs after the first
(which traces) only. Printed: median step times and their ratio to unsharded, and
the bytes a worker sent per step (``history["bytes_per_step"]``) against unsharded.

``memory``: a model of about 50M parameters (``big``: dense 2048-4096-4096-4096-2048-10,
50,397,194 parameters) with Adam, at N = 2, 4 and 8 workers (one cluster each), a
run of ``--big-steps`` steps for each of unsharded, ``"optimizer"`` and
``"gradients"``, each on a cluster of its own (unsharded only up to
``--unsharded-max`` workers: 8 whole copies of the state do not fit a 24 GiB
machine; a worker's unsharded slots and gradients do not depend on N). Read on
every worker at the epoch's end (what it holds, not a
formula): the bytes of the replica's optimizer variables (TensorFlow's), the most
of its own gradient it held at once (the backward pass's output: whole, or with
``"gradients"`` on this chain model the largest stage of its staged backward pass,
``dasktf.runtime.staged``; unsharded, the model's trainable values x 4), the
summed gradient it keeps (unsharded: the all-reduce's whole output; sharded: its
slice's sum) and the most bytes of peers' gradient parts that ever waited in its
mailbox (the group's metering, per phase). Printed per N: the largest worker's
figures and their ratio to unsharded, against the target (1 + r)/N + 5%
(``--redundancy`` r, 0 by default; with 1 a worker's slots and sums include its
copy of a neighbour's slice and the sum relayed for it).

The load average is printed before and after each part (a shared 2-core machine:
the workers share the cores).

``--architecture residual`` makes the memory part's model functional, the same
layers with two residual blocks (a staged backward pass cuts around each block).

``--bucket`` and ``--stage`` set ``dasktf.p2p.shard-bucket`` and
``dasktf.p2p.shard-stage`` (``false``: the one-call backward pass); ``--modes`` picks
the memory part's modes (``none`` for unsharded).

Usage: ``python benchmarks/sharded_state.py [--part time|memory|all] [--rows 30720]
[--cnn-rows 2560] [--epochs 3] [--repeats 2] [--workers 2,4,8] [--big-steps 2]
[--unsharded-max 4] [--bucket 4MiB] [--stage 16MiB] [--modes none,optimizer,gradients]
[--redundancy 0] [--architecture sequential|residual]
[--data /work/shared/data/mnist.npz]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import numpy as np

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


def _slot_bytes(dask_worker: Any = None) -> list[int]:
    from dasktf.runtime.replica import registered_replicas

    return [int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                    for v in r.model.optimizer.variables))
            for r in registered_replicas(dask_worker).values()]


#: the unsharded all-reduces' message phases (dasktf.runtime.p2p.algorithms): the
#: most bytes of any one of them that waited (they follow one another)
ALLREDUCE_PHASES = ("ds", "dg", "rs", "ag", "rd", "fold", "unfold", "sg")


def _held(dask_worker: Any = None) -> list[dict[str, int]]:
    """Per replica on this worker: the bytes of its optimizer variables, its own
    gradient, the summed gradient it keeps and the most of peers' gradient parts
    that waited (see the module)."""
    from dasktf.runtime.manager import run_manager
    from dasktf.runtime.replica import registered_replicas

    manager = run_manager(dask_worker)
    out = []
    for (run_id, _), r in registered_replicas(dask_worker).items():
        own = 4 * int(sum(r.sizes))
        slots = int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                        for v in r.model.optimizer.variables))
        shard = r.shard_optimizer
        if shard is not None:
            summed = 4 * (shard.edges[shard.rank + 1] - shard.edges[shard.rank])
            waited = int(shard.held)
            own = int(shard.own)  # its largest stage where the backward pass is staged
            backup = getattr(shard, "backup", None)  # redundancy 1: a neighbour's slice
            if backup is not None:
                slots += int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                                 for v in backup.optimizer.variables))
                # the relayed sum of that slice, held until both are applied
                summed += 4 * (backup.edges[backup.rank + 1] - backup.edges[backup.rank])
        else:
            link = manager.links.get(run_id)
            group = None if link is None else link.group
            summed = own  # the all-reduce's output, whole
            waited = 0 if group is None else max(
                group.mailbox.peak.get(p, 0) for p in ALLREDUCE_PHASES)
        out.append({"slots": slots, "own": own, "summed": summed, "waited": waited,
                    # the worker process's peak resident memory (a fresh cluster
                    # per run): everything, TensorFlow's and Python's
                    "peak_rss": 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    return out


def run(client: Any, model: Any, x: np.ndarray, y: np.ndarray, epochs: int, batch: int,
        n: int, shard_state: str | None, redundancy: int = 0) -> dict[str, Any]:
    """One run: seconds per step of each epoch after the first, bytes per step, and
    what each worker held at the last epoch's end."""
    import keras

    import dasktf

    steps = -(-len(x) // batch)
    seen: dict[str, Any] = {"epochs": []}

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            seen["begin"] = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            seen["epochs"].append(time.perf_counter() - seen["begin"])
            seen["held"] = [h for v in client.run(_held).values() for h in v]

    history = dasktf.fit(model, x, y, client=client, n_workers=n, epochs=epochs,
                         batch_size=batch, optimizer="adam", learning_rate=1e-3,
                         loss="sparse_categorical_crossentropy", shuffle=False, seed=0,
                         verbose=0, engine="p2p", shard_state=shard_state,
                         # one copy of each slice unless --redundancy 1 (the
                         # slots' and sums' target is then (1 + r)/N + 5%)
                         **({"redundancy": redundancy} if shard_state else {}),
                         callbacks=[Clock()])
    return {"step": [s / steps for s in seen["epochs"][1:]], "held": seen["held"],
            "bytes": float(np.mean(history.history["bytes_per_step"]))}


MODES: tuple[str | None, ...] = (None, "optimizer", "gradients")


def _load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def time_part(args: argparse.Namespace) -> None:
    from distributed import Client

    import dasktf

    with np.load(args.data) as f:
        x = (f["x_train"][:args.rows] / 255.0).astype(np.float32)
        y = f["y_train"][:args.rows].astype(np.int64)
    data = {"mnist-mlp": (x.reshape(-1, 784), y),
            "cnn": (x[:args.cnn_rows], y[:args.cnn_rows])}
    before = _load()
    times = {(m, s): [] for m in data for s in MODES}
    sent: dict[tuple[str, str | None], float] = {}
    with dasktf.make_local_cluster(3, tf_threads=1) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=120)
        for _ in range(args.repeats):
            for model, (xs, ys) in data.items():
                for mode in MODES:
                    got = run(client, model, xs, ys, args.epochs, 256, 3, mode)
                    times[model, mode] += got["step"]
                    sent[model, mode] = got["bytes"]
    print(f"step time, 3 workers, batch 256, Adam, {args.epochs} epochs x "
          f"{args.repeats} rounds (medians of the epochs after the first); load "
          f"average before {before}, after {_load()}")
    for model, (xs, _) in data.items():
        plain = statistics.median(times[model, None])
        for mode in MODES:
            t = statistics.median(times[model, mode])
            print(f"  {model:9s} ({len(xs)} rows) {mode!s:9s} {t * 1e3:8.2f} ms/step "
                  f"({t / plain:.2f}x)  bytes/step {sent[model, mode] / 1e6:8.3f} MB "
                  f"({sent[model, mode] / sent[model, None]:.3f}x)")


def big_model(architecture: str = "sequential") -> Any:
    """About 50M parameters of dense layers (50,397,194): a ``Sequential``, or
    (``"residual"``) the same layers as a functional model whose two middle layers
    each add their input back (residual blocks: no parameter more)."""
    import keras

    keras.utils.set_random_seed(0)
    if architecture == "sequential":
        return keras.Sequential([keras.Input((2048,))] + [
            keras.layers.Dense(u, activation="relu") for u in (4096, 4096, 4096, 2048)
        ] + [keras.layers.Dense(10, activation="softmax")])
    inputs = keras.Input((2048,))
    h = keras.layers.Dense(4096, activation="relu")(inputs)
    for _ in range(2):
        h = keras.layers.Add()([h, keras.layers.Dense(4096, activation="relu")(h)])
    h = keras.layers.Dense(2048, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(h))


def memory_part(args: argparse.Namespace) -> None:
    from distributed import Client

    import dasktf

    rng = np.random.default_rng(0)
    r = args.redundancy
    print(f"per-worker bytes, ~50M-parameter {args.architecture} model, Adam, {args.big_steps} steps a run, "
          f"a fresh cluster a run, redundancy {r} (the largest worker's; ratio to "
          f"unsharded; target {1 + r}/N + 5%)")
    base: dict[str, int] | None = None
    for n in args.workers:
        batch = 8 * n
        x = rng.standard_normal((args.big_steps * batch, 2048)).astype(np.float32)
        y = rng.integers(0, 10, len(x)).astype(np.int64)
        before = _load()
        held = {}
        # unsharded past --unsharded-max workers: not run (each worker would hold the
        # whole state: 8 of them do not fit this machine); its slots and gradients a
        # worker do not depend on N, so the last N's stand
        modes = [m for m in args.modes if m is not None or n <= args.unsharded_max]
        for mode in modes:
            with dasktf.make_local_cluster(n, tf_threads=1) as cluster, \
                    Client(cluster) as client:
                client.wait_for_workers(n, timeout=300)
                got = run(client, big_model(args.architecture), x, y, 1, batch, n, mode,
                          args.redundancy)["held"]
                held[mode] = {k: max(h[k] for h in got) for k in got[0]}
        if None in held:
            base = held[None]
        assert base is not None
        print(f"  N={n} (load average before {before}, after {_load()}); target "
              f"{(1 + r) / n + 0.05:.3f}" + ("" if None in held else
                                       "; unsharded: the last N's figures"))
        base_grad = base["own"] + base["summed"] + base["waited"]
        for mode in held:
            top = held[mode]
            grad = top["own"] + top["summed"] + top["waited"]
            print(f"    {mode!s:9s} slots {top['slots'] / 1e6:8.2f} MB "
                  f"({top['slots'] / base['slots']:.3f}x)  own gradient "
                  f"{top['own'] / 1e6:7.2f} MB  summed {top['summed'] / 1e6:7.2f} MB  "
                  f"peers' parts waiting {top['waited'] / 1e6:7.2f} MB  gradients in all "
                  f"{grad / 1e6:7.2f} MB ({grad / base_grad:.3f}x; without the own "
                  f"{(grad - top['own']) / max(1, base_grad - base['own']):.3f}x)  "
                  f"slots + gradients {(top['slots'] + grad) / (base['slots'] + base_grad):.3f}x"
                  f"  peak RSS {top['peak_rss'] / 2**30:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["time", "memory", "all"], default="all")
    parser.add_argument("--rows", type=int, default=30720)
    parser.add_argument("--cnn-rows", type=int, default=2560)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=lambda s: [int(v) for v in s.split(",")],
                        default=[2, 4, 8])
    parser.add_argument("--big-steps", type=int, default=2)
    parser.add_argument("--unsharded-max", type=int, default=4)
    parser.add_argument("--bucket", default=None, help="dasktf.p2p.shard-bucket")
    parser.add_argument("--stage", default=None,
                        help="dasktf.p2p.shard-stage (false: never staged)")
    parser.add_argument("--modes", default=MODES, type=lambda s: [
        None if m == "none" else m for m in s.split(",")])
    parser.add_argument("--architecture", choices=["sequential", "residual"],
                        default="sequential",
                        help="the memory part's model: a Sequential, or residual blocks")
    parser.add_argument("--redundancy", type=int, default=0, choices=[0, 1],
                        help="the memory part's sharded runs (a backup slice a worker)")
    parser.add_argument("--data", default=DATA)
    args = parser.parse_args()
    import dask

    settings = {}
    if args.bucket is not None:
        settings["dasktf.p2p.shard-bucket"] = args.bucket
    if args.stage is not None:
        settings["dasktf.p2p.shard-stage"] = False if args.stage == "false" else args.stage
    print(f"settings: {settings or 'the defaults'}")
    with dask.config.set(settings):
        if args.part in ("time", "all"):
            time_part(args)
        if args.part in ("memory", "all"):
            memory_part(args)


if __name__ == "__main__":
    main()
