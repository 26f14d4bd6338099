"""The all-reduce algorithms: recursive doubling for small buffers, a direct or ring
reduce-scatter + all-gather for large ones.

Each runs on the training thread over a :class:`Transport` (send without waiting,
receive with a bounded wait) and sums a flat float32 buffer plus a few float64
scalars (counts, loss sums) in an order fixed by the ranks alone, never by which
message arrives first. So every member ends with the same bits: Adam turns an ulp
of difference between replicas into whole learning-rate steps
(``../shared/MEASUREMENTS.md``), so "close" is not enough.

``doubling`` (recursive doubling, with the fold for N not a power of two;
Thakur, Rabenseifner & Gropp 2005)
    With ``p`` the largest power of two <= N, the ranks ``p + i`` first hand their
    buffer to rank ``i``; then for d = 1, 2, 4 ... < p, ranks r and ``r ^ d``
    exchange their sums and both add them. IEEE addition is commutative, so both
    compute the same bits; at the end ranks ``i`` hand the result back to ``p + i``.
    ``log2 p (+2)`` latencies and the fewest messages (``N - 1 + 2 m`` in all for
    N = p + m, about one per rank and round), but each rank sends the whole buffer
    every round: the choice for small buffers.
``direct`` (reduce-scatter, then all-gather, each by direct sends)
    Rank r owns chunk r of N: every rank sends it its part, it adds the N parts
    in rank order, and sends the finished chunk to everyone. ``2 (N-1)/N``
    buffers sent and received a rank (the allreduce bound) in two latencies.
``ring`` (the same two phases round a ring; Patarasuk & Yuan 2009)
    In round k of the reduce-scatter rank r sends chunk ``r-k`` to its right and
    adds what its left sends (chunk ``r-k-1``) in front of its own: chunk c is
    summed as ``((x_c + x_{c+1}) + ...) + x_{c-1}`` and ends on rank ``c-1``, which
    sends it round unchanged. The same bytes as ``direct`` and as many messages, but
    ``2 (N-1)`` latencies one after another; it needs two connections a rank where
    ``direct`` needs N-1 (and may suffer incast on a large cluster).

Which is faster depends on what bounds a message: on a loaded 2-core machine
(loopback, 3 workers) the CPU cost of each message dominates and recursive doubling
wins up to ~20 MB; with each worker's link at 1 Gbit/s the bandwidth-optimal ones
win from ~1 MB, at 200 Mbit/s from ~200 KB (``benchmarks/p2p_allreduce.py``,
docs/p2p.md). :func:`choose` takes the threshold (``dasktf.p2p.bandwidth-threshold``).

``gather`` (an all-gather of encoded parts, for sparse codecs)
    Every rank sends its whole encoded buffer (top-k: ``(index, value)`` pairs) to
    every other and adds the N parts in rank order: ``(N-1)`` parts a rank, which
    for ``topk:0.01`` is a tenth or less of a dense sum's bytes.

Codecs (:mod:`dasktf.wire.codecs`): every encoding of a value still to be summed
keeps an :class:`~dasktf.wire.codecs.ErrorFeedback` residual at its position in the
algorithm (the same chunk and round every update while the group stands), so what
one update's encoding loses is sent with the next; so does the one re-encoding of
a finished chunk (the all-gather's, ``encode_sum``), kept by the rank that summed
it. Hence ``Σ sums + Σ residuals == Σ buffers`` over any number of updates
(:meth:`Coding.residual`; ring, direct, gather, and doubling with two members).
Whoever adds a received value adds its *decoded* form, and a rank that sent a
value it also adds uses its own decoded form, so the members agree bit for bit.
``direct`` encodes each contribution once (the owner's own part included) and each
finished chunk once: ``2 (N-1)/N`` buffers a rank at the codec's ratio, which is
why :func:`choose` takes it (or ``gather`` for a sparse codec) whenever a lossy
codec is on. The ring's and recursive doubling's partial sums travel encoded at
every hop (topk re-cut there, the union of indices filling in); recursive
doubling hands its result back to the folded ranks in float32.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

import numpy as np

from dasktf.runtime.p2p.mailbox import Key
from dasktf.wire.codecs import Codec, Encoded, ErrorFeedback, TopK, decode

ALGORITHMS = ("ring", "direct", "doubling", "gather")

#: What travels in one message: the values (float32 or a codec's form) and the
#: float64 scalars riding with them (``None`` where they do not ride).
Payload = tuple[Any, np.ndarray | None]


class Transport(Protocol):
    """One member's end of a group: ``send`` returns at once (the bytes go out on
    the worker's event loop), ``recv`` waits, bounded, for one keyed message."""

    rank: int
    size: int

    def send(self, dest: int, key: Key, payload: Payload) -> None: ...

    def recv(self, source: int, key: Key) -> Payload: ...


