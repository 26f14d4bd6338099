"""The worker's side of the collectives: handlers on the worker's own Dask comms.

As Dask's P2P shuffle does (``distributed/shuffle/_worker_plugin.py``), a
:class:`P2PPlugin` registered on every worker adds handlers to ``worker.handlers``
and peers call them with ``worker.rpc(address)``: the workers' existing listeners
and connection pools, with TLS whenever the cluster has a ``Security``; nothing
new listens anywhere. Three handlers:

``dasktf_p2p_stream``
    a peer's stream of messages for a group: one connection per group and pair,
    opened by the sender on its first message and held for the group's life; each
    message is filed in that group's :class:`Mailbox` under its key, where the
    training thread waits for it (a message may come before this worker formed the
    group: the endpoint is made on demand). No replies: TCP's own flow control
    bounds what is in flight, and a request-reply per message cost its two worker
    event loops more CPU than the step's whole TensorFlow compute on a small model
    (docs/p2p.md).
``dasktf_p2p_watch``
    held open by each peer this worker receives from, for the group's life:
    when this worker's process dies, its end of the connection closes and the
    watching peer hears of it at once (no heartbeat to wait for).
``dasktf_p2p_abort``
    fail the group here: a peer noticed a lost member, or the run decided to stop.

Sends are queued from the training thread onto the worker's event loop
(:meth:`P2PPlugin.post`), which writes them to the peer's stream (every message
queued meanwhile in one write), so the thread never blocks on the network; a send
that fails, or a watch that breaks, fails the group here and tells the other
members (:meth:`P2PPlugin.lost`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.comm import connect
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from dasktf import config
from dasktf.exceptions import CollectiveAbortedError, PeerLostError
from dasktf.runtime.p2p.direct import Channel, Links, detachable, take_socket
from dasktf.runtime.p2p.mailbox import Key, Mailbox

if TYPE_CHECKING:
    from distributed import Client, Worker
    from distributed.comm import Comm

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dasktf-p2p"
#: Closed groups remembered, so that a late message does not make a new endpoint.
_CLOSED_KEPT = 1024


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


class P2PPlugin(WorkerPlugin):
    """Registers the collective handlers on a worker (see the module)."""

    name = PLUGIN_NAME
    idempotent = True  # every run registers it; the first one stays

    worker: Worker

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._endpoints: dict[str, Endpoint] = {}
        self._closed: deque[str] = deque(maxlen=_CLOSED_KEPT)
        worker.handlers["dasktf_p2p_stream"] = self.stream
        worker.handlers["dasktf_p2p_direct"] = self.direct
        worker.handlers["dasktf_p2p_watch"] = self.watch
        worker.handlers["dasktf_p2p_abort"] = self.abort
        worker.extensions[PLUGIN_NAME] = self

    def teardown(self, worker: Worker) -> None:
        with self._lock:
            endpoints = list(self._endpoints.values())
        for ep in endpoints:
            ep.mailbox.fail(CollectiveAbortedError(
                f"worker {worker.address} is closing; group {ep.gid} ends with it."))
            ep.done.set()

    @classmethod
    def on(cls, worker: Worker) -> P2PPlugin:
        """The plugin of ``worker``.

        Raises
        ------
        RuntimeError
            Not registered there (:func:`register` was not called).
        """
        plugin = worker.extensions.get(PLUGIN_NAME)
        if plugin is None:
            raise RuntimeError(
                f"Worker {worker.address} has no dasktf p2p plugin; register it first "
                "with dasktf.runtime.p2p.plugin.register(client)."
            )
        return plugin  # type: ignore[no-any-return]

    # -- endpoints ---------------------------------------------------------------
    def endpoint(self, gid: str) -> Endpoint | None:
        """The endpoint of ``gid`` (made on demand), ``None`` once it closed here."""
        with self._lock:
            ep = self._endpoints.get(gid)
            if ep is None and gid not in self._closed:
                ep = self._endpoints[gid] = Endpoint(gid)
                ep.links = self._links(ep)
            return ep

    def _links(self, ep: Endpoint) -> Links:
        links = Links(
            connect=lambda rank: self.open_direct(ep, rank),
            deliver=lambda source, key, payload: ep.mailbox.put(key, source, payload,
                                                                wake=False),
            lost=lambda rank, error: self.lost(ep, ep.members[rank], error),
        )
        ep.mailbox.wakers.append(links.wake)
        return links

    def find(self, gid: str) -> Endpoint | None:
        """The endpoint of ``gid`` if it is open here (never makes one)."""
        with self._lock:
            return self._endpoints.get(gid)

    def forget(self, ep: Endpoint) -> None:
        with self._lock:
            self._endpoints.pop(ep.gid, None)
            self._closed.append(ep.gid)
        if ep.links is not None:
            ep.links.close()

    # -- handlers (on the event loop) ---------------------------------------------
    async def stream(self, comm: Comm, group: str, source: int) -> None:
        """A peer's messages for ``group``, until it closes the stream (it left the
        group, or its process died: the watches tell which)."""
        ep = self.endpoint(group)
        try:
            while True:
                messages = await comm.read()
                if ep is None:  # a group closed here: late messages are dropped
                    continue
                for message in messages:
                    # (kept after a failure too: it may complete a collective a
                    # peer completed)
                    ep.mailbox.put(Key(*message["key"]), int(source), message["payload"])
        except OSError:
            pass

    async def direct(self, comm: Comm, group: str, source: int) -> None:
        """A peer's connection for the direct transport: its socket goes to this
        member's training thread, then the peer hears ``READY`` on it.

        The order matters: Tornado reads whatever arrives on an idle connection into
        a buffer of its own (to notice a close), so nothing may reach a socket
        before it leaves Tornado. The peer sends nothing after its request until it
        read ``READY``, which goes out on the raw socket once this end left Tornado;
        the peer's end left Tornado as its request was written. Where this end
        cannot leave Tornado (:func:`~dasktf.runtime.p2p.direct.take_socket`), the
        peer hears ``LOOP`` and sends through the event loop instead.
        """
        ep = self.endpoint(group)
        taken = take_socket(comm)
        if taken is None:  # the comm stays Tornado's: the answer goes through it
            logger.warning("dasktf p2p group %s: the connection from rank %s cannot "
                           "leave Tornado (%s); its messages take the event loop",
                           group, source, type(comm).__name__)
            stream = getattr(comm, "stream", None)
            if stream is not None:
                await stream.write(LOOP)
            return
        sock, buffered = taken
        if ep is None or ep.links is None or buffered or sock.pending():
            _send_byte(sock, CLOSED)  # (buffered: the peer broke the protocol)
            sock.close()
            return
        _send_byte(sock, READY)
        ep.links.arrived(int(source), sock)

    def open_direct(self, ep: Endpoint, rank: int) -> Channel | None:
        """A direct socket to member ``rank`` (from the training thread: waits,
        bounded, while the loop opens it and the peer says it is ready); ``None``
        where either end's socket cannot leave Tornado (messages to ``rank`` then
        take the event loop: said in the log and in the group's stats).

        Raises
        ------
        OSError
            The peer could not be reached, or closed the group.
        """
        timeout = config.get_seconds("p2p.timeout")
        address = ep.members[rank]
        # Every wait here also ends when the group fails (a lost member: Dask's
        # connect retries a refused address until its timeout).
        opening = self.submit(self._open_direct(ep, address, timeout))
        concurrent.futures.wait([opening, ep.mailbox.failed], timeout,
                                concurrent.futures.FIRST_COMPLETED)
        if not opening.done():
            opening.cancel()
            raise ConnectionError(f"no direct connection to {address} for group "
                                  f"{ep.gid}: {ep.mailbox.failure or 'timed out'}")
        taken = opening.result()
        if taken is None:
            logger.warning("dasktf p2p group %s: the connection to %s cannot leave "
                           "Tornado; this member's messages to it take the event loop",
                           ep.gid, address)
            return None
        sock, buffered = taken
        try:
            answer = buffered[:1] or _await_byte(sock, timeout, ep.mailbox)
        except OSError:
            sock.close()
            raise
        if answer == LOOP:  # (the peer's end stayed in Tornado, which closes it)
            sock.close()
            logger.warning("dasktf p2p group %s: %s cannot take a direct connection; "
                           "this member's messages to it take the event loop",
                           ep.gid, address)
            return None
        if answer != READY:
            sock.close()
            raise ConnectionError(
                f"peer {address} refused a direct connection for group {ep.gid} "
                f"({'it closed the group' if answer == CLOSED else 'no answer'})")
        sock.sock.setblocking(False)
        return sock

    async def _open_direct(self, ep: Endpoint, address: str, timeout: float
                           ) -> tuple[Channel, bytes] | None:
        comm = await connect(address, timeout=timeout, **self.worker.connection_args)
        if not detachable(comm):  # asked for nothing: the peer is not waiting on it
            comm.abort()
            return None
        try:
            await comm.write({"op": "dasktf_p2p_direct", "group": ep.gid,
                              "source": ep.rank, "reply": False})
        except BaseException:
            comm.abort()
            raise
        taken = take_socket(comm)  # (READY, if it came already, is in the buffer)
        assert taken is not None  # (detachable above, and nobody read meanwhile)
        return taken

    async def watch(self, group: str, watcher: str) -> str:
        ep = self.endpoint(group)
        if ep is not None:
            await ep.done.wait()
        return "closed"

    def abort(self, group: str, reason: str, lost: str | None = None) -> str:
        ep = self.endpoint(group)
        if ep is not None:
            ep.announced = True  # the sender told the others
            ep.mailbox.fail(_error(ep, reason, lost))
        return "OK"

    # -- what the training thread asks of the loop ---------------------------------
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
        ep.mailbox.fail(_error(ep, reason, address))
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


#: the one byte a peer answers a direct connection with, on the raw socket (``LOOP``:
#: through Tornado, whose socket that end could not take: use the event loop)
READY, CLOSED, LOOP = b"R", b"C", b"L"


def _await_byte(channel: Channel, timeout: float, mailbox: Mailbox) -> bytes:
    """One byte from ``channel`` (``b""``: closed), waiting at most ``timeout`` and no
    longer than the group stands."""
    sock = channel.sock
    end = time.monotonic() + timeout
    while time.monotonic() < end and mailbox.failure is None:
        sock.settimeout(min(0.1, max(end - time.monotonic(), 0.001)))
        try:
            return sock.recv(1)
        except TimeoutError:
            continue
    return b""


def _send_byte(channel: Channel, byte: bytes) -> None:
    try:
        channel.sock.send(byte)
    except OSError:
        pass  # the peer is gone: its wait for the byte fails


def _error(ep: Endpoint, reason: str, lost: str | None) -> Exception:
    """The error this member's waits raise (``step``: the collective it stops,
    one after the last it completed)."""
    step = ep.step
    if lost is None:
        return CollectiveAbortedError(
            f"Group {ep.gid} was aborted during update {step} (the last completed "
            f"here: {ep.completed}): {reason}")
    rank = ep.members.index(lost) if lost in ep.members else "?"
    return PeerLostError(
        f"Peer {lost} (rank {rank}) of group {ep.gid} was lost during update {step} "
        f"(the last completed here: {ep.completed}): {reason}. The other members "
        "stopped; the run decides whether to go on without it.",
        lost, step,
    )


def register(client: Client) -> None:
    """Register the collective handlers on every worker of ``client``'s cluster
    (and on those that join later); idempotent."""
    client.register_plugin(P2PPlugin(), name=PLUGIN_NAME)


def abort_group(gid: str, reason: str, dask_worker: Worker | None = None) -> bool:
    """Fail group ``gid`` on this worker, releasing a thread that waits in it (run
    with ``client.run(abort_group, gid, reason, workers=...)``). ``True`` if the
    group was open here."""
    from distributed import get_worker

    worker = dask_worker if dask_worker is not None else get_worker()
    ep = P2PPlugin.on(worker).find(gid)
    if ep is None:
        return False
    ep.mailbox.fail(_error(ep, reason, None))
    return True
