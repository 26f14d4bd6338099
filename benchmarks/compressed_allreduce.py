"""Codecs inside the p2p all-reduce (issue 39): bytes per step per worker against the
bound for each codec and group size, and the accuracy beside the bytes.

``bytes`` (the default part): one LocalCluster of 8 plain worker processes; for each
codec and N = 2, 3, 4, 8, a group of the first N workers sums the MNIST MLP's
gradient (784-100-10: 79,510 float32 values) ``--steps`` times through
:func:`~dasktf.runtime.p2p.gradients.allreduce_gradient`, as the p2p engine does,
once with the algorithm chosen now and once with the one chosen before (the choice
by the buffer's bytes alone: recursive doubling below ``dasktf.p2p.bandwidth-threshold``,
which re-encodes partial sums at each hop and hands the folded ranks the sum in
float32). Bytes are counts, not timings: what each member sent and received, per
step; the busiest member's busier direction is set against the target, the codec's
ratio times the dense all-reduce bound ``2 (N-1)/N x 4 P`` for ``fp16``, ``bf16``
and ``int8``, the sparse all-gather's ``(N-1) x 8 k`` for ``topk``.

``accuracy``: MNIST-60k, the built-in ``mnist-mlp``, 3 workers, global batch 256,
Adam 1e-3, seed 0, the p2p engine: H=1 for ``--epochs-h1`` epochs and H=64 with the
Nesterov outer step for ``--epochs-h64``, each codec beside no codec; the test
accuracy after each epoch and the bytes per step (a round) per worker.

``per-example`` (issue 39's 1,000x): for each ``--models`` model, H=1 without a codec
against each ``--rounds`` configuration (``H:CODEC``, the Nesterov outer step), the
same epochs (``--epochs``, ``--rows`` training rows), one run each, side by side: the
test-accuracy curve per epoch, the bytes sent per example trained (dasktf's
``bytes_per_example``) and how many times fewer than H=1, and whether a configuration
is within 0.3 points of H=1 at the last epoch with >= 1,000x fewer bytes. As run for
docs/local_steps.md: ``--part per-example`` (the MLP, 60,000 rows, 8 epochs) and
``--part per-example --models cnn --rows 16384 --epochs 3 --rounds
4:topk:0.0013,2:topk:0.00065``.

Usage: ``python benchmarks/compressed_allreduce.py [--part bytes,accuracy,per-example]
[--out benchmarks/results/compressed-allreduce.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from typing import Any

import numpy as np

from dasktf.cluster.membership import alive_workers

CODECS = ("none", "fp16", "bf16", "int8", "topk:0.01")
SIZES = (2, 3, 4, 8)
#: the MNIST MLP's parameters (784-100-10)
PARAMS = 79_510
ACCURACY_CODECS = ("none", "fp16", "int8", "topk:0.01")


def steps_task(gid: str, members: list[str], codec: str, algorithm: str | None,
               steps: int) -> dict[str, Any]:
    """``steps`` gradient sums through a group: this member's bytes each step."""
    from distributed import get_worker

    from dasktf.runtime.p2p.gradients import allreduce_gradient
    from dasktf.runtime.p2p.group import Group
    from dasktf.wire.messages import GradientSum

    rank = members.index(get_worker().address)
    sent, received, chosen = [], [], set()
    with Group(gid, members, codec=None if codec == "none" else codec, timeout=120,
               algorithm=algorithm or "auto") as group:
        for step in range(steps):
            x = np.random.default_rng([rank, step]).standard_normal(PARAMS)
            grad = GradientSum((x * 85).astype(np.float32), 85, 1.0)
            allreduce_gradient(group, grad, step, scale=1 / 256)
            sent.append(group.last.bytes_sent)
            received.append(group.last.bytes_received)
            chosen.add(group.last.algorithm)
    return {"sent": sent, "received": received, "algorithm": sorted(chosen)}


def _import_tensorflow() -> None:
    import tensorflow  # noqa: F401


def target(codec: str, n: int) -> float:
    from dasktf.wire.codecs import get_codec

    c = get_codec(None if codec == "none" else codec)
    dense = 2 * (n - 1) / n * 4 * PARAMS
    if c.sparse:
        return float((n - 1) * 8 * c.kept(PARAMS))
    return dense / c.ratio(PARAMS)


