"""The epoch ends of a p2p segment that spans epochs, as a worker holds them.

A spanning segment (:attr:`~dasktf.runtime.p2p.segment.Segment.spans`) ends each
epoch as a per-epoch segment does (statistics averaged, validation, the report),
then files the epoch's result in its run's :class:`Gate` and waits there for the
client's word: go on with the next epoch, or end the segment. The client reads the
results and gives its word over the workers' own comms
(:class:`~dasktf.runtime.p2p.plugin.P2PPlugin`'s ``dasktf_p2p_epoch`` and
``dasktf_p2p_word``), never through the scheduler: so an epoch costs the scheduler
nothing, and the workers are where a per-epoch segment leaves them while the client
runs the epoch's end (callbacks, a learning rate they set, a checkpoint, a re-form),
which therefore sees and changes exactly what it would between two segments.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any

from dasktf.exceptions import CollectiveAbortedError

if TYPE_CHECKING:
    from dasktf.runtime.p2p.group import Group

#: an epoch's :class:`~dasktf.runtime.p2p.segment.SegmentResult` (not imported:
#: the segment imports this module through its link)
SegmentResult = Any


class Gate:
    """One run's epoch results waiting for the client (each kept until the word
    that follows it), and the client's words (``True``: go on after that epoch;
    ``False``: end there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results: dict[int, SegmentResult] = {}
        self._words: dict[int, concurrent.futures.Future[bool]] = {}
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.closed = False

    def _word(self, epoch: int) -> concurrent.futures.Future[bool]:
        with self._lock:
            word = self._words.setdefault(epoch, concurrent.futures.Future())
            if self.closed and not word.done():
                word.set_result(False)
            return word

    def drop_results(self) -> None:
        """Forget the results filed and not read: the replica went back to a restore
        point (:func:`~dasktf.runtime.p2p.redundancy.reshard_task`), and the epoch
        they end is trained again, by a new segment whose results the client must
        not take for those."""
        with self._lock:
            self._results.clear()

    # -- the training thread ------------------------------------------------------
    def put(self, epoch: int, result: SegmentResult) -> None:
        """File epoch ``epoch``'s result for the client."""
        with self._lock:
            self._results[epoch] = result
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def wait_word(self, epoch: int, group: Group, timeout: float) -> bool:
        """The client's word after epoch ``epoch``: whether to go on.

        Raises
        ------
        PeerLostError
            A member of ``group`` was lost meanwhile (its failure, as its next
            collective would have raised it).
        CollectiveAbortedError
            The run aborted the group, or no word came within ``timeout`` (the
            client is gone: its run's release closes the gate before that, as a
            rule).
        """
        word = self._word(epoch)
        concurrent.futures.wait([word, group.mailbox.failed], timeout,
                                concurrent.futures.FIRST_COMPLETED)
        if word.done() and not word.result():
            return False
        if group.mailbox.failure is not None:  # told to go on or not: the group cannot
            raise group.mailbox.failure
        if word.done():
            return True
        raise CollectiveAbortedError(
            f"no word from the client within {timeout:g}s after epoch {epoch + 1}")

    def close(self) -> None:
        """The run is over here: a segment waiting for a word ends."""
        with self._lock:
            self.closed = True
            words = list(self._words.values())
        for word in words:
            if not word.done():
                word.set_result(False)
        with self._lock:
            self._results.clear()

    # -- the event loop (the client's calls) ------------------------------------------
    def say(self, epoch: int, go: bool) -> None:
        """The client's word after epoch ``epoch`` (it has read the results up to
        there, which are dropped)."""
        with self._lock:
            for done in [e for e in self._results if e <= epoch]:
                del self._results[done]
        word = self._word(epoch)
        if not word.done():
            word.set_result(bool(go))

    async def take(self, epoch: int, wait: float) -> SegmentResult | None:
        """Epoch ``epoch``'s result, waiting up to ``wait`` seconds for it; kept
        until the client's word (an answer lost on its way is asked for again)."""
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self._lock:
            found = self._results.get(epoch)
            if found is None:
                self._waiters.append(entry)
        if found is not None:
            return found
        try:
            await asyncio.wait_for(event.wait(), wait)
        except asyncio.TimeoutError:
            pass
        with self._lock:
            self._waiters.remove(entry)
            return self._results.get(epoch)
