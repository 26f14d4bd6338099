"""The model replica that lives on a worker for the whole run.

A :class:`Replica` owns a Keras model built from the run's model package
(:class:`~dasktf.transport.ModelRef`: the client's model as Keras saves it), its
own copy of the optimizer (continuing the client's where the run continues it), its data shard and two compiled functions: one
computes the gradient of a local batch as a single flat float32 buffer (already
multiplied by the batch size, so partial sums add up), the other applies a summed
gradient. Every replica applies the same sums in the same order, so all hold the
same weights without ever broadcasting them.

Each worker keeps its replicas in its :class:`~dasktf.runtime.manager.RunManager`
(:func:`register_replica`, :func:`get_replica`); the Dask tasks that drive them
live in :mod:`dasktf.runtime.tasks`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dasktf import compat
from dasktf.cluster.devices import (
    compute_device,
    precision_policy,
)
from dasktf.data.shards import Shard
from dasktf.data.streams import StreamedShard
from dasktf.data.structure import first_leaf
from dasktf.exceptions import ReplicaError
from dasktf.models import CompileRecipe
from dasktf.runtime.keras_step import (
    MetricEvaluator,
    SignatureFunction,
    batch_args,
    batch_signature,
    build_metrics,
    flat_gradient,
    metric_states,
    weigh_output_losses,
)
from dasktf.runtime.manager import RunManager, run_manager
from dasktf.runtime.rounds import LocalSpec, Rounds
from dasktf.runtime.statistics import non_trainable_floats, read_values
from dasktf.runtime.timing import StepTimer, StepTiming
from dasktf.transport import ModelRef, built_optimizer, seed_states
from dasktf.wire.messages import GradientSum

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaConfig:
    """Everything a worker needs to build its replica; small and picklable."""

    model: ModelRef  # the run's model package (a key: the package is on the workers)
    recipe: CompileRecipe  # optimizer, loss, loss weights, metrics
    seed: int
    eval_batch_size: int = 256
    #: Keras mixed precision: mixed_float16 with loss scaling on a GPU worker,
    #: mixed_bfloat16 on a CPU one (see dasktf.cluster.devices.precision_policy).
    mixed_precision: bool = False
    #: publish step records (the client's ``dasktf.metrics`` at run start)
    publish_metrics: bool = True
    #: how gradients and weights travel (a :class:`dasktf.wire.packets.CommSpec`); None:
    #: plain float32 GradientSums (the async holder's own replica)
    comm: Any = None
    #: rounds of local steps (:class:`dasktf.runtime.rounds.LocalSpec`); None: sync steps
    local: LocalSpec | None = None
    sliced: bool = False  #: the optimizer cut into slices at the first step (shard_state)


@dataclass
class EpochReport:
    """What a replica hands back at the end of an epoch."""

    worker: str
    train_states: list[np.ndarray]
    val_states: list[np.ndarray] | None
    weights: list[np.ndarray] | None = None
    step_seconds: list[float] = field(default_factory=list)
    #: this process's byte ledger of the run (:func:`dasktf.wire.packets.traffic`), read
    #: after the epoch's last sum arrived, so every step's bytes are in it
    traffic: dict[str, Any] | None = None
    #: the optimizer's variables, where the engine asked for them (checkpoints)
    optimizer_variables: list[np.ndarray] | None = None
    #: rounds of local steps: the outer updates this replica applied this epoch,
    #: each ``{update, drift, loss, examples}`` (:class:`dasktf.runtime.rounds.Rounds`)
    rounds: list[dict[str, Any]] | None = None
    #: the seed generators' states, with the weights (the client's model goes on
    #: drawing where this replica stopped, as after a Keras ``fit``)
    seeds: list[np.ndarray] | None = None
    records: list[dict[str, Any]] | None = None  #: unsent step records (the client's to publish)


class Replica:
    """A worker-resident model replica with its shard and compiled step functions."""

    def __init__(
        self,
        config: ReplicaConfig,
        index: int,
        shard: Shard,
        schedule: np.ndarray,
        weights: list[np.ndarray] | None = None,
        val_shard: Shard | None = None,
        shuffle: bool = True,
    ) -> None:
        """``weights``: the model's weights to start from (a recovery's); ``None``:
        the packed model's own."""
        import tensorflow as tf

        self.index = index
        self.shard = shard
        self.val_shard = val_shard
        self.schedule = np.asarray(schedule)
        self.offsets = np.concatenate([[0], np.cumsum(self.schedule)])
        self.shuffle = shuffle
        self.seed = config.seed
        self.eval_batch_size = config.eval_batch_size
        self.comm = config.comm

        # The model and its step live on this worker's one GPU if it has one (it was
        # pinned at spawn); batches are numpy slices on the host.
        self.device = compute_device()
        probe = shard.take(slice(0, 1))
        with compat.keras_seeded(config.seed + index), tf.device(self.device), \
                precision_policy(config.mixed_precision) as policy:
            # compiled, its optimizer built (and continued where the run continues it)
            model = config.model.build(config.recipe, stream=index, sliced=config.sliced,
                                       policy=policy if config.mixed_precision else None)
        if weights is not None:
            model.set_weights(weights)
        self.model = model
        self.variables = list(model.trainable_variables)
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.stats_variables = non_trainable_floats(model)
        build_metrics(model, probe.x, probe.y, probe.w)
        self.loss_tracker = next(m for m in model.metrics if m.name == "loss")
        self.output_loss_trackers = compat.output_loss_metrics(model)
        self.weighted = probe.w is not None
        self.evaluator = MetricEvaluator(model)
        self.batch_spec = batch_signature(probe)  #: the gradient functions' batch inputs
        self._gradient_fn = SignatureFunction(self.batch_gradient, self.batch_spec)
        # A fixed signature: a Python int count would retrace for every new value
        # (the short last batch of each epoch, for one).
        summed = [tf.TensorSpec((sum(self.sizes),), tf.float32), tf.TensorSpec((), tf.float32)]
        self._apply_fn = SignatureFunction(self.apply_mean, summed)
        # A sync step's apply and the next step's gradient in one TensorFlow call
        # (the p2p engine's steps; :meth:`apply_then_gradient`): half the calls,
        # whose fixed cost dominates a small model's step.
        self._apply_gradient_fn = SignatureFunction(self._apply_then_gradient,
                                                    [*summed, *self.batch_spec])
        self._epoch = -1
        self._order = None if isinstance(shard, StreamedShard) else np.arange(len(shard))
        self.step_seconds: list[float] = []
        from dasktf.diagnostics.events import MetricsBuffer

        # the first replica's records carry the global loss the client relays
        self.events = MetricsBuffer(enabled=config.publish_metrics, reports_loss=index == 0,
                                    n_workers=getattr(config.comm, "n_workers", 1))
        self.timing = StepTimer(self.events.enabled)
        self.run_id = ""
        #: A straggler for tests and demos: after each step, sleep (factor - 1) x
        #: that step's compute time (see :func:`straggle`).
        self.slow_factor = 1.0
        #: The parameter holder's version these weights were read at (async modes).
        self.holder_version = -1
        #: Who this replica is to the parameter holder (async): its index, or a new
        #: one when it took over a lost worker's shard.
        self.identity = index
        #: Its end of the wire (:func:`dasktf.runtime.channel.channel`), made on first use.
        self.channel: Any = None
        #: Its link to the parameter holder (:mod:`dasktf.engines.holder.tasks`).
        self.holder_link: Any = None
        #: A step has run: :func:`straggle` slows the ones after the first (tracing).
        self.traced = False
        #: The last global update applied, and every update applied in order: a sum is
        #: applied at most once even when recovery hands it over again.
        self.applied = -1
        self.applied_log: list[int] = []
        self.apply_lock = threading.Lock()
        self.fenced = False
        #: ``{update: training state right after it}``, kept for a checkpoint the
        #: client asked for in advance (see :meth:`keep_state`).
        self.kept: dict[int, dict[str, Any]] = {}
        #: ``(first update, steps, from lr, to lr)`` while a warm-up is under way
        self.lr_ramp: tuple[int, int, float, float] | None = None
        #: Shards adopted from lost workers: ``(index, shard, schedule column)``; their
        #: rows join this replica's batches (see :mod:`dasktf.engines.graph.elastic`).
        self.adopted: list[tuple[int, Shard, np.ndarray]] = []
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        #: Rounds of local steps (``local_steps=H``): the outer optimizer and the
        #: round's start; ``None`` for sync steps.
        self.rounds = Rounds(self, config.local) if config.local is not None else None
        #: ``shard_state="optimizer"``: this replica's slice of the optimizer
        #: (:class:`dasktf.runtime.p2p.sharding.ShardOptimizer`), made by the first step
        self.shard_optimizer: Any = None
        #: shard_state="gradients": ``(the least values a stage holds, the backward
        #: pass's stages or None)`` (:mod:`dasktf.runtime.staged`), found at a first step
        self.backward_stages: tuple[int, Any] | None = None

    # -- compiled bodies (traced here, and into a round's loop by rounds.py) ---
    def batch_gradient(self, x: Any, y: Any, w: Any = None) -> tuple[Any, Any]:
        """One batch's flat gradient and loss, each times its rows (a TF body)."""
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)
            loss, scaled, n = self.batch_loss(x, y, y_pred, w)
        grads = tape.gradient(scaled, self.variables)
        self.track(x, y, y_pred, w, loss, n)
        flat = flat_gradient(grads, self.variables)
        return flat * tf.cast(n, flat.dtype), loss * tf.cast(n, loss.dtype)

    def batch_loss(self, x: Any, y: Any, y_pred: Any, w: Any) -> tuple[Any, Any, Any]:
        """The batch's loss, the loss the backward pass starts from and its rows
        (inside the tape; the staged backward pass, :mod:`dasktf.runtime.staged`,
        shares it)."""
        import tensorflow as tf

        # Keras' reduction divides the weighted sum by the batch size, not the
        # weights' sum: times n, summed and divided by the global count, it is
        # Keras' weighted loss of the global batch.
        before = [m.total + 0.0 for m in self.output_loss_trackers]
        loss = self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w,
                                       training=True)
        n = tf.shape(first_leaf(x))[0]
        weigh_output_losses(self.output_loss_trackers, before, n)
        # A LossScaleOptimizer (mixed_float16) scales here and unscales, checks for
        # overflow and adapts the scale in apply_gradients; every replica applies
        # the same sum, so their scales stay equal. Else a no-op.
        return loss, self.model.optimizer.scale_loss(loss), n

    def track(self, x: Any, y: Any, y_pred: Any, w: Any, loss: Any, n: Any) -> None:
        """The batch's loss and metrics into the model's trackers."""
        self.loss_tracker.update_state(loss, sample_weight=n)
        self.model.compute_metrics(x, y, y_pred, sample_weight=w)

    def apply_mean(self, total: Any, count: Any) -> None:
        """Apply the flat gradient ``total / count`` with the optimizer (a TF body)."""
        import tensorflow as tf

        grads = [tf.reshape(part, shape) for part, shape
                 in zip(tf.split(total / count, self.sizes), self.shapes, strict=False)]
        self.model.optimizer.apply_gradients(zip(grads, self.variables, strict=False))

    def _apply_then_gradient(self, total: Any, count: Any, x: Any, y: Any, w: Any = None
                             ) -> tuple[Any, Any]:
        """:meth:`apply_mean`, then :meth:`batch_gradient` at the new weights (a TF
        body: automatic control dependencies keep the reads after the writes)."""
        self.apply_mean(total, count)
        return self.batch_gradient(x, y, w)

    # -- what the tasks call --------------------------------------------------
    def apply_then_gradient(self, summed: GradientSum | None, epoch: int, step: int
                            ) -> GradientSum:
        """:meth:`apply` ``summed``, then :meth:`gradient` of ``(epoch, step)``: the
        same state and result, in one TensorFlow call where both have work (no
        rounds, no learning-rate ramp, examples on both sides)."""
        batch = self.batch(epoch, step)
        fusable = (summed is not None and summed.count and len(batch)
                   and self.rounds is None and self.lr_ramp is None)
        if fusable:
            assert summed is not None and summed.total is not None
            with self.apply_lock:
                if self._claim(summed.update):
                    return self.gradient_call(self._apply_gradient_fn, batch, summed.total,
                                              np.float32(summed.count))
        self.apply(summed)
        return self._gradient_of(batch)

    def apply(self, summed: GradientSum | None) -> None:
        if summed is None:
            return
        with self.apply_lock:
            if not self._claim(summed.update):
                return
            if self.rounds is not None:  # an outer step, not a gradient
                self.rounds.apply(summed)
                return
            if self.lr_ramp is not None and summed.update >= 0:
                self._ramp(summed.update)
            if summed.count:
                assert summed.total is not None
                with _on(self.device):
                    self._apply_fn(summed.total, np.float32(summed.count))

    def claim_update(self, update: int) -> bool:
        """Whether a sharded step (:mod:`dasktf.runtime.p2p.sharding`) applies ``update``
        here, counted once as :meth:`apply` counts its sums (a warm-up's rate set)."""
        with self.apply_lock:
            claimed = self._claim(update)
            if claimed and self.lr_ramp is not None and update >= 0:
                self._ramp(update)
            return claimed

    def take_weights(self, flat: np.ndarray, update: int) -> None:
        """The servers' weights after ``update`` (``placement="ps"``): counted and
        taken once, like a sum :meth:`apply` applies."""
        with self.apply_lock:
            if self._claim(update):
                self.set_flat_weights(flat)

    def _claim(self, update: int) -> bool:
        """Whether ``update`` is to be applied here now, counting it if so (under
        ``apply_lock``): not while a recovery has fenced the replica, never twice
        (recovery may hand an update over again); ``-1``: untracked, always."""
        if self.fenced:
            return False
        if update >= 0:
            if update <= self.applied:
                return False
            self.applied = update
            self.applied_log.append(update)
        return True

    def training_state(self) -> dict[str, Any]:
        """Weights, optimizer variables and ``applied``: a consistent cut (no
        apply half-way)."""
        with self.apply_lock:
            state = {
                "weights": [np.asarray(w) for w in self.model.get_weights()],
                "optimizer": [np.asarray(v.numpy()) for v in built_optimizer(self.model).variables],
                "applied": self.applied,
                "index": self.index,
            }
            return state if self.rounds is None else self.rounds.cut(state)

    def keep_state(self) -> None:
        """Keep the state as it is now, after the update just applied, for a
        checkpoint of exactly that update: the client reads it a little later, when
        this worker may be steps ahead (:meth:`dasktf.engines.graph.steps.SyncEngine.state_after`)."""
        state = self.training_state()
        # Several may wait: the client can lag more than checkpoint_every steps
        # behind (a slow callback) while this replica keeps the next grid state.
        with self.apply_lock:
            self.kept[state["applied"]] = state

    def _ramp(self, update: int) -> None:
        """Linear learning-rate warm-up after a worker-count change (``scale_lr``)."""
        assert self.lr_ramp is not None
        self.model.optimizer.learning_rate, done = ramped_learning_rate(self.lr_ramp, update)
        if done:
            self.lr_ramp = None

    def batch(self, epoch: int, step: int) -> Shard:
        """This replica's rows of global step ``step`` (its own, then adopted ones)."""
        if epoch != self._epoch:
            self._epoch = epoch
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch, self.index])
                self._order = (None if isinstance(self.shard, StreamedShard)
                               else rng.permutation(len(self.shard)))
        if isinstance(self.shard, StreamedShard):  # read in order, part by part
            own = self.shard.window(epoch, self.offsets[step], self.offsets[step + 1],
                                    (self.seed, epoch, self.index) if self.shuffle else None)
        else:
            own = self.shard.take(self._order[self.offsets[step] : self.offsets[step + 1]])
        if not self.adopted:
            return own
        return Shard.concat([own, *(self.adopted_batch(index, shard, column, epoch, step)
                                    for index, shard, column in self.adopted)])

    def adopted_batch(
        self, index: int, shard: Shard, column: np.ndarray, epoch: int, step: int
    ) -> Shard:
        """Rows of an adopted shard, in the order its lost owner would have read them
        (same seed, same per-epoch permutation), so the global batch is unchanged."""
        if isinstance(shard, StreamedShard):
            offsets = np.concatenate([[0], np.cumsum(column)])
            return shard.window(epoch, offsets[step], offsets[step + 1],
                                (self.seed, epoch, index) if self.shuffle else None)
        key = (index, epoch)
        order = self._orders.get(key)
        if order is None:
            order = np.arange(len(shard))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch, index]).permutation(len(shard))
            self._orders = {k: v for k, v in self._orders.items() if k[1] == epoch}
            self._orders[key] = order
        offsets = np.concatenate([[0], np.cumsum(column)])
        rows = order[offsets[step] : offsets[step + 1]]
        return shard.take(rows)

    def gradient(self, epoch: int, step: int) -> GradientSum:
        return self._gradient_of(self.batch(epoch, step))

    def _gradient_of(self, batch: Shard) -> GradientSum:
        if len(batch) == 0:
            return GradientSum(None, 0, 0.0)
        return self.gradient_call(self._gradient_fn, batch)

    def gradient_call(self, fn: Any, batch: Shard, *leading: Any) -> GradientSum:
        """``fn(*leading, *batch)`` on this replica's device, a compiled body that
        ends with :meth:`batch_gradient`'s ``(flat gradient, loss)``, as the sum of
        ``batch`` (it has rows)."""
        with _on(self.device):
            flat, loss_sum = fn(*leading, *batch_args(batch))
        # a read-only view of the tensor, not Tensor.numpy()'s copy: nothing writes
        # into a gradient (the codecs and the sums make new arrays)
        return GradientSum(np.asarray(flat), len(batch), float(loss_sum))

    def record_step(
        self,
        epoch: int,
        step: int,
        previous: GradientSum | None,
        out: GradientSum,
        timing: StepTiming | None = None,
        moved: int | None = None,
        loss_step: int | None = None,
    ) -> None:
        """Queue this step's record (schema: :class:`dasktf.diagnostics.events.StepRecord`); the
        global loss of ``previous``, the sum this replica just applied, rides along (the
        step before's; ``loss_step``: the update it belongs to otherwise)."""
        if not self.events.enabled:
            return
        update = epoch * (len(self.schedule) if self.rounds is None
                          else self.rounds.spec.rounds(len(self.schedule))) + step
        moved = moved if moved is not None else (
            (out.total.nbytes if out.total is not None else 0)
            + (previous.total.nbytes if previous is not None and previous.total is not None else 0)
        )
        record: dict[str, Any] = {
            "run": self.run_id,
            "kind": "step",
            "mode": "sync",
            "epoch": epoch,
            "step": step,
            "update": update,
            "worker": self.index,
            "batch_size": out.count,
            "local_loss": out.loss if out.count else None,
            "staleness": 0,
            "compute_s": out.compute_seconds,
            "bytes": moved,
            "wall_time": time.time(),
        }
        if timing is not None:
            record["communication_s"] = timing.communication_s
            record["waiting_s"] = timing.waiting_s
        if previous is not None and previous.count:
            record["loss"] = previous.loss
            record["loss_step"] = update - 1 if loss_step is None else loss_step
        if self.rounds is not None:
            self.rounds.annotate(record, previous)
        self.events.add(record)

    def set_flat_weights(self, flat: np.ndarray) -> None:
        """Assign the trainable variables from one flat float32 buffer."""
        for v, part, shape in zip(
            self.variables, np.split(flat, np.cumsum(self.sizes)[:-1]), self.shapes, strict=False
        ):
            v.assign(part.reshape(shape))

    def flat_weights(self) -> np.ndarray:
        """The trainable variables as one flat float32 buffer."""
        return np.concatenate(
            [np.asarray(v.numpy(), dtype=np.float32).ravel() for v in self.variables]
        )

    def seed_values(self) -> list[np.ndarray]:
        """The model's seed generators' states (where its random layers are)."""
        return [np.asarray(v.numpy()) for v in seed_states(self.model)]

    def non_trainable_values(self) -> list[np.ndarray] | None:
        """The model's non-trainable float state (BatchNormalization's moving
        statistics), ``None`` when it has none."""
        return read_values(self.stats_variables)

    def set_non_trainable(self, values: list[np.ndarray] | None) -> None:
        """Assign :meth:`non_trainable_values`' variables (``None``: nothing)."""
        if values is None:
            return
        with self.apply_lock:
            for v, value in zip(self.stats_variables, values, strict=True):
                v.assign(value)

    def take_metric_states(self) -> list[np.ndarray]:
        """The metric states accumulated since the last call, then reset them."""
        states = self.metric_states()
        self.model.reset_metrics()
        return states

    def metric_states(self) -> list[np.ndarray]:
        return metric_states(self.model)

    def evaluate(self) -> list[np.ndarray] | None:
        """The metric states on this replica's validation rows (Keras' evaluate's),
        ``None`` without any; the metrics are left holding them."""
        if self.val_shard is None or len(self.val_shard) == 0:
            return None
        with _on(self.device):
            return self.evaluator.states(self.val_shard, self.eval_batch_size)


