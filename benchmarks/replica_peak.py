"""What sets a worker's peak resident memory when it builds and steps a replica,
phase by phase, unsharded and with ``shard_state="optimizer"``.

Each mode runs in a fresh process (so a peak is that mode's own), which does what a
p2p worker does for its replica, in order, with a thread sampling the process's
resident set (``psutil``, every 2 ms; ``tracemalloc`` does not see TensorFlow's
allocations):

``import``: TensorFlow, Keras and dasktf imported;
``receive``: the model package unpickled from the bytes a worker is sent (the
bytes freed after, as Dask frees a message's frames);
``read``: the ``.keras`` archive read into a model (:func:`dasktf.transport._read`);
``compile``: the recipe compiled; ``optimizer``: (unsharded) the optimizer built
over the trainable variables (all its slots; a sharded replica builds only its
slice's);
``replica``: the rest of the replica (its metrics, its compiled functions' setup);
``gradient``: the first step's gradient (traced, then run);
``slice``: (sharded) the slice's optimizer made (:class:`ShardOptimizer`), taking
over the model's; ``apply``: the first apply (the whole gradient unsharded; the
slice's summed part sharded), traced and run; ``take``: (sharded) the gathered
weights written into the model; ``step2``: a second gradient and apply.

Printed per phase: the resident set at its end and its peak within it (MiB), and
the bytes TensorFlow's live variables hold at the end (the model's weights and
the optimizer's variables). The N of ``--workers`` gives the slice (rank 0 of N);
no other worker runs: the exchange is the identity.

Usage: ``python benchmarks/replica_peak.py [--units 2048,2048,2048,2048]
[--inputs 2048] [--workers 2] [--modes none,optimizer]``; with ``--fit
[--steps 3] [--redundancy R]``, each mode in a real ``dasktf.fit`` on a fresh
cluster of ``--workers`` (``--modes`` may name ``gradients`` too): every worker's
peak resident set (sampled every 2 ms in a thread on the worker) and its last.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np


class Sampler:
    """A thread reading this process's resident set; :meth:`phase` closes one."""

    def __init__(self, every: float = 0.002) -> None:
        import psutil

        self._proc = psutil.Process()
        self._every = every
        self._peak = 0
        self._stop = threading.Event()
        self.phases: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(self._every)

    def phase(self, name: str, live: int) -> None:
        rss = self._proc.memory_info().rss
        peak = max(self._peak, rss)
        self.phases.append({"phase": name, "rss": rss, "peak": peak, "live": live})
        self._peak = rss

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _live(model: Any, extra: list[Any] = ()) -> int:
    """Bytes of the model's variables and of its optimizer's (TensorFlow's)."""
    seen: dict[int, Any] = {}
    variables = list(model.weights) + list(getattr(getattr(model, "optimizer", None), "variables", []) or [])
    for v in variables + list(extra):
        seen[id(v)] = v
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in seen.values()))


def big_model(inputs: int, units: list[int]) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((inputs,))] + [
        keras.layers.Dense(u, activation="relu") for u in units
    ] + [keras.layers.Dense(10, activation="softmax")])


