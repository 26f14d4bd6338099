"""A replica's link to its peers in a p2p run: its group, and the run's stop request.

One :class:`Link` per run and worker in each process (like the replica registry of
:mod:`dasktf.runtime.replica`). It keeps the worker's :class:`Group` from one
segment task to the next while the membership stands (the group id is the same),
so the codecs' error-feedback residuals and the peers' watches carry on; a new
membership (a loss, a re-form) brings a new id and a new group. The client's stop
request (:func:`request_stop`) sets :attr:`Link.stop`, which the segment's next
collective carries as its vote.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dasktf.runtime.p2p.group import Group

if TYPE_CHECKING:
    from distributed import Worker


@dataclass(frozen=True)
class GroupSpec:
    """How the members of a group sum, the same on every member (the client's
    configuration: members choosing otherwise would wait for messages never sent)."""

    gid: str
    members: tuple[str, ...]
    codec: str = "none"
    algorithm: str = "auto"
    threshold: int = 1 << 20
    timeout: float = 300.0


class Link:
    """This worker's group of one run, and its stop request."""

    def __init__(self) -> None:
        self.group: Group | None = None
        #: the client asked the run to stop: voted in the next collective
        self.stop = False
        #: the last update this replica had applied when the request arrived
        self.stop_heard_after: int | None = None
        self._lock = threading.Lock()

    def group_for(self, spec: GroupSpec) -> Group:
        """The group of ``spec`` here: the one already formed, or a new one (an
        older membership's is left first)."""
        with self._lock:
            group = self.group
            if group is not None and group.gid == spec.gid and not group.closed:
                return group
            if group is not None:
                group.close(flush=False)
            self.group = Group(spec.gid, list(spec.members), codec=spec.codec,
                               algorithm=spec.algorithm, threshold=spec.threshold,
                               timeout=spec.timeout)
            return self.group

    def fail(self, error: BaseException) -> None:
        """Leave the group after ``error`` (the other members hear of it at once)."""
        with self._lock:
            group, self.group = self.group, None
        if group is not None:
            group.close(error)

    def close(self) -> None:
        """Leave the group without waiting for anything (the run is over)."""
        with self._lock:
            group, self.group = self.group, None
        if group is not None:
            group.close(flush=False)


#: (run id, worker address) -> its link
_LINKS: dict[tuple[str, str], Link] = {}
_LOCK = threading.Lock()


def link(run_id: str, address: str) -> Link:
    """The link of ``run_id`` on the worker at ``address`` (made on first use)."""
    with _LOCK:
        found = _LINKS.get((run_id, address))
        if found is None:
            found = _LINKS[(run_id, address)] = Link()
        return found


def request_stop(run_id: str, dask_worker: Worker | None = None) -> bool:
    """Ask this worker's replica of ``run_id`` to vote for stopping in its next
    collective (run with ``client.run``); ``True`` if it had a link."""
    from dasktf.runtime.replica import registered_replicas

    if dask_worker is None:
        from distributed import get_worker

        dask_worker = get_worker()
    with _LOCK:
        found = _LINKS.get((run_id, dask_worker.address))
    if found is None:
        return False
    replica = registered_replicas().get((run_id, dask_worker.address))
    found.stop_heard_after = replica.applied if replica is not None else None
    found.stop = True
    return True


def close_links(run_id: str) -> int:
    """Leave every group of ``run_id`` in this process (the run ends or re-forms its
    replicas); how many links there were. Never waits: it runs on the event loop."""
    with _LOCK:
        mine = [k for k in _LINKS if k[0] == run_id]
        links = [_LINKS.pop(k) for k in mine]
    for one in links:
        one.close()
    return len(links)