def _on(device: str) -> Any:
    import tensorflow as tf

    return tf.device(device)


def take_kept(kept: dict[int, Any], update: int | None) -> Any:
    """The state kept after ``update`` (``None`` if not kept or not asked), dropping
    it and any older one: the client reads the checkpoint grid in order, so what
    it skipped is never read."""
    if update is None:
        return None
    for older in [u for u in kept if u < update]:
        del kept[older]
    return kept.pop(update, None)


def ramped_learning_rate(
    ramp: tuple[int, int, float, float], update: int
) -> tuple[float, bool]:
    """The learning rate of ``update`` in a linear warm-up ``(first update, steps,
    from, to)``, and whether the warm-up is over."""
    start, steps, low, high = ramp
    frac = min(1.0, max(0.0, (update - start + 1) / steps))
    return low + (high - low) * frac, frac >= 1.0


def straggle(replica: Replica, compute_seconds: float) -> None:
    """Make a replica with ``slow_factor`` f > 1 take f times its compute time.

    It sleeps rather than computes more, so a slowed worker frees its core (as a
    worker waiting on a slow disk or a shared GPU would) and its results are
    unchanged: only the timing differs. The first step is not slowed: its time is
    mostly tracing, a one-off cost every worker pays.
    """
    delay = run_manager().delay  # (tests: :func:`dasktf.testing.delay_worker`)
    factor = max(replica.slow_factor, delay["factor"])
    pause = max((factor - 1.0) * compute_seconds, delay["seconds"] - compute_seconds)
    if pause > 0 and replica.traced:
        time.sleep(pause)
    replica.traced = True


