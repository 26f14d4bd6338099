"""The scheduler-side history of every run: :class:`MetricsStore`.

The scheduler's event log keeps only the last ``distributed.admin.low-level-log-length``
events per topic (1000 by default), so a dashboard that attaches late to a long run
could not rebuild it from there. The client of every run therefore registers a
:class:`MetricsStore` scheduler plugin (idempotently: one store per scheduler, shared by
all runs). Its ``log_event`` hook sees every batch of records published on
:data:`dasktf.diagnostics.events.TOPIC` as the scheduler receives it, and folds them into a
bounded per-run summary:

* series (global loss against update, per-worker staleness against update, the epoch
  metrics) of at most ``dasktf.dashboard.max-points`` rows each; a full series merges
  neighbouring rows in pairs (their mean) and from then on averages twice as many
  records per row, so the whole run stays visible at a resolution that halves as it
  grows, in constant memory;
* a staleness histogram (exact counts);
* per-worker aggregates (steps, bytes, staleness, the last update) and a short
  window of recent steps for the rates (examples/s, compute / communication /
  waiting seconds).

Anyone connected to the scheduler reads it through the scheduler handler
``dasktf_metrics`` (:func:`fetch`): the first call returns the whole summary, later
calls pass back the returned cursor and receive only the rows added since, or a
whole series again when pairs were merged in the meantime.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dasktf import config
from dasktf.cluster.plugins import register_once
from dasktf.diagnostics.events import TOPIC, table_rows
from dasktf.diagnostics.series import DecimatedSeries

if TYPE_CHECKING:
    from distributed import Client, Scheduler

logger = logging.getLogger(__name__)

#: The name of the scheduler plugin and of its handler.
PLUGIN_NAME = "dasktf-metrics-store"
HANDLER = "dasktf_metrics"
#: Staleness values above this share the last histogram bucket (bounds its size).
MAX_STALENESS_BUCKET = 256

Cursor = dict[str, Any]


class Columns:
    """One :func:`~dasktf.diagnostics.events.pack` table's fields as columns, a
    field of one value repeated for every row."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.n = int(table["n"])
        self.same: dict[str, Any] = table["same"]
        self.columns: dict[str, list[Any]] = table["columns"]
        update = "update" if self.has("update") else "step"
        self.updates = [int(u) for u in self.get(update, 0)]
        self.staleness = [int(s or 0) for s in self.get("staleness")]

    def has(self, field: str) -> bool:
        return field in self.same or field in self.columns

    def get(self, field: str, default: Any = None) -> list[Any]:
        column = self.columns.get(field)
        return column if column is not None else [self.same.get(field, default)] * self.n


class WorkerStats:
    """Running totals of one replica plus a window of its recent steps."""

    __slots__ = ("bytes", "last_seen", "last_update", "recent", "staleness_sum", "steps")

    def __init__(self, window: int = 32) -> None:
        self.steps = 0
        self.bytes = 0
        self.staleness_sum = 0
        self.last_update = -1
        self.last_seen = 0.0
        # (batch, compute, communication, waiting) of the last steps: live rates
        self.recent: deque[tuple[int, float, float, float]] = deque(maxlen=window)

    def add(self, r: dict[str, Any], now: float) -> None:
        self.steps += 1
        self.bytes += int(r.get("bytes") or 0)
        self.staleness_sum += int(r.get("staleness") or 0)
        self.last_update = max(self.last_update, int(r.get("update", -1)))
        self.last_seen = now
        self.recent.append((int(r.get("batch_size") or 0), float(r.get("compute_s") or 0.0),
                            float(r.get("communication_s") or 0.0),
                            float(r.get("waiting_s") or 0.0)))

    def add_many(self, c: Columns, now: float) -> None:
        """``n`` steps at once, as ``n`` :meth:`add` calls would."""
        self.steps += c.n
        self.bytes += sum(int(b or 0) for b in c.get("bytes"))
        self.staleness_sum += sum(c.staleness)
        self.last_update = max(self.last_update, max(c.updates))
        self.last_seen = now
        self.recent.extend(zip(
            (int(b or 0) for b in c.get("batch_size")),
            (float(x or 0.0) for x in c.get("compute_s")),
            (float(x or 0.0) for x in c.get("communication_s")),
            (float(x or 0.0) for x in c.get("waiting_s")), strict=True))

    def recent_means(self) -> tuple[float, float, float, float]:
        """Examples/s and mean compute / communication / waiting seconds per step."""
        if not self.recent:
            return 0.0, 0.0, 0.0, 0.0
        n = len(self.recent)
        batch = sum(x[0] for x in self.recent)
        compute = sum(x[1] for x in self.recent) / n
        comm = sum(x[2] for x in self.recent) / n
        wait = sum(x[3] for x in self.recent) / n
        period = compute + comm + wait
        return (batch / n / period if period > 0 else 0.0), compute, comm, wait


