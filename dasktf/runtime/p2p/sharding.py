"""Sharded optimizer state on the p2p engine (ZeRO-1, ``shard_state="optimizer"``).

Every replica keeps the whole model, but only a slice of the optimizer: the flat
parameter buffer (the trainable variables, flattened and concatenated in order) is
cut into N contiguous slices of (nearly) equal bytes, the cut of the ``direct``
all-reduce's chunks (:func:`~dasktf.runtime.p2p.algorithms.chunk_edges`), so one
large variable is split over several workers. Rank r owns slice r. Each step, in
one collective (:func:`sharded_update`):

1. reduce-scatter: every member sends slice s of its gradient to its owner, which
   adds the N parts in rank order (the ``direct`` all-reduce's order, so the sum has
   the same bits as an unsharded large-buffer sum); the few float64 scalars
   (example count, loss sum, votes) go to every owner, each adding them in rank
   order, so every member gets the same scalars;
2. the owner applies its optimizer to its slice (:class:`ShardOptimizer`);
3. all-gather: each owner sends its updated slice to every member, which writes
   the N slices into its model.

With ``redundancy=1`` each slice also has a copy on the next rank, which the owner
relays its summed slice to (and then sends it no all-gather message: the copy's
holder computed the new values itself); see :mod:`dasktf.runtime.p2p.redundancy`.

The slice's optimizer is a clone of the model's Keras optimizer (``from_config``)
built over one flat ``keras.Variable`` per trainable variable (the variable's part
of the slice, empty where it has none): the same class, the same variables in the
same order as the whole optimizer's, each slot a flat part of the whole one. So an
elementwise update (Adam, SGD with momentum, RMSprop, ``clipvalue``, weight decay)
gives the same values on the slice as on the whole variable, and the whole
optimizer is put back together by concatenating the owners' parts
(:func:`assemble_optimizer`). Clipping by a norm (``clipnorm``: each whole
variable's; ``global_clipnorm``: all of them) sums the slices' squared norms over
the members first (:meth:`ShardOptimizer.scales`). A loss-scale optimizer (mixed precision) skips a
step on every slice when the summed gradient is not finite in any: a vote of the
slices, taken in the same small exchange. Gradient accumulation or weight averaging
is refused (:func:`optimizer_refusal`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import compat
from dasktf.exceptions import ShardingError
from dasktf.runtime.keras_step import SignatureFunction
from dasktf.runtime.p2p.algorithms import chunk_edges, values_of
from dasktf.runtime.p2p.mailbox import Key
from dasktf.wire.messages import GradientSum

if TYPE_CHECKING:
    from dasktf.runtime.p2p.algorithms import Coding, Transport
    from dasktf.runtime.p2p.group import Group
    from dasktf.runtime.replica import Replica
    from dasktf.runtime.staged import StagedBackward

#: The values of ``shard_state``: ``"gradients"`` (ZeRO-2) buckets the
#: reduce-scatter (:mod:`dasktf.runtime.p2p.buckets`).
SHARD_STATES = ("optimizer", "gradients")

#: The most bytes of weights :meth:`ShardOptimizer.take` writes in one TensorFlow call.
TAKE_IN_ONE_CALL = 16 << 20
_PIECE = re.compile(r"dasktfpiece(\d+)x")


def check_shard_state(value: str | None) -> None:
    """Refuse a ``shard_state`` this version cannot train."""
    if value is None or value in SHARD_STATES:
        return
    raise ValueError(f"shard_state must be None, 'optimizer' or 'gradients'; got {value!r}.")


def optimizer_refusal(optimizer: Any) -> str | None:
    """Why a Keras ``optimizer`` (an instance, or its ``keras.optimizers.serialize``
    form: the client checks the compile recipe before any model is compiled)
    cannot be sharded exactly yet, or ``None`` when it can (its update is
    elementwise on every variable)."""
    if optimizer is None:
        return None
    if isinstance(optimizer, dict):
        name, config = optimizer.get("class_name", "optimizer"), optimizer.get("config", {})
    else:
        name, config = type(optimizer).__name__, optimizer.get_config()
    inner = config.get("inner_optimizer")
    if inner is not None:  # a LossScaleOptimizer: its skip is voted over the slices
        inner = inner if isinstance(inner, dict) else {"config": inner.get_config()}
        clipped = [k for k in ("clipnorm", "global_clipnorm") if inner["config"].get(k)]
        if clipped:
            return (f"shard_state='optimizer' does not clip by a norm ({clipped[0]}=) "
                    f"under a {name} yet (the norm of the unscaled gradient would be "
                    f"summed over the slices); use clipvalue, or shard_state=None.")
        return optimizer_refusal(inner)
    for key, what in (("gradient_accumulation_steps", "accumulated gradients"),
                      ("use_ema", "averaged weights"),
                      ("loss_scale_factor", "a scaled loss")):
        if config.get(key):
            return (f"shard_state='optimizer' cannot apply {name}({key}=...) on "
                    f"slices yet ({what}); drop {key}, or use shard_state=None.")
    return None


class ShardOptimizer:
    """Rank ``rank`` of ``n``'s slice of ``replica``'s optimizer (see the module).

    It takes over the model's optimizer (``model.optimizer`` becomes the slice's:
    the learning rate a callback sets, the iterations, ``training_state`` all read
    it), starting from the whole optimizer's state (a second ``fit`` continues it);
    the whole one's slots are dropped, so a worker holds 1/N of them.
    """

    def __init__(self, replica: Replica, rank: int, n: int, take_over: bool = True
                 ) -> None:
        import keras
        import tensorflow as tf

        self.rank, self.n = rank, n
        self.sizes = list(replica.sizes)
        self.edges = chunk_edges(int(sum(self.sizes)), n)
        lo, hi = self.edges[rank], self.edges[rank + 1]
        starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        #: per trainable variable, the flat range of it this slice holds
        self.parts = [(max(lo, s) - s, max(min(hi, s + size), max(lo, s)) - s)
                      for s, size in zip(starts[:-1], self.sizes, strict=True)]
        #: the variables the slice holds any of: the others' pieces are empty, and
        #: an update of nothing still costs the apply call its ops (on a small model
        #: most of a slice's pieces are empty, and ops are most of the call); a
        #: slice of nothing (more workers than values) keeps them all: its apply
        #: still counts the iteration, as the other slices' do
        self.live = [j for j, (a, b) in enumerate(self.parts) if b > a] or list(
            range(len(self.parts)))
        whole = replica.model.optimizer
        why = optimizer_refusal(whole)
        if why is not None:
            raise ValueError(why)
        config = whole.get_config()
        #: the whole optimizer's config: one is built again to re-cut the slices
        self.config = dict(config)
        # Clipping by a norm needs the norm of each whole variable (clipnorm) or of
        # all of them (global_clipnorm): summed across the slices (:meth:`scales`)
        # and applied here as a factor per variable, not by the slice's optimizer.
        self.clipnorm = config.get("clipnorm") or None
        #: a LossScaleOptimizer: its skip (a non-finite gradient) is voted on by
        #: every slice (:meth:`scales`), so the scale stays the same everywhere
        self.loss_scaled = hasattr(whole, "inner_optimizer")
        # The replica's gradient function was traced with the whole optimizer's
        # scale_loss: it reads the whole one's scale, kept equal to the slice's.
        self.traced_scale = whole.dynamic_scale if self.loss_scaled and whole.built else None
        self.global_clipnorm = config.get("global_clipnorm") or None
        config.update(clipnorm=None, global_clipnorm=None)
        self.optimizer = opt = type(whole).from_config(config)
        with tf.device(replica.device):
            self.pieces = [keras.Variable(np.zeros(b - a, np.float32), name=f"dasktfpiece{j}x")
                           for j, (a, b) in enumerate(self.parts)]
            compat.exclude_from_weight_decay(  # piece j: variable j's part
                opt, self.pieces, compat.weight_decay_excluded(whole, replica.variables))
            opt.build(self.pieces)
        #: per optimizer variable: the trainable variable it is a slot of, or -1
        self.layout = [_piece_of(v) for v in opt.variables]
        self._continue(whole)
        if take_over:  # (a redundant copy of another rank's slice does not)
            compat.replace_optimizer(replica.model, opt)  # the whole one's slots freed
        self.variables = replica.variables
        #: the most bytes of the peers' gradient parts that waited here (sharded_step)
        self.held = 0
        #: the most bytes of this worker's own gradient held at once (whole, or
        #: the largest stage of a staged backward pass)
        self.own = 0
        self.shapes = list(replica.shapes)
        # the short call path (one concrete function, arguments handed flat): a
        # small model's step is mostly the fixed cost of each TensorFlow call
        self._apply = SignatureFunction(self._apply_body, [
            tf.TensorSpec((hi - lo,), tf.float32), tf.TensorSpec((), tf.float32),
            tf.TensorSpec((len(self.parts),), tf.float32)])
        flat_spec = tf.TensorSpec((int(sum(self.sizes)),), tf.float32)
        self._take = SignatureFunction(self._take_body, [flat_spec])
        # A step's gathered weights are taken by the next step's gradient call
        # (:meth:`take_then_gradient`): one TensorFlow call fewer a step, as the
        # unsharded step fuses its apply into the next gradient
        self._take_gradient = SignatureFunction(
            functools.partial(self._take_gradient_body, replica),
            [flat_spec, *replica.batch_spec])
        #: the gathered weights of the update applied here, not taken yet
        self.untaken: np.ndarray | None = None

    def _continue(self, whole: Any) -> None:
        """Start from ``whole``'s state: its scalars (iterations), its slots' parts
        when it was built."""
        theirs = list(whole.variables)
        if len(theirs) == len(self.layout):
            for mine, value, j in zip(self.optimizer.variables, theirs, self.layout,
                                      strict=True):
                v = np.asarray(value.numpy())
                if j >= 0:
                    a, b = self.parts[j]
                    v = v.ravel()[a:b]
                mine.assign(v)
            return
        scalars = [v for v in self.optimizer.variables if _piece_of(v) < 0]
        for mine, value in zip(scalars, theirs, strict=False):
            mine.assign(np.asarray(value.numpy()))

    def _apply_body(self, chunk: Any, count: Any, scales: Any) -> Any:
        """The slice's update from its summed gradient ``chunk`` over ``count``
        examples; the slice's new values (a TF body)."""
        import tensorflow as tf

        live = [(self.pieces[j], self.variables[j], self.parts[j], j) for j in self.live]
        for piece, v, (a, b), _ in live:
            piece.assign(tf.reshape(v, [-1])[a:b])  # the weights as the model has them
        grads = tf.split(chunk / count, [b - a for _, _, (a, b), _ in live])
        if self.clipnorm or self.global_clipnorm or self.loss_scaled:  # else ones
            grads = [g * scales[j] for g, (_, _, _, j) in zip(grads, live, strict=True)]
        # (the empty pieces' update is nothing: an iteration is counted per apply)
        self.optimizer.apply(grads, [piece for piece, *_ in live])
        if self.traced_scale is not None:
            self.traced_scale.assign(self.optimizer.dynamic_scale)
        return tf.concat([tf.identity(piece) for piece, *_ in live], 0)

    def _take_body(self, flat: Any) -> None:
        """Assign the trainable variables from the gathered flat weights, in one
        TensorFlow call (a TF body)."""
        import tensorflow as tf

        for v, part, shape in zip(self.variables, tf.split(flat, self.sizes),
                                  self.shapes, strict=True):
            v.assign(tf.reshape(part, shape))

    def _take_gradient_body(self, replica: Replica, flat: Any, *batch: Any) -> Any:
        """:meth:`_take_body`, then the replica's gradient at those weights (a TF
        body: automatic control dependencies keep the reads after the writes)."""
        self._take_body(flat)
        return replica.batch_gradient(*batch)

    def take_later(self, flat: np.ndarray, replica: Replica) -> None:
        """Keep ``flat`` (the update applied here) for the next step's gradient call
        to take, or :meth:`settle`; a large model's is taken now, variable by
        variable (kept, it would be one more whole copy of the weights for a
        while, and one call's fixed cost is nothing beside its size)."""
        self.untaken = flat
        if 4 * len(flat) > TAKE_IN_ONE_CALL:
            self.settle(replica)

    def settle(self, replica: Replica) -> None:
        """Take the weights kept by :meth:`take_later`, if any: before anything
        reads the model (the segment's end, a stop)."""
        flat, self.untaken = self.untaken, None
        if flat is not None:
            with replica.apply_lock:
                if self._current(replica):
                    self.take(flat)

    def _current(self, replica: Replica) -> bool:
        """Whether the weights kept here may still be taken: not once a recovery
        fenced the replica or loaded a state (which dropped this slice)."""
        return not replica.fenced and replica.shard_optimizer is self

    def take_then_gradient(self, replica: Replica, epoch: int, step: int) -> GradientSum:
        """The kept weights taken and the gradient of ``(epoch, step)`` at them: in
        one TensorFlow call when the batch has rows and the model is small."""
        flat = self.untaken
        batch = replica.batch(epoch, step)
        if flat is None or not len(batch):
            self.settle(replica)
            return replica.gradient(epoch, step)
        self.untaken = None
        with replica.apply_lock:
            if not self._current(replica):
                return replica.gradient(epoch, step)
            summed = replica.gradient_call(self._take_gradient, batch, flat)
            self.taken()
        return summed

    def taken(self) -> None:
        """The model holds the slices' values again (see the redundant slices)."""

    def take(self, flat: np.ndarray) -> None:
        """The model's weights from the all-gather's flat buffer: in one TensorFlow
        call for a small model (a call's fixed cost dominates), else variable by
        variable from views of ``flat`` (the one call's input and split outputs are
        two more whole copies of the weights: the sharded step's memory peak)."""
        if 4 * len(flat) <= TAKE_IN_ONE_CALL:
            self._take(flat)
        else:
            at = 0
            for v, size, shape in zip(self.variables, self.sizes, self.shapes, strict=True):
                v.assign(flat[at:at + size].reshape(shape))
                at += size
        self.taken()

    def apply(self, chunk: np.ndarray, count: float,
              exchange: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """:meth:`_apply_body` on NumPy values; ``exchange`` sums a small vector
        over the members (every member calls it, or none)."""
        return self.apply_scaled(chunk, count, self.scales(chunk, count, exchange))

    def apply_scaled(self, chunk: np.ndarray, count: float, scales: np.ndarray
                     ) -> np.ndarray:
        """:meth:`_apply_body` with the clipping factors ``scales`` known."""
        return np.asarray(self._apply(chunk, np.float32(count), scales))

    def step(self, replica: Replica, update: int, chunk: np.ndarray, count: int,
             exchange: Callable[[np.ndarray], np.ndarray],
             relay: Callable[[np.ndarray], np.ndarray]) -> Any:
        """Apply ``update`` (its summed slice ``chunk`` over ``count`` examples)
        here if the replica claims it; the slice's new values, ``None`` if not
        (``relay``: unused here, see :mod:`dasktf.runtime.p2p.redundancy`)."""
        if not (count and replica.claim_update(update)):
            return None
        return self.apply(chunk, count, exchange)

    def scales(self, chunk: np.ndarray, count: float,
               exchange: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """The factor each variable's gradient is clipped by (Keras' ``clipnorm``
        per variable, ``global_clipnorm`` over all), from the squared norms of the
        slices' parts summed over the members; ones without clipping."""
        ones = np.ones(len(self.parts), np.float32)
        if self.loss_scaled:
            # Keras skips the step (and halves the scale) when any element of the
            # whole summed gradient is not finite: a vote of every slice, taken after
            # the reduce-scatter (finite parts may sum to an inf). NaN factors make
            # every slice's loss-scale optimizer see it.
            skip = exchange(np.array([float(not np.all(np.isfinite(chunk)))]))[0]
            return ones * np.float32(np.nan) if skip else ones
        if self.clipnorm is None and self.global_clipnorm is None:
            return ones
        mean = np.asarray(chunk, np.float32) / np.float32(count)
        at = np.cumsum([0] + [b - a for a, b in self.parts])
        squares = exchange(np.array([np.sum(np.square(mean[at[j]:at[j + 1]],
                                                      dtype=np.float64))
                                     for j in range(len(self.parts))]))
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.clipnorm is not None:
                norms = np.sqrt(squares)
                c = float(self.clipnorm)
                return np.where(norms > 0, c / np.maximum(norms, c), 1.0).astype(np.float32)
            c = float(self.global_clipnorm)
            norm = float(np.sqrt(np.sum(squares)))
            scale = c * min(1.0 / norm if norm else np.inf, 1.0 / c) + (norm - norm)
            return ones * np.float32(scale)

    def own_values(self) -> np.ndarray:
        """The slice's current weights, read from the model (nothing to apply)."""
        if self.untaken is not None:
            return self.untaken[self.edges[self.rank]:self.edges[self.rank + 1]]
        return np.concatenate([np.asarray(v.numpy(), np.float32).ravel()[a:b]
                               for v, (a, b) in zip(self.variables, self.parts,
                                                    strict=True)])

    def gradient_peak(self) -> int:
        """The most bytes of summed-gradient buffers this worker held in a step: the
        peers' parts of its slice waiting to be added (the most that ever waited)
        and the slice's sum. (Its own gradient, the backward pass's output, is
        whole on every worker, sharded or not.)"""
        return int(self.held) + 4 * (self.edges[self.rank + 1] - self.edges[self.rank])

    def slot_bytes(self) -> int:
        """The bytes of the slice's optimizer variables (what TensorFlow holds)."""
        return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                       for v in self.optimizer.variables))