# -- the worker's replicas, held by its RunManager ------------------------------------
def _key(run_id: str, slot: int | None = None) -> tuple[RunManager, tuple[str, str]]:
    manager = run_manager()
    address = manager.address
    return manager, (run_id, address if slot is None else f"{address}#{slot}")


def register_replica(run_id: str, replica: Replica, slot: int | None = None) -> None:
    """Make ``replica`` this worker's replica of ``run_id`` (``slot``: one built here
    for a lost worker's shard)."""
    manager, key = _key(run_id, slot)
    manager.replicas[key] = replica


def get_replica(run_id: str, slot: int | None = None) -> Replica:
    """This worker's replica of ``run_id`` (``slot``: one adopted from a lost worker)."""
    manager, key = _key(run_id, slot)
    try:
        return manager.replicas[key]
    except KeyError:
        raise ReplicaError(
            f"No replica of run {run_id} on this worker: it was lost or never built "
            "(a worker restarted mid-run?)."
        ) from None


def registered_replicas(dask_worker: Any = None) -> dict[tuple[str, str], Replica]:
    """Every replica on this worker, by (run id, worker)."""
    return dict(run_manager(dask_worker).replicas)


def replicas_of(run_id: str, dask_worker: Any = None) -> list[Replica]:
    """Every replica of ``run_id`` on this worker (adopted ones included)."""
    return [r for (run, _), r in registered_replicas(dask_worker).items() if run == run_id]
