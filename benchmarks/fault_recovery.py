"""What a worker loss costs: time to detect, time to resume, steps lost, accuracy.

Runs the digits MLP on a loopback cluster of 3 worker processes, once without a
fault and once with worker 2 SIGKILLed halfway (sync, then async), then async with
the parameter holder's own worker (0) SIGKILLed halfway, then async with two
holders (``num_ps=2``, on workers 0 and 1) losing the slice holder's worker (1) and
the coordinator's (0), then sync with three parameter servers (``num_ps=3``, one per
worker: the kill always takes a server, and the run rewinds to its restore point),
and prints the figures side by side. About six minutes on a loaded 2-core machine.

    python benchmarks/fault_recovery.py
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from distributed import Client

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.diagnostics.events import unpack
from dasktf.testing import KillWorkerAt

EPOCHS, BATCH = 4, 64


def run(mode: str, kill: bool, victim: int = 2, num_ps: int = 1) -> dict[str, float]:
    data = dasktf.load_dataset("digits")
    with dasktf.make_local_cluster(3, tf_threads=1) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=120)
        workers = alive_workers(client)
        steps = -(-len(data.x_train) // BATCH) * (3 if mode == "async" else 1) * EPOCHS
        cbs = [KillWorkerAt(client, workers[victim], step=steps // 2)] if kill else []
        history = dasktf.fit(
            "mnist-mlp", data.x_train, data.y_train, client=client, n_workers=3, mode=mode,
            epochs=EPOCHS, batch_size=BATCH, optimizer="adam",
            learning_rate=0.01 if mode == "sync" else 0.005, metrics=["accuracy"], seed=3,
            validation_data=(data.x_test, data.y_test), callbacks=cbs, verbose=0,
            **({"num_ps": num_ps} if num_ps > 1 else {}),
        )
        out = {"val_accuracy": history.history["val_accuracy"][-1],
               "wall_s": history.wall_seconds}
        if kill:
            records = [r for e in client.get_events("dasktf-metrics") for r in unpack(e)
                       if r.get("run") == history.run_id]
            lost = next(r for r in records if r["kind"] == "worker_lost")
            (rec,) = history.recoveries
            out.update(detect_s=lost["detected_at"] - cbs[0].killed_at,
                       resume_s=rec["resume_s"], steps_lost=rec["steps_lost"],
                       redone=rec.get("holder", {}).get("redone", 0)
                       or rec.get("steps_recomputed", 0))
        return out


def main() -> None:
    print(f"load average before: {os.getloadavg()}")
    cases = [("sync", 2, 1, "1 of 3"), ("async", 2, 1, "1 of 3"),
             ("async", 0, 1, "the holder's worker"),
             ("async", 1, 2, "the slice holder's worker"),
             ("async", 0, 2, "the coordinator's worker"),
             ("sync", 2, 3, "a server's worker")]
    clean_runs: dict[tuple[str, int], dict[str, float]] = {}
    for mode, victim, num_ps, what in cases:
        if (mode, num_ps) not in clean_runs:
            clean_runs[mode, num_ps] = run(mode, False, num_ps=num_ps)
        clean, faulted = clean_runs[mode, num_ps], run(mode, True, victim, num_ps)
        mode = mode if num_ps == 1 else f"{mode} ps{num_ps}"
        print(f"{mode:5s} no fault: val_accuracy {clean['val_accuracy']:.4f}  "
              f"wall {clean['wall_s']:.1f}s")
        print(f"{mode:5s} SIGKILL {what} at half: val_accuracy {faulted['val_accuracy']:.4f}  "
              f"wall {faulted['wall_s']:.1f}s  detect {faulted['detect_s']:.3f}s  "
              f"resume {faulted['resume_s']:.3f}s  steps lost {faulted['steps_lost']}  "
              f"updates redone {faulted['redone']}  "
              f"(accuracy ratio {faulted['val_accuracy'] / clean['val_accuracy']:.3f})")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