class Coding:
    """A member's codec and its error-feedback residuals, one per position.

    A position is where an encoding sits in an algorithm (a chunk and a round, the
    same every update while the group stands) and covers a slice of the buffer
    (``at``): :meth:`residual` puts every residual back in place, so a test (or a
    reader) can check that nothing is lost, only delayed:
    ``Σ_steps sum + Σ_members residual == Σ_steps Σ_members buf``.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._feedback: dict[Hashable, ErrorFeedback] = {}
        self._at: dict[Hashable, slice] = {}

    @property
    def lossy(self) -> bool:
        return self.codec.lossy

    def partial(self, x: np.ndarray, position: Hashable,
                at: slice = slice(None)) -> tuple[Any, np.ndarray]:
        """``(sent, decoded)`` of a value still to be summed (lossless: ``x`` twice;
        callers must not write into ``x`` while it travels)."""
        if not self.codec.lossy:
            return x, x
        sent = self._feedback_at(position, at, summed=False).encode(x)
        return sent, decode(sent, out=np.empty(x.size, np.float32))

    def partial_encoded(self, x: np.ndarray, position: Hashable,
                        at: slice = slice(None)) -> Encoded:
        """What :meth:`partial` sends, without decoding it (lossy codecs only)."""
        return self._feedback_at(position, at, summed=False).encode(x)

    def final(self, x: np.ndarray, position: Hashable | None = None,
              at: slice = slice(None)) -> tuple[Any, np.ndarray]:
        """``(sent, decoded)`` of a finished sum on its way to every member. With a
        ``position`` (the member that made the sum encodes it), what a lossy
        re-encoding loses is kept there and sent with the next update's sum."""
        if not self.codec.lossy:
            return x, x
        if position is None or not self.codec.sum_lossy:
            sent = self.codec.encode_sum(x)
        else:
            sent = self._feedback_at(position, at, summed=True).encode(x)
        return sent, decode(sent, out=np.empty(x.size, np.float32))

    def _feedback_at(self, position: Hashable, at: slice, summed: bool) -> ErrorFeedback:
        feedback = self._feedback.get(position)
        if feedback is None:
            feedback = self._feedback[position] = ErrorFeedback(self.codec, summed)
            self._at[position] = at
        return feedback

    def residual(self, size: int) -> np.ndarray:
        """Every residual this member keeps, added at its place in a buffer of
        ``size`` values (float64): what its encodings have not delivered yet."""
        out = np.zeros(size, np.float64)
        for position, feedback in self._feedback.items():
            if feedback.residual is not None:
                out[self._at[position]] += feedback.residual
        return out

    def reset(self) -> None:
        """Forget the residuals (the group re-formed: positions changed)."""
        self._feedback.clear()
        self._at.clear()


def values_of(values: Any, out: np.ndarray | None = None) -> np.ndarray:
    """A message's values as float32 (written into ``out`` if given)."""
    if isinstance(values, Encoded):
        return decode(values, out=out)
    if out is None:
        return np.asarray(values, np.float32)
    out[...] = values
    return out


