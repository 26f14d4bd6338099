"""Messages between the members' training threads on sockets of their own, over
connections Dask opened.

On the event loop path (:mod:`dasktf.runtime.p2p.loop`) every message crosses
two threads at each end and Tornado's and Dask's framing: on a small model that
cost each worker's event loop 2-3 ms of CPU a step, more than the step's
TensorFlow compute (docs/p2p.md#measured). Here a member's training thread writes each
message straight into a socket, and the receiver's training thread reads it
while it waits, as MPI's and NCCL's progress engines do.

The connections are Dask's: the sender opens one with ``distributed.comm.connect``
to the peer worker's own listener (its handshake, its connection arguments) and
asks for ``dasktf_p2p_direct``; both ends take the socket out of Tornado's hands
(a duplicate of the descriptor; the comm is then aborted, which closes Tornado's
descriptor without shutting the connection down), in the order
:mod:`dasktf.runtime.p2p.handshake` keeps. Nothing new listens, nothing is bound
beyond the workers' addresses.

Under TLS the socket is the ``ssl.SSLSocket`` of Dask's own TLS comm, taken over
whole: its session (the handshake Dask made, the peer's certificate checked as
Dask checks it) carries on in the training thread, which encrypts and decrypts
there. It cannot be duplicated (the session lives in the object), so Tornado's
``close`` must leave it open: a file made with ``makefile()`` keeps the
descriptor open through ``socket.close()`` (the rule ``socket.close`` documents)
until the file is closed too (:class:`Channel`). Where the comm is neither, or
this Tornado keeps its buffer elsewhere (:func:`dasktf.compat.unread_bytes`), the pair falls back to
the event loop path, and says so.

Sends never block: a message is queued and written as far as the kernel takes it;
the rest goes out while this member waits for a message (:meth:`Links.progress`
reads every peer and writes every queue, so two members sending each other large
buffers cannot deadlock), and :meth:`Links.flush` (bounded) ends each collective
with every byte handed to the kernel, so the caller may reuse its buffers.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import select
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.compat import unread_bytes
from dasktf.exceptions import PeerTimeoutError
from dasktf.runtime.p2p.mailbox import Key

if TYPE_CHECKING:
    from distributed.comm import Comm

#: a message: its head's bytes and its out-of-band buffers' count, then each
#: buffer's length, the head (the key and the payload, pickled; or with the
#: ``_ARRAYS`` flag, the payload's dtypes and shapes), the buffers
_FRAME = struct.Struct("!II")
#: buffers handed to one ``sendmsg`` (below the kernel's IOV_MAX of 1024)
_IOV = 64
#: the last frame a member sends a peer as it leaves the group (an empty head): a
#: closed connection after it is a departure, without it a lost process
_BYE = _FRAME.pack(0, 0)
#: set in a frame's buffer count: the head carries each payload item's dtype and
#: shape, not the arrays' pickles (see :func:`frames`)
_ARRAYS = 1 << 31
#: under TLS, consecutive buffers smaller than this are sent as one (each ``send``
#: of an ``SSLSocket`` is at least one record: a record and a call per small part)
_SMALL = 16384


class Channel:
    """One direct connection's socket, out of Tornado's hands: plain TCP, or the TLS
    comm's ``ssl.SSLSocket`` (its session carries on here). Would-block is
    ``BlockingIOError`` either way."""

    def __init__(self, sock: socket.socket, hold: io.IOBase | None = None) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        #: (TLS) keeps the descriptor open through Tornado's ``sock.close()``
        self._hold = hold
        #: (TLS) one thread at a time in the TLS object: a group closed from the
        #: event loop writes its goodbye while the training thread may still be in
        #: a write (two threads in one OpenSSL object is undefined; on a plain socket
        #: it only interleaves bytes of a failing group)
        self._lock = threading.Lock() if self.tls else contextlib.nullcontext()

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv_into(self, view: memoryview) -> int:
        """Bytes read into ``view`` (0: the peer closed)."""
        try:
            with self._lock:
                return self.sock.recv_into(view)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None

    def send(self, buffers: list[memoryview]) -> int:
        """Bytes of ``buffers`` the kernel took. Under TLS the first buffer only,
        whole (OpenSSL, unless told otherwise, writes all of it or nothing; a retry
        after would-block must pass the same bytes again, which the caller's queue
        does)."""
        if not self.tls:
            return self.sock.sendmsg(buffers)
        try:
            with self._lock:
                return self.sock.send(buffers[0])
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None

    def pack(self, buffers: list[memoryview]) -> list[memoryview]:
        """``buffers`` as queued: under TLS the small neighbours joined (copied), so a
        message's head is one record rather than three."""
        if not self.tls:
            return buffers
        out: list[memoryview] = []
        small: list[memoryview] = []
        for b in buffers:
            if b.nbytes < _SMALL:
                small.append(b)
                continue
            if small:
                out.append(memoryview(b"".join(small)))
                small = []
            out.append(b)
        if small:
            out.append(memoryview(b"".join(small)))
        return out

    def pending(self) -> int:
        """Decrypted bytes the TLS object holds: readable now whatever ``poll`` says."""
        return self.sock.pending() if self.tls else 0

    def close(self) -> None:
        with self._lock:
            try:
                self.sock.close()
            finally:
                if self._hold is not None:
                    self._hold.close()  # (the descriptor closes with the last of the two)


