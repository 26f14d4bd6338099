"""The collective step engine: sync training on ``tf.distribute`` ring all-reduce.

The task-graph engine (:mod:`dasktf.sync`) pays a scheduler hop or two per step,
which a model whose step takes a few milliseconds cannot amortize. This engine runs
the same Keras model under ``tf.distribute.MultiWorkerMirroredStrategy`` instead:
one TensorFlow child process per Dask worker (started through the bridge,
:mod:`dasktf.tfconfig`), fed from the shard dasktf already placed on that worker,
with gradients all-reduced by TensorFlow's collectives and no scheduler in the
per-step path. Dask only carries one task per worker per epoch (run the epoch,
hand back the metric states) and the step records, which the parent task forwards
to the same metrics stream as the graph engine, so the dashboard works unchanged.

Keras 3's ``Model.fit`` does not run under this strategy (TensorFlow 2.21 fails
with "unsupported type PerReplica"), so the step is a custom loop: ``strategy.run``
on a ``tf.function``, the optimizer built in ``strategy.scope()``. Each worker
computes the gradient of its local loss *sum* divided by the step's global example
count, and Keras' optimizer all-reduces (sums) them: the batch-size-weighted mean
the graph engine applies, so both engines train the same model on the same batches.

Failure: a worker that leaves is seen by the client's ``wait_for`` within
``dasktf.poll-interval``; the engine then kills every child (a child whose Dask
worker died exits on its own), so nothing is left blocked in a collective, and
raises :class:`~dasktf.exceptions.WorkerLostError` naming the worker and the last
checkpoint. There is no in-run recovery: TensorFlow's collective runtime cannot
re-form a ring inside a running process, so a run resumes from its checkpoint.

Checkpoints are the graph engine's (:mod:`dasktf.checkpoint`, driven by
:class:`~dasktf.recovery.RunGuard`), written at epoch ends from replica 0's weights
and optimizer variables, so either engine resumes the other's checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf._tfprocess import ChildError, ChildProcess
from dasktf.exceptions import DasktfError, EngineHint, WorkerLostError
from dasktf.replica import EpochReport, ReplicaConfig

if TYPE_CHECKING:
    from distributed import Future

    from dasktf.sync import RunContext

logger = logging.getLogger(__name__)

ENGINES = ("graph", "collective", "auto")

#: ``on_epoch_end(weights, optimizer_variables, epoch)``: called on the client after
#: every epoch with replica 0's weights and optimizer state (checkpoint hook).
EpochEndHook = Callable[[list[np.ndarray], list[np.ndarray], int], None]

_CHILDREN: dict[str, ChildProcess] = {}


# -- choosing an engine --------------------------------------------------------
def validate_fault_options(engine: str, options: Any) -> None:
    """``engine="collective"`` checkpoints and resumes at epoch ends only and keeps
    its worker count: say so before anything starts, instead of silently ignoring
    ``checkpoint_every`` or ``scale_lr``."""
    asked = [name for name in ("checkpoint_every", "scale_lr") if getattr(options, name)]
    if engine == "collective" and asked:
        raise ValueError(
            f"engine='collective' does not support {', '.join(asked)}: it checkpoints "
            "at every epoch end (checkpoint_dir, resume=True) and a lost worker ends "
            "the run with WorkerLostError. Use engine='graph' for step checkpoints "
            "and in-run recovery."
        )


def validate_engine(engine: str, mode: str, sync_quorum: int | None,
                    slow_workers: dict[int, float] | None) -> None:
    """Reject engine options that cannot work together (at the public boundary)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}; got {engine!r}.")
    if engine == "collective" and (mode != "sync" or sync_quorum is not None or slow_workers):
        raise ValueError(
            "engine='collective' runs plain sync training (every step all-reduces "
            "all workers' gradients); it has no async, sync_quorum or slow_workers. "
            "Use engine='graph' for those."
        )


def resolve_engine(engine: str) -> str:
    """The engine a run uses: ``"graph"`` or ``"collective"``.

    ``"auto"`` is always the graph engine. The collective engine starts TensorFlow
    gRPC servers that listen, unauthenticated, on every interface (TensorFlow
    hard-codes ``0.0.0.0:<port>``), so it runs only when asked for by name; where
    it would have been faster, :func:`collective_hint` says so instead.
    """
    return "collective" if engine == "collective" else "graph"


