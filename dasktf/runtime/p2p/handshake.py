"""How two members' training threads get a direct socket (:mod:`.direct`) out of
a connection Dask opened.

An idle Tornado stream reads whatever arrives into a buffer of its own, so
nothing may reach a socket before it left Tornado: the request is the sender's
(:func:`open_direct`) last write through Tornado, the receiver (:func:`accept`)
takes its end first and answers ``READY`` on the raw socket, and the sender sends
only after reading it. ``LOOP``: that end cannot leave Tornado (the event loop
carries the messages); ``CLOSED``: it closed the group.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING

from distributed.comm import connect

from dasktf import config
from dasktf.runtime.p2p.direct import Channel, detachable, take_socket

if TYPE_CHECKING:
    from distributed import Worker
    from distributed.comm import Comm

    from dasktf.runtime.p2p.loop import Endpoint
    from dasktf.runtime.p2p.mailbox import Mailbox

logger = logging.getLogger(__name__)

#: the one byte a peer answers a direct connection with, on the raw socket (``LOOP``:
#: through Tornado, whose socket that end could not take: use the event loop)
READY, CLOSED, LOOP = b"R", b"C", b"L"
#: how long a member a peer refused with ``CLOSED`` waits for the abort that says why
CLOSED_GRACE = 5.0


async def accept(comm: Comm, ep: Endpoint | None, group: str, source: int) -> None:
    """A peer's connection for the direct transport (on the loop): its socket goes
    to this member's training thread, then the peer hears ``READY`` on it."""
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


def open_direct(worker: Worker, ep: Endpoint, rank: int) -> Channel | None:
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
    opening = asyncio.run_coroutine_threadsafe(_open(worker, ep, address, timeout),
                                               worker.loop.asyncio_loop)
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
        if answer == CLOSED:
            # It closed the group: the group failed there, and the abort that says
            # why is on its way here (an abort goes to every member). Wait for it a
            # little rather than declare the peer lost (and tell everyone so).
            concurrent.futures.wait([ep.mailbox.failed], min(timeout, CLOSED_GRACE))
        raise ConnectionError(
            f"peer {address} refused a direct connection for group {ep.gid} "
            f"({'it closed the group' if answer == CLOSED else 'no answer'})")
    sock.sock.setblocking(False)
    return sock


async def _open(worker: Worker, ep: Endpoint, address: str, timeout: float
                ) -> tuple[Channel, bytes] | None:
    comm = await connect(address, timeout=timeout, **worker.connection_args)
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