def chunk_edges(size: int, n: int) -> list[int]:
    """Where the ring cuts a buffer of ``size`` values into ``n`` chunks."""
    return [size * c // n for c in range(n + 1)]


def _copy(a: np.ndarray | None) -> np.ndarray | None:
    return None if a is None else a.copy()


def _add(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None or b is None:
        return a if b is None else b
    return a + b


def ring(t: Transport, buf: np.ndarray, scalars: np.ndarray | None, coding: Coding,
         step: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Sum ``buf`` (and ``scalars``) over the group by reduce-scatter + all-gather.

    The scalars ride with chunk 0, so they are summed in chunk 0's fixed order.
    """
    n, r = t.size, t.rank
    edges = chunk_edges(buf.size, n)
    right, left = (r + 1) % n, (r - 1) % n
    work = np.array(buf, np.float32, copy=True)  # partial sums; never written once sent
    out = np.empty_like(work)  # finished chunks
    sc = None if scalars is None else np.array(scalars, np.float64, copy=True)

    def seg(c: int) -> slice:
        return slice(edges[c], edges[c + 1])

    for k in range(n - 1):
        c_send, c_recv = (r - k) % n, (r - k - 1) % n
        sent, _ = coding.partial(work[seg(c_send)], ("rs", k), seg(c_send))
        t.send(right, Key(step, "rs", k, c_send), (sent, sc if c_send == 0 else None))
        values, theirs = t.recv(left, Key(step, "rs", k, c_recv))
        mine = work[seg(c_recv)]
        np.add(values_of(values), mine, out=mine)  # the partial sum first, then ours
        if c_recv == 0:
            sc = _add(theirs, sc)
    owned = (r + 1) % n
    sent, done = coding.final(work[seg(owned)], ("ag", owned), seg(owned))
    out[seg(owned)] = done
    carry: Payload = (sent, sc if owned == 0 else None)
    total_sc = carry[1]
    for k in range(n - 1):
        c_send, c_recv = (r + 1 - k) % n, (r - k) % n
        t.send(right, Key(step, "ag", k, c_send), carry)
        carry = t.recv(left, Key(step, "ag", k, c_recv))
        values_of(carry[0], out=out[seg(c_recv)])
        if c_recv == 0:
            total_sc = carry[1]
    return out, _copy(total_sc)  # (the scalars we forwarded may still be on their way)


def doubling(t: Transport, buf: np.ndarray, scalars: np.ndarray | None, coding: Coding,
             step: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Sum ``buf`` (and ``scalars``) over the group by recursive doubling."""
    n, r = t.size, t.rank
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    sc = None if scalars is None else np.array(scalars, np.float64, copy=True)
    if r >= p:  # folded: hand the buffer to rank r - p, get the result back
        sent, _ = coding.partial(np.asarray(buf, np.float32), ("fold", 0))
        t.send(r - p, Key(step, "fold", 0, 0), (sent, sc))
        values, total_sc = t.recv(r - p, Key(step, "unfold", 0, 0))
        # (a message's arrays are the receiver's own: the sender sent a copy)
        return values_of(values), total_sc
    # Never written: ``v`` (the caller's buffer, then every new sum) may be on its
    # way to the partner; each addition makes a new array (no copy of ``buf``
    # first: a 2-core step's copies of a 400 KB buffer were a tenth of its CPU).
    v = np.asarray(buf, np.float32)
    if r < extra:
        values, theirs = t.recv(r + p, Key(step, "fold", 0, 0))
        v = v + values_of(values)
        sc = _add(sc, theirs)
    d, k = 1, 0
    while d < p:
        partner = r ^ d
        sent, mine = coding.partial(v, ("rd", k))
        t.send(partner, Key(step, "rd", k, 0), (sent, sc))
        values, theirs = t.recv(partner, Key(step, "rd", k, 0))
        # a new array: ``v`` may be on its way to the partner still
        v = mine + values_of(values)
        sc = _add(sc, theirs)
        d, k = d << 1, k + 1
    if r < extra:  # (copies: the caller owns what we return, and may write into it)
        t.send(r + p, Key(step, "unfold", 0, 0), (v.copy(), _copy(sc)))
    return v, sc


def direct(t: Transport, buf: np.ndarray, scalars: np.ndarray | None, coding: Coding,
           step: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Sum ``buf`` (and ``scalars``) by a direct reduce-scatter and all-gather.

    Rank r owns chunk r: every rank sends it its part of chunk r, it adds the N
    parts in rank order, and sends the finished chunk to every rank. The ring's
    bytes (``2 (N-1)/N`` buffers a rank) in two message latencies instead of
    ``2 (N-1)``, for N-1 connections a rank at once instead of two.
    """
    n, r = t.size, t.rank
    edges = chunk_edges(buf.size, n)
    x = np.asarray(buf, np.float32)
    sc = None if scalars is None else np.array(scalars, np.float64, copy=True)

    def seg(c: int) -> slice:
        return slice(edges[c], edges[c + 1])

    # Views of the caller's buffer travel: it is not written before we return, and
    # we return only after every owner sent its chunk, so after it had ours.
    for k in range(1, n):
        dest = (r + k) % n
        sent, _ = coding.partial(x[seg(dest)], ("ds", dest), seg(dest))
        t.send(dest, Key(step, "ds", 0, dest), (sent, sc if dest == 0 else None))
    acc: np.ndarray | None = None
    total_sc = None  # (summed by the owner of chunk 0, which the scalars ride with)
    for source in range(n):  # the parts of our chunk, added in rank order
        if source == r:  # ours goes through the codec too, as everyone else's did
            part, theirs = coding.partial(x[seg(r)], ("ds", r), seg(r))[1], sc
        else:
            values, theirs = t.recv(source, Key(step, "ds", 0, r))
            part = values_of(values)
        if acc is None:
            acc = np.array(part, np.float32, copy=True)
        else:
            acc += part
        if r == 0:
            total_sc = _add(total_sc, theirs)
    assert acc is not None
    out = np.empty(buf.size, np.float32)
    sent, done = coding.final(acc, ("dg", r), seg(r))  # (its loss fed back here)
    out[seg(r)] = done
    for k in range(1, n):
        dest = (r + k) % n
        t.send(dest, Key(step, "dg", 0, r), (sent, total_sc if r == 0 else None))
    for k in range(1, n):
        source = (r - k) % n
        values, theirs = t.recv(source, Key(step, "dg", 0, source))
        values_of(values, out=out[seg(source)])
        if source == 0:
            total_sc = theirs
    return out, _copy(total_sc)


def sources(rank: int, n: int) -> list[int]:
    """The ranks ``rank`` receives from in either algorithm: the peers it watches
    (a loss anywhere else reaches it through the others' abort)."""
    if n <= 1:
        return []
    p = 1 << (n.bit_length() - 1)
    out = {(rank - 1) % n}
    if rank >= p:
        out.add(rank - p)
    else:
        d = 1
        while d < p:
            out.add(rank ^ d)
            d <<= 1
        if rank < n - p:
            out.add(rank + p)
    out.discard(rank)
    return sorted(out)


def payload_nbytes(payload: Payload) -> int:
    """The bytes a message's values and scalars weigh on the wire."""
    values, scalars = payload
    n = int(values.nbytes)
    return n + (0 if scalars is None else int(scalars.nbytes))


def gather(t: Transport, buf: np.ndarray, scalars: np.ndarray | None, coding: Coding,
           step: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Sum ``buf`` (and ``scalars``) by an all-gather of every member's encoded
    buffer: the sparse codecs' all-reduce.

    Every rank encodes its whole buffer once (with its residual) and sends it to
    every other rank; every rank then adds the N parts in rank order into zeros, a
    top-k part as its ``(index, value)`` pairs, so all end with the same bits.
    ``(N-1)`` encoded buffers sent and received a rank: fewer bytes than a dense sum
    (``2 (N-1)/N`` float32 buffers) while a part is under ``2/N`` of float32's, and
    nothing is re-encoded, so no index set fills in on the way.
    """
    n, r = t.size, t.rank
    x = np.asarray(buf, np.float32)
    sc = None if scalars is None else np.array(scalars, np.float64, copy=True)
    mine = x if not coding.lossy else coding.partial_encoded(x, ("sg", 0))
    for k in range(1, n):
        t.send((r + k) % n, Key(step, "sg", 0, r), (mine, sc))
    out = np.zeros(x.size, np.float32)
    total_sc = None
    for source in range(n):  # in rank order, the same on every member
        if source == r:
            values, theirs = mine, sc
        else:
            values, theirs = t.recv(source, Key(step, "sg", 0, source))
        _accumulate(out, values)
        total_sc = _add(total_sc, theirs) if source else _copy(theirs)
    return out, total_sc


def _accumulate(out: np.ndarray, values: Any) -> None:
    """``out += values``; a top-k part adds only its kept values (their indices are
    distinct within a part, so a fancy-indexed add is exact)."""
    if isinstance(values, Encoded) and values.codec == TopK.name:
        index, kept = values.arrays
        out[index] += kept
    else:
        out += values_of(values)


def choose(nbytes: int, n: int, threshold: int, large: str = "direct",
           codec: Codec | None = None) -> str:
    """The algorithm for a buffer of ``nbytes`` over ``n`` members: ``large`` (a
    bandwidth-optimal one) from ``threshold`` bytes on, recursive doubling below,
    and always with two members (it moves the same bytes in one message).

    A lossy ``codec`` is there to save bytes, so the choice keeps its ratio:
    a sparse one gathers its parts (:func:`gather`) while they weigh less than a
    dense sum; otherwise, from three members on, ``direct``, whose every
    contribution and every finished chunk is encoded once (recursive doubling
    sends ``log2 N`` whole buffers a rank, and hands the folded ranks the sum in
    float32).
    """
    if codec is not None and codec.lossy and n > 1:
        size = nbytes // 4
        if codec.sparse and gather_cheaper(codec, size, n):
            return "gather"
        if n > 2:
            return large
    return large if n > 2 and nbytes >= threshold else "doubling"


def gather_cheaper(codec: Codec, size: int, n: int) -> bool:
    """Whether gathering ``n`` parts of ``codec`` moves fewer bytes a rank than a
    dense float32 sum of ``size`` values (``2 (N-1)/N`` buffers each way)."""
    part = 4.0 * size / codec.ratio(size)
    return (n - 1) * part < 2.0 * (n - 1) / n * 4.0 * size


RUNNERS = {"ring": ring, "direct": direct, "doubling": doubling, "gather": gather}
