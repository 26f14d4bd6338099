"""``scale.py``'s report: its table's columns and rows, and the cost model fitted
to the figures (what 100, 256 and 1,000 workers would cost)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

COLUMNS = [("n", "N", "{:d}"), ("mode", "mode", "{}"), ("wall_ms", "wall ms", "{:.1f}"),
           ("sched_cpu_ms", "sched CPU ms", "{:.2f}"),
           ("sched_cpu_per_worker", "per worker", "{:.3f}"),
           ("sched_net_per_worker", "net of idle, per worker", "{:.3f}"),
           ("client_cpu_ms", "client CPU ms", "{:.2f}"),
           ("submit_cpu_ms", "of it submit", "{:.2f}"), ("sched_tasks", "tasks", "{:.1f}"),
           ("sched_msgs_in", "msgs in", "{:.1f}"), ("sched_msgs_out", "msgs out", "{:.1f}"),
           ("sched_kb", "sched. sends kB", "{:.1f}"), ("records", "records", "{:.2f}"),
           ("dispatch_ms", "dispatch ms", "{:.1f}"), ("critical_ms", "critical ms", "{:.1f}"),
           ("submit_to_started_ms", "submit→started ms", "{:.1f}"),
           ("scheduler_dispatch_ms", "sched. dispatch ms", "{:.2f}"),
           ("holder_cpu_ms", "holder CPU ms", "{:.2f}"),
           ("worker_cpu_ms", "worker CPU ms", "{:.2f}"), ("knee_n", "knee N*", "{:.1f}")]


def format_row(r: dict[str, Any]) -> str:
    r = {**r, "sched_cpu_per_worker": r["sched_cpu_ms"] / r["n"]}
    cells = []
    for key, _, fmt in COLUMNS:
        v = r.get(key)
        cells.append("-" if v is None else fmt.format(v))
    return "| " + " | ".join(cells) + " |"


def header() -> str:
    names = [name for _, name, _ in COLUMNS]
    return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


# -- the cost model ------------------------------------------------------------------
QUANTITIES = ("sched_cpu_ms", "sched_net_ms", "client_cpu_ms", "scheduler_dispatch_ms", "dispatch_ms",
              "sched_msgs_in")


def _polyfit(ns: np.ndarray, vs: np.ndarray, degree: int) -> np.ndarray:
    """The polynomial fit, or the mean where the data fall with N (a cost that does
    not grow: a negative slope would only extrapolate noise below zero)."""
    coef = np.polyfit(ns, vs, degree)
    if coef[0] <= 0:
        return np.array([vs.mean()])
    return coef


def fit_model(results: list[dict[str, Any]], holdout: int | None = None) -> str:
    """Per mode and quantity: least squares ``a + b·N`` (``+ c·N²`` for the ring,
    whose tasks grow with N²). The check: fitted without the largest N measured
    (or ``holdout``), then that point predicted. The predictions for 100, 256 and
    1,000 workers come from the fit on every point; its largest residual is shown."""
    lines = ["| mode | quantity | fit on all points | max residual | held-out N: measured"
             " / predicted | N=100 | N=256 | N=1000 |", "|" + "---|" * 8]
    by_mode: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_mode[r["mode"]].append(r)
    for mode, rows in by_mode.items():
        degree = 2 if mode == "ring" else 1
        for q in QUANTITIES:
            pts = sorted((r["n"], r[q]) for r in rows if r.get(q) is not None)
            if len(pts) < degree + 2:
                continue
            ns = np.array([n for n, _ in pts], float)
            vs = np.array([v for _, v in pts], float)
            held = holdout if holdout in ns else ns.max()
            train = ns != held
            coef = _polyfit(ns[train], vs[train], degree)
            check = f"{vs[~train][0]:.2f} / {np.polyval(coef, held):.2f} (N={held:.0f})"
            coef = _polyfit(ns, vs, degree)
            resid = np.abs(vs - np.polyval(coef, ns)).max()
            terms = [f"{coef[-1]:.3g}"] + [
                f"{c:.3g}·N{'²' if p == 2 else ''}"
                for p, c in zip(range(len(coef) - 1, 0, -1), coef[:-1], strict=True)]
            if len(coef) == 1:
                terms[0] += " (flat)"
            preds = " | ".join(f"{np.polyval(coef, m):.4g}" for m in (100, 256, 1000))
            lines.append(f"| {mode} | {q} | {' + '.join(terms)} | {resid:.2f} | {check} "
                         f"| {preds} |")
    return "\n".join(lines)
