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

What it cannot shard: each worker's own gradient, the output of its backward pass
(one TensorFlow call returns it whole), is a whole buffer on every worker, sharded
or not; it is only read here (views of it travel).
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


def bucket_values(nbytes: int) -> int:
    """A bucket of ``nbytes`` (``dasktf.p2p.shard-bucket``) in float32 values."""
    return max(1, int(nbytes) // 4)


def bucketed_update(bucket: int, apply: Callable[..., np.ndarray],
                    t: Transport, buf: np.ndarray, scalars: np.ndarray | None,
                    coding: Coding, step: int) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`~dasktf.runtime.p2p.sharding.sharded_update` with its reduce-scatter
    in rounds of at most ``bucket`` values of each slice (see the module)."""
    n, r = t.size, t.rank
    edges = chunk_edges(buf.size, n)
    lengths = [edges[c + 1] - edges[c] for c in range(n)]
    rounds = max(1, max(-(-length // bucket) for length in lengths))
    x = np.asarray(buf, np.float32)
    sc = np.zeros(0) if scalars is None else np.array(scalars, np.float64, copy=True)

    def part(c: int, k: int) -> slice:  # bucket k of slice c, in ``buf``
        a, b = min(k * bucket, lengths[c]), min((k + 1) * bucket, lengths[c])
        return slice(edges[c] + a, edges[c] + b)

    acc = np.empty(lengths[r], np.float32)
    total: np.ndarray | None = None
    for k in range(rounds):
        for j in range(1, n):  # views of ``buf`` travel: not written before we return
            dest = (r + j) % n
            t.send(dest, Key(step, "zb", k, dest), (x[part(dest, k)], sc if k == 0 else None))
        here = part(r, k)
        into = acc[here.start - edges[r]:here.stop - edges[r]]
        for source in range(n):  # in rank order: the one-round step's bits
            if source == r:
                values, theirs = x[here], sc
            else:
                values, theirs = t.recv(source, Key(step, "zb", k, r))
            if source == 0:
                values_of(values, out=into)
            else:
                into += values_of(values)
            if k == 0:
                total = np.array(theirs, copy=True) if total is None else total + theirs
    assert total is not None
    return apply_and_gather(apply, t, acc, total, buf.size, step, scalars is not None)
