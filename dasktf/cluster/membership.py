"""Learn of workers leaving and joining as it happens, from the scheduler.

A :class:`MembershipPlugin` on the scheduler publishes every ``remove_worker`` and
``add_worker`` on the ``dasktf-membership`` topic; a client-side
:class:`MembershipWatcher` subscribes to it. A SIGKILLed worker's connection drops at
once, so on loopback the client hears of it within tens of milliseconds, where a
heartbeat timeout would take ``distributed.scheduler.worker-ttl`` (minutes).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dasktf.cluster.plugins import register_once, subscribe_shared

if TYPE_CHECKING:
    from distributed import Client, Scheduler

#: The scheduler event topic membership changes are published on.
TOPIC = "dasktf-membership"
PLUGIN_NAME = "dasktf-membership"


class MembershipPlugin(SchedulerPlugin):
    """Publishes worker arrivals and departures on :data:`TOPIC` (scheduler side)."""

    name = PLUGIN_NAME
    idempotent = True  # registering it again (every run does) keeps the first one

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        scheduler.log_event(TOPIC, {"action": "added", "worker": worker, "time": time.time()})

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        scheduler.log_event(
            TOPIC, {"action": "removed", "worker": worker, "time": time.time(),
                    "stimulus": str(kwargs.get("stimulus_id", ""))}
        )


@dataclass
class Change:
    """One membership change as the client learned it."""

    action: str  # "added" | "removed"
    worker: str
    scheduler_time: float  #: time.time() on the scheduler when it removed/added it
    seen_time: float  #: time.time() on the client when the event arrived


class MembershipWatcher:
    """The client side: collects the scheduler's membership events for a run.

    Thread-safe: the handler runs on the client's event loop, the engines read from
    the training thread.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self._lock = threading.Lock()
        self.changes: list[Change] = []
        self.changed = threading.Event()
        #: when :meth:`backstop_due` last said yes (``None``: never)
        self._asked: float | None = None
        register_once(client, PLUGIN_NAME, lambda: client.register_plugin(
            MembershipPlugin(), name=PLUGIN_NAME))
        self._unsubscribe = subscribe_shared(client, TOPIC, self._on_event)

    def _on_event(self, event: Any) -> None:
        _, msg = event if isinstance(event, tuple) else (None, event)
        if not isinstance(msg, dict) or "worker" not in msg:
            return
        change = Change(str(msg["action"]), str(msg["worker"]), float(msg["time"]), time.time())
        with self._lock:
            self.changes.append(change)
        self.changed.set()

    def removed(self, workers: list[str]) -> list[Change]:
        """The removals of any of ``workers`` seen so far."""
        with self._lock:
            return [c for c in self.changes if c.action == "removed" and c.worker in workers]

    def backstop_due(self, every: float, asking: bool = False) -> bool:
        """Whether a check of the membership should also ask the scheduler which
        workers it lists: the first time, then at most every ``every`` seconds
        (``asking``: the caller asks anyway; the next is due ``every`` from now).
        Between two, the events alone answer (a removal reaches the watcher as it
        happens); the question covers one that never arrived (a subscription made
        after the removal, a connection to the scheduler that dropped meanwhile)."""
        now = time.monotonic()
        with self._lock:
            if not asking and self._asked is not None and now - self._asked < every:
                return False
            self._asked = now
            return True

    def added_since(self, since: float, exclude: list[str]) -> list[str]:
        """Workers added after ``since`` (client time) that are not in ``exclude``
        and were not removed again."""
        with self._lock:
            out: list[str] = []
            for c in self.changes:
                if c.seen_time < since or c.worker in exclude:
                    continue
                if c.action == "added" and c.worker not in out:
                    out.append(c.worker)
                elif c.action == "removed" and c.worker in out:
                    out.remove(c.worker)
            return out

    def close(self) -> None:
        self._unsubscribe()


# -- who the scheduler lists now -------------------------------------------
def alive_workers(client: Client) -> list[str]:
    """Addresses of the workers the scheduler knows now, sorted."""
    # Not client.scheduler_info(): it returns the client's cached identity, which
    # the client's periodic refresh (n_workers=0: no workers listed) can overwrite
    # between the fetch and the return; under load every worker then looks lost.
    return sorted(described_workers(client))


def described_workers(client: Client) -> dict[str, Any]:
    """``{address: the scheduler's description}`` of every worker it knows now
    (their resources among it): the scheduler's identity, asked for once (see
    :func:`alive_workers`)."""
    info = client.sync(client.scheduler.identity, n_workers=-1)
    return info["workers"]  # type: ignore[no-any-return]


def listed_workers(client: Client, workers: list[str]) -> set[str]:
    """Which of ``workers`` the scheduler lists now: one small query (their thread
    counts), where :func:`alive_workers` has the scheduler describe every worker
    (its identity: O(cluster) of metrics, a few ms at 32 workers, which a waiting
    client's every poll would cost the scheduler)."""
    return set(client.sync(client.scheduler.ncores, workers=list(workers)))
