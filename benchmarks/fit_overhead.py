"""The scheduler's CPU per step per worker over whole short-epoch fits, repeated
(issue 39's "no scheduler work per epoch" figure).

``scale.py --whole-fit`` times one fit and takes out an idle rate sampled once, for
6 s, before it: on a 2-core machine that single sample moves by more than the
figure itself (8 workers: 0.039 to 0.074 ms net in three runs of one commit). Here,
on one CLI-started cluster per N (``scale.CliCluster``: ``dask scheduler`` and
``dask worker``, as users start theirs), after one untimed fit (imports, tracing):

* ``--repeats`` fits of ``--rows`` rows for ``--epochs`` epochs (32 rows per worker
  a step: 4,096 rows are 16 steps an epoch at N=8), each read as ``scale.py``
  reads its window (the scheduler process's CPU, its messages);
* before each fit and after the last, the scheduler's idle rate for ``--idle``
  seconds, the workers connected and doing nothing; a fit's idle rate is the mean
  of the samples on either side of it;
* per fit: gross CPU, and net of idle (CPU minus idle rate x the fit's wall time),
  per step per worker; then the median and the spread over the fits.

Usage (prints a Markdown row per fit and per N, and the JSON with ``--json``)::

    python benchmarks/fit_overhead.py --workers 2 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale

cloudpickle.register_pickle_by_value(scale)  # the probe runs on the scheduler


def measure(n: int, repeats: int, rows: int, epochs: int, idle_s: float,
            mode: str = "p2p") -> dict[str, Any]:
    from distributed import Client

    cluster = scale.CliCluster(n)
    try:
        client = Client(scheduler_file=cluster.file, timeout="60s")
        client.wait_for_workers(n, timeout=300)
        pid = client.run_on_scheduler(scale.install_probe)
        scale.measure_fit(client, n, "p2p", pid, rows, 1)  # imports and traces, untimed
        idles = [scale.idle_rate(pid, idle_s)]
        fits = []
        for _ in range(repeats):
            fits.append(scale.measure_fit(client, n, mode, pid, rows, epochs))
            idles.append(scale.idle_rate(pid, idle_s))
        client.close()
    finally:
        cluster.close()
    rows_out = []
    for i, r in enumerate(fits):
        idle = (idles[i] + idles[i + 1]) / 2
        rows_out.append({
            "wall_ms_per_step": r["wall_ms"], "idle_ms_per_s": idle * 1e3,
            "gross": r["sched_cpu_ms"] / n,
            "net": (r["sched_cpu_ms"] - idle * r["wall_ms"]) / n,
            "msgs_in_per_step": r["sched_msgs_in"], "tasks_per_fit": r["fit_tasks"],
        })
    nets = [r["net"] for r in rows_out]
    return {"n": n, "mode": mode, "rows": rows, "epochs": epochs, "fits": rows_out,
            "net_median": statistics.median(nets), "net_min": min(nets),
            "net_max": max(nets), "gross_median": statistics.median(r["gross"] for r in rows_out),
            "load": open("/proc/loadavg").read().split()[:3]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--idle", type=float, default=4.0, help="seconds of each idle sample")
    p.add_argument("--mode", default="p2p", choices=list(scale.MODES),
                   help="a scale.py mode (p2p-nometrics: what the step records cost)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    print("| N | fit | wall ms/step | idle ms/s | gross ms/step/worker | net | msgs in/step |")
    print("|---|---|---|---|---|---|---|")
    out = []
    for n in args.workers:
        r = measure(n, args.repeats, args.rows, args.epochs, args.idle, args.mode)
        out.append(r)
        for i, f in enumerate(r["fits"]):
            print(f"| {n} | {i + 1} | {f['wall_ms_per_step']:.1f} | {f['idle_ms_per_s']:.1f} "
                  f"| {f['gross']:.3f} | {f['net']:.3f} | {f['msgs_in_per_step']:.2f} |")
        print(f"| {n} | median | | | {r['gross_median']:.3f} | **{r['net_median']:.3f}** "
              f"({r['net_min']:.3f}-{r['net_max']:.3f}) | |", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