#: Where the hint's figure comes from: ``dasktf bench --models mnist-mlp --workers
#: 1,3 --epochs 3`` on a 2-core machine (MEASUREMENTS.md, 2026-11-24).
_MEASURED_SPEEDUP = ("ran 1.6x faster than the graph engine in `dasktf bench` (mnist-mlp, "
                     "3 CPU workers: 20.7k against 13.2k examples/s)")
_hinted = False


def collective_hint(engine: str, mode: str, sync_quorum: int | None,
                    slow_workers: dict[int, float] | None, n_params: int,
                    n_workers: int, total_steps: int, gpu: bool,
                    fault_options: bool = False) -> str | None:
    """The hint for an ``engine="auto"`` run the collective engine would have run
    faster, or ``None``.

    Measured here (2 cores, benchmarks/peers.py): the graph engine costs ~7 ms of
    scheduler hops per step, the collective engine ~10-15 s more to start (a
    TensorFlow child per worker) and next to nothing per step. So it wins for
    plain sync runs on 2+ CPU workers of a small model (under
    ``dasktf.collective.hint-max-params`` parameters, where the hop is a large
    share of the step) with enough steps (``hint-min-steps``) to pay back its
    start-up, unless checkpoints, resume or ``scale_lr`` were asked for
    (``fault_options``: only the graph engine recovers inside the run).
    """
    plain_sync = mode == "sync" and sync_quorum is None and not slow_workers
    if (engine == "auto" and plain_sync and not gpu and not fault_options
            and n_workers >= 2
            and n_params < int(config.get("collective.hint-max-params"))
            and total_steps >= int(config.get("collective.hint-min-steps"))):
        return (
            f"This run's step is hop-bound (a {n_params:,}-parameter model, "
            f"{n_workers} CPU workers, {total_steps:,} steps): engine='collective' "
            f"(dasktf fit --engine collective) {_MEASURED_SPEEDUP}. It is not picked "
            "by itself because its TensorFlow servers accept unauthenticated "
            "connections on every interface; see the README's Security section."
        )
    return None


def warn_collective_hint(hint: str | None) -> None:
    """Say :func:`collective_hint`'s hint once per process."""
    global _hinted
    if hint is not None and not _hinted:
        _hinted = True
        warnings.warn(hint, EngineHint, stacklevel=2)


