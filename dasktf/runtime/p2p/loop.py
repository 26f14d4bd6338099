"""A group as a worker holds it (:class:`Endpoint`), and the event loop transport.

Sends are queued from the training thread onto the worker's event loop
(:meth:`LoopTransport.post`), which writes them to the peer's
``dasktf_p2p_stream`` (every message queued meanwhile in one write), so the
thread never blocks on the network. No replies: TCP's own flow control bounds
what is in flight, and a request-reply per message cost its two worker event
loops more CPU than the step's whole TensorFlow compute on a small model
(docs/p2p.md). A send that fails, or a watch that breaks, fails the group here
and tells the other members (:meth:`LoopTransport.lost`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.comm import connect
from distributed.protocol import to_serialize

from dasktf import config
from dasktf.exceptions import CollectiveAbortedError, PeerLostError
from dasktf.runtime.p2p.direct import Links
from dasktf.runtime.p2p.mailbox import Key, Mailbox

if TYPE_CHECKING:
    from distributed import Worker
    from distributed.comm import Comm

logger = logging.getLogger(__name__)


@dataclass
class Outbox:
    """This member's stream of one group's messages to one peer (used on the loop):
    ``(message, written)`` pairs waiting, ``written`` set once the message is in
    the connection (the peer's kernel holds it)."""

    address: str
    queue: deque[tuple[dict[str, Any], concurrent.futures.Future[None]]] = field(
        default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    task: asyncio.Task[None] | None = None


@dataclass
class Endpoint:
    """One group as this worker holds it (shared by the loop and the thread)."""

    gid: str
    mailbox: Mailbox = field(default_factory=Mailbox)
    members: list[str] = field(default_factory=list)
    rank: int = -1
    #: set on the loop when the group closes here (ends the watches held on us)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    watches: list[concurrent.futures.Future[Any]] = field(default_factory=list)
    closing: bool = False
    #: the last collective this member completed (set by its training thread)
    completed: int = -1
    #: the other members know this group failed (told by us, or they told us)
    announced: bool = False
    #: this member's streams to its peers, by address (made on the loop)
    outboxes: dict[str, Outbox] = field(default_factory=dict)
    #: the sockets of the direct transport (:mod:`dasktf.runtime.p2p.direct`)
    links: Links | None = None

    @property
    def step(self) -> int:
        """The collective a failure now stops here: the one after the last completed
        (update numbers are consecutive)."""
        return self.completed + 1

    def error(self, reason: str, lost: str | None = None) -> Exception:
        """The error this member's waits raise (``step``: the collective it stops,
        one after the last it completed)."""
        if lost is None:
            return CollectiveAbortedError(
                f"Group {self.gid} was aborted during update {self.step} (the last "
                f"completed here: {self.completed}): {reason}")
        rank = self.members.index(lost) if lost in self.members else "?"
        return PeerLostError(
            f"Peer {lost} (rank {rank}) of group {self.gid} was lost during update "
            f"{self.step} (the last completed here: {self.completed}): {reason}. The "
            "other members stopped; the run decides whether to go on without it.",
            lost, self.step,
        )


class LoopTransport:
    """What a worker's training threads ask of its event loop (see the module)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on the worker's event loop; returns at once."""
        return asyncio.run_coroutine_threadsafe(coro, self.worker.loop.asyncio_loop)

    def post(self, ep: Endpoint, address: str, key: Key, payload: Any
             ) -> concurrent.futures.Future[None]:
        """Queue a message to ``address`` (from the training thread); the future is
        done once it is written (or the group failed: its mailbox says so)."""
        written: concurrent.futures.Future[None] = concurrent.futures.Future()
        message = {"key": (key.step, key.phase, key.round, key.chunk),
                   "payload": to_serialize(payload)}
        self.worker.loop.add_callback(self._queue, ep, address, message, written)
        return written

    def _queue(self, ep: Endpoint, address: str, message: dict[str, Any],
               written: concurrent.futures.Future[None]) -> None:
        box = ep.outboxes.get(address)
        if box is None:
            box = ep.outboxes[address] = Outbox(address)
            box.task = asyncio.ensure_future(self._pump(ep, box))
        if box.closed:  # the group left here already, or the stream broke
            written.set_result(None)
            return
        box.queue.append((message, written))
        box.wake.set()

    async def _pump(self, ep: Endpoint, box: Outbox) -> None:
        """Write ``box``'s messages to its peer's stream, every one queued
        meanwhile in one write, until the group closes here."""
        comm: Comm | None = None
        batch: list[tuple[dict[str, Any], concurrent.futures.Future[None]]] = []
        try:
            comm = await connect(box.address, timeout=config.get_seconds("p2p.timeout"),
                                 **self.worker.connection_args)
            await comm.write({"op": "dasktf_p2p_stream", "group": ep.gid,
                              "source": ep.rank, "reply": False})
            while True:
                if not box.queue:
                    if box.closed:
                        break
                    box.wake.clear()
                    await box.wake.wait()
                    continue
                batch = list(box.queue)
                box.queue.clear()
                await comm.write([message for message, _ in batch])
                for _, written in batch:
                    written.set_result(None)
                batch = []
        except OSError as e:  # CommClosedError included; a timeout to connect too
            self.lost(ep, box.address, e)
        finally:
            box.closed = True
            for _, written in [*batch, *box.queue]:
                if not written.done():
                    written.set_result(None)
            box.queue.clear()
            if comm is not None and not comm.closed():
                await comm.close()

    def close_outboxes(self, ep: Endpoint) -> None:
        """End ``ep``'s streams once what is queued is written (on the loop)."""
        for box in ep.outboxes.values():
            box.closed = True
            box.wake.set()

    async def hold_watch(self, ep: Endpoint, address: str) -> None:
        """Hold ``address``'s ``dasktf_p2p_watch`` open for the group's life: it
        breaks at once when that worker's process dies."""
        try:
            await self.worker.rpc(address).dasktf_p2p_watch(
                group=ep.gid, watcher=self.worker.address)
        except OSError as e:
            if not ep.closing:
                self.lost(ep, address, e)

    def lost(self, ep: Endpoint, address: str, cause: BaseException) -> None:
        """``address``'s connection closed: fail the group here, tell the others."""
        if ep.closing or ep.mailbox.failure is not None:
            return
        reason = f"its connection closed ({type(cause).__name__}: {cause})"
        ep.mailbox.fail(ep.error(reason, address))
        logger.warning("dasktf p2p group %s: peer %s lost after update %d: %s",
                       ep.gid, address, ep.completed, reason)
        self.broadcast_abort(ep, reason, address)

    def broadcast_abort(self, ep: Endpoint, reason: str, lost: str | None) -> None:
        """Tell every other member (but ``lost``) to fail the group (on the loop)."""
        ep.announced = True
        for address in ep.members:
            if address not in (self.worker.address, lost):
                self.worker.loop.add_callback(self._abort_peer, ep, address, reason, lost)

    async def _abort_peer(self, ep: Endpoint, address: str, reason: str,
                          lost: str | None) -> None:
        try:
            await asyncio.wait_for(self.worker.rpc(address).dasktf_p2p_abort(
                group=ep.gid, reason=reason, lost=lost),
                config.get_seconds("p2p.timeout"))
        except (OSError, asyncio.TimeoutError):
            pass  # that one is gone too: its own watchers will say so
