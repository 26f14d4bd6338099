"""Everything dasktf keeps on one Dask worker between tasks, in one owner.

As Dask's P2P shuffle keeps its runs in one ``_ShuffleRunManager`` on its worker
plugin (``distributed/shuffle/_worker_plugin.py``), a :class:`RunManager` holds
this worker's replicas (every engine's), the parameter-server slices
(``placement="ps"``), the p2p runs' links and the all-reduce groups' endpoints,
and the faults tests arm (:mod:`dasktf.testing`). It lives in
``worker.extensions`` (:func:`run_manager` makes it on first use: the graph and
holder engines register no plugin); the p2p plugin holds the same object.
Releasing a run, or closing the worker (Dask closes its extensions), closes what
it holds.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dasktf.data.streams import StreamedShard
from dasktf.exceptions import CollectiveAbortedError

if TYPE_CHECKING:
    from distributed import Worker

EXTENSION = "dasktf"
#: Closed groups remembered, so that a late message does not make a new endpoint.
_CLOSED_KEPT = 1024


class RunManager:
    """This worker's dasktf state (see the module)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.lock = threading.Lock()
        # (typed Any: the modules of these classes import this one)
        #: Replica by (run id, address; "address#slot": one adopted for a lost worker)
        self.replicas: dict[tuple[str, str], Any] = {}
        #: servers.PSShard by (run id, slice index)
        self.shards: dict[tuple[str, int], Any] = {}
        self.links: dict[str, Any] = {}  #: p2p.links.Link by run id
        self.endpoints: dict[str, Any] = {}  #: p2p.loop.Endpoint by group id
        self._closed_groups: deque[str] = deque(maxlen=_CLOSED_KEPT)
        self.closed = False
        #: (tests) ``hook(replica, update)`` before each p2p step; ``hook(group,
        #: dest, key, acknowledged)`` once a p2p message is sent (``acknowledged``:
        #: done once it is in the connection); each step takes ``factor`` x its
        #: compute and at least ``seconds`` (:func:`dasktf.testing.delay_worker`)
        self.step_hooks: list[Callable[..., None]] = []
        self.send_hooks: list[Callable[..., None]] = []
        self.delay = {"factor": 1.0, "seconds": 0.0}

    def link(self, run_id: str, make: Callable[[], Any]) -> Any:
        """The link of ``run_id`` here (made on first use)."""
        with self.lock:
            found = self.links.get(run_id)
            if found is None:
                found = self.links[run_id] = make()
            return found

    def endpoint(self, gid: str, make: Callable[[], Any]) -> Any:
        """The endpoint of ``gid`` (made on demand), ``None`` once it closed here."""
        with self.lock:
            ep = self.endpoints.get(gid)
            if ep is None and gid not in self._closed_groups:
                ep = self.endpoints[gid] = make()
            return ep

    def forget_endpoint(self, gid: str) -> None:
        with self.lock:
            self.endpoints.pop(gid, None)
            self._closed_groups.append(gid)

    def release(self, run_id: str) -> int:
        """Drop the replicas and server slices of ``run_id`` and leave its groups
        (never waits: it runs on the event loop); how many replicas there were."""
        with self.lock:
            keys = [k for k in self.replicas if k[0] == run_id]
            replicas = [self.replicas.pop(k) for k in keys]
            for key in [k for k in self.shards if k[0] == run_id]:
                del self.shards[key]
            link = self.links.pop(run_id, None)
        for replica in replicas:
            for shard in [replica.shard, *(s for _, s, _ in replica.adopted)]:
                if isinstance(shard, StreamedShard):
                    shard.close()  # its reading thread stops with the run
        if link is not None:
            link.close()
        return len(keys)

    def close(self) -> None:
        """The worker closes: every run here ends, every group fails."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            runs = {run for run, _ in [*self.replicas, *self.shards]} | set(self.links)
            endpoints = list(self.endpoints.values())
        for ep in endpoints:
            ep.mailbox.fail(CollectiveAbortedError(
                f"worker {self.address} is closing; group {ep.gid} ends with it."))
            ep.done.set()
        for run_id in runs:
            self.release(run_id)


def run_manager(worker: Worker | None = None) -> RunManager:
    """The :class:`RunManager` of ``worker`` (default: the one running this task),
    made on first use."""
    if worker is None:
        from distributed import get_worker

        worker = get_worker()
    manager = worker.extensions.get(EXTENSION)
    if manager is None:
        manager = worker.extensions.setdefault(EXTENSION, RunManager(worker.address))
    return manager  # type: ignore[no-any-return]
