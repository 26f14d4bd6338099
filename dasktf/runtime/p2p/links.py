"""A replica's link to its peers in a p2p run: its group, and the run's stop request.

One :class:`Link` per run on each worker, held by its
:class:`~dasktf.runtime.manager.RunManager` with its replicas (which closes it
with the run). It keeps the worker's :class:`Group` from one segment task to the
next while the membership stands (the group id is the same), so the codecs'
error-feedback residuals and the peers' watches carry on; a new membership (a
loss, a re-form) brings a new id and a new group. The client's stop
request (:func:`request_stop`) sets :attr:`Link.stop`, which the segment's next
collective carries as its vote.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dasktf.runtime.manager import run_manager
from dasktf.runtime.p2p.group import Group
from dasktf.runtime.p2p.span import Gate

if TYPE_CHECKING:
    from collections.abc import Callable

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
    #: shard_state="gradients": the reduce-scatter's bucket, in bytes
    shard_bucket: int = 4 << 20
    #: shard_state="gradients": the gradient bytes over which a chain model's
    #: backward pass runs in stages (:mod:`dasktf.runtime.staged`); None: never
    shard_stage: int | None = 16 << 20


class Link:
    """This worker's group of one run, and its stop request."""

    def __init__(self, step_hooks: list[Callable[..., None]]) -> None:
        self.group: Group | None = None
        #: (tests) called before each step (:class:`~dasktf.runtime.manager.RunManager`)
        self.step_hooks = step_hooks
        #: the client asked the run to stop: voted in the next collective
        self.stop = False
        #: the last update this replica had applied when the request arrived
        self.stop_heard_after: int | None = None
        #: a spanning segment's epoch ends (:mod:`dasktf.runtime.p2p.span`)
        self.gate = Gate()
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

    def fail(self, error: BaseException | None = None) -> None:
        """Leave the group without waiting for anything; after ``error``, the
        other members hear of it at once."""
        with self._lock:
            group, self.group = self.group, None
        if group is not None:
            group.close(error, flush=False)

    def close(self, error: BaseException | None = None) -> None:
        """The run is over: leave the group, end a segment waiting at its gate."""
        self.gate.close()
        self.fail(error)


def link(run_id: str, address: str | None = None) -> Link:
    """The link of ``run_id`` on this worker (made on first use; ``address``: this
    worker's, as the caller knows it)."""
    manager = run_manager()
    return manager.link(run_id, lambda: Link(manager.step_hooks))


def request_stop(run_id: str, dask_worker: Worker | None = None) -> bool:
    """Ask this worker's replica of ``run_id`` to vote for stopping in its next
    collective (run with ``client.run``); ``True`` if it had a link."""
    manager = run_manager(dask_worker)
    found = manager.links.get(run_id)
    if found is None:
        return False
    replica = manager.replicas.get((run_id, manager.address))
    found.stop_heard_after = replica.applied if replica is not None else None
    found.stop = True
    return True