def bytes_part(steps: int) -> list[dict[str, Any]]:
    import dask
    from dask.utils import parse_bytes
    from distributed import Client, LocalCluster

    from dasktf.runtime.p2p.algorithms import choose
    from dasktf.runtime.p2p.plugin import register

    threshold = parse_bytes(dask.config.get("dasktf.p2p.bandwidth-threshold"))
    rows = []
    # (no memory limit: fp16 casts with TensorFlow, ~0.5 GB a worker on import)
    with LocalCluster(n_workers=max(SIZES), threads_per_worker=1, processes=True,
                      dashboard_address=":0", memory_limit=0) as cluster, Client(cluster) as client:
        client.wait_for_workers(max(SIZES), timeout=120)
        # fp16 casts with TensorFlow: import it everywhere first, not while a group
        # waits on a member importing it (tens of seconds on a loaded machine)
        client.run(_import_tensorflow)
        register(client)
        workers = alive_workers(client)
        for codec in CODECS:
            for n in SIZES:
                members = workers[:n]
                before = choose(4 * PARAMS, n, threshold)  # (by the bytes alone)
                row: dict[str, Any] = {"codec": codec, "n": n, "target": target(codec, n),
                                       "dense_bound": 2 * (n - 1) / n * 4 * PARAMS}
                for when, algorithm in (("before", before), ("now", None)):
                    gid = f"bench-{uuid.uuid4().hex}"
                    results = client.gather([
                        client.submit(steps_task, gid, members, codec, algorithm, steps,
                                      workers=[w], pure=False) for w in members])
                    mean = np.mean([np.mean(np.add(r["sent"], r["received"]))
                                    for r in results])
                    busiest = max(max(*r["sent"], *r["received"]) for r in results)
                    row[when] = {"algorithm": results[0]["algorithm"],
                                 "sent_plus_received": float(mean),
                                 "busiest_direction": int(busiest)}
                rows.append(row)
    none = {r["n"]: r["now"]["sent_plus_received"] for r in rows if r["codec"] == "none"}
    print(f"\nMNIST MLP gradient ({PARAMS:,} values), {steps} steps a case; MB per step "
          "per worker (sent + received, mean over members); busiest: the busiest "
          "member's busier direction over the target (the codec's ratio x the dense "
          "bound, or the sparse all-gather)\n")
    print("| codec | N | before: algorithm | MB | busiest/target | now: algorithm | MB "
          "| busiest/target | fewer than none |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, w = r["before"], r["now"]
        print(f"| {r['codec']} | {r['n']} | {','.join(b['algorithm'])} | "
              f"{b['sent_plus_received'] / 1e6:.3f} | "
              f"{b['busiest_direction'] / r['target']:.2f} | {','.join(w['algorithm'])} | "
              f"{w['sent_plus_received'] / 1e6:.3f} | "
              f"{w['busiest_direction'] / r['target']:.2f} | "
              f"{none[r['n']] / w['sent_plus_received']:.2f}x |", flush=True)
    return rows


def accuracy_part(epochs_h1: int, epochs_h64: int, codecs: list[str],
                  cases: list[str]) -> list[dict[str, Any]]:
    from distributed import Client

    import dasktf
    from dasktf.cli.bench import load_data

    data = load_data("mnist", 60_000, 10_000)
    runs = []
    if "h1" in cases:
        runs += [("H=1", codec, epochs_h1, {}) for codec in codecs]
    if "h64" in cases:
        runs += [("H=64 nesterov", codec, epochs_h64,
                  {"local_steps": 64, "outer_optimizer": "nesterov"}) for codec in codecs]
    rows = []
    with dasktf.make_local_cluster(3) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=120)
        for label, codec, epochs, options in runs:
            began = time.perf_counter()
            history = dasktf.fit(
                "mnist-mlp", data["x"], data["y"], client=client, n_workers=3,
                epochs=epochs, batch_size=256, optimizer="adam", learning_rate=1e-3,
                metrics=["accuracy"], validation_data=(data["x_val"], data["y_val"]),
                seed=0, verbose=0, engine="p2p",
                compression=None if codec == "none" else codec, **options)
            h = history.history
            row = {"case": label, "codec": codec, "epochs": epochs,
                   "val_accuracy": [float(a) for a in h["val_accuracy"]],
                   "bytes_per_step": float(np.mean(h["bytes_per_step"])),
                   "bytes_per_example": float(np.mean(h["bytes_per_example"])),
                   "seconds": time.perf_counter() - began,
                   "load": os.getloadavg()[0]}
            rows.append(row)
            print(f"  {label} {codec}: accuracy {row['val_accuracy'][-1]:.4f}, "
                  f"{row['bytes_per_step'] / 1e6:.3f} MB/step/worker, "
                  f"{row['seconds']:.0f} s (load {row['load']:.1f})", flush=True)
    print("\n| run | codec | epochs | test accuracy | vs no codec | MB per step "
          "per worker | fewer than no codec | bytes sent per example |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next((b for b in rows if b["case"] == r["case"] and b["codec"] == "none"),
                    r)
        print(f"| {r['case']} | {r['codec']} | {r['epochs']} | {r['val_accuracy'][-1]:.4f} | "
              f"{r['val_accuracy'][-1] - base['val_accuracy'][-1]:+.4f} | "
              f"{r['bytes_per_step'] / 1e6:.3f} | "
              f"{base['bytes_per_step'] / r['bytes_per_step']:.2f}x | "
              f"{r['bytes_per_example']:,.0f} |", flush=True)
    return rows


def parse_rounds(spec: str) -> list[tuple[int, str]]:
    """``"64:topk:0.01,128:int8"`` -> ``[(64, "topk:0.01"), (128, "int8")]``."""
    out = []
    for item in spec.split(","):
        h, _, codec = item.partition(":")
        out.append((int(h), codec or "none"))
    return out