class RunHistory:
    """The bounded summary of one run, as the store keeps it."""

    def __init__(self, run: str, max_points: int) -> None:
        self.run = run
        self.max_points = max_points
        self.meta: dict[str, Any] = {}
        self.status = "running"
        self.error: str | None = None
        self.first_seen = time.time()
        self.last_seen = self.first_seen
        self.records = 0
        self.mode = ""
        self.max_update = -1
        self.max_epoch = -1
        self.loss = DecimatedSeries(["update", "loss"], max_points, order_by="update")
        self.epochs = DecimatedSeries(
            ["epoch", "update", "loss", "accuracy", "val_loss", "val_accuracy",
             "examples_per_sec"],
            max_points,
        )
        self.staleness: dict[int, DecimatedSeries] = {}
        #: Rounds of local steps: each worker's inner-step losses against the global
        #: step, and per round its end step, drift and the bytes moved per example
        #: so far (all workers' bytes over all rows they trained on).
        self.inner: dict[int, DecimatedSeries] = {}
        self.rounds = DecimatedSeries(["round", "step", "drift", "bytes_per_example"],
                                      max_points, order_by="round")
        self._bytes = 0.0
        self._rows = 0
        self._last_round = -1
        self.histogram: dict[int, int] = {}
        self.workers: dict[int, WorkerStats] = {}
        self.lost: set[str] = set()
        self._last_loss_update = -1
        self._first_step: tuple[float, int] | None = None

    # -- ingestion ------------------------------------------------------------
    def add(self, r: dict[str, Any], now: float) -> None:
        self.records += 1
        self.last_seen = now
        kind = r.get("kind")
        if kind in ("step", "update"):
            self._add_step(r, now)
        elif kind == "inner":
            self._add_inner(r)
        elif kind == "epoch":
            self._add_epoch(r)
        elif kind == "run_start":
            self.meta = dict(r)
            self.mode = str(r.get("mode", self.mode))
            self.first_seen = now
        elif kind == "run_end":
            self.status = str(r.get("status", "finished"))
            self.error = r.get("error")
        elif kind == "worker_lost" and r.get("worker_address"):  # dasktf.engines.graph.elastic
            self.lost.add(str(r["worker_address"]))

    def add_table(self, table: dict[str, Any], now: float) -> None:
        """A :func:`~dasktf.diagnostics.events.pack` table of this run's records, as
        its rows one by one would be: one replica's steps (a round's drift aside)
        taken as columns, anything else row by row."""
        same = table["same"]
        if (table["n"] < 2 or same.get("kind") not in ("step", "update")
                or "worker" not in same or "drift" in same or "drift" in table["columns"]):
            for r in table_rows(table):
                self.add(r, now)
            return
        c = Columns(table)
        self.records += c.n
        self.last_seen = now
        worker = int(same["worker"])
        self._worker(worker, same.get("mode"), c.updates[0], now).add_many(c, now)
        self.max_update = max(self.max_update, max(c.updates))
        self.max_epoch = max(self.max_epoch, max(int(e) for e in c.get("epoch", 0)))
        for staleness in c.staleness:
            bucket = min(staleness, MAX_STALENESS_BUCKET)
            self.histogram[bucket] = self.histogram.get(bucket, 0) + 1
        series = self.staleness.get(worker)
        if series is None:
            series = self.staleness[worker] = DecimatedSeries(
                ["update", "staleness"], self.max_points)
        series.extend({"update": c.updates, "staleness": c.staleness}, c.n)
        self._bytes += sum(float(b or 0) for b in c.get("bytes"))
        self._rows += sum(int(b or 0) for b in c.get("batch_size"))
        if not c.has("loss"):
            return
        steps = c.get("loss_step") if c.has("loss_step") else c.updates
        for loss, at, update in zip(c.get("loss"), steps, c.updates, strict=True):
            if loss is not None:
                self._add_loss(int(update if at is None else at), float(loss),
                               same["kind"] == "update")

    def _add_loss(self, at: int, loss: float, each: bool) -> None:
        """Sync: every worker carries the same global loss; keep it once. Async
        (``each``): one loss per update, possibly arriving late (inserted in order)."""
        if each:
            self.loss.append({"update": at, "loss": loss})
        elif at > self._last_loss_update:
            self._last_loss_update = at
            self.loss.append({"update": at, "loss": loss})

    def _worker(self, worker: int, mode: Any, update: int, now: float) -> WorkerStats:
        """The stats of replica ``worker``, whose steps from ``update`` arrive."""
        if not self.mode and mode:
            self.mode = str(mode)
        if self._first_step is None:
            self._first_step = (now, update)
        stats = self.workers.get(worker)
        if stats is None:
            stats = self.workers[worker] = WorkerStats()
        return stats

    def _add_step(self, r: dict[str, Any], now: float) -> None:
        worker = int(r.get("worker", 0))
        update = int(r.get("update", r.get("step", 0)))
        self._worker(worker, r.get("mode"), update, now).add(r, now)
        self.max_update = max(self.max_update, update)
        self.max_epoch = max(self.max_epoch, int(r.get("epoch", 0)))
        staleness = int(r.get("staleness") or 0)
        bucket = min(staleness, MAX_STALENESS_BUCKET)
        self.histogram[bucket] = self.histogram.get(bucket, 0) + 1
        series = self.staleness.get(worker)
        if series is None:
            series = self.staleness[worker] = DecimatedSeries(
                ["update", "staleness"], self.max_points
            )
        series.append({"update": update, "staleness": staleness})
        self._bytes += float(r.get("bytes") or 0)
        self._rows += int(r.get("batch_size") or 0)
        # a round's drift rides with its sum's loss: on the next round's records
        # (graph engine) or on its own (p2p), ``loss_step`` says which
        round_ = int(r.get("loss_step", update - 1))
        if r.get("drift") is not None and round_ > self._last_round:
            self._add_round(round_, float(r["drift"]))
        loss = r.get("loss")
        if loss is not None:
            self._add_loss(int(r.get("loss_step", update)), float(loss),
                           r.get("kind") == "update")

    def _add_inner(self, r: dict[str, Any]) -> None:
        worker = int(r.get("worker", 0))
        steps = int(self.meta.get("steps_per_epoch") or 0)
        series = self.inner.get(worker)
        if series is None:
            series = self.inner[worker] = DecimatedSeries(["step", "loss"], self.max_points,
                                                          order_by="step")
        series.append({"step": int(r.get("epoch", 0)) * steps + int(r.get("step", 0)),
                       "loss": r.get("local_loss")})

    def _add_round(self, round_: int, drift: float) -> None:
        """A sync round's drift."""
        self._last_round = round_
        steps = int(self.meta.get("steps_per_epoch") or 0)
        h = int(self.meta.get("local_steps") or 1)
        per_epoch = max(1, -(-steps // h))
        epoch, local = divmod(round_, per_epoch)
        self.rounds.append({
            "round": round_, "step": epoch * steps + min((local + 1) * h, steps),
            "drift": drift,
            "bytes_per_example": self._bytes / self._rows if self._rows else None,
        })

    def _add_epoch(self, r: dict[str, Any]) -> None:
        logs = r.get("logs") or {}
        row = {k: logs.get(k) for k in self.epochs.columns}
        row["epoch"] = int(r.get("epoch", 0)) + 1
        row["update"] = r.get("update", self.max_update)
        self.epochs.append(row)
        self.max_epoch = max(self.max_epoch, int(r.get("epoch", 0)))

    # -- reading ----------------------------------------------------------------
    def header(self, now: float) -> dict[str, Any]:
        m = self.meta
        epochs = m.get("epochs")
        total = m.get("total_updates")
        done = self.max_update + 1
        rate = 0.0
        eta = None
        if self._first_step is not None and self.last_seen > self._first_step[0]:
            rate = (self.max_update - self._first_step[1]) / (
                self.last_seen - self._first_step[0]
            )
        if self.status == "running" and total and rate > 0:
            eta = max(0.0, (total - done) / rate)
        elif self.status != "running":
            eta = 0.0
        devices = m.get("devices") or []
        return {
            "run": self.run,
            "mode": self.mode or m.get("mode", ""),
            "engine": m.get("engine", ""),
            "model": m.get("model", ""),
            "n_workers": len(m.get("workers") or self.workers),
            "devices": sorted(set(devices)),
            "epoch": self.max_epoch + 1,
            "epochs": epochs,
            "updates": done,
            "total_updates": total,
            "updates_per_s": rate,
            "eta_s": eta,
            "elapsed_s": self.last_seen - self.first_seen,
            "status": self.status,
            "error": self.error,
            "records": self.records,
            "age_s": now - self.last_seen,
        }

    def worker_rows(self, now: float, slow_factor: float) -> dict[str, list[Any]]:
        addresses = list(self.meta.get("workers") or [])
        n = max(len(addresses), max(self.workers, default=-1) + 1)
        devices = list(self.meta.get("devices") or [])
        shards = list(self.meta.get("shard_sizes") or [])
        means = {i: s.recent_means() for i, s in self.workers.items()}
        computes = [means[i][1] for i in means if self.workers[i].steps]
        periods = [sum(means[i][1:]) for i in means if self.workers[i].steps]
        median_compute = statistics.median(computes) if computes else 0.0
        median_period = statistics.median(periods) if periods else 0.0
        cols: dict[str, list[Any]] = {
            k: []
            for k in (
                "worker", "address", "device", "shard_size", "steps", "last_update",
                "state", "examples_per_s", "compute_ms", "communication_ms",
                "waiting_ms", "mb_moved", "staleness_mean", "label",
            )
        }
        for i in range(n):
            s = self.workers.get(i)
            address = addresses[i] if i < len(addresses) else ""
            rate, compute, comm, wait = means.get(i, (0.0, 0.0, 0.0, 0.0))
            cols["worker"].append(i)
            cols["address"].append(address)
            cols["device"].append(devices[i] if i < len(devices) else "")
            cols["shard_size"].append(shards[i] if i < len(shards) else None)
            cols["steps"].append(s.steps if s else 0)
            cols["last_update"].append(s.last_update if s else -1)
            cols["state"].append(
                self._state(s, address, now, slow_factor, compute, median_compute,
                            median_period)
            )
            cols["examples_per_s"].append(rate)
            cols["compute_ms"].append(1000 * compute)
            cols["communication_ms"].append(1000 * comm)
            cols["waiting_ms"].append(1000 * wait)
            cols["mb_moved"].append((s.bytes if s else 0) / 1e6)
            cols["staleness_mean"].append(s.staleness_sum / s.steps if s and s.steps else 0.0)
            cols["label"].append(f"{i}: {address.rsplit('/', 1)[-1]}" if address else str(i))
        return cols

    def _state(
        self, s: WorkerStats | None, address: str, now: float, slow_factor: float,
        compute: float, median_compute: float, median_period: float,
    ) -> str:
        if address and address in self.lost:
            return "lost"
        if self.status != "running":
            return self.status
        if s is None or not s.steps:
            return "starting"
        silent_limit = max(5.0, slow_factor * 10 * median_period)
        if now - s.last_seen > silent_limit:
            return "slow"
        if median_compute > 0 and compute > slow_factor * median_compute:
            return "slow"
        return "running"

    def snapshot(self, cursor: Cursor | None, now: float, slow_factor: float) -> dict[str, Any]:
        """Everything a dashboard shows, with only new rows since ``cursor``."""
        cursor = cursor if cursor and cursor.get("run") == self.run else {}
        loss, loss_cursor = self.loss.since(cursor.get("loss"))
        epochs, epochs_cursor = self.epochs.since(cursor.get("epochs"))
        staleness, staleness_cursor = _per_worker(self.staleness,
                                                  cursor.get("staleness") or {})
        inner, inner_cursor = _per_worker(self.inner, cursor.get("inner") or {})
        rounds, rounds_cursor = self.rounds.since(cursor.get("rounds"))
        hist = sorted(self.histogram.items())
        return {
            "run": self.run,
            "meta": self.meta,
            "header": self.header(now),
            "workers": self.worker_rows(now, slow_factor),
            "histogram": {"staleness": [k for k, _ in hist], "count": [v for _, v in hist]},
            "series": {"loss": loss, "epochs": epochs, "staleness": staleness,
                       "inner": inner, "rounds": rounds},
            "cursor": {
                "run": self.run,
                "loss": loss_cursor,
                "epochs": epochs_cursor,
                "staleness": staleness_cursor,
                "inner": inner_cursor,
                "rounds": rounds_cursor,
            },
        }


def _per_worker(
    series: dict[int, DecimatedSeries], old: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """Each worker's rows since ``old``; all of them again when one was reset (the
    dashboard shows the workers in one source)."""
    parts: dict[str, Any] = {}
    cursors: dict[str, list[int]] = {}
    for w, s in sorted(series.items()):
        parts[str(w)], cursors[str(w)] = s.since(old.get(str(w)))
    if any(p["reset"] for p in parts.values()):
        for w, s in sorted(series.items()):
            parts[str(w)], cursors[str(w)] = s.since(None)
    return parts, cursors


class MetricsStore(SchedulerPlugin):
    """Keeps a bounded history of every dasktf run on the scheduler.

    Register it from a client with :func:`ensure_store` (idempotent: a store already
    there, with its history, is kept), or from a scheduler preload
    (``dasktf.dashboard.preload``). Read it with :func:`fetch`.

    Parameters
    ----------
    max_points
        Rows kept per series (default ``dasktf.dashboard.max-points``).
    max_runs
        Runs remembered, oldest dropped first (default ``dasktf.dashboard.max-runs``).
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(
        self,
        max_points: int | None = None,
        max_runs: int | None = None,
        slow_factor: float | None = None,
    ) -> None:
        self.max_points = int(config.get("dashboard.max-points", max_points))
        self.max_runs = int(config.get("dashboard.max-runs", max_runs))
        self.slow_factor = float(config.get("dashboard.slow-factor", slow_factor))
        self.runs: OrderedDict[str, RunHistory] = OrderedDict()

    # -- scheduler hooks --------------------------------------------------------
    async def start(self, scheduler: Scheduler) -> None:
        scheduler.handlers[HANDLER] = self.fetch

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == TOPIC and isinstance(msg, dict):
            self.add_message(msg)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        for history in self.runs.values():
            if history.status == "running" and worker in (history.meta.get("workers") or []):
                history.lost.add(worker)

    # -- the store ----------------------------------------------------------------
    def add_message(self, msg: dict[str, Any], now: float | None = None) -> None:
        """Fold one event's message (:func:`~dasktf.diagnostics.events.pack`'s
        tables, or plain ``records``) into the per-run histories."""
        now = time.time() if now is None else now
        self.add_records(msg.get("records") or [], now)
        for table in msg.get("tables") or ():
            run = table["same"].get("run")
            if run is None:  # the run differs between rows: not one replica's
                self.add_records(table_rows(table), now)
            elif run:
                self._history(run).add_table(table, now)

    def add_records(self, records: list[dict[str, Any]], now: float | None = None) -> None:
        """Fold a batch of records into the per-run histories."""
        now = time.time() if now is None else now
        for r in records:
            run = r.get("run")
            if run:
                self._history(run).add(r, now)

    def _history(self, run: str) -> RunHistory:
        history = self.runs.get(run)
        if history is None:
            history = self.runs[run] = RunHistory(run, self.max_points)
            while len(self.runs) > self.max_runs:
                self.runs.popitem(last=False)
        return history

    def fetch(self, run: str | None = None, cursor: Cursor | None = None) -> dict[str, Any]:
        """The scheduler handler ``dasktf_metrics``: a run's summary after ``cursor``.

        ``run=None`` is the newest run. The answer always lists the known ``runs``;
        ``error`` says why there is nothing else (no run yet, an unknown id).
        """
        runs = [
            {"run": h.run, "mode": h.mode, "model": h.meta.get("model", ""),
             "status": h.status, "started": h.first_seen}
            for h in self.runs.values()
        ]
        if not self.runs:
            return {"runs": runs, "run": None, "error": "no dasktf run has published yet"}
        if run is None:
            history = next(reversed(self.runs.values()))
        elif run in self.runs:
            history = self.runs[run]
        else:
            known = ", ".join(self.runs) or "none"
            return {"runs": runs, "run": None,
                    "error": f"unknown run {run!r}; the scheduler knows: {known}"}
        out = history.snapshot(cursor, time.time(), self.slow_factor)
        out["runs"] = runs
        return out


def ensure_store(client: Client) -> None:
    """Register a :class:`MetricsStore` on ``client``'s scheduler unless one is there
    (or this client registered it over its connection: :mod:`dasktf.cluster.plugins`)."""
    register_once(client, PLUGIN_NAME, lambda: client.register_plugin(
        MetricsStore(), name=PLUGIN_NAME))


async def fetch_async(client: Client, run: str | None = None,
                      cursor: Cursor | None = None) -> dict[str, Any]:
    """Await a run's summary from the scheduler's store (see :meth:`MetricsStore.fetch`)."""
    out = await client.scheduler.dasktf_metrics(run=run, cursor=cursor)
    if out is None:  # a scheduler without the handler answers None (and logs it)
        return {"runs": [], "run": None,
                "error": "the scheduler has no dasktf MetricsStore yet (no run has "
                "started there since it started)"}
    return out  # type: ignore[no-any-return]


def fetch(client: Client, run: str | None = None, cursor: Cursor | None = None,
          timeout: float | None = None) -> dict[str, Any]:
    """Blocking :func:`fetch_async` for scripts: ``fetch(client)["header"]``."""
    timeout = config.get_seconds("connect-timeout", timeout)
    return client.sync(fetch_async, client, run, cursor,  # type: ignore[no-any-return]
                       callback_timeout=timeout)
