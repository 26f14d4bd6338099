"""The worker's side of the collectives: handlers on the worker's own Dask comms.

As Dask's P2P shuffle does (``distributed/shuffle/_worker_plugin.py``), a
:class:`P2PPlugin` registered on every worker adds handlers to ``worker.handlers``
and peers call them with ``worker.rpc(address)``: the workers' existing listeners
and connection pools, with TLS whenever the cluster has a ``Security``; nothing
new listens anywhere. Three handlers:

``dasktf_p2p_put``
    a peer's message for a group: filed in that group's :class:`Mailbox` under its
    key, where the training thread waits for it (a message may come before this
    worker formed the group: the endpoint is made on demand).
``dasktf_p2p_watch``
    held open by each peer this worker receives from, for the group's life:
    when this worker's process dies, its end of the connection closes and the
    watching peer hears of it at once (no heartbeat to wait for).
``dasktf_p2p_abort``
    fail the group here: a peer noticed a lost member, or the run decided to stop.

Sends are coroutines on the worker's event loop, scheduled from the training
thread (:meth:`P2PPlugin.submit`), so the thread never blocks on the network; a
send that fails, or a watch that breaks, fails the group here and tells the other
members (:meth:`P2PPlugin.lost`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from dasktf import config
from dasktf.exceptions import CollectiveAbortedError, PeerLostError
from dasktf.runtime.p2p.mailbox import Key, Mailbox

if TYPE_CHECKING:
    from distributed import Client, Worker

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dasktf-p2p"
#: Closed groups remembered, so that a late message does not make a new endpoint.
_CLOSED_KEPT = 1024


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
        worker.handlers["dasktf_p2p_put"] = self.put
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
            return ep

    def find(self, gid: str) -> Endpoint | None:
        """The endpoint of ``gid`` if it is open here (never makes one)."""
        with self._lock:
            return self._endpoints.get(gid)

    def forget(self, ep: Endpoint) -> None:
        with self._lock:
            self._endpoints.pop(ep.gid, None)
            self._closed.append(ep.gid)

    # -- handlers (on the event loop) ---------------------------------------------
    def put(self, group: str, key: tuple[int, str, int, int], source: int,
            payload: Any) -> str:
        ep = self.endpoint(group)
        if ep is None:
            return "closed"
        # (kept after a failure too: it may complete a collective a peer completed)
        ep.mailbox.put(Key(*key), int(source), payload)
        return "OK"

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

    async def send(self, ep: Endpoint, address: str, key: Key, payload: Any) -> None:
        try:
            await self.worker.rpc(address).dasktf_p2p_put(
                group=ep.gid, key=(key.step, key.phase, key.round, key.chunk),
                source=ep.rank, payload=to_serialize(payload),
            )
        except OSError as e:  # CommClosedError included
            self.lost(ep, address, e)

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