def _piece_of(variable: Any) -> int:
    found = _PIECE.search(str(getattr(variable, "path", variable.name)))
    return int(found.group(1)) if found else -1


def sharded_update(apply: Callable[..., np.ndarray],
                   t: Transport, buf: np.ndarray, scalars: np.ndarray | None,
                   coding: Coding, step: int) -> tuple[np.ndarray, np.ndarray | None]:
    """One sharded step as a collective runner (``Group.allreduce(runner=...)``):
    reduce-scatter ``buf`` (and the ``scalars``), ``apply(summed slice, summed
    scalars, exchange, relay)`` on this rank's slice, all-gather the slices it
    returns (with a relay, the previous rank's slice comes from ``apply`` too).
    Returns the new flat weights and the summed scalars, the same on every member."""
    n, r = t.size, t.rank
    edges = chunk_edges(buf.size, n)
    x = np.asarray(buf, np.float32)
    sc = np.zeros(0) if scalars is None else np.array(scalars, np.float64, copy=True)

    def seg(c: int) -> slice:
        return slice(edges[c], edges[c + 1])

    for k in range(1, n):  # views of ``buf`` travel: not written before we return
        dest = (r + k) % n
        t.send(dest, Key(step, "zs", 0, dest), (x[seg(dest)], sc))
    acc: np.ndarray | None = None
    total: np.ndarray | None = None
    for source in range(n):  # in rank order: the ``direct`` sum's bits
        if source == r:
            part, theirs = x[seg(r)], sc
        else:
            values, theirs = t.recv(source, Key(step, "zs", 0, r))
            part = values_of(values)
        acc = np.array(part, np.float32, copy=True) if acc is None else acc + part
        total = np.array(theirs, copy=True) if total is None else total + theirs
    assert acc is not None and total is not None
    return apply_and_gather(apply, t, acc, total, buf.size, step, scalars is not None)


