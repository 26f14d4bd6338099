"""``shard_state="gradients"`` (ZeRO-2): the sharded step's reduce-scatter in buckets.

With ``shard_state="optimizer"`` (:func:`~dasktf.runtime.p2p.sharding.sharded_update`)
no worker ever holds the whole *summed* gradient already: the reduce-scatter hands
rank r the N parts of its slice, which it adds into a slice-sized sum. But every
member sends its N-1 parts at once, so the owner's mailbox may hold all of them
before it adds them: up to (N-1)/N of a gradient waiting, on top of the slice's
sum, on a worker whose peers are faster than it.

Here each slice goes in rounds of at most ``bucket`` values: in round k every
member sends bucket k of each owner's slice, then takes bucket k from every member,
in rank order, adding it into its sum. A member sends round k+1 only once it has
every member's round k, and no member has round k+1's before this one sent its
round k+1: so at most two rounds wait in a mailbox, 2 (N-1) buckets, whatever the
model's size (and the queued sends are bounded the same way). The sums are the
same bits as the one-round step (each value's N parts added in rank order), and
the apply and the all-gather are the same
(:func:`~dasktf.runtime.p2p.sharding.apply_and_gather`).

Each worker's own gradient, the output of its backward pass, is only read here
(views of it travel). One TensorFlow call returns it whole; for a large chain
model the backward pass runs a group of layers at a time instead
(:mod:`dasktf.runtime.staged`), each group's parts sent in rounds of their own
before the next group is computed, so no worker holds its whole own gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dasktf.runtime.p2p.algorithms import chunk_edges, values_of
from dasktf.runtime.p2p.mailbox import Key
from dasktf.runtime.p2p.sharding import apply_and_gather

if TYPE_CHECKING:
    from dasktf.runtime.p2p.algorithms import Coding, Transport
    from dasktf.runtime.staged import StagedBackward


def bucket_values(nbytes: int) -> int:
    """A bucket of ``nbytes`` (``dasktf.p2p.shard-bucket``) in float32 values."""
    return max(1, int(nbytes) // 4)


def bucketed_update(bucket: int, apply: Callable[..., np.ndarray],
                    t: Transport, buf: np.ndarray, scalars: np.ndarray | None,
                    coding: Coding, step: int, staged: StagedBackward | None = None
                    ) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`~dasktf.runtime.p2p.sharding.sharded_update` with its reduce-scatter
    in rounds of at most ``bucket`` values of each slice (see the module).

    ``staged``: this member's gradient comes a group of layers at a time from its
    backward pass (:mod:`dasktf.runtime.staged`; ``buf`` is not read): each
    stage's parts go in rounds of their own before the next stage is computed,
    every member sending every other a message each round (empty where the stage
    has none of the peer's slice), so the rounds stay in step and the bound holds.
    Its parts are not yet times the rows (a copy each): an owner multiplies each
    bucket it adds by its sender's rows, the first of the scalars
    (:func:`~dasktf.runtime.p2p.sharding.sharded_step`'s layout), the float32
    product the sender would have made.
    """
    n, r = t.size, t.rank
    size = buf.size if staged is None else staged.size
    edges = chunk_edges(size, n)
    sc = np.zeros(0) if scalars is None else np.array(scalars, np.float64, copy=True)
    parts = [(0, np.asarray(buf, np.float32))] if staged is None else staged.parts()
    acc = np.empty(edges[r + 1] - edges[r], np.float32)
    total: np.ndarray | None = None
    rows = np.ones(n, np.float32)  # staged: each member's rows, from round 0's scalars
    k = 0  # the round, counted across the stages
    for start, values in parts:
        # each owner's part of this stage, in the whole buffer (empty: a == b)
        spans = [(min(max(start, edges[c]), edges[c + 1]),
                  max(min(start + len(values), edges[c + 1]), edges[c])) for c in range(n)]
        spans = [(a, max(a, b)) for a, b in spans]
        rounds = max(1, max(-(-(b - a) // bucket) for a, b in spans))
        for j in range(rounds):
            # round j of each slice c's part, in ``values``
            piece = [slice(min(a + j * bucket, b) - start, min(a + (j + 1) * bucket, b) - start)
                     for a, b in spans]
            for i in range(1, n):  # views travel: not written before we return
                dest = (r + i) % n
                t.send(dest, Key(step, "zb", k, dest),
                       (values[piece[dest]], sc if k == 0 else None))
            here = piece[r]
            into = acc[here.start + start - edges[r]:here.stop + start - edges[r]]
            for source in range(n):  # in rank order: the one-round step's bits
                if source == r:
                    got, theirs = values[here], sc
                else:
                    got, theirs = t.recv(source, Key(step, "zb", k, r))
                if k == 0:
                    total = np.array(theirs, copy=True) if total is None else total + theirs
                    if staged is not None:
                        rows[source] = theirs[0]
                part = values_of(got, out=into if source == 0 else None)
                if staged is not None:  # (in place where ``part`` is ``into``)
                    part = np.multiply(part, rows[source], out=into if source == 0 else None)
                if source:
                    into += part
            k += 1
    assert total is not None
    return apply_and_gather(apply, t, acc, total, size, step, scalars is not None)
