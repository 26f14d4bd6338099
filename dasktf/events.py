"""The metrics stream: compact step records published through the Dask scheduler.

Workers buffer one record per step and send a batch at most every
``dasktf.metrics-interval`` with ``Worker.log_event`` (fire-and-forget over the
worker's existing batched stream: no round trip on the hot path). Any client
connected to the scheduler can follow a run with ``Client.subscribe_topic(TOPIC,
...)`` or read the recent past with ``Client.get_events(TOPIC)``.

A record is a dict: ``run`` (run id), ``kind`` (``"step"``, ``"epoch"``, ...),
``epoch``, ``step``, ``worker`` and the measured values (``loss``, ``batch_size``,
``compute_s``, ``wall_time``). Async and quorum runs add ``staleness``, ``update``
and ``version_read`` to the record of each applied update, and ``dropped: True``
to the record of a gradient a quorum step left out.
"""

from __future__ import annotations

import time
from typing import Any

from dasktf import config

#: The scheduler event topic every dasktf run publishes on.
TOPIC = "dasktf-metrics"


class MetricsBuffer:
    """Worker-side batching of records; flushes by time, never per record."""

    def __init__(self, interval: float | None = None) -> None:
        self.interval = config.get_seconds("metrics-interval", interval)
        self.records: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()

    def add(self, record: dict[str, Any], *, flush: bool = False) -> None:
        self.records.append(record)
        if flush or time.monotonic() - self._last_flush >= self.interval:
            self.flush()

    def flush(self, worker: Any = None) -> None:
        """Send the buffered records (``worker``: the Worker, outside a task)."""
        if not self.records:
            return
        if worker is None:
            from distributed import get_worker

            worker = get_worker()
        worker.log_event(TOPIC, {"records": self.records})
        self.records = []
        self._last_flush = time.monotonic()


def unpack(event: Any) -> list[dict[str, Any]]:
    """The records of one event as delivered by ``subscribe_topic``/``get_events``."""
    _, msg = event if isinstance(event, tuple) else (None, event)
    return list(msg.get("records", [])) if isinstance(msg, dict) else []