def apply_and_gather(apply: Callable[..., np.ndarray], t: Transport, acc: np.ndarray,
                     total: np.ndarray, size: int, step: int, scalars: bool
                     ) -> tuple[np.ndarray, np.ndarray | None]:
    """The rest of a sharded step once rank r holds its summed slice ``acc`` and
    the summed scalars ``total``: ``apply`` it, all-gather the updated slices into
    the ``size`` new flat weights (:func:`sharded_update`)."""
    n, r = t.size, t.rank
    edges = chunk_edges(size, n)

    def seg(c: int) -> slice:
        return slice(edges[c], edges[c + 1])
    calls = 0

    def exchange(vector: np.ndarray) -> np.ndarray:
        """``vector`` (float64) summed over the members in rank order (the
        ``calls``-th exchange of this step: a step may have several)."""
        nonlocal calls
        calls += 1
        for k in range(1, n):
            t.send((r + k) % n, Key(step, "zn", calls, r), (np.zeros(0, np.float32), vector))
        out = None
        for source in range(n):
            theirs = (vector if source == r else
                      t.recv(source, Key(step, "zn", calls, source))[1])
            out = np.array(theirs, np.float64) if out is None else out + theirs
        assert out is not None
        return out

    relayed = False

    def relay(values: np.ndarray) -> np.ndarray:
        """``values`` to the next rank; what the previous rank relayed here."""
        nonlocal relayed
        relayed = True
        t.send((r + 1) % n, Key(step, "zf", 0, r), (values, None))
        got, _ = t.recv((r - 1) % n, Key(step, "zf", 0, (r - 1) % n))
        return np.array(values_of(got), np.float32, copy=True)

    # ``apply`` returns the slice's new values, and with a relay the previous
    # rank's slice as this rank's copy computed it (or ``None``: not applied)
    new = apply(acc, total, exchange, relay)
    mine, copied = new if isinstance(new, tuple) else (new, None)
    mine = np.ascontiguousarray(mine, np.float32)
    out = np.empty(size, np.float32)
    out[seg(r)] = mine
    if copied is not None:
        out[seg((r - 1) % n)] = copied
    # relayed: the next rank computed this slice's new values itself (the same
    # update on the same bits), and the previous rank's are here: not sent
    skip = 1 if relayed else 0
    for k in range(1 + skip, n):
        t.send((r + k) % n, Key(step, "zg", 0, r), (mine, None))
    for k in range(1 + skip, n):
        source = (r - k) % n
        values, _ = t.recv(source, Key(step, "zg", 0, source))
        values_of(values, out=out[seg(source)])
    return out, (total if scalars else None)


