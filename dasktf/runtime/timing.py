"""Where a sync step's time went besides compute, as one worker saw it: Dask's
own transfer measurements and the wait between this worker's steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTiming:
    """Where a step's time went besides compute, as one worker saw it."""

    communication_s: float
    waiting_s: float


class StepTimer:
    """Splits the gap between a worker's consecutive steps into transfer and wait.

    The transfers are Dask's own measurements: a worker appends a ``"transfer"``
    entry to the ``startstops`` of the task that needed the data it fetched. What
    remains of the gap since this worker's previous step ended is waiting (for the
    reduction, for the slowest peer, for the scheduler). The first step of an epoch
    has no gap to split (the epoch end and validation came before it).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._epoch = -1
        self._last_end: float | None = None

    def begin(self, epoch: int, start: float) -> StepTiming | None:
        if not self.enabled:
            return None
        communication = _incoming_transfer_seconds()
        if epoch != self._epoch or self._last_end is None:
            self._epoch = epoch
            return StepTiming(communication, 0.0)
        gap = max(0.0, start - self._last_end)
        return StepTiming(communication, max(0.0, gap - communication))

    def end(self, end: float) -> None:
        self._last_end = end


def _incoming_transfer_seconds() -> float:
    """Seconds Dask spent fetching the running task's inputs onto this worker."""
    from distributed import get_worker

    worker = get_worker()
    try:
        ts = worker.state.tasks[worker.get_current_task()]
    except (KeyError, AttributeError):  # not inside a task (direct calls in tests)
        return 0.0
    return float(
        sum(s["stop"] - s["start"] for s in ts.startstops if s.get("action") == "transfer")
    )