def per_example_part(models: list[str], rows: int, epochs: int,
                     rounds: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """H=1 without a codec against rounds with a codec: bytes per example and the
    test accuracy per epoch, side by side (see the module)."""
    from distributed import Client

    import dasktf
    from dasktf.cli.bench import load_data

    data = load_data("mnist", rows, 10_000)
    runs = [(1, "none"), *rounds]
    out = []
    with dasktf.make_local_cluster(3) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=120)
        for model in models:
            for h, codec in runs:
                began = time.perf_counter()
                options = ({} if h == 1 else
                           {"local_steps": h, "outer_optimizer": "nesterov"})
                history = dasktf.fit(
                    model, data["x"], data["y"], client=client, n_workers=3,
                    epochs=epochs, batch_size=256, optimizer="adam", learning_rate=1e-3,
                    metrics=["accuracy"], validation_data=(data["x_val"], data["y_val"]),
                    seed=0, verbose=0, engine="p2p",
                    compression=None if codec == "none" else codec, **options)
                hist = history.history
                row = {"model": model, "rows": len(data["x"]), "local_steps": h,
                       "codec": codec, "epochs": epochs,
                       "val_accuracy": [float(a) for a in hist["val_accuracy"]],
                       "bytes_per_example": float(np.mean(hist["bytes_per_example"])),
                       "bytes_per_step": float(np.mean(hist["bytes_per_step"])),
                       "epoch_seconds": [float(t) for t in hist["epoch_seconds"]],
                       "seconds": time.perf_counter() - began, "load": os.getloadavg()[0]}
                out.append(row)
                print(f"  {model} H={h} {codec}: {row['val_accuracy']}, "
                      f"{row['bytes_per_example']:,.2f} B/example, {row['seconds']:.0f} s "
                      f"(load {row['load']:.1f})", flush=True)
    print_per_example(out)
    return out


def print_per_example(rows: list[dict[str, Any]]) -> None:
    """The side-by-side table: accuracy per epoch, bytes per example, the verdict."""
    for model in dict.fromkeys(r["model"] for r in rows):
        same = [r for r in rows if r["model"] == model]
        base = next(r for r in same if r["local_steps"] == 1 and r["codec"] == "none")
        epochs = len(base["val_accuracy"])
        print(f"\n{model}, {base['rows']:,} rows, test accuracy after each epoch\n")
        print("| run | bytes sent per example | fewer than H=1 | "
              + " | ".join(f"epoch {e + 1}" for e in range(epochs))
              + " | last vs H=1 | >= 1,000x within 0.3 points |")
        print("|---|---|---|" + "---|" * epochs + "---|---|")
        for r in same:
            fewer = base["bytes_per_example"] / r["bytes_per_example"]
            gap = r["val_accuracy"][-1] - base["val_accuracy"][-1]
            ok = fewer >= 1000 and gap >= -0.003
            name = ("H=1, no codec" if r is base
                    else f"H={r['local_steps']} nesterov, {r['codec']}")
            print(f"| {name} | {r['bytes_per_example']:,.2f} | {fewer:,.0f}x | "
                  + " | ".join(f"{a:.4f}" for a in r["val_accuracy"])
                  + f" | {gap:+.4f} | {'' if r is base else ('yes' if ok else 'no')} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="bytes,accuracy")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--epochs-h1", type=int, default=1)
    parser.add_argument("--epochs-h64", type=int, default=8)
    parser.add_argument("--codecs", default=",".join(ACCURACY_CODECS),
                        help="the accuracy part's codecs")
    parser.add_argument("--cases", default="h1,h64", help="the accuracy part's runs")
    parser.add_argument("--models", default="mnist-mlp", help="the per-example part's")
    parser.add_argument("--rows", type=int, default=60_000, help="the per-example part's")
    parser.add_argument("--epochs", type=int, default=8, help="the per-example part's")
    parser.add_argument("--rounds", default="64:topk:0.01,128:topk:0.01",
                        help="the per-example part's rounds: H:CODEC,...")
    parser.add_argument("--out", default=os.path.join(
        os.path.dirname(__file__), "results", "compressed-allreduce.json"))
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parts = args.part.split(",")
    load_before = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average before {load_before}", flush=True)
    out: dict[str, Any] = {"args": vars(args), "load_before": load_before}
    if "bytes" in parts:
        out["bytes"] = bytes_part(args.steps)
    if "accuracy" in parts:
        out["accuracy"] = accuracy_part(args.epochs_h1, args.epochs_h64,
                                        args.codecs.split(","), args.cases.split(","))
    if "per-example" in parts:
        out["per_example"] = per_example_part(args.models.split(","), args.rows,
                                              args.epochs, parse_rounds(args.rounds))
    out["load_after"] = os.getloadavg()
    print(f"load average after {out['load_after']}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":  # LocalCluster workers re-import the main module
    main()