def take_socket(comm: Comm) -> tuple[Channel, bytes] | None:
    """The socket under ``comm``, taken from Tornado (``comm`` is aborted), with what
    Tornado had already read from it and nobody consumed; ``None`` (and ``comm``
    untouched) when it cannot be (not a TCP or TLS comm; :func:`dasktf.compat.unread_bytes`)."""
    if not detachable(comm):
        return None
    stream = comm.stream
    assert stream is not None
    buffered = unread_bytes(stream)
    assert buffered is not None
    sock = stream.socket
    if isinstance(sock, ssl.SSLSocket):
        # The TLS session lives in this object: it is kept, not duplicated. Tornado's
        # close (the abort) calls ``sock.close()``, which leaves the descriptor open
        # while a file made with makefile() is open: ``Channel.close`` closes both.
        hold = sock.makefile("rb", buffering=0)
        comm.abort()
        channel = Channel(sock, hold)
    else:
        fd = os.dup(sock.fileno())
        comm.abort()  # closes Tornado's descriptor only: the connection lives on in ours
        channel = Channel(socket.socket(fileno=fd))
    channel.sock.setblocking(False)
    return channel, buffered


def detachable(comm: Comm) -> bool:
    """Whether :func:`take_socket` can take ``comm``'s socket (the same answer until
    ``comm`` is used by anyone else)."""
    from distributed.comm.tcp import TCP

    stream = getattr(comm, "stream", None)
    return (isinstance(comm, TCP) and stream is not None
            and isinstance(getattr(stream, "socket", None), socket.socket)
            and unread_bytes(stream) is not None)


