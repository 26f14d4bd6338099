"""Where a worker's incoming collective messages wait for its training thread.

The worker's event loop puts each message under its full key (group, update,
phase, round, chunk) and the sender's rank; the training thread takes exactly the
key it needs next, so a late, early or duplicated message can never be mixed into
another update's sum. A failure (a peer's connection closed, an abort) is set once
and wakes every waiter at once; a message that is there is still taken, so a member
completes every collective whose messages all arrived, and the members of a failed
group stop as close together as the lost one's last messages allow.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dasktf.exceptions import PeerTimeoutError


@dataclass(frozen=True, order=True)
class Key:
    """What one message carries: which update, which part of the algorithm."""

    step: int
    #: ``"rs"`` (reduce-scatter), ``"ag"`` (all-gather), ``"rd"`` (recursive
    #: doubling), ``"fold"`` / ``"unfold"`` (the ranks beyond a power of two)
    phase: str
    round: int
    chunk: int


class Mailbox:
    """A thread-safe store of one group's incoming messages (see the module)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._messages: dict[tuple[Key, int], Any] = {}
        self._failure: BaseException | None = None
        #: done when the group fails here: a wait on something else (a
        #: write) can wait on this too and end at once
        self.failed: concurrent.futures.Future[None] = concurrent.futures.Future()
        #: the collective the training thread is in: older messages are late
        #: (dropped); newer ones are early (kept: a peer may be one ahead)
        self._step = -1
        self.duplicates = 0
        #: the bytes of the messages waiting here, per phase, and the most that
        #: ever waited (what a sharded step's buffers cost a worker: docs/sharding.md)
        self.held: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        #: called (outside the lock) when a message comes or the group fails: a
        #: training thread that waits in ``poll`` rather than on the condition
        #: (:mod:`dasktf.runtime.p2p.direct`) is woken by it
        self.wakers: list[Callable[[], None]] = []

    # -- the event loop's side --------------------------------------------------
    def put(self, key: Key, source: int, payload: Any, wake: bool = True) -> bool:
        """File a message; ``False`` when it is late or a duplicate (dropped).
        ``wake=False``: the training thread files it itself (no waker to call)."""
        with self._cond:
            if key.step < self._step or (key, source) in self._messages:
                self.duplicates += 1
                return False
            self._messages[(key, source)] = payload
            held = self.held[key.phase] = self.held.get(key.phase, 0) + _nbytes(payload)
            self.peak[key.phase] = max(self.peak.get(key.phase, 0), held)
            self._cond.notify_all()
        if wake:
            for waker in self.wakers:
                waker()
        return True

    def fail(self, error: BaseException) -> None:
        """Fail every wait for a message that is not here with ``error`` (the first
        one kept), now and later."""
        with self._cond:
            if self._failure is None:
                self._failure = error
                self.failed.set_result(None)
            self._cond.notify_all()
        for waker in self.wakers:
            waker()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def step(self) -> int:
        """The collective the training thread is in (or last was in)."""
        return self._step

    # -- the training thread's side ---------------------------------------------
    def begin(self, step: int) -> None:
        """The training thread starts collective ``step``: drop what is older."""
        with self._cond:
            self._step = step
            stale = [k for k in self._messages if k[0].step < step]
            for k in stale:
                self.held[k[0].phase] -= _nbytes(self._messages.pop(k))

    def take(self, key: Key, source: int, timeout: float, peer: str,
             progress: Callable[[float], None] | None = None) -> Any:
        """The message ``key`` from rank ``source`` (``peer``), waiting at most
        ``timeout`` seconds (``progress(left)``: how to wait, outside the lock, for
        at most ``left`` seconds; default: on the condition the loop notifies).

        Raises
        ------
        PeerLostError
            The group failed (a peer's connection closed); :class:`PeerTimeoutError`
            when nothing came from ``peer`` in time.
        CollectiveAbortedError
            The group was aborted.
        """
        end = time.monotonic() + timeout
        while True:
            with self._cond:
                payload = self._messages.pop((key, source), _MISSING)
                if payload is not _MISSING:
                    self.held[key.phase] -= _nbytes(payload)
                    return payload
                if self._failure is not None:
                    raise self._failure
                left = end - time.monotonic()
                if left <= 0:
                    raise PeerTimeoutError(
                        f"Nothing came from peer {peer} (rank {source}) for update "
                        f"{key.step} ({key.phase}, round {key.round}) within "
                        f"dasktf.p2p.timeout ({timeout:g}s); its connection is open, so "
                        "it is alive but stuck (check its log), or raise the timeout "
                        "with DASK_DASKTF__P2P__TIMEOUT.",
                        peer, key.step,
                    )
                if progress is None:
                    self._cond.wait(left)
                    continue
            progress(left)

    def pending(self) -> int:
        with self._cond:
            return len(self._messages)


_MISSING = object()


def _nbytes(payload: Any) -> int:
    """The bytes of a message's values and scalars (``(values, scalars)``)."""
    if not isinstance(payload, tuple):
        return 0
    return int(sum(getattr(part, "nbytes", 0) or 0 for part in payload))
