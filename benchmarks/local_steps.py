"""Rounds of local steps (``local_steps=H``) against sync steps and the peers, side by side.

For each model, on real MNIST, with 3 workers, the same global batch, Adam and
epochs, in one run:

* ``keras``: one process (the faster of ``Model.fit`` and a ``tf.function`` loop);
* ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy``, custom loop (as
  ``dasktf bench`` runs it);
* ``sync H=1``: dasktf's graph engine, one task graph per step;
* ``collective``: dasktf's collective engine;
* ``H=4/16/64 average`` and ``H=4/16/64 nesterov``: rounds of H local steps per
  worker, averaged (outer SGD, lr 1) or DiLoCo's outer Nesterov step (lr 0.7,
  momentum 0.9);
* ``async H=16``: async rounds of 16 steps pushed to the parameter holder.

Columns: examples/s over the epochs after the first (the first traces), wall bytes
per example (dasktf's ``bytes_per_example``: bytes all workers sent, per example
trained), training time until the validation accuracy first reached the target
(0.97 for ``mnist-mlp``, 0.98 for ``cnn``), and the validation accuracy of the last
epoch done within the same wall-clock budget (``--budget``, seconds of training).
Ratios against sync H=1 and MWMS are printed beside them; so are the load average
before and after (on a 2-core machine the 3 workers share the cores, and one
process is the physical limit).

Usage: ``python benchmarks/local_steps.py [--models mnist-mlp,cnn] [--epochs 8]
[--batch-size 256] [--budget 30] [--out local_steps]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from dasktf.cli.bench import keras_run, load_data, mwms_run
from dasktf.cluster.membership import alive_workers

TARGETS = {"mnist-mlp": 0.97, "cnn": 0.98}
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("sync H=1", {}),
    ("collective", {"engine": "collective"}),
    *[(f"H={h} average", {"local_steps": h}) for h in (4, 16, 64)],
    *[(f"H={h} nesterov", {"local_steps": h, "outer_optimizer": "nesterov"})
      for h in (4, 16, 64)],
    ("async H=16", {"mode": "async", "local_steps": 16}),
]


def at_budget(epoch_seconds: list[float], val_acc: list[float], budget: float) -> float | None:
    """Validation accuracy of the last epoch finished within ``budget`` seconds."""
    done, best = 0.0, None
    for seconds, acc in zip(epoch_seconds, val_acc, strict=True):
        done += seconds
        if done > budget:
            break
        best = acc
    return best


def row_of(epoch_seconds: list[float], val_acc: list[float], n: int, target: float,
           budget: float) -> dict[str, Any]:
    later = epoch_seconds[1:] or epoch_seconds
    reached = next((i for i, a in enumerate(val_acc) if a >= target), None)
    return {
        "examples_per_s": n * len(later) / sum(later),
        "time_to_target_s": None if reached is None else sum(epoch_seconds[: reached + 1]),
        "final_val_accuracy": val_acc[-1],
        "accuracy_at_budget": at_budget(epoch_seconds, val_acc, budget),
        "epoch_seconds": epoch_seconds, "val_accuracy": val_acc,
    }


def dasktf_variant(client: Any, model: str, data: dict[str, Any], batch: int, epochs: int,
                   lr: float, options: dict[str, Any]) -> dict[str, Any]:
    import dasktf

    history = dasktf.fit(model, data["x"], data["y"], client=client, n_workers=3,
                         epochs=epochs, batch_size=batch, optimizer="adam",
                         learning_rate=lr, metrics=["accuracy"],
                         validation_data=(data["x_val"], data["y_val"]), seed=0,
                         verbose=0, **options)
    h = history.history
    out = {"epoch_seconds": h["epoch_seconds"], "val_accuracy": h["val_accuracy"]}
    if "bytes_per_example" in h:
        out["bytes_per_example"] = sum(h["bytes_per_example"]) / len(h["bytes_per_example"])
    if "drift" in h:
        out["drift"] = h["drift"][-1]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mnist-mlp,cnn")
    parser.add_argument("--train-size", type=int, default=60000)
    parser.add_argument("--test-size", type=int, default=10000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--budget", type=float, default=30.0,
                        help="training seconds for the accuracy-at-budget column")
    parser.add_argument("--variants", default="",
                        help="comma-separated subset of the variants (default: all)")
    parser.add_argument("--out", default="local_steps")
    args = parser.parse_args()

    from distributed import Client

    import dasktf
    from dasktf.cluster.local import QUIET_TF_LOG_LEVEL

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_TF_LOG_LEVEL)
    data = load_data("mnist", args.train_size, args.test_size)
    n = len(data["x"])
    load_before = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load_before}; data "
          f"{data['name']} {data['x'].shape}, 3 workers, global batch {args.batch_size}, "
          f"{args.epochs} epochs, Adam {args.lr}", flush=True)
    chosen = [v for v in VARIANTS if not args.variants or v[0] in args.variants.split(",")]
    rows: list[dict[str, Any]] = []
    began = time.perf_counter()
    with dasktf.make_local_cluster(3) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=120)
        workers = alive_workers(client)
        for model in args.models.split(","):
            target = TARGETS.get(model, 0.9)

            def add(name: str, raw: dict[str, Any], model: str = model,
                    target: float = target) -> None:
                row = row_of(list(raw["epoch_seconds"]), list(raw["val_accuracy"]), n,
                             target, args.budget)
                row.update(model=model, runner=name,
                           bytes_per_example=raw.get("bytes_per_example"),
                           drift=raw.get("drift"))
                rows.append(row)
                print(f"  {model} {name}: {row['examples_per_s']:,.0f} ex/s, to "
                      f"{target}: {row['time_to_target_s']}, final "
                      f"{row['final_val_accuracy']:.4f}", flush=True)

            ref = keras_run(model, data, args.batch_size, args.epochs, args.lr, target)
            add("keras", {"epoch_seconds": ref["epoch_seconds"],
                          "val_accuracy": ref["val_accuracy"]})
            peer = mwms_run(client, workers, model, data, args.batch_size, args.epochs,
                            args.lr, target)
            add("mwms", {"epoch_seconds": peer["epoch_seconds"],
                         "val_accuracy": peer["val_accuracy"]})
            for name, options in chosen:
                add(name, dasktf_variant(client, model, data, args.batch_size,
                                         args.epochs, args.lr, options))
    load_after = os.getloadavg()
    print_table(rows)
    print(f"\nwall time {time.perf_counter() - began:.0f}s; load average before "
          f"{load_before}, after {load_after}")
    with open(f"{args.out}.json", "w") as f:
        json.dump({"args": vars(args), "cores": os.cpu_count(), "load_before": load_before,
                   "load_after": load_after, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}.json")


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'model':<10} {'runner':<14} {'examples/s':>10} {'vs H=1':>7} "
              f"{'vs mwms':>7} {'bytes/ex':>9} {'to target s':>11} {'acc@budget':>10} "
              f"{'final acc':>9}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        same = {x["runner"]: x for x in rows if x["model"] == r["model"]}
        sync, mwms = same.get("sync H=1"), same.get("mwms")
        vs_sync = r["examples_per_s"] / sync["examples_per_s"] if sync else float("nan")
        vs_mwms = r["examples_per_s"] / mwms["examples_per_s"] if mwms else float("nan")
        tt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        bpe = "-" if r["bytes_per_example"] is None else f"{r['bytes_per_example']:,.0f}"
        acc = "-" if r["accuracy_at_budget"] is None else f"{r['accuracy_at_budget']:.4f}"
        print(f"{r['model']:<10} {r['runner']:<14} {r['examples_per_s']:>10,.0f} "
              f"{vs_sync:>7.2f} {vs_mwms:>7.2f} {bpe:>9} {tt:>11} {acc:>10} "
              f"{r['final_val_accuracy']:>9.4f}")


if __name__ == "__main__":
    main()
