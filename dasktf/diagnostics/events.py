"""The metrics stream: compact records published through the Dask scheduler.

Workers buffer one record per step and send a batch at most every
``dasktf.metrics-interval`` with ``Worker.log_event`` (fire-and-forget over the
worker's existing batched stream: no round trip on the hot path). The client adds a
few records per run (its start, each epoch, its end) with ``Client.log_event``. Any
client connected to the scheduler can follow a run with
``Client.subscribe_topic(TOPIC, ...)`` or read the recent past with
``Client.get_events(TOPIC)``; the scheduler keeps only the last
``distributed.admin.low-level-log-length`` events per topic, so the whole run lives,
downsampled, in :class:`dasktf.diagnostics.metrics.MetricsStore` on the scheduler.

A record is a flat dict of msgpack-friendly values whose ``kind`` says which of
the schemas below it follows. Fields a producer cannot measure are absent or
``None``; consumers (the dashboard, the store) must accept both, so sync and async
engines share one schema. On the wire an event is a list of tables (:func:`pack`):
a worker's step records share their fields and most of their values, and the
scheduler decoding every field name of every record, one dict each, was most of
what a 32-worker run's records cost it (issue 39). Read an event's records with
:func:`unpack`.

Async and quorum runs publish ``kind="update"`` records with ``staleness``,
``version_read`` and the update's timings (``push_s``, ``task_s``, ``idle_s``), and
``dropped: True`` on the record of a gradient a quorum step left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from dasktf import config

if TYPE_CHECKING:
    from distributed import Client

#: The scheduler event topic every dasktf run publishes on.
TOPIC = "dasktf-metrics"
#: The newest global loss alone, from one replica per run: what the client's
#: callbacks need mid-epoch. The client listens here, not on :data:`TOPIC`, whose
#: records (one per worker per step) would cost it O(workers) per step.
LOSS_TOPIC = "dasktf-loss"


class StepRecord(TypedDict, total=False):
    """One applied step (sync: one per worker per step) or update (async).

    ``kind`` is ``"step"`` in sync mode and ``"update"`` in async modes.
    """

    run: str  #: run id
    kind: str  #: "step" | "update"
    mode: str  #: "sync" | "async" | ...
    epoch: int
    step: int  #: step within the epoch
    update: int  #: global step / update number, from 0, monotonic over the run
    worker: int  #: replica index (``run_start.workers[worker]`` is its address)
    batch_size: int  #: examples this worker's gradient covered
    #: the global (all-worker) loss of step ``loss_step`` (sync: the step before,
    #: read from the sum this worker just applied); async: this update's loss
    loss: float | None
    loss_step: int | None  #: the global update number ``loss`` belongs to
    local_loss: float | None  #: this worker's mean loss on its own batch
    staleness: int  #: updates applied between reading the weights and applying (sync: 0)
    compute_s: float  #: apply + gradient on the worker
    communication_s: float  #: Dask-measured transfers of this step's inputs to the worker
    waiting_s: float  #: idle time since this worker's previous step, minus transfers
    #: bytes this step received from other workers plus the bytes of the gradient
    #: it produced, counted at the codec (dasktf.wire.packets): what it moves at most (a
    #: reduction that runs on the same worker moves less; the exact per-worker
    #: figures are history.history["bytes_per_step"])
    bytes: int
    wall_time: float  #: time.time() on the worker when the record was made


class RunStartRecord(TypedDict, total=False):
    """Published by the client once the replicas are built (``kind="run_start"``)."""

    run: str
    kind: str
    mode: str
    engine: str  #: "graph" (a Dask task graph per step) or "collective"
    model: str
    workers: list[str]  #: worker addresses, by replica index
    devices: list[str]  #: "GPU" / "CPU" per worker
    shard_sizes: list[int]
    epochs: int
    steps_per_epoch: int
    total_updates: int  #: updates the run will apply if it is not stopped early
    batch_size: int  #: the global batch
    n_samples: int
    #: steps per round of local steps (1: an update per step); the workers then also
    #: publish ``kind="inner"`` records, one per inner step (worker, epoch, round,
    #: step, batch_size, local_loss), and their step records carry ``drift``
    local_steps: int
    wall_time: float


class EpochRecord(TypedDict, total=False):
    """The merged metrics of one epoch (``kind="epoch"``), validation included."""

    run: str
    kind: str
    epoch: int
    update: int  #: the last global update of the epoch
    logs: dict[str, float]  #: loss, accuracy, val_loss, val_accuracy, examples_per_sec ...
    wall_time: float


class RunEndRecord(TypedDict, total=False):
    """The run finished (``status="finished"``) or failed (``"failed"``, ``error``)."""

    run: str
    kind: str
    status: str
    error: str | None
    wall_time: float


class MetricsBuffer:
    """Worker-side batching of records; flushes by time, never per record.

    ``dasktf.metrics: false`` turns publishing off (records are dropped), which the
    sync benchmark uses to measure what publishing costs.
    """

    def __init__(self, interval: float | None = None, enabled: bool | None = None,
                 topic: str = TOPIC, reports_loss: bool = False,
                 n_workers: int = 1) -> None:
        self.interval = config.get_seconds("metrics-interval", interval)
        if not reports_loss:
            # The scheduler takes every message: with many workers, each sends less
            # often (more records a message), so a run sends at most ``metrics-rate``
            # of them a second whatever its size. Replica 0, whose records carry the
            # global loss the client and the loss plot read, keeps the interval.
            rate = float(config.get("metrics-rate"))
            if rate <= 0:
                raise ValueError(f"dasktf.metrics-rate must be a positive number of "
                                 f"messages a second, not {rate:g}.")
            self.interval = max(self.interval, n_workers / rate)
        self.enabled = bool(config.get("metrics", enabled))
        self.topic = topic
        #: also send the newest global loss of each batch on :data:`LOSS_TOPIC`
        self.reports_loss = reports_loss
        self.records: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()

    def add(self, record: dict[str, Any], *, flush: bool = False) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        if flush or time.monotonic() - self._last_flush >= self.interval:
            self.flush()

    def take(self) -> list[dict[str, Any]]:
        """The buffered records, handed to the caller to send (the buffer empties)."""
        records, self.records = self.records, []
        return records

    def flush(self, worker: Any = None) -> None:
        """Send the buffered records (``worker``: the Worker, outside a task)."""
        if not self.records:
            return
        if worker is None:
            from distributed import get_worker

            worker = get_worker()
        send_records(worker, self.records, self.topic, self.reports_loss)
        self.records = []
        self._last_flush = time.monotonic()


def send_records(worker: Any, records: list[dict[str, Any]], topic: str = TOPIC,
                 reports_loss: bool = False) -> None:
    """One message of a worker's step records (:func:`pack`); with
    ``reports_loss``, a second, tiny one on :data:`LOSS_TOPIC` with the newest
    global loss among them."""
    worker.log_event(topic, pack(records))
    if reports_loss:
        latest = next((r for r in reversed(records) if r.get("loss") is not None), None)
        if latest is not None:
            worker.log_event(LOSS_TOPIC, {"records": [
                {"run": latest["run"], "loss": latest["loss"],
                 "loss_step": latest.get("loss_step")}]})


def publish(client: Client, *records: dict[str, Any]) -> None:
    """Publish a few client-side records (run start, epoch ends): one message.

    Made msgpack-friendly first (Dask refuses a dict with keys that are not
    strings, or NumPy numbers, and the record would be lost): keys become strings,
    NumPy numbers and arrays Python ones."""
    if records and config.get("metrics"):
        client.log_event(TOPIC, pack([plain(r) for r in records]))


def plain(value: Any) -> Any:
    """``value`` with msgpack's types only: dicts keyed by strings, lists, Python
    numbers (NumPy scalars and arrays converted)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # NumPy scalar or array
        return plain(value.tolist())
    return value