def child(path: str, mode: str, n: int) -> None:
    """One mode, in this fresh process (see the module)."""
    sampler = Sampler()
    import keras
    import tensorflow as tf  # noqa: F401

    from dasktf.runtime import replica as rep
    from dasktf.wire.messages import GradientSum

    sampler.phase("import", 0)
    with open(path, "rb") as f:
        data = f.read()
    package, x, y, recipe = pickle.loads(data)
    del data
    sampler.phase("receive", 0)

    from dasktf import models, transport

    marks: dict[str, Any] = {}

    def wrap(owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            model = marks.get("model", out if name == "read" else None)
            marks["model"] = model
            sampler.phase(name, 0 if model is None else _live(model))
            return out

        setattr(owner, attr, wrapped)

    wrap(transport, "_read", "read")
    wrap(models.CompileRecipe, "compile", "compile")
    opt_cls = type(keras.optimizers.deserialize(recipe.optimizer))
    build = opt_cls.build

    def opt_build(self: Any, variables: Any) -> Any:
        out = build(self, variables)
        if not marks.get("built") and "model" in marks:
            marks["built"] = True
            sampler.phase("optimizer", _live(marks["model"]))
        return out

    opt_cls.build = opt_build
    # sharded, the whole optimizer is not built (no ``optimizer`` phase)
    cfg = rep.ReplicaConfig(package.ref(), recipe, 0, publish_metrics=False,
                            sliced=mode != "none")
    r = rep.Replica(cfg, 0, rep.Shard(x, y), np.array([len(x)]))
    opt_cls.build = build
    sampler.phase("replica", _live(r.model))
    grad = r.gradient(0, 0)
    sampler.phase("gradient", _live(r.model))
    if mode == "none":
        r.apply(GradientSum(grad.total, grad.count, grad.loss_sum))
        sampler.phase("apply", _live(r.model))
    else:
        from dasktf.runtime.p2p.sharding import ShardOptimizer

        shard = ShardOptimizer(r, 0, n)
        sampler.phase("slice", _live(r.model, shard.pieces))
        lo, hi = shard.edges[0], shard.edges[1]
        new = shard.apply(np.asarray(grad.total)[lo:hi], float(grad.count), lambda v: v)
        sampler.phase("apply", _live(r.model, shard.pieces))
        flat = r.flat_weights()
        flat[lo:hi] = new
        shard.take(flat)
        del flat
        sampler.phase("take", _live(r.model, shard.pieces))
    grad = r.gradient(0, 0)
    if mode == "none":
        r.apply(GradientSum(grad.total, grad.count, grad.loss_sum))
    else:
        new = shard.apply(np.asarray(grad.total)[lo:hi], float(grad.count), lambda v: v)
    sampler.phase("step2", _live(r.model, [] if mode == "none" else shard.pieces))
    sampler.stop()
    print(json.dumps(sampler.phases))


def _start_sampler(dask_worker: Any = None) -> int:
    """A :class:`Sampler` on this worker (kept on the worker object)."""
    dask_worker.dasktf_peak_sampler = Sampler()
    return dask_worker.dasktf_peak_sampler._proc.memory_info().rss


def _read_sampler(dask_worker: Any = None) -> dict[str, int]:
    sampler = dask_worker.dasktf_peak_sampler
    sampler.phase("fit", 0)
    return {"start": sampler.phases[0]["rss"] if len(sampler.phases) == 1 else 0,
            "peak": max(p["peak"] for p in sampler.phases),
            "end": sampler.phases[-1]["rss"]}


def fit_part(args: argparse.Namespace) -> None:
    """Each mode in a real ``dasktf.fit`` (a fresh cluster each): every worker's
    resident set before the run, its peak during it and at its end."""
    import keras
    from distributed import Client

    import dasktf

    rng = np.random.default_rng(0)
    n, batch = args.workers, args.batch * args.workers
    x = rng.standard_normal((args.steps * batch, args.inputs)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int64)
    mib = 2**20
    print(f"dasktf.fit, {n} workers, {args.steps} steps, global batch {batch}, Adam; "
          f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")
    for mode in args.modes.split(","):
        with dasktf.make_local_cluster(n, tf_threads=1) as cluster, Client(cluster) as client:
            client.wait_for_workers(n, timeout=300)
            client.run(_start_sampler)
            keras.utils.set_random_seed(0)
            dasktf.fit(big_model(args.inputs, args.units), x, y, client=client, n_workers=n,
                       epochs=1, batch_size=batch, optimizer="adam", learning_rate=1e-3,
                       loss="sparse_categorical_crossentropy", shuffle=False, seed=0,
                       verbose=0, engine="p2p",
                       shard_state=None if mode == "none" else mode,
                       **({} if mode == "none" or args.redundancy is None
                          else {"redundancy": args.redundancy}))
            got = client.run(_read_sampler)
        peaks = sorted(g["peak"] / mib for g in got.values())
        ends = sorted(g["end"] / mib for g in got.values())
        print(f"  {mode:9s} workers' peak RSS {', '.join(f'{p:.0f}' for p in peaks)} MiB;"
              f" at the end {', '.join(f'{e:.0f}' for e in ends)} MiB")
    print(f"load average after {' '.join(open('/proc/loadavg').read().split()[:3])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=2048)
    parser.add_argument("--units", type=lambda s: [int(v) for v in s.split(",")],
                        default=[2048, 2048, 2048, 2048])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--modes", default="none,optimizer")
    parser.add_argument("--fit", action="store_true",
                        help="each mode in a real dasktf.fit instead (see fit_part)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--redundancy", type=int, default=None,
                        help="with --fit, sharded: copies of each slice beyond one "
                        "(default: dasktf's)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit:
        fit_part(args)
        return
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return

    import tempfile

    import keras

    from dasktf.models import CompileRecipe
    from dasktf.transport import ModelPackage

    model = big_model(args.inputs, args.units)
    params = model.count_params()
    package = ModelPackage.pack(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.inputs)).astype(np.float32)
    y = rng.integers(0, 10, args.batch).astype(np.int64)
    recipe = CompileRecipe(keras.optimizers.serialize(keras.optimizers.Adam(1e-3)),
                           "sparse_categorical_crossentropy")
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        pickle.dump((package, x, y, recipe), f, protocol=5)
        path = f.name
    del model
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"model: {params:,} parameters ({4 * params / 2**20:.1f} MiB of float32), "
          f"archive {package.nbytes / 2**20:.1f} MiB; Adam; slice rank 0 of "
          f"{args.workers}; load average {load}")
    results = {}
    try:
        for mode in args.modes.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", path, mode,
                                  str(args.workers)], capture_output=True, text=True,
                                 check=False, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
            if out.returncode:
                print(out.stderr[-3000:])
                raise SystemExit(f"{mode}: exit {out.returncode}")
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(path)
    mib = 2**20
    for mode, phases in results.items():
        print(f"  {mode}:")
        before = phases[0]["rss"]
        for p in phases:
            print(f"    {p['phase']:9s} rss {p['rss'] / mib:8.1f} MiB  peak "
                  f"{p['peak'] / mib:8.1f} (+{(p['peak'] - before) / mib:7.1f} over the "
                  f"phase's start)  live TF variables {p['live'] / mib:7.1f} MiB")
            before = p["rss"]
        top = max(p["peak"] for p in phases)
        print(f"    process peak {top / mib:.1f} MiB; reached in "
              f"{next(p['phase'] for p in phases if p['peak'] == top)}")
    print(f"load average after {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
