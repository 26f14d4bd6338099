"""What one step record costs the scheduler to take in, in one process (issue 39).

At 32 workers on long epochs the step records are what keeps the scheduler's CPU
over 0.01 ms per step per worker (docs/SCALING.md: 0.002 net with
``dasktf.metrics`` off, 0.019 on, about 17 us a record on a loaded 2-core
machine). This isolates the two parts that are dasktf's to change, without a
cluster, so that a change of the record format reads as a ratio in seconds:

* **decode**: the worker's ``log-event`` message (``--records`` step records of
  one worker, as :class:`dasktf.diagnostics.events.MetricsBuffer` sends them)
  deserialised as the scheduler's comm does (``distributed.protocol.loads``);
* **store**: :class:`dasktf.diagnostics.metrics.MetricsStore` taking the decoded
  message (``log_event``), for ``--workers`` workers' messages in turn.

Both for the message as sent now (``tables``: :func:`dasktf.diagnostics.events.pack`,
one replica's records as columns) and as sent before (``rows``: a dict a record),
side by side, alternating.

Usage::

    python benchmarks/record_ingest.py --workers 32 --records 128 --repeats 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any


def step_record(run: str, update: int, worker: int) -> dict[str, Any]:
    """A sync step record with the fields a p2p replica fills in
    (:class:`dasktf.diagnostics.events.StepRecord`)."""
    return {"run": run, "kind": "step", "mode": "sync", "epoch": 0, "step": update,
            "update": update, "worker": worker, "batch_size": 32,
            "local_loss": 2.3 + random.random(), "staleness": 0,
            "compute_s": 0.01 * random.random(), "communication_s": 0.001,
            "waiting_s": 0.02 * random.random(), "bytes": 12345,
            "wall_time": time.time()}


def measure(workers: int, records: int, repeats: int, form: str) -> dict[str, float]:
    from distributed.protocol import dumps, loads

    import dasktf  # noqa: F401 - its configuration defaults
    from dasktf.diagnostics.events import TOPIC, pack
    from dasktf.diagnostics.metrics import MetricsStore

    def message(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return pack(rows) if form == "tables" else {"records": rows}

    decode, store = [], []
    for repeat in range(repeats):
        run = f"bench{repeat:05d}"
        frames = [dumps({"op": "log-event", "topic": TOPIC, "msg": message([
            step_record(run, u, w) for u in range(records)])}) for w in range(workers)]
        start = time.perf_counter()
        messages = [loads(f) for f in frames]
        decode.append(time.perf_counter() - start)
        metrics = MetricsStore()
        start = time.perf_counter()
        for m in messages:
            metrics.log_event(m["topic"], m["msg"])
        store.append(time.perf_counter() - start)
    n = workers * records
    size = sum(len(b) for f in frames for b in f) / n
    return {"decode_us": statistics.median(decode) / n * 1e6,
            "store_us": statistics.median(store) / n * 1e6, "bytes": size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--records", type=int, default=128, help="records a message")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    results: dict[str, list[dict[str, float]]] = {"rows": [], "tables": []}
    for _ in range(args.repeats):  # alternating, so that both see the same machine
        for form in results:
            results[form].append(measure(args.workers, args.records, 1, form))
    median = {form: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
              for form, runs in results.items()}
    for form, r in median.items():
        print(f"{form:6s} per record: decode {r['decode_us']:.2f} us, store "
              f"{r['store_us']:.2f} us, {r['bytes']:.0f} bytes on the wire "
              f"(median of {args.repeats})")
    rows, tables = median["rows"], median["tables"]
    print("tables/rows: decode {:.2f}x, store {:.2f}x, decode+store {:.2f}x, bytes {:.2f}x"
          .format(tables["decode_us"] / rows["decode_us"], tables["store_us"] / rows["store_us"],
                  (tables["decode_us"] + tables["store_us"])
                  / (rows["decode_us"] + rows["store_us"]), tables["bytes"] / rows["bytes"]))


if __name__ == "__main__":
    main()