def listen_for_losses(client: Client, run: str,
                      callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Call ``callback(record)`` with each :data:`LOSS_TOPIC` record of ``run``
    that reaches ``client``, through the client's one subscription to the topic
    (:func:`dasktf.cluster.plugins.subscribe_shared`); returns what stops it."""
    from dasktf.cluster.plugins import subscribe_shared

    def route(event: Any) -> None:
        for record in unpack(event):
            if record.get("run") == run:
                callback(record)

    return subscribe_shared(client, LOSS_TOPIC, route)


def pack(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The message of one event of ``records``: ``{"tables": [table, ...]}``, one
    table per run of consecutive records with the same fields, in order, a table
    ``{"n": rows, "same": {field: value}, "columns": {field: [value per row]}}``
    (a field of one value and type in every row, in ``same`` once)."""
    tables = []
    start = 0
    for end in range(1, len(records) + 1):
        if end == len(records) or records[end].keys() != records[start].keys():
            tables.append(_table(records[start:end]))
            start = end
    return {"tables": tables}


def _table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    same, columns = {}, {}
    for field, value in rows[0].items():
        column = [r[field] for r in rows]
        kind = type(value)
        if all(type(v) is kind and v == value for v in column):
            same[field] = value
        else:
            columns[field] = column
    return {"n": len(rows), "same": same, "columns": columns}


def table_rows(table: dict[str, Any]) -> list[dict[str, Any]]:
    """A :func:`pack` table's records, as dicts."""
    same, columns = table["same"], table["columns"]
    if not columns:
        return [dict(same) for _ in range(table["n"])]
    fields = list(columns)
    return [{**same, **dict(zip(fields, values, strict=True))}
            for values in zip(*columns.values(), strict=True)]


def unpack(event: Any) -> list[dict[str, Any]]:
    """The records of one event as delivered by ``subscribe_topic``/``get_events``
    (a :func:`pack` message's tables, or a plain ``{"records": [...]}``)."""
    _, msg = event if isinstance(event, tuple) else (None, event)
    if not isinstance(msg, dict):
        return []
    records = list(msg.get("records", []))
    for table in msg.get("tables", ()):
        records.extend(table_rows(table))
    return records


def run_start_record(
    run: str,
    *,
    mode: str,
    model: str,
    workers: list[str],
    engine: str = "graph",
    replica_info: list[dict[str, Any]],
    epochs: int,
    steps_per_epoch: int,
    batch_size: int,
    n_samples: int,
    total_updates: int | None = None,
    local_steps: int = 1,
) -> dict[str, Any]:
    """The :class:`RunStartRecord` of a run whose replicas are built."""
    devices = [
        "GPU" if any("GPU" in str(d) for d in info.get("devices", [])) else "CPU"
        for info in replica_info
    ]
    return {
        "run": run, "kind": "run_start", "mode": mode, "engine": engine, "model": model,
        "workers": list(workers), "devices": devices,
        "shard_sizes": [int(info.get("shard_size", 0)) for info in replica_info],
        "epochs": int(epochs), "steps_per_epoch": int(steps_per_epoch),
        "total_updates": int(total_updates if total_updates is not None
                             else epochs * steps_per_epoch),
        "batch_size": int(batch_size), "n_samples": int(n_samples),
        "local_steps": int(local_steps), "wall_time": time.time(),
    }


def epoch_record(run: str, epoch: int, update: int, logs: dict[str, Any]) -> dict[str, Any]:
    """The :class:`EpochRecord` of a finished epoch (numeric logs only)."""
    values = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}
    return {"run": run, "kind": "epoch", "epoch": int(epoch), "update": int(update),
            "logs": values, "wall_time": time.time()}