def shard_state_task(run_id: str) -> dict[str, Any]:
    """This replica's training state with its optimizer slice and the slice's
    layout (:func:`assemble_optimizer` puts the slices together)."""
    from dasktf.runtime.replica import get_replica

    replica = get_replica(run_id)
    shard = replica.shard_optimizer
    state = replica.training_state()
    if shard is None:  # no step ran yet: the whole optimizer is still the model's
        return {**state, "layout": None, "parts": None}
    return {**state, "layout": shard.layout, "parts": shard.parts,
            "rank": shard.rank, "slot_bytes": shard.slot_bytes(),
            "gradient_peak": shard.gradient_peak()}


def assemble_optimizer(states: list[dict[str, Any]], shapes: list[tuple[int, ...]]
                       ) -> list[np.ndarray]:
    """The whole optimizer's variables from every rank's :func:`shard_state_task`
    (the order Keras builds them in over the trainable variables)."""
    if states[0]["layout"] is None:
        return list(states[0]["optimizer"])
    ranked = sorted(states, key=lambda s: s["rank"])
    out = []
    for k, j in enumerate(ranked[0]["layout"]):
        if j < 0:
            out.append(np.asarray(ranked[0]["optimizer"][k]))
        else:
            flat = np.concatenate([np.asarray(s["optimizer"][k]).ravel() for s in ranked])
            out.append(flat.reshape(shapes[j]))
    return out


