"""Rounds of local steps (Local SGD, DiLoCo): what a replica does with ``local_steps=H``.

A round is ``H`` inner steps of the run's optimizer (the *inner* one, whose state
stays on this worker across rounds) on this replica's own batches, from the
round's start weights ``w``; the replica then hands over its parameter change
``Δ_i = w - w_i`` (times its row count, as a gradient sum is, so the reduction
weighs every worker by its batches). Every replica receives the same sum, goes
back to ``w`` and applies the *outer* optimizer to the mean ``Δ`` as if it were a
gradient: outer SGD with learning rate 1 and no momentum is plain model averaging
(Lin et al. 2018); Nesterov momentum 0.9 with learning rate 0.7 is DiLoCo
(Douillard et al. 2023). So the whole of the sync engine (topology, codec with
error feedback, recovery) carries ``Δ`` instead of a gradient, once per round.

With a sparse codec (``topk:R``, :attr:`LocalSpec.codec`) a synced round cuts its
change itself: the worker sends the top-k of ``Δ_i`` and keeps the rest, ``u_i``, in
its own next start: its next inner steps begin from ``w' - u_i`` rather than from
the new round weights ``w'``, so ``Δ_i`` next round includes ``u_i`` and nothing is
lost or counted twice (``Σ sent + u_i == Σ`` of the worker's own progress; one
worker follows Keras' ``fit`` exactly). Error feedback kept in the all-reduce
instead re-adds a change the next round's inner steps, begun where the model has
not moved, find again (issue 39: topk:0.01 at H=64 with the Nesterov outer step
reached 0.935 test accuracy on MNIST after 8 epochs, against 0.955 this way and
0.963 without a codec). The all-reduce's own encoding then sends the cut change
exactly. A checkpoint keeps each worker's ``u_i`` beside its inner optimizer state,
so a resumed run goes on as the uninterrupted one.

``drift`` (per round) is the rows-weighted spread of the workers' ``Δ_i`` around
their mean, over the mean's norm: ``sqrt(mean ||Δ_i||² - ||Δ̄||²) / ||Δ̄||``. Each
worker sends ``n_i ||Δ_i||²`` with its sum (``GradientSum.square_sum``), so the
spread costs one scalar, whatever the topology.

Recovery redoes a round: the state at the round's start (the weights ``w`` and the
inner optimizer's variables) is kept (:class:`RoundStart`), and a round task that
finds no new update applied since goes back to it before its inner steps. A
checkpoint (or a reconciliation) of a replica mid-round is its round-start state.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from dasktf.data.shards import Shard
from dasktf.runtime.keras_step import batch_args, batch_signature
from dasktf.wire.messages import GradientSum

#: The outer optimizers by name (any ``keras.optimizers.Optimizer`` is taken too).
OUTER_OPTIMIZERS = ("average", "nesterov")
#: DiLoCo's outer step (Douillard et al. 2023, section 3).
NESTEROV_LEARNING_RATE = 0.7
NESTEROV_MOMENTUM = 0.9


@dataclass(frozen=True)
class LocalSpec:
    """A run's rounds: ``steps`` inner steps each, then the outer step."""

    steps: int
    #: the outer optimizer's Keras config (``keras.optimizers.serialize``)
    outer: dict[str, Any]
    #: ``"average"``, ``"nesterov"`` or the class name of the instance given
    name: str
    #: the run's ``compression`` when it is sparse (``topk:R``): each round's change
    #: is cut here, the rest kept in this worker's start (see the module)
    codec: str | None = None

    def rounds(self, steps_per_epoch: int) -> int:
        """Rounds in an epoch of ``steps_per_epoch`` inner steps (the last may be short)."""
        return -(-int(steps_per_epoch) // self.steps)

    def round_steps(self, round_: int, steps_per_epoch: int) -> range:
        """The inner steps of round ``round_`` of an epoch."""
        first = round_ * self.steps
        return range(first, min(first + self.steps, int(steps_per_epoch)))


def local_spec(
    local_steps: int, outer_optimizer: Any, outer_learning_rate: float | None,
    outer_momentum: float | None, compression: str | None = None,
) -> LocalSpec | None:
    """The rounds a run trains in, or ``None`` for plain sync steps (one inner step
    averaged by outer SGD with learning rate 1 is exactly one sync step: dasktf then
    runs the sync step, whose one optimizer sees the averaged gradient).

    With a sparse ``compression`` (``topk:R``) one inner step averaged is a round
    all the same: the optimizer's update is cut, not the gradient. An adaptive
    optimizer (Adam) divides each component by its own running scale, so a gradient
    component that error feedback holds back for m steps and then delivers at once
    moves the weights by about sqrt(m) steps' worth instead of m; an update held back
    and delivered is applied as it is (issue 39: topk:0.01 at H=1 lost 3.2 points
    of test accuracy after one epoch of MNIST that way, 1.8 as rounds).
    """
    import keras

    from dasktf.wire.codecs import get_codec

    sparse = compression is not None and get_codec(compression).sparse

    if isinstance(outer_optimizer, keras.optimizers.Optimizer):
        if outer_learning_rate is not None or outer_momentum is not None:
            raise ValueError(
                "outer_learning_rate and outer_momentum configure the named outer "
                "optimizers; set them on the keras optimizer you passed instead."
            )
        opt = outer_optimizer.__class__.from_config(outer_optimizer.get_config())
        name = type(outer_optimizer).__name__
    elif outer_optimizer == "average":
        if outer_momentum is not None:
            raise ValueError(
                "outer_optimizer='average' is outer SGD without momentum; use "
                "outer_optimizer='nesterov' for outer_momentum."
            )
        lr = 1.0 if outer_learning_rate is None else float(outer_learning_rate)
        opt = keras.optimizers.SGD(learning_rate=lr)
        name = "average"
        if local_steps == 1 and lr == 1.0 and not sparse:
            return None
    elif outer_optimizer == "nesterov":
        lr = NESTEROV_LEARNING_RATE if outer_learning_rate is None else float(outer_learning_rate)
        momentum = NESTEROV_MOMENTUM if outer_momentum is None else float(outer_momentum)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer_momentum must lie in [0, 1); got {outer_momentum!r}.")
        opt = keras.optimizers.SGD(learning_rate=lr, momentum=momentum, nesterov=True)
        name = "nesterov"
    else:
        raise ValueError(
            f"outer_optimizer must be one of {OUTER_OPTIMIZERS} or a "
            f"keras.optimizers.Optimizer; got {outer_optimizer!r}."
        )
    if outer_learning_rate is not None and not outer_learning_rate > 0:
        raise ValueError(f"outer_learning_rate must be positive; got {outer_learning_rate!r}.")
    return LocalSpec(int(local_steps), keras.optimizers.serialize(opt), name,
                     str(compression) if sparse else None)


def rounds_compression(options: Any) -> str | None:
    """The ``compression`` :func:`local_spec` is to see for a run's ``options`` (a
    :class:`~dasktf.run.options.TrainOptions`, its comm settings checked): the
    run's own where its rounds would be synced ones (sync mode, no quorum, no
    parameter servers, not the collective engine), else ``None``, so a sparse codec
    never turns one local step into a round the run cannot take."""
    synced = (options.mode == "sync" and options.sync_quorum is None
              and options.engine != "collective" and options.comm.num_ps <= 1
              and options.comm.placement != "ps")
    return options.compression if synced else None


class RoundReplica(Protocol):
    """What a replica's rounds use of it (:class:`dasktf.runtime.replica.Replica`)."""

    model: Any
    variables: list[Any]
    sizes: list[int]
    shapes: list[tuple[int, ...]]
    shard: Shard
    schedule: np.ndarray
    applied: int
    apply_lock: threading.Lock
    fenced: bool
    device: str
    events: Any
    run_id: str
    index: int
    comm: Any

    def batch(self, epoch: int, step: int) -> Shard: ...
    def flat_weights(self) -> np.ndarray: ...
    def set_flat_weights(self, flat: np.ndarray) -> None: ...
    def batch_gradient(self, x: Any, y: Any, w: Any = None) -> tuple[Any, Any]: ...
    def apply_mean(self, total: Any, count: Any) -> None: ...


@dataclass
class RoundStart:
    """A replica at the start of a round: after update ``applied``, its trainable
    weights ``weights`` (flat) and its inner optimizer's variables."""

    applied: int
    weights: np.ndarray
    inner: list[np.ndarray]
    #: times the round was begun again from here (a recovery redid it)
    redone: int = 0
    #: this worker's change that earlier rounds could not send (sparse codecs): its
    #: inner steps start from ``weights - unsent``
    unsent: np.ndarray | None = None


@dataclass
class Rounds:
    """A replica's rounds: the outer optimizer, the round start, the drift log."""

    replica: RoundReplica
    spec: LocalSpec
    outer: Any = None
    start: RoundStart | None = None
    #: ``{update, drift, loss, examples, redone}`` of each outer update this replica applied
    #: since the last epoch end (the first replica's go to the history)
    log: list[dict[str, Any]] = field(default_factory=list)
    #: Async rounds: each round's change is scaled by this share (1 / workers)
    share: float = 1.0
    #: Sparse codecs: this worker's change not sent yet (after the last outer step)
    unsent: np.ndarray | None = None
    #: ... and after the round in flight, once its outer step is applied
    _unsent_next: np.ndarray | None = None

    def __post_init__(self) -> None:
        import keras
        import tensorflow as tf

        from dasktf.wire.codecs import get_codec

        r = self.replica
        self.codec = None if self.spec.codec is None else get_codec(self.spec.codec)
        self.outer = keras.optimizers.deserialize(self.spec.outer)
        self.outer.build(r.variables)
        # Positions of the trainable variables among model.get_weights()' arrays.
        trainable = {id(v) for v in r.variables}
        self.positions = [i for i, w in enumerate(r.model.weights) if id(w) in trainable]
        signature = batch_signature(r.shard.take(slice(0, 1)))
        # One call per round: the round's batches go in as one block of rows with
        # their offsets, and a graph loop takes the inner steps (a call per step
        # cost ~2 ms of Python dispatch, as much as a small model's step itself).
        self._round_fn = tf.function(
            self._round, input_signature=[tf.TensorSpec((None,), tf.int32), *signature])
        self._outer_fn = tf.function(
            self._outer_step,
            input_signature=[tf.TensorSpec((sum(r.sizes),), tf.float32),
                             tf.TensorSpec((), tf.float32)],
        )

    # -- compiled bodies ------------------------------------------------------
    def _round(self, offsets: Any, *rows: Any) -> Any:
        """The inner steps of a round: step ``i`` on rows ``offsets[i]:offsets[i+1]``;
        each step's summed loss."""
        import tensorflow as tf

        from dasktf.data.structure import map_nest

        steps = tf.shape(offsets)[0] - 1
        losses = tf.TensorArray(tf.float32, size=steps)
        for i in tf.range(steps):
            lo, hi = offsets[i], offsets[i + 1]
            batch = [map_nest(lambda a, lo=lo, hi=hi: a[lo:hi], part) for part in rows]
            total, loss_sum = self.replica.batch_gradient(*batch)
            self.replica.apply_mean(total, tf.cast(hi - lo, tf.float32))
            losses = losses.write(i, tf.cast(loss_sum, tf.float32))
        return losses.stack()

    def _outer_step(self, total: Any, count: Any) -> None:
        import tensorflow as tf

        r = self.replica
        mean = total / count
        deltas = [tf.reshape(p, s) for p, s in zip(tf.split(mean, r.sizes), r.shapes,
                                                   strict=True)]
        self.outer.apply_gradients(zip(deltas, r.variables, strict=True))

    # -- the round ------------------------------------------------------------
    def begin(self) -> RoundStart:
        """The round's start (under ``apply_lock``): a new one after a new update,
        else the kept one, restored (a recovery redoes this round)."""
        r = self.replica
        start = self.start
        self._unsent_next = None
        if start is not None and start.applied == r.applied:
            r.set_flat_weights(_shifted(start))
            for v, value in zip(r.model.optimizer.variables, start.inner, strict=True):
                v.assign(value)
            start.redone += 1
            return start
        self.start = RoundStart(r.applied, r.flat_weights(),
                                [np.array(v.numpy()) for v in r.model.optimizer.variables],
                                unsent=self.unsent)
        if self.unsent is not None:
            r.set_flat_weights(_shifted(self.start))
        return self.start

    def begin_at(self, flat: np.ndarray, version: int) -> RoundStart:
        """Async: the round starts from the holder's weights of ``version``; its
        change is pushed scaled by this worker's share, ``1/N`` (dasktf's shards
        are equal to a row), so N rounds move the weights as one averaged round."""
        r = self.replica
        self.share = 1.0 / max(1, int(getattr(r.comm, "n_workers", 1) or 1))
        r.set_flat_weights(flat)
        self.start = RoundStart(version, np.array(flat, np.float32), [])
        return self.start

    def run(self, epoch: int, round_: int, synced: bool = True) -> GradientSum:
        """Round ``round_`` of ``epoch``: its inner steps, then the change to send
        (``total = n Δ``, ``square_sum = n ||Δ||²``); empty if the replica was fenced
        (a recovery stopped it: the round is redone). ``synced=False``: an async
        round, begun by :meth:`begin_at`."""
        r = self.replica
        if synced:
            with r.apply_lock:
                self.begin()
        start = self.start
        assert start is not None
        began = time.perf_counter()
        steps, batches = [], []
        for step in self.spec.round_steps(round_, len(r.schedule)):
            batch = r.batch(epoch, step)
            if len(batch):
                steps.append(step)
                batches.append(batch)
        if not batches:
            return GradientSum(None, 0, 0.0, compute_seconds=time.perf_counter() - began)
        sizes = [len(b) for b in batches]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        with r.apply_lock:  # a recovery's fence waits for the round, then stops it
            if r.fenced:
                return GradientSum(None, 0, 0.0)
            with _on(r.device):
                step_losses = self._round_fn(offsets,
                                             *batch_args(Shard.concat(batches))).numpy()
        rows, loss_sum = int(offsets[-1]), float(np.sum(step_losses, dtype=np.float64))
        if r.events.enabled:
            now = time.time()
            for step, n, loss in zip(steps, sizes, step_losses, strict=True):
                r.events.add({
                    "run": r.run_id, "kind": "inner", "epoch": epoch, "round": round_,
                    "step": step, "worker": r.index, "batch_size": n,
                    "local_loss": float(loss) / n, "wall_time": now,
                })
        delta = start.weights - r.flat_weights()  # (with what earlier rounds kept)
        if synced and self.codec is not None:
            delta, self._unsent_next = self._cut(delta)
        scale = np.float32(rows * self.share)
        return GradientSum(delta * scale, rows, loss_sum,
                           compute_seconds=time.perf_counter() - began,
                           square_sum=float(rows) * float(np.dot(delta, delta)))

    def apply(self, summed: GradientSum) -> None:
        """The outer step of a round's sum (under ``apply_lock``, claimed): back to
        the round's start, then the outer optimizer on the mean change."""
        r, start = self.replica, self.start
        if start is not None:
            r.set_flat_weights(start.weights)
        if self._unsent_next is not None:
            self.unsent, self._unsent_next = self._unsent_next, None
        if not summed.count or summed.total is None:
            return
        with _on(r.device):
            self._outer_fn(summed.total, np.float32(summed.count))
        mean = summed.total / np.float32(summed.count)
        self.log.append({
            "update": summed.update, "drift": drift(mean, summed.square_sum, summed.count),
            "loss": summed.loss, "examples": summed.count,
            "redone": start.redone if start is not None else 0,
        })

    def _cut(self, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(sent, kept)`` of a round's change under the sparse codec: what travels
        (decoded; the all-reduce's own encoding then sends it exactly) and what this
        worker keeps, in its weights, for the next rounds."""
        from dasktf.wire.codecs import decode

        assert self.codec is not None
        sent = decode(self.codec.encode(delta))
        return sent, delta - sent

    def annotate(self, record: dict[str, Any], previous: GradientSum | None) -> None:
        """A round's step record: its H, and the drift of the round just applied."""
        record["local_steps"] = self.spec.steps
        if self.log and previous is not None and previous.count:
            record["drift"] = self.log[-1]["drift"]

    # -- state ----------------------------------------------------------------
    def cut(self, state: dict[str, Any]) -> dict[str, Any]:
        """A replica's training state at its round start (mid-round, the weights and
        inner state the round began with), with the outer optimizer's variables."""
        r, start = self.replica, self.start
        unsent = self.unsent
        if start is not None and start.applied == r.applied and start.inner:
            weights = list(state["weights"])
            flat = np.split(start.weights, np.cumsum(r.sizes)[:-1])
            for i, part, shape in zip(self.positions, flat, r.shapes, strict=True):
                weights[i] = part.reshape(shape)
            state = {**state, "weights": weights, "optimizer": list(start.inner)}
            unsent = start.unsent
        state["outer"] = [np.asarray(v.numpy()) for v in self.outer.variables]
        # this worker's change its sparse codec has not sent yet, by worker as the
        # inner states (a resume without it would drop that progress: the run
        # would differ from the uninterrupted one)
        state["unsent"] = {} if unsent is None else {r.index: np.array(unsent, np.float32)}
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Take a state's outer optimizer and, where it has this replica's, inner
        optimizer variables (a reconciliation keeps the replica's own inner state:
        inner states are per worker)."""
        r = self.replica
        for v, value in zip(self.outer.variables, state.get("outer") or [], strict=False):
            v.assign(value)
        inner = (state.get("inner") or {}).get(r.index)
        if inner is not None:
            for v, value in zip(r.model.optimizer.variables, inner, strict=True):
                v.assign(value)
        self.start = None  # the next round starts from the state loaded
        unsent = (state.get("unsent") or {}).get(r.index)  # a checkpoint's, per worker
        self.unsent = None if unsent is None else np.array(unsent, np.float32)
        self._unsent_next = None

    def take_log(self) -> list[dict[str, Any]]:
        log, self.log = self.log, []
        return log


def _shifted(start: RoundStart) -> np.ndarray:
    """Where a round's inner steps begin: its weights, less what is unsent."""
    return start.weights if start.unsent is None else start.weights - start.unsent


def drift(mean: np.ndarray, square_sum: float, count: int) -> float:
    """The workers' spread around the mean change over its norm (see the module)."""
    norm2 = float(np.dot(mean, mean))
    if norm2 <= 0.0 or not count:
        return 0.0
    spread = max(0.0, square_sum / count - norm2)
    return float(np.sqrt(spread / norm2))


def _on(device: str) -> Any:
    import tensorflow as tf

    return tf.device(device)