def run_end_record(run: str, error: BaseException | None = None) -> dict[str, Any]:
    """The :class:`RunEndRecord`: ``finished``, or ``failed`` with the error's first line."""
    text = None
    if error is not None:
        lines = str(error).strip().splitlines()
        text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return {"run": run, "kind": "run_end",
            "status": "finished" if error is None else "failed",
            "error": text, "wall_time": time.time()}


def worker_lost_records(run: str, lost: list[str], detected: float,
                        removals: dict[str, Any] | None = None, **fields: Any
                        ) -> list[dict[str, Any]]:
    """A ``worker_lost`` record per worker of ``lost``: when the scheduler removed it
    and the client heard (``removals``' change), else when the client found it gone
    (``detected``); ``fields``: where (``epoch``, ``update``, ``phase``)."""
    records = []
    for w in lost:
        change = (removals or {}).get(w)
        records.append({
            "run": run, "kind": "worker_lost", "worker_address": w, **fields,
            "detect_s": (change.seen_time - change.scheduler_time) if change else None,
            "removed_at": change.scheduler_time if change else None,
            "detected_at": change.seen_time if change else detected,
            "wall_time": time.time()})
    return records


def recovered_record(run: str, workers: list[str], lost: list[str],
                     since: float | None, moved: list[tuple[int, str]] | None = None,
                     **fields: Any) -> dict[str, Any]:
    """The ``recovered`` record of a run gone on over ``workers`` without ``lost``,
    their shards ``moved`` (``(index, adopter)``), ``resume_s`` after ``since``
    (``None``: not known yet); ``fields``: the engine's or phase's own."""
    now = time.time()
    return {"run": run, "kind": "recovered", "workers": list(workers), "lost": list(lost),
            "moved": [[i, a] for i, a in moved or []], "steps_lost": 0, **fields,
            "resume_s": None if since is None else now - since, "wall_time": now}


def worker_joined_record(run: str, address: str, since: float, **fields: Any
                         ) -> dict[str, Any]:
    """The ``worker_joined`` record of ``address`` put to work ``join_s`` after
    ``since``; ``fields``: the engine's own (``worker``, ``shard``, ...)."""
    now = time.time()
    return {"run": run, "kind": "worker_joined", "worker_address": address, **fields,
            "join_s": now - since, "wall_time": now}
