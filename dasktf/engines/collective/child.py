"""The collective engine's worker side: one TensorFlow child per Dask worker
running ``MultiWorkerMirroredStrategy``, and the Dask tasks that drive it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from dasktf import config
from dasktf.data.structure import first_leaf
from dasktf.runtime.keras_step import batch_args, batch_signature
from dasktf.runtime.replica import EpochReport, ReplicaConfig
from dasktf.tf.child import ChildError, ChildProcess

_CHILDREN: dict[str, ChildProcess] = {}


# -- the child process (one per worker) ----------------------------------------
class _CollectiveReplica:
    """The child's state: the strategy, the distributed model, and a plain
    :class:`~dasktf.runtime.replica.Replica` for batches, metrics and evaluation."""

    def __init__(self, cfg: ReplicaConfig, index: int, shard: Any, schedule: np.ndarray,
                 weights: list[np.ndarray] | None, val_shard: Any, shuffle: bool) -> None:
        import tensorflow as tf

        from dasktf.runtime.replica import Replica

        # Blocks until every worker of TF_CONFIG has joined.
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy()
        self.index = index
        self.totals = np.asarray(schedule).sum(axis=1).astype(np.float32)
        # The local replica gives the same batches (same shuffle) as the graph
        # engine's, and owns the metrics and validation; it is never trained.
        self.local = Replica(dataclasses.replace(cfg, publish_metrics=False), index,
                             shard, schedule[:, index], weights, val_shard, shuffle)
        with self.strategy.scope():
            # The loss and optimizer only: the local replica keeps the metrics.
            model = cfg.model.build(
                dataclasses.replace(cfg.recipe, metrics=None, weighted_metrics=None),
                stream=index)
            if weights is not None:
                model.set_weights(weights)
        self.model = model
        self.grad_bytes = 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        self._step = tf.function(self._train_step, input_signature=[
            tf.TensorSpec((), tf.float32), *batch_signature(self.local.shard.take(slice(0, 1)))])
        self._metrics = tf.function(self._update_metrics)

    def _train_step(self, total: Any, x: Any, y: Any, w: Any = None) -> Any:
        import tensorflow as tf

        strategy, model = self.strategy, self.model
        replicas = float(strategy.num_replicas_in_sync)

        def replica_fn(x: Any, y: Any, w: Any) -> Any:
            n = tf.cast(tf.shape(first_leaf(x))[0], tf.float32)
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                # Keras divides the loss by the replica count under a strategy;
                # undo that: this replica's share is its loss *sum* over the step's
                # global count, and the optimizer's all-reduce SUMs the shares.
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=w,
                                          training=True)
                loss = loss * replicas
                share = loss * n / total
            grads = tape.gradient(share, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
            return y_pred, loss

        y_pred, loss = strategy.run(replica_fn, args=(x, y, w))
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

    def _update_metrics(self, x: Any, y: Any, y_pred: Any, loss: Any, w: Any = None) -> None:
        import tensorflow as tf

        self.local.loss_tracker.update_state(loss, sample_weight=tf.shape(first_leaf(x))[0])
        self.local.model.compute_metrics(x, y, y_pred, sample_weight=w)

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
            batch = self.local.batch(epoch, step)
            y_pred, loss = self._step(self.totals[step], *batch_args(batch))
            if len(batch):
                self._metrics(batch.x, batch.y, y_pred, loss, batch.w)
            # No .numpy() here: reading the loss every step would wait for the
            # step and stop TensorFlow from overlapping the next one's input.
            compute = time.perf_counter() - began
            seconds.append(compute)
            if publish:
                pending.append((step, len(batch), loss, compute))
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
        # Schema: dasktf.diagnostics.events.StepRecord. The loss is this worker's local one (the
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
                schedule: np.ndarray, weights: list[np.ndarray] | None, val_shard: Any,
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
                          schedule: np.ndarray, weights: list[np.ndarray] | None,
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
    # The child is no Dask worker: the model package travels to it inline.
    cfg = dataclasses.replace(cfg, model=cfg.model.carried())
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
    from dasktf.diagnostics.events import send_records

    worker, child = _child(run_id)
    child.send(("epoch", epoch, with_weights, with_optimizer, start, learning_rate))

    def forward(records: list[dict[str, Any]]) -> None:
        if records:  # the first replica's also carry the loss the client relays
            send_records(worker, records, reports_loss=records[0].get("worker") == 0)

    out = child.wait_reply(config.get_seconds("step-timeout"), f"epoch {epoch + 1}",
                           on_event=forward)
    return EpochReport(worker.address, out["train_states"], out["val_states"],
                       out["weights"], out["step_seconds"],
                       optimizer_variables=out["optimizer"])


def stop_children(run_id: str, dask_worker: Any = None) -> int:
    """Kill this worker's children of ``run_id`` (through ``Client.run``)."""
    keys = [k for k in _CHILDREN if k[0] == run_id]
    for k in keys:
        _CHILDREN.pop(k).kill()
    return len(keys)


def child_count(dask_worker: Any = None) -> int:
    """The TensorFlow children alive on this worker, of any run (through ``Client.run``)."""
    return len(_CHILDREN)


def _key(run_id: str, address: str) -> tuple[str, str]:
    return run_id, address
