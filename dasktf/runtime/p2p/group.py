"""A group of workers summing buffers together, as the training thread sees it.

A :class:`Group` is formed on each member inside a long-running Dask task (one
per worker) with the same id and the same ordered member addresses; the member's
rank is its place in that list. :meth:`Group.allreduce` is synchronous: it returns
the sum, the same bits on every member, once this member's part is done. Its
messages go out on the worker's event loop; what peers send waits in the group's
mailbox (:mod:`dasktf.runtime.p2p.plugin`, :mod:`dasktf.runtime.p2p.loop`).

Bounds: every wait for a peer is at most ``dasktf.p2p.timeout``; a member whose
connection closes fails the group on every survivor at once
(:class:`~dasktf.exceptions.PeerLostError`, naming it and the update); at most the
previous collective's messages are still unwritten when the next one starts (on
the direct sockets, none: each collective ends with its bytes in the kernel).
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from dask.utils import parse_bytes

from dasktf import config
from dasktf.exceptions import (
    CollectiveAbortedError,
    PeerTimeoutError,
)
from dasktf.runtime.p2p.algorithms import (
    ALGORITHMS,
    RUNNERS,
    Coding,
    Payload,
    choose,
    payload_nbytes,
    sources,
)
from dasktf.runtime.p2p.mailbox import Key, Mailbox
from dasktf.runtime.p2p.plugin import P2PPlugin
from dasktf.wire.codecs import Codec, get_codec

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from distributed import Worker

    from dasktf.runtime.p2p.loop import Endpoint

    #: a collective the group runs (as ``RUNNERS``' algorithms are called)
    Runner = Callable[[Any, np.ndarray, np.ndarray | None, Coding, int],
                      tuple[np.ndarray, np.ndarray | None]]

#: How many collectives of this process's groups took each transport (``"direct"``,
#: ``"loop"``, ``"mixed"``; ``CollectiveStats.transport``): a TLS run that fell back
#: to the event loop shows here and in the log.
collectives_by_transport: collections.Counter[str] = collections.Counter()


@dataclass
class CollectiveStats:
    """One all-reduce as this member saw it."""

    step: int
    algorithm: str
    #: bytes of the float32 buffer summed
    nbytes: int
    seconds: float
    #: of which waiting for peers' messages
    wait_seconds: float
    #: payload bytes this member sent and received (codec forms, scalars included)
    bytes_sent: int
    bytes_received: int
    messages: int
    #: how this member's messages went: ``"direct"`` (the training threads' own
    #: sockets, plain TCP or TLS), ``"loop"`` (the workers' event loops), ``"mixed"``
    #: (some peers each way: one's socket could not leave Tornado), ``""`` (none sent)
    transport: str = ""


class Group:
    """This worker's membership of one all-reduce group.

    Parameters
    ----------
    gid
        The group's id, the same on every member and new for every membership (a
        run id and a generation): messages are keyed by it, so two groups never mix.
    members
        The members' worker addresses, in rank order, the same list on every member.
    codec
        How values travel (:func:`dasktf.wire.codecs.get_codec`: ``None``/``"none"``,
        ``"fp16"``, ``"bf16"``, ``"int8"``, ``"topk:R"``), with error feedback.
    algorithm
        ``"auto"`` (by the buffer's bytes, see ``threshold``), ``"doubling"``,
        ``"direct"`` or ``"ring"``; default ``dasktf.p2p.algorithm``.
    threshold
        ``"auto"``: buffers of at least this many bytes use ``direct``, smaller
        ones recursive doubling; default ``dasktf.p2p.bandwidth-threshold``.
        The engine passes these two from the client's configuration, so that every
        member chooses alike (a member choosing otherwise would wait for messages
        that never come, until the timeout).
    timeout
        The longest wait for one peer's message, in seconds; default
        ``dasktf.p2p.timeout``.
    worker
        This worker (default: the worker running the calling task).

    Examples
    --------
    >>> def train(members, gid):  # one long-running task per worker  # doctest: +SKIP
    ...     with Group(gid, members) as group:
    ...         for step in range(steps):
    ...             total, (count,) = group.allreduce(grad, step, np.array([n]))
    """

    def __init__(self, gid: str, members: list[str], *, codec: str | Codec | None = None,
                 algorithm: str | None = None, threshold: int | str | None = None,
                 timeout: float | None = None,
                 worker: Worker | None = None) -> None:
        if worker is None:
            from distributed import get_worker

            worker = get_worker()
        self.worker = worker
        self.plugin = P2PPlugin.on(worker)
        self.transport = self.plugin.loop
        #: (tests) called once a message is sent (:mod:`dasktf.runtime.manager`)
        self.send_hooks = self.plugin.manager.send_hooks
        self.members = [str(m) for m in members]
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"Group {gid}: a member is named twice in {self.members}.")
        if worker.address not in self.members:
            raise ValueError(
                f"Group {gid}: this worker ({worker.address}) is not among its members "
                f"{self.members}; form a group only on its members."
            )
        self.gid = gid
        self.rank = self.members.index(worker.address)
        self.size = len(self.members)
        self.coding = Coding(get_codec(codec))
        self.algorithm = str(config.get("p2p.algorithm", algorithm))
        if self.algorithm not in ("auto", *ALGORITHMS):
            raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS}; got "
                             f"{self.algorithm!r}.")
        self.threshold = _bytes(config.get("p2p.bandwidth-threshold", threshold))
        self.timeout = config.get_seconds("p2p.timeout", timeout)
        ep = self.plugin.endpoint(gid)
        if ep is None or ep.rank >= 0:
            raise ValueError(
                f"Group {gid} was already formed on {worker.address}; every new "
                "membership needs a new group id."
            )
        ep.members, ep.rank = self.members, self.rank
        self._ep = ep
        #: messages on sockets of the training threads' own (plain TCP or TLS), or
        #: through the workers' event loops (``dasktf.p2p.transport: loop``, other
        #: comms, or a peer whose socket cannot leave Tornado: ``links.loop``)
        self.links = ep.links if (
            config.get("p2p.transport") == "auto" and ep.links is not None
            and all(m.startswith(("tcp://", "tls://")) for m in self.members)) else None
        #: (peer, collective, written) of the event loop's messages still in flight
        self._pending: collections.deque[
            tuple[str, int, concurrent.futures.Future[Any]]] = collections.deque()
        self._last = -1
        self.closed = False
        self.last: CollectiveStats | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._step_sent = self._step_received = self._messages = 0
        self._step_direct = self._step_loop = 0
        self._wait = 0.0
        for source in sources(self.rank, self.size):
            ep.watches.append(self.transport.submit(
                self.transport.hold_watch(ep, self.members[source])))

    # -- the collective -----------------------------------------------------------
    def allreduce(self, buf: np.ndarray, step: int, scalars: np.ndarray | None = None,
                  algorithm: str | None = None, runner: Runner | None = None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
        """The sum of every member's ``buf`` (flattened, float32) and ``scalars``
        (float64), the same bits on every member.

        Parameters
        ----------
        buf
            This member's values; not modified.
        step
            The collective's number, increasing from call to call and the same on
            every member (the update number; a second collective in one update
            needs a number of its own).
        scalars
            A few float64 values summed exactly alongside (counts, loss sums); every
            member passes as many, or none.
        algorithm
            ``"doubling"``, ``"direct"`` or ``"ring"`` for this call; default: the
            group's (``"auto"``: chosen by the buffer's bytes).
        runner
            Another collective over this group's transport, called as the
            algorithms are (``runner(group, buf, scalars, coding, step)``): a
            sharded step (:func:`dasktf.runtime.p2p.sharding.sharded_update`).

        Raises
        ------
        PeerLostError
            A member was lost (:class:`~dasktf.exceptions.PeerTimeoutError`: one sent
            nothing within the timeout).
        CollectiveAbortedError
            The group was aborted.
        """
        if self.closed:
            raise CollectiveAbortedError(f"Group {self.gid} is closed on this worker.")
        if step <= self._last:
            raise ValueError(
                f"Group {self.gid}: collective {step} after {self._last}; numbers must "
                "increase, the same on every member."
            )
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}.")
        flat = np.ascontiguousarray(buf, np.float32).ravel()
        self._settle(keep=self._last)  # the previous collective's may still fly
        self._last = step
        self._ep.mailbox.begin(step)
        name = algorithm or self.algorithm
        if runner is not None:
            # (a functools.partial of one: its function's name)
            name = getattr(getattr(runner, "func", runner), "__name__", "custom")
        elif name == "auto":
            name = choose(flat.nbytes, self.size, self.threshold, codec=self.coding.codec)
        self._step_sent = self._step_received = self._messages = 0
        self._step_direct = self._step_loop = 0
        self._wait = 0.0
        start = time.perf_counter()
        if self.size == 1 and runner is None:
            out = flat.copy()
            sc = None if scalars is None else np.array(scalars, np.float64, copy=True)
        else:
            run = runner if runner is not None else RUNNERS[name]
            out, sc = run(self, flat, scalars, self.coding, step)
            if self.links is not None:  # the caller may reuse what is still queued
                self.links.flush(self.timeout, self.members.__getitem__, step)
        transport = ("mixed" if self._step_direct and self._step_loop else
                     "direct" if self._step_direct else "loop" if self._step_loop else "")
        self.last = CollectiveStats(step, name, flat.nbytes, time.perf_counter() - start,
                                    self._wait, self._step_sent, self._step_received,
                                    self._messages, transport)
        if transport:
            collectives_by_transport[transport] += 1
        self._ep.completed = step
        return out, sc

    # -- the transport the algorithms use -----------------------------------------
    def send(self, dest: int, key: Key, payload: Payload) -> None:
        address = self.members[dest]
        n = payload_nbytes(payload)
        self._step_sent += n
        self.bytes_sent += n
        self._messages += 1
        if self.links is not None and self.links.send(dest, key, payload):
            self._step_direct += 1
            if self.send_hooks:  # (tests) the message handed to the kernel, the peer's
                self.links.flush(self.timeout, self.members.__getitem__, key.step)
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                future.set_result(None)
                for hook in self.send_hooks:
                    hook(self, dest, key, future)
            return
        self._step_loop += 1
        future = self.transport.post(self._ep, address, key, payload)
        self._pending.append((address, key.step, future))
        for hook in self.send_hooks:
            hook(self, dest, key, future)

    def recv(self, source: int, key: Key) -> Payload:
        start = time.perf_counter()
        try:
            payload: Payload = self._ep.mailbox.take(
                key, source, self.timeout, self.members[source],
                None if self.links is None else self.links.progress)
        except PeerTimeoutError as e:
            self._ep.mailbox.fail(e)  # (the others hear of it when we leave)
            raise
        finally:
            self._wait += time.perf_counter() - start
        n = payload_nbytes(payload)
        self._step_received += n
        self.bytes_received += n
        return payload

    def _settle(self, keep: int) -> None:
        """Collect the writes in: those already done, and every one of a
        collective before ``keep`` (each wait bounded by the timeout)."""
        mailbox = self._ep.mailbox
        while self._pending:
            address, sent_in, future = self._pending[0]
            if not future.done() and sent_in >= keep:
                return
            # (a failure ends the wait: a send to a lost peer may hang in connect)
            concurrent.futures.wait([future, mailbox.failed], self.timeout,
                                    concurrent.futures.FIRST_COMPLETED)
            if mailbox.failure is not None:
                raise mailbox.failure
            if not future.done():
                raise PeerTimeoutError(
                    f"Peer {address} did not take a message of update {sent_in} "
                    f"within dasktf.p2p.timeout ({self.timeout:g}s).", address, sent_in,
                )
            future.result()  # a send that failed otherwise than by a lost connection
            self._pending.popleft()

    @property
    def mailbox(self) -> Mailbox:
        """This member's mailbox: its ``failed``/``failure`` (a peer lost, an abort)
        and the most bytes of each phase that waited in it (``peak``)."""
        return self._ep.mailbox

    # -- ending -----------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Fail the group here and on every other member (the run stops)."""
        error = CollectiveAbortedError(
            f"Group {self.gid} was aborted by {self.worker.address}: {reason}")
        self._ep.mailbox.fail(error)
        self.transport.broadcast_abort(self._ep, reason, None)

    def close(self, error: BaseException | None = None, flush: bool = True) -> None:
        """Leave the group. Without ``error``, first wait (bounded) until the peers
        took every message (``flush=False``: not; on the worker's event loop, which
        the writes need, or once every member is done); with one (or
        after a failure) tell the other members at once, unless they know already,
        so none waits for this one."""
        if self.closed:
            return
        self.closed = True
        ep = self._ep
        failure = ep.mailbox.failure or error
        if failure is not None and not ep.announced:
            self.abort(f"member {self.worker.address} left the group after "
                       f"{type(failure).__name__}: {failure}")
        elif error is None and ep.mailbox.failure is None and flush:
            try:
                self.flush()
            finally:
                self._end(ep)
            return
        self._end(ep)

    def flush(self) -> None:
        """Wait (each at most ``timeout``) until the peers took every
        message this member sent."""
        if self.links is not None:
            self.links.flush(self.timeout, self.members.__getitem__, self._last)
        self._settle(keep=self._last + 1)

    def _end(self, ep: Endpoint) -> None:
        ep.closing = True
        for watch in ep.watches:
            watch.cancel()
        self.worker.loop.add_callback(ep.done.set)
        self.worker.loop.add_callback(self.transport.close_outboxes, ep)
        self.plugin.forget(ep)

    @property
    def completed(self) -> int:
        """The last collective this member completed (-1: none): after a failure,
        the members may differ by one (the run reconciles them)."""
        return self._ep.completed

    def __enter__(self) -> Group:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(exc)

    def __repr__(self) -> str:
        return f"<Group {self.gid} rank {self.rank}/{self.size}>"


def _bytes(value: Any) -> int:
    return int(parse_bytes(value)) if isinstance(value, str) else int(value)