def sharded_step(replica: Replica, group: Group, grad: GradientSum, update: int,
                 size: int, votes: np.ndarray,
                 make: Callable[[Replica, int, int], ShardOptimizer] = ShardOptimizer,
                 collective: Callable[..., tuple[np.ndarray, np.ndarray | None]] | None = None,
                 staged: StagedBackward | None = None) -> tuple[GradientSum, np.ndarray]:
    """:func:`~dasktf.runtime.p2p.gradients.allreduce_step` of a sharded run: the
    step's gradient summed, applied slice by slice and the new weights taken, in
    one collective. Returns the sum (without its buffer: no member holds it whole)
    and the summed votes, the same on every member. ``make(replica, rank, n)``
    builds the replica's slice at a group's first step (redundant slices:
    :func:`dasktf.runtime.p2p.redundancy.redundant_shard`). ``collective``: the
    step's collective, called as :func:`sharded_update` (the default) is
    (``shard_state="gradients"``: its reduce-scatter in buckets,
    :func:`~dasktf.runtime.p2p.buckets.bucketed_update`). ``staged``: the
    collective computes this member's gradient itself, a group of layers at a
    time (``grad`` has no buffer, and none is made)."""
    shard = replica.shard_optimizer
    if shard is None:  # the first step: the slice takes over the optimizer
        shard = replica.shard_optimizer = make(replica, group.rank, group.size)
    elif (shard.rank, shard.n) != (group.rank, group.size):
        raise ShardingError(
            f"replica {replica.index} holds slice {shard.rank} of {shard.n} of the "
            f"optimizer, and its group is now rank {group.rank} of {group.size}, with "
            "no state loaded in between to cut the slices again; this is a dasktf bug.")
    total = (np.zeros(0 if staged is not None else size, np.float32) if grad.total is None
             else np.asarray(grad.total, np.float32).ravel())
    scalars = np.concatenate([[grad.count, grad.loss_sum, grad.square_sum],
                              np.asarray(votes, np.float64).ravel()])
    claimed = False

    def apply(chunk: np.ndarray, sums: np.ndarray,
              exchange: Callable[[np.ndarray], np.ndarray],
              relay: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        nonlocal claimed
        new = shard.step(replica, update, chunk, round(float(sums[0])), exchange, relay)
        claimed = new is not None
        return shard.own_values() if new is None else new

    collective = collective or sharded_update
    flat, sums = group.allreduce(total, update, scalars,
                                 runner=functools.partial(collective, apply))
    assert sums is not None
    shard.held = max(group.mailbox.peak.get(p, 0) for p in ("zs", "zb"))
    shard.own = max(shard.own, total.nbytes if staged is None else staged.largest)
    if claimed:  # the next step's gradient call, or the segment's end, takes it
        shard.take_later(flat, replica)
    summed = GradientSum(None, round(float(sums[0])), float(sums[1]),
                         grad.compute_seconds, grad.update, float(sums[2]))
    return summed, sums[3:]