# -- the child process (one per worker) ----------------------------------------
class _CollectiveReplica:
    """The child's state: the strategy, the distributed model, and a plain
    :class:`~dasktf.replica.Replica` for batches, metrics and evaluation."""

    def __init__(self, cfg: ReplicaConfig, index: int, shard: Any, schedule: np.ndarray,
                 weights: list[np.ndarray], val_shard: Any, shuffle: bool) -> None:
        import keras
        import tensorflow as tf

        from dasktf.replica import Replica

        # Blocks until every worker of TF_CONFIG has joined.
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy()
        self.index = index
        self.totals = np.asarray(schedule).sum(axis=1).astype(np.float32)
        # The local replica gives the same batches (same shuffle) as the graph
        # engine's, and owns the metrics and validation; it is never trained.
        self.local = Replica(dataclasses.replace(cfg, publish_metrics=False), index,
                             shard, schedule[:, index], weights, val_shard, shuffle)
        with self.strategy.scope():
            model = cfg.model.build()
            model.compile(optimizer=keras.optimizers.deserialize(cfg.optimizer),
                          loss=cfg.loss)
            model.set_weights(weights)
            model.optimizer.build(model.trainable_variables)
        self.model = model
        self.grad_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        spec = [tf.TensorSpec((None, *shard.x.shape[1:]), tf.as_dtype(shard.x.dtype)),
                tf.TensorSpec((None, *shard.y.shape[1:]), tf.as_dtype(shard.y.dtype))]
        self._step = tf.function(self._train_step,
                                 input_signature=[*spec, tf.TensorSpec((), tf.float32)])
        self._metrics = tf.function(self._update_metrics)

    def _train_step(self, x: Any, y: Any, total: Any) -> Any:
        import tensorflow as tf

        strategy, model = self.strategy, self.model
        replicas = float(strategy.num_replicas_in_sync)

        def replica_fn(x: Any, y: Any) -> Any:
            n = tf.cast(tf.shape(x)[0], tf.float32)
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                # Keras divides the loss by the replica count under a strategy;
                # undo that: this replica's share is its loss *sum* over the step's
                # global count, and the optimizer's all-reduce SUMs the shares.
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
                loss = loss * replicas
                share = loss * n / total
            grads = tape.gradient(share, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
            return y_pred, loss

        y_pred, loss = strategy.run(replica_fn, args=(x, y))
        local = strategy.experimental_local_results
        return local(y_pred)[0], local(loss)[0]

    def load_state(self, weights: list[np.ndarray], optimizer: list[np.ndarray]) -> int:
        """Assign a checkpoint's weights and optimizer variables (the optimizer was
        built in ``__init__``, so its variables exist and are mirrored)."""
        variables = self.model.optimizer.variables
        if len(optimizer) != len(variables):
            raise ValueError(
                f"The checkpoint holds {len(optimizer)} optimizer variables but this "
                f"run's optimizer has {len(variables)}: resume with the optimizer the "
                "checkpoint was written with."
            )
        self.model.set_weights(weights)
        for v, value in zip(variables, optimizer, strict=False):
            v.assign(value)
        return len(variables)

    def _update_metrics(self, x: Any, y: Any, y_pred: Any, loss: Any) -> None:
        import tensorflow as tf

        self.local._loss_tracker.update_state(loss, sample_weight=tf.shape(x)[0])
        self.local.model.compute_metrics(x, y, y_pred, sample_weight=None)

    def run_epoch(self, conn: Any, run_id: str, epoch: int, with_weights: bool,
                  with_optimizer: bool, start: int = 0) -> dict[str, Any]:
        interval = config.get_seconds("metrics-interval")
        publish = bool(config.get("metrics"))
        steps = len(self.totals)
        pending: list[tuple[int, int, Any, float]] = []
        last_send = time.monotonic()
        seconds = []
        # ``start`` > 0: resuming from a graph-engine checkpoint taken mid-epoch.
        for step in range(start, steps):
            began = time.perf_counter()
            x, y = self.local.batch(epoch, step)
            y_pred, loss = self._step(x, y, self.totals[step])
            if len(x):
                self._metrics(x, y, y_pred, loss)
            # No .numpy() here: reading the loss every step would wait for the
            # step and stop TensorFlow from overlapping the next one's input.
            compute = time.perf_counter() - began
            seconds.append(compute)
            if publish:
                pending.append((step, len(x), loss, compute))
            if time.monotonic() - last_send >= interval:
                # Also the parent's heartbeat: it times out on silence, not on length.
                conn.send(("event", self._records(run_id, epoch, pending)))
                pending, last_send = [], time.monotonic()
        if pending:
            conn.send(("event", self._records(run_id, epoch, pending)))
        local = self.local
        train = local.metric_states()
        local.model.reset_metrics()
        local.model.set_weights(self.model.get_weights())
        val = local.evaluate()
        local.model.reset_metrics()
        return {
            "train_states": train,
            "val_states": val,
            "weights": [np.asarray(w) for w in self.model.get_weights()] if with_weights else None,
            "optimizer": ([np.asarray(v) for v in self.model.optimizer.variables]
                          if with_optimizer else None),
            "step_seconds": seconds,
        }

    def _records(self, run_id: str, epoch: int,
                 pending: list[tuple[int, int, Any, float]]) -> list[dict[str, Any]]:
        return [self._record(run_id, epoch, step, n, float(loss), compute)
                for step, n, loss, compute in pending]

    def _record(self, run_id: str, epoch: int, step: int, n: int, loss: float,
                compute: float) -> dict[str, Any]:
        update = epoch * len(self.totals) + step
        # Schema: dasktf.events.StepRecord. The loss is this worker's local one (the
        # global one would cost another all-reduce per step); epoch records carry
        # the exact merged metrics. compute_s is the time to dispatch the step
        # (TensorFlow runs steps asynchronously).
        return {
            "run": run_id, "kind": "step", "mode": "sync", "engine": "collective",
            "epoch": epoch, "step": step, "update": update, "worker": self.index,
            "batch_size": n, "local_loss": loss if n else None,
            "loss": loss if n else None, "loss_step": update, "staleness": 0,
            "compute_s": compute, "communication_s": 0.0, "waiting_s": 0.0,
            "bytes": 2 * self.grad_bytes, "wall_time": time.time(),
        }


def _child_main(conn: Any, cfg: ReplicaConfig, index: int, shard: Any,
                schedule: np.ndarray, weights: list[np.ndarray], val_shard: Any,
                shuffle: bool, run_id: str) -> None:
    """Child-side target: build, report ready, then run epochs until told to stop."""
    import tensorflow as tf

    replica = _CollectiveReplica(cfg, index, shard, schedule, weights, val_shard, shuffle)
    conn.send(("reply", {
        "replicas": replica.strategy.num_replicas_in_sync,
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
    }))
    while True:
        message = conn.recv()
        if message[0] == "stop":
            conn.send(("reply", None))
            return
        if message[0] == "load":
            conn.send(("reply", replica.load_state(*message[1:])))
            continue
        _, epoch, with_weights, with_optimizer, start, learning_rate = message
        if learning_rate is not None:  # the mirrored variable: every replica's
            replica.model.optimizer.learning_rate = learning_rate
        conn.send(("reply", replica.run_epoch(conn, run_id, epoch, with_weights,
                                              with_optimizer, start)))


# -- the Dask tasks (run on the workers) ----------------------------------------
def collective_start_task(run_id: str, expected: str, tf_config: dict[str, Any],
                          cfg: ReplicaConfig, index: int, shard: Any,
                          schedule: np.ndarray, weights: list[np.ndarray],
                          val_shard: Any, shuffle: bool, timeout: float) -> dict[str, Any]:
    """Start this worker's TensorFlow child and wait until its strategy is ready."""
    import os

    from distributed import get_worker

    address = get_worker().address
    if address != expected:
        raise ValueError(f"Collective replica {index} was meant for {expected} but ran "
                         f"on {address}; the task was moved, which dasktf never asks for.")
    threads = _worker_threads()
    env = {"TF_NUM_INTRAOP_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    child = ChildProcess(tf_config, f"worker {address} (collective replica {index})",
                         connect_timeout=timeout, extra_env=env)
    _CHILDREN[_key(run_id, address)] = child
    child.call(_child_main, cfg, index, shard, schedule, weights, val_shard, shuffle,
               run_id)
    info = child.wait_reply(timeout, "joining the MultiWorkerMirroredStrategy cluster")
    return {**info, "worker": address, "shard_size": len(shard)}


def _worker_threads() -> int:
    """The worker's TensorFlow intra-op threads: the child gets the same share."""
    import sys

    if "tensorflow" in sys.modules:
        import tensorflow as tf

        threads = tf.config.threading.get_intra_op_parallelism_threads()
        if threads:
            return int(threads)
    import os

    return int(os.environ.get("TF_NUM_INTRAOP_THREADS", "0")) or (os.cpu_count() or 1)


def _child(run_id: str) -> tuple[Any, ChildProcess]:
    from distributed import get_worker

    worker = get_worker()
    child = _CHILDREN.get(_key(run_id, worker.address))
    if child is None:
        raise ChildError(f"No collective replica of run {run_id} on {worker.address} "
                         "(the worker restarted mid-run?).")
    return worker, child


def collective_load_task(run_id: str, state: dict[str, Any]) -> int:
    """Load a checkpoint's weights and optimizer variables into this worker's child."""
    _, child = _child(run_id)
    child.send(("load", state["weights"], state["optimizer"]))
    return int(child.wait_reply(config.get_seconds("step-timeout"), "loading the checkpoint"))


def collective_epoch_task(run_id: str, epoch: int, with_weights: bool,
                          with_optimizer: bool, start: int = 0,
                          learning_rate: float | None = None) -> EpochReport:
    """Run one epoch in this worker's child (with ``learning_rate`` set first, if
    given); forward its step records meanwhile."""
    from dasktf.events import TOPIC

    worker, child = _child(run_id)
    child.send(("epoch", epoch, with_weights, with_optimizer, start, learning_rate))

    def forward(records: list[dict[str, Any]]) -> None:
        if records:
            worker.log_event(TOPIC, {"records": records})

    out = child.wait_reply(config.get_seconds("step-timeout"), f"epoch {epoch + 1}",
                           on_event=forward)
    report = EpochReport(worker.address, out["train_states"], out["val_states"],
                         out["weights"], out["step_seconds"])
    report.optimizer_variables = out["optimizer"]  # type: ignore[attr-defined]
    return report


def stop_children(run_id: str, dask_worker: Any = None) -> int:
    """Kill this worker's children of ``run_id`` (through ``Client.run``)."""
    keys = [k for k in _CHILDREN if k[0] == run_id]
    for k in keys:
        _CHILDREN.pop(k).kill()
    return len(keys)


def _key(run_id: str, address: str) -> tuple[str, str]:
    return run_id, address


# -- the engine (client side) ---------------------------------------------------
class CollectiveEngine:
    """Runs sync epochs on ``MultiWorkerMirroredStrategy`` children of the workers.

    Parameters
    ----------
    ctx
        The run's context (client, run id, workers).
    cfg, shards, schedule, weights, val_shards, shuffle
        What the graph engine's replicas are built from (see :class:`_Run`).
    on_epoch_end
        User hook ``(weights, optimizer_variables, epoch)``, called on the client
        after every epoch with replica 0's state (every replica holds the same).
    keep_state
        Fetch replica 0's optimizer state every epoch for :meth:`state` (the
        run's :class:`~dasktf.recovery.RunGuard` checkpoints it).
    last_checkpoint
        Returns the newest checkpoint written (named when a worker is lost).
    """

    mode = "sync"
    engine = "collective"

    def __init__(self, ctx: RunContext, cfg: ReplicaConfig, shards: list[Future],
                 schedule: np.ndarray, weights: Any, val_shards: list[Any],
                 shuffle: bool, on_epoch_end: EpochEndHook | None = None,
                 keep_state: bool = False,
                 last_checkpoint: Callable[[], Any] | None = None) -> None:
        from dasktf.sync import wait_for
        from dasktf.tfconfig import tf_config, warn_tf_servers

        self.ctx = ctx
        self.on_epoch_end = on_epoch_end
        self.keep_state = keep_state
        self.last_checkpoint = last_checkpoint or (lambda: None)
        #: The first global update of the epoch under way (the RunGuard's counter).
        self.update_base = 0
        self._state: dict[str, Any] | None = None
        #: A learning rate to set in the children before the next epoch's steps.
        self.learning_rate: float | None = None
        timeout = config.get_seconds("collective.start-timeout")
        configs = tf_config(ctx.client, ctx.workers, timeout=timeout)
        warn_tf_servers(configs, "engine='collective'")
        started = time.perf_counter()
        futures = [
            ctx.client.submit(
                collective_start_task, ctx.run_id, w, configs[w], cfg, i, shards[i],
                schedule, weights, val_shards[i], shuffle, timeout,
                key=f"dasktf-collective-start-{ctx.run_id}-{i}",
                # The shard lives on this worker and the child binds its port.
                workers=[w], allow_other_workers=False, resources=ctx.resources,
            )
            for i, w in enumerate(ctx.workers)
        ]
        try:
            with dask_config({"dasktf.step-timeout": timeout + 30}):
                wait_for(ctx, futures, "starting the collective engine's TensorFlow "
                         "children")
            self.info = ctx.client.gather(futures)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - started
        logger.info("Collective engine of run %s ready in %.1fs on %s", ctx.run_id,
                    self.start_seconds, ctx.workers)

    def run_epoch(self, epoch: int, on_step: Callable[[int], None] | None = None,
                  start: int = 0) -> list[EpochReport]:
        """Train one epoch from step ``start``; every replica's report (metric
        states, weights)."""
        from dasktf.sync import check_alive, wait_for

        client = self.ctx.client
        with_optimizer = self.on_epoch_end is not None or self.keep_state
        futures = [
            client.submit(
                collective_epoch_task, self.ctx.run_id, epoch, i == 0,
                i == 0 and with_optimizer, start, self.learning_rate,
                key=f"dasktf-collective-epoch-{self.ctx.run_id}-{epoch}-{i}",
                workers=[w], allow_other_workers=False, resources=self.ctx.resources,
            )
            for i, w in enumerate(self.ctx.workers)
        ]
        # The workers bound each step by dasktf.step-timeout (their children send a
        # heartbeat at least every metrics-interval); the client watches liveness.
        step_timeout = config.get_seconds("step-timeout")
        what = f"epoch {epoch + 1} (collective engine)"
        try:
            with dask_config({"dasktf.step-timeout": step_timeout * self.ctx.steps_per_epoch}):
                wait_for(self.ctx, futures, what)
        except DasktfError:
            # A lost worker fails its peers' tasks too (their ring broke, or Dask
            # gave up on the task): name the lost worker rather than the symptom.
            # The scheduler may learn of the death a moment after a peer's ring
            # broke, hence a short, bounded look.
            try:
                for _ in range(5):
                    check_alive(self.ctx, what)
                    time.sleep(config.get_seconds("poll-interval") / 2)
            except WorkerLostError as exc:
                raise self._lost(exc) from exc
            raise
        reports: list[EpochReport] = client.gather(futures)
        if on_step is not None:
            # The steps ran in the children; Keras batch callbacks (the progress bar
            # among them) hear of them at the epoch's end, in order.
            for step in range(start, self.ctx.steps_per_epoch):
                on_step(step)
        first = reports[0]
        optimizer = getattr(first, "optimizer_variables", None) or []
        steps = self.ctx.steps_per_epoch
        self.update_base = (epoch + 1) * steps
        if self.keep_state:
            self._state = {"weights": first.weights or [], "optimizer": optimizer,
                           "applied": self.update_base - 1}
        if self.on_epoch_end is not None:
            self.on_epoch_end(first.weights or [], optimizer, epoch)
        return reports

    def _lost(self, exc: WorkerLostError) -> WorkerLostError:
        """The lost worker(s) and what to do: resume from the last checkpoint."""
        path = self.last_checkpoint()
        advice = (f"Nothing new was saved; the last checkpoint is {path}: restart or "
                  "replace the worker(s), then resume with resume=True (dasktf fit "
                  "--resume)." if path else
                  "No checkpoint was written; pass checkpoint_dir= (--checkpoint-dir) "
                  "to be able to resume a collective run.")
        return WorkerLostError(
            f"Worker(s) {exc.workers} left the cluster during a collective run; its "
            f"ring all-reduce cannot go on without them, so every child was stopped. "
            f"{advice}", exc.workers,
        )

    # -- checkpoints (driven by the run's RunGuard) --------------------------------
    def state(self) -> dict[str, Any]:
        """The training state after the last epoch (or the one loaded): weights,
        optimizer variables and ``applied``, the last global update."""
        if self._state is None:
            raise RuntimeError("The collective engine keeps its state only with "
                               "keep_state=True, after an epoch or a load_state.")
        return self._state

    def set_learning_rate(self, lr: float) -> None:
        """The children take ``lr`` with the next epoch's message."""
        self.learning_rate = lr

    def load_state(self, state: dict[str, Any]) -> None:
        """Load a checkpoint (of either engine) into every child."""
        from dasktf.sync import wait_for

        client = self.ctx.client
        big = client.scatter(state, broadcast=True, hash=False)
        futures = [client.submit(collective_load_task, self.ctx.run_id, big,
                                 key=f"dasktf-collective-load-{self.ctx.run_id}-{i}",
                                 workers=[w], allow_other_workers=False)
                   for i, w in enumerate(self.ctx.workers)]
        wait_for(self.ctx, futures, "loading the checkpoint into the collective children")
        self._state = state

    def close(self) -> None:
        """Kill every child of the run on the workers still alive; never raises."""
        from dasktf.cluster import alive_workers

        try:
            alive = set(alive_workers(self.ctx.client))
            workers = [w for w in self.ctx.workers if w in alive]
            if workers:
                self.ctx.client.run(stop_children, self.ctx.run_id, workers=workers,
                                    on_error="ignore")
        except Exception:
            logger.debug("stopping the collective children of %s failed",
                         self.ctx.run_id, exc_info=True)


def make_engine(run: Any, epochs: int, graph: Callable[[], Any]) -> Any:
    """The sync engine of a trainer's ``_Run``: collective when asked for by name,
    else ``graph()`` (the fault-tolerant task-graph engine), with the hint of
    :func:`collective_hint` where the collective engine would have been faster."""
    t = run.trainer
    if resolve_engine(t.engine) == "graph":
        n_params = sum(int(np.prod(w.shape)) for w in run.model.trainable_weights)
        options = run.options
        fault_options = bool(options.checkpoint_dir or options.resume or options.scale_lr)
        warn_collective_hint(collective_hint(
            t.engine, t.mode, t.sync_quorum, t.slow_workers, n_params,
            len(run.workers), epochs * run.ctx.steps_per_epoch,
            bool(run.ctx.resources), fault_options))
        return graph()
    cfg, weights, val = run._engine_inputs
    return CollectiveEngine(run.ctx, cfg, run.placed.shards, run.placed.schedule,
                            weights, val, run.shuffle, on_epoch_end=t.on_epoch_end,
                            keep_state=run.options.checkpoint_dir is not None,
                            last_checkpoint=lambda: run.guard.last_checkpoint)


def dask_config(values: dict[str, Any]) -> Any:
    import dask

    return dask.config.set(values)
