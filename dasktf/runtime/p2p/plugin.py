"""The worker's side of the collectives: handlers on the worker's own Dask comms.

As Dask's P2P shuffle does (``distributed/shuffle/_worker_plugin.py``), a
:class:`P2PPlugin` registered on every worker adds handlers to ``worker.handlers``
and peers call them with ``worker.rpc(address)``: the workers' existing listeners
and connection pools, with TLS whenever the cluster has a ``Security``; nothing
new listens anywhere. The groups' endpoints live in the worker's
:class:`~dasktf.runtime.manager.RunManager` (:attr:`P2PPlugin.manager`). Handlers:

``dasktf_p2p_stream``
    a peer's messages for a group (:mod:`.loop`), held for the group's life, each
    filed in the group's mailbox (the endpoint is made on demand: a message may
    come before this worker formed the group).
``dasktf_p2p_direct``
    a peer's connection for the direct transport (:mod:`.handshake`).
``dasktf_p2p_watch``
    held open by each peer this worker receives from, for the group's life:
    when this worker's process dies, its end of the connection closes and the
    watching peer hears of it at once (no heartbeat to wait for).
``dasktf_p2p_abort``
    fail the group here: a peer noticed a lost member, or the run decided to stop.
``dasktf_p2p_epoch`` and ``dasktf_p2p_word``
    the client's: an epoch's result of a segment that spans epochs, and its word
    at that epoch's end (:mod:`.span`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from dasktf.runtime.manager import RunManager, run_manager
from dasktf.runtime.p2p import handshake
from dasktf.runtime.p2p.direct import Links
from dasktf.runtime.p2p.loop import Endpoint, LoopTransport
from dasktf.runtime.p2p.mailbox import Key

if TYPE_CHECKING:
    from distributed import Client, Worker
    from distributed.comm import Comm

PLUGIN_NAME = "dasktf-p2p"


class P2PPlugin(WorkerPlugin):
    """Registers the collective handlers on a worker (see the module)."""

    name = PLUGIN_NAME
    idempotent = True  # every run registers it; the first one stays

    worker: Worker
    manager: RunManager
    loop: LoopTransport

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        self.manager = run_manager(worker)
        self.loop = LoopTransport(worker)
        worker.handlers["dasktf_p2p_stream"] = self.stream
        worker.handlers["dasktf_p2p_direct"] = self.direct
        worker.handlers["dasktf_p2p_watch"] = self.watch
        worker.handlers["dasktf_p2p_abort"] = self.abort
        worker.handlers["dasktf_p2p_epoch"] = self.epoch
        worker.handlers["dasktf_p2p_word"] = self.word
        worker.extensions[PLUGIN_NAME] = self

    def teardown(self, worker: Worker) -> None:
        self.manager.close()

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

    def endpoint(self, gid: str) -> Endpoint | None:
        """The endpoint of ``gid`` (made on demand), ``None`` once it closed here."""
        return self.manager.endpoint(gid, lambda: self._make(gid))

    def _make(self, gid: str) -> Endpoint:
        ep = Endpoint(gid)
        ep.links = Links(
            connect=lambda rank: handshake.open_direct(self.worker, ep, rank),
            deliver=lambda source, key, payload: ep.mailbox.put(key, source, payload,
                                                                wake=False),
            lost=lambda rank, error: self.loop.lost(ep, ep.members[rank], error),
        )
        ep.mailbox.wakers.append(ep.links.wake)
        return ep

    def forget(self, ep: Endpoint) -> None:
        self.manager.forget_endpoint(ep.gid)
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
        await handshake.accept(comm, self.endpoint(group), group, source)

    async def watch(self, group: str, watcher: str) -> str:
        ep = self.endpoint(group)
        if ep is not None:
            await ep.done.wait()
        return "closed"

    def abort(self, group: str, reason: str, lost: str | None = None) -> str:
        ep = self.endpoint(group)
        if ep is not None:
            ep.announced = True  # the sender told the others
            ep.mailbox.fail(ep.error(reason, lost))
        return "OK"

    async def epoch(self, run: str, epoch: int, wait: float) -> Any:
        """Run ``run``'s result of epoch ``epoch`` here, waiting up to ``wait``
        seconds for it; ``None``: not there (yet)."""
        link = self.manager.links.get(run)
        found = None if link is None else await link.gate.take(epoch, wait)
        return None if found is None else to_serialize(found)

    def word(self, run: str, epoch: int, go: bool) -> str:
        """The client's word after run ``run``'s epoch ``epoch``: go on, or end."""
        link = self.manager.links.get(run)
        if link is not None:
            link.gate.say(epoch, go)
        return "OK"


def register(client: Client) -> None:
    """Register the collective handlers on every worker of ``client``'s cluster
    (and on those that join later); idempotent."""
    client.register_plugin(P2PPlugin(), name=PLUGIN_NAME)


def abort_group(gid: str, reason: str, dask_worker: Worker | None = None) -> bool:
    """Fail group ``gid`` on this worker, releasing a thread that waits in it (run
    with ``client.run(abort_group, gid, reason, workers=...)``). ``True`` if the
    group was open here."""
    ep = run_manager(dask_worker).endpoints.get(gid)
    if ep is None:
        return False
    ep.mailbox.fail(ep.error(reason))
    return True