def frames(key: Key, payload: Any) -> list[memoryview]:
    """``payload`` under ``key`` as the buffers of one message (arrays not copied:
    they must not change until :meth:`Links.flush` returned).

    A collective's payload is almost always a tuple of plain arrays (or ``None``):
    its head then holds each one's dtype and shape, and the arrays go as raw
    buffers. Pickling an array (its ``__reduce_ex__``, and its reconstruction at
    the other end) cost about 3x as much CPU, and a sharded step sends a few
    small messages (docs/p2p.md)."""
    described = _described(payload)
    if described is not None:
        head = pickle.dumps((key.step, key.phase, key.round, key.chunk, described),
                            protocol=5)
        raws = [pickle.PickleBuffer(a).raw() for a in payload if a is not None]
        flag = _ARRAYS
    else:
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps((key.step, key.phase, key.round, key.chunk, payload),
                            protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        flag = 0
    lengths = struct.pack(f"!{len(raws)}Q", *(r.nbytes for r in raws))
    return [memoryview(_FRAME.pack(len(head), len(raws) | flag)), memoryview(lengths),
            memoryview(head), *raws]


def _described(payload: Any) -> tuple[tuple[str, tuple[int, ...]] | None, ...] | None:
    """Each item's ``(dtype, shape)`` (``None`` for ``None``) when ``payload`` is a
    tuple of plain C-contiguous numeric arrays and ``None``s; else ``None``."""
    if type(payload) is not tuple:
        return None
    out: list[tuple[str, tuple[int, ...]] | None] = []
    for a in payload:
        if a is None:
            out.append(None)
        elif (type(a) is np.ndarray and a.dtype.kind in "biuf"
              and a.flags.c_contiguous):
            out.append((a.dtype.str, a.shape))
        else:
            return None
    return tuple(out)


def _arrays(described: tuple[tuple[str, tuple[int, ...]] | None, ...],
            parts: list[bytearray]) -> tuple[np.ndarray | None, ...]:
    """The payload :func:`frames` described, on the buffers read (writable)."""
    it = iter(parts)
    return tuple(None if d is None else np.frombuffer(next(it), d[0]).reshape(d[1])
                 for d in described)


class _Reader:
    """One peer's incoming bytes, read straight into each part's own buffer."""

    def __init__(self, sock: Channel) -> None:
        self.sock = sock
        #: the peer said goodbye: its closed connection is no loss
        self.departed = False
        self._parts: list[bytearray] = []
        self._start(bytearray(_FRAME.size), "frame")

    def _start(self, buf: bytearray, stage: str) -> None:
        self._buf, self._view, self._got, self._stage = buf, memoryview(buf), 0, stage

    def read(self, deliver: Callable[[Key, Any], None]) -> bool:
        """Read what is there, ``deliver`` every message completed; ``False`` once
        the peer closed its end."""
        while True:
            while self._got < len(self._buf):
                try:
                    n = self.sock.recv_into(self._view[self._got:])
                except (BlockingIOError, InterruptedError):
                    return True
                if n == 0:
                    return False
                self._got += n
            self._advance(deliver)

    def _advance(self, deliver: Callable[[Key, Any], None]) -> None:
        if self._stage == "frame":
            head, count = _FRAME.unpack(self._buf)
            if head == 0:
                self.departed = True
                self._start(bytearray(_FRAME.size), "frame")
                return
            self._head_size, self._count = head, count & ~_ARRAYS
            self._described = bool(count & _ARRAYS)
            self._start(bytearray(8 * self._count), "lengths")
        elif self._stage == "lengths":
            self._lengths = list(struct.unpack(f"!{self._count}Q", self._buf))
            self._start(bytearray(self._head_size), "head")
        else:
            if self._stage == "buffer":
                self._parts.append(self._buf)
            else:
                self._head = self._buf
            if len(self._parts) < self._count:
                self._start(bytearray(self._lengths[len(self._parts)]), "buffer")
                return
            if self._described:
                step, phase, round_, chunk, described = pickle.loads(self._head)
                payload = _arrays(described, self._parts)
            else:
                step, phase, round_, chunk, payload = pickle.loads(self._head,
                                                                   buffers=self._parts)
            self._parts = []
            self._start(bytearray(_FRAME.size), "frame")
            deliver(Key(step, phase, round_, chunk), payload)


class Links:
    """One member's sockets to and from its peers (used by its training thread).

    Parameters
    ----------
    connect
        ``connect(rank)``: a socket to that peer (blocks while Dask opens it);
        ``None``: that peer takes this member's messages through the event loop
        (:meth:`send` says so).
    deliver
        ``deliver(source, key, payload)``: file a message read from rank ``source``.
    lost
        ``lost(rank, error)``: the peer's connection closed (fail the group).
    """

    def __init__(self, connect: Callable[[int], Channel | None],
                 deliver: Callable[[int, Key, Any], None],
                 lost: Callable[[int, BaseException], None]) -> None:
        self._connect = connect
        self._deliver = deliver
        self._lost = lost
        self._out: dict[int, Channel] = {}
        #: the peers this member sends to through the event loop (see ``connect``)
        self.loop: set[int] = set()
        self._queues: dict[int, deque[memoryview]] = {}
        self._readers: dict[int, _Reader] = {}
        self._arrived: list[tuple[int, Channel]] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.closed = False

    # -- any thread ----------------------------------------------------------------
    def arrived(self, source: int, sock: Channel) -> None:
        """A peer's connection to us (from the worker's event loop)."""
        with self._lock:
            if self.closed:
                sock.close()
                return
            self._arrived.append((source, sock))
        self.wake()

    def wake(self) -> None:
        """End the training thread's current wait (a message or a failure came
        another way)."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken (the buffer is full), or closed

    # -- the training thread ---------------------------------------------------------
    def send(self, dest: int, key: Key, payload: Any) -> bool:
        """Queue a message to ``dest`` and write what the kernel takes; ``False``:
        not sent, ``dest`` takes this member's messages through the event loop."""
        if dest in self.loop:
            return False
        if dest not in self._out:
            try:
                channel = self._connect(dest)
            except OSError as e:  # (a timeout included) the group fails here
                self._lost(dest, e)
                return True
            if channel is None:
                self.loop.add(dest)
                return False
            self._out[dest] = channel
            self._queues[dest] = deque()
        channel = self._out[dest]
        self._queues[dest].extend(f for f in channel.pack(frames(key, payload)) if f.nbytes)
        self._write(dest)
        return True

    def pending(self, dest: int | None = None) -> bool:
        """Bytes still queued (to ``dest``, or to anyone)."""
        if dest is not None:
            return bool(self._queues.get(dest))
        return any(self._queues.values())

    def progress(self, timeout: float) -> None:
        """Wait at most ``timeout`` for something to do, then read every peer and
        write every queue as far as the kernel takes them."""
        with self._lock:
            arrived, self._arrived = self._arrived, []
        for source, sock in arrived:
            self._readers[source] = _Reader(sock)
        readers = {r.sock.fileno(): (source, r) for source, r in self._readers.items()}
        writers = {self._out[d].fileno(): d for d, q in self._queues.items() if q}
        # (TLS) bytes already decrypted are readable whatever poll says of the socket
        if any(r.sock.pending() for r in self._readers.values()):
            timeout = 0
        # poll, not select: a busy worker's descriptors may number past FD_SETSIZE
        poller = select.poll()
        wake = self._wake_r.fileno()
        for fd in {wake, *readers, *writers}:
            poller.register(fd, (select.POLLIN if fd in readers or fd == wake else 0)
                            | (select.POLLOUT if fd in writers else 0))
        try:
            events = poller.poll(max(timeout, 0) * 1000)
        except (OSError, ValueError):  # a socket closed under us: the group ends
            return
        readable = {fd for fd, ev in events if ev & ~select.POLLOUT and
                    (fd in readers or fd == wake)}
        readable |= {fd for fd, (_, r) in readers.items() if r.sock.pending()}
        writable = [fd for fd, ev in events if fd in writers and
                    ev & (select.POLLOUT | select.POLLERR | select.POLLHUP)]
        for fd in readable:
            if fd == wake:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
                continue
            source, reader = readers[fd]
            try:
                alive = reader.read(lambda key, payload, s=source: self._deliver(s, key, payload))
                error: BaseException = ConnectionError("the peer closed its connection")
            except OSError as e:
                alive, error = False, e
            if not alive:
                del self._readers[source]
                reader.sock.close()
                if not reader.departed:
                    self._lost(source, error)
        for fd in writable:
            self._write(writers[fd])

    def flush(self, timeout: float, peer: Callable[[int], str], update: int) -> None:
        """Hand every queued byte to the kernel, reading meanwhile; each peer gets
        at most ``timeout`` seconds without taking any."""
        while self.pending():
            before = {d: sum(m.nbytes for m in q) for d, q in self._queues.items() if q}
            end = time.monotonic() + timeout
            while time.monotonic() < end and self.pending():
                self.progress(end - time.monotonic())
                now = {d: sum(m.nbytes for m in q) for d, q in self._queues.items() if q}
                if any(now.get(d, 0) < n for d, n in before.items()):
                    break  # some progress: a new deadline
            else:
                if self.pending():
                    dest = next(d for d, q in self._queues.items() if q)
                    raise PeerTimeoutError(
                        f"Peer {peer(dest)} took none of this worker's message of update "
                        f"{update} within dasktf.p2p.timeout ({timeout:g}s); its "
                        "connection is open, so it is alive but stuck (check its log), "
                        "or raise the timeout with DASK_DASKTF__P2P__TIMEOUT.",
                        peer(dest), update)

    def close(self) -> None:
        """Say goodbye to every peer (what the kernel takes now: a member leaving
        after a failure does not wait) and close every socket."""
        with self._lock:
            self.closed = True
        for dest, queue in self._queues.items():
            queue.append(memoryview(_BYE))
            self._write(dest, lost=False)
        for sock in [*self._out.values(), *(r.sock for r in self._readers.values())]:
            try:
                sock.close()
            except OSError:
                pass
        with self._lock:
            for _, sock in self._arrived:
                sock.close()
            self._arrived = []
        self._out.clear()
        self._readers.clear()
        self._queues.clear()
        self._wake_r.close()
        self._wake_w.close()

    def _write(self, dest: int, lost: bool = True) -> None:
        queue, sock = self._queues[dest], self._out[dest]
        while queue:
            try:
                n = sock.send(_head(queue, _IOV))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                queue.clear()
                if lost:
                    self._lost(dest, e)
                return
            while n and queue:
                first = queue[0]
                if n >= first.nbytes:
                    n -= first.nbytes
                    queue.popleft()
                else:
                    queue[0] = first[n:]
                    n = 0


def _head(queue: deque[memoryview], n: int) -> list[memoryview]:
    return [queue[i] for i in range(min(n, len(queue)))]
