"""What publishing the metrics stream costs, measured with the step's own code
(benchmarks/sync_overhead.py and the metrics test read it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dasktf.diagnostics.events import TOPIC
from dasktf.diagnostics.metrics import MetricsStore

if TYPE_CHECKING:
    from distributed import Client


# -- what publishing costs (the sync benchmark and a test use these) ----------------
def worker_record_seconds(n: int = 20_000) -> float:
    """Seconds per step record on the calling worker, running ``step_task``'s own
    metrics code (time split, record, batching into ``Worker.log_event``)."""
    from types import SimpleNamespace

    import numpy as np

    from dasktf.diagnostics.events import MetricsBuffer
    from dasktf.runtime.replica import Replica, StepTimer
    from dasktf.wire.messages import GradientSum

    grad = np.zeros(79_510, dtype=np.float32)  # the MNIST MLP's gradient
    # A topic of its own: the same log_event cost, but no "run" in the store.
    events = MetricsBuffer(enabled=True, topic=f"{TOPIC}-cost-probe")
    replica = SimpleNamespace(events=events, schedule=np.zeros(100),
                              run_id="cost-probe", index=0, timing=StepTimer(True),
                              rounds=None)
    out, previous = GradientSum(grad, 64, 1.0, 0.01), GradientSum(grad, 128, 2.0, 0.0)
    start = time.perf_counter()
    for i in range(n):
        timing = replica.timing.begin(0, time.perf_counter())
        replica.timing.end(time.perf_counter())
        Replica.record_step(replica, 0, i % 100, previous, out, timing)  # type: ignore[arg-type]
    replica.events.flush()
    return (time.perf_counter() - start) / n


def store_record_seconds(n: int = 20_000) -> float:
    """Seconds a MetricsStore spends folding in one step record."""
    store = MetricsStore()
    records = [
        {"run": "cost-probe", "kind": "step", "mode": "sync", "epoch": 0, "step": i,
         "update": i, "worker": i % 2, "batch_size": 64, "loss": 1.0, "loss_step": i - 1,
         "staleness": 0, "compute_s": 0.01, "communication_s": 0.001,
         "waiting_s": 0.002, "bytes": 636_080, "wall_time": 0.0}
        for i in range(n)
    ]
    start = time.perf_counter()
    for i in range(0, n, 100):
        store.add_records(records[i : i + 100])
    return (time.perf_counter() - start) / n


def publishing_cost(client: Client, n_workers: int, n: int = 20_000) -> float:
    """Seconds of CPU per sync step that publishing adds, counted conservatively:
    one worker's record (measured on a worker, its batches really sent to the
    scheduler) plus the store ingesting all ``n_workers`` records of the step (on
    one machine the scheduler's CPU is the workers' CPU)."""
    per_worker = client.submit(worker_record_seconds, n, pure=False).result()
    return float(per_worker) + n_workers * store_record_seconds(n)
