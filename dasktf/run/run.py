"""One ``fit`` call: the replicas, the engine, the epoch loop and the clean-up."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf.callbacks import History, LearningRateRelay, ProgressBar
from dasktf.cluster.local import (
    alive_workers,
)
from dasktf.cluster.waits import RunContext, wait_for
from dasktf.data.sources import (
    PlacedData,
    ShardStats,
    check_labels,
    place_validation,
)
from dasktf.diagnostics.events import (
    TOPIC,
    epoch_record,
    publish,
    run_end_record,
    run_start_record,
    unpack,
)
from dasktf.diagnostics.metrics import ensure_store
from dasktf.models import ModelSpec, model_spec
from dasktf.run.engine import make_engine
from dasktf.run.guard import RunGuard
from dasktf.run.options import FaultOptions
from dasktf.runtime.replica import ReplicaConfig, build_metrics, merge_metric_states
from dasktf.runtime.tasks import create_replica_task, release_replicas

if TYPE_CHECKING:
    from distributed import Client

    from dasktf.trainer import Trainer

logger = logging.getLogger(__name__)

_SPARSE_LOSSES = ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy")


def _resolve_loss(loss: Any, model: Any, stats: ShardStats) -> Any:
    import keras

    if loss is None:
        loss = getattr(model, "loss", None) if getattr(model, "compiled", False) else None
    if loss is None:
        outputs = model.outputs[0].shape[-1] if getattr(model, "outputs", None) else 1
        loss = "sparse_categorical_crossentropy" if stats.y_integral and outputs > 1 else "mse"
        logger.info("No loss given; using %s", loss)
    if isinstance(loss, str):
        try:
            keras.losses.get(loss)
        except ValueError:
            raise ValueError(
                f"Unknown loss {loss!r}; use a Keras loss name (e.g. "
                "sparse_categorical_crossentropy, categorical_crossentropy, mse, mae) "
                "or a keras.losses.Loss instance."
            ) from None
    return loss


def _is_sparse(loss: Any) -> bool:
    name = loss if isinstance(loss, str) else type(loss).__name__
    return name in _SPARSE_LOSSES


class Run:
    """One ``fit`` call: the replicas, the engine, the epoch loop and the clean-up."""

    def __init__(
        self,
        trainer: Trainer,
        client: Client,
        workers: list[str],
        placed: PlacedData,
        batch_size: int,
        shuffle: bool,
        resources: dict[str, float] | None = None,
    ) -> None:
        self.trainer = trainer
        self.client = client
        self.workers = workers
        self.placed = placed
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.run_id = uuid.uuid4().hex[:10]
        self.ctx = RunContext(
            client, self.run_id, workers, placed.steps_per_epoch, resources
        )
        self.replica_info: list[dict[str, Any]] = []
        self._latest_loss: float | None = None
        self._futures: list[Any] = []
        # fault tolerance (dasktf.run.guard); Trainer.fit sets them
        self.source: Any = None
        self.validation_data: tuple[Any, Any] | None = None
        self.verbose = 0
        self.fault = FaultOptions()
        self._generation = 0

    # -- set-up -------------------------------------------------------------------
    def _reference_model(self) -> tuple[Any, ModelSpec]:
        """Build (or take) the client-side model and its recipe; check the shapes."""
        import keras

        t, o = self.trainer, self.trainer.options
        stats = self.placed.stats[0]
        if t.model is not None:  # a second fit() continues from the trained weights
            model, spec = t.model, model_spec(t.model, stats.x_shape, None)
        elif isinstance(o.model, keras.Model):
            model, spec = o.model, model_spec(o.model, stats.x_shape, None)
        else:
            keras.utils.set_random_seed(o.seed)
            num_outputs = (
                int(max(s.y_max for s in self.placed.stats)) + 1
                if stats.y_integral and not stats.y_shape
                else int(np.prod(stats.y_shape or (1,)))
            )
            spec = model_spec(o.model, stats.x_shape, num_outputs)
            model = spec.build()
        probe = np.zeros((2, *stats.x_shape), dtype=stats.x_dtype)
        try:
            model(probe)
        except Exception as exc:
            raise ValueError(
                f"The model does not accept inputs of shape {(None, *stats.x_shape)} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0]}). Check x's shape "
                "against the model's input."
            ) from exc
        return model, spec

    def build(self, validation_data: tuple[Any, Any] | None) -> None:
        import keras

        t, o = self.trainer, self.trainer.options
        model, spec = self._reference_model()
        loss = _resolve_loss(o.loss, model, self.placed.stats[0])
        if _is_sparse(loss):
            check_labels(self.placed.stats, int(model.outputs[0].shape[-1]))
        model.compile(
            optimizer=keras.optimizers.deserialize(o.optimizer_config),
            loss=loss,
            metrics=_metrics_objects(o.metric_configs),
        )
        stats = self.placed.stats[0]
        probe_x = np.zeros((1, *stats.x_shape), dtype=stats.x_dtype)
        probe_y = np.zeros((1, *stats.y_shape), dtype=stats.y_dtype)
        build_metrics(model, probe_x, probe_y)
        self.model = model
        t.model = model
        self.spec_description = spec.description or getattr(model, "name", "")
        self._cfg = ReplicaConfig(
            spec, o.optimizer_config, loss, o.metric_configs, o.seed,
            mixed_precision=o.mixed_precision,
            publish_metrics=bool(config.get("metrics")),
            comm=dataclasses.replace(o.comm, n_workers=len(self.workers)),
        )
        self._validation = validation_data
        if o.comm.num_ps > 1:  # refuse a num_ps the parameters cannot be split over
            from dasktf.wire.packets import shard_plan

            shapes = [tuple(v.shape) for v in model.trainable_variables]
            shard_plan(shapes, o.comm.num_ps)
        self.ps_layout = None
        if o.comm.placement == "ps" and o.mode == "sync" and o.sync_quorum is None:
            from dasktf.runtime.servers import optimizer_layout

            # Checkpoints, restore points and re-forms merge the servers' optimizer
            # slices into the model optimizer's layout: refuse one that has none.
            positions = {id(w): i for i, w in enumerate(model.weights)}
            self.ps_layout = (
                optimizer_layout(o.optimizer_config, model.trainable_variables),
                [positions[id(v)] for v in model.trainable_variables],
            )
        self._create_replicas()

    def _create_replicas(self) -> None:
        """One replica per worker of ``self.workers`` from ``self.model``'s weights."""
        o, cfg, validation_data = self.trainer.options, self._cfg, self._validation
        val = (
            place_validation(self.client, *validation_data, self.workers)
            if validation_data is not None
            else [None] * len(self.workers)
        )
        # hash=False: a content-hashed key is shared with an earlier fit of the same
        # model, whose release can then race this scatter ("lost dependencies").
        weights = self.client.scatter(
            [np.asarray(w) for w in self.model.get_weights()], broadcast=True, hash=False
        )
        futures = [
            self.client.submit(
                create_replica_task,
                self.run_id,
                w,
                cfg,
                i,
                self.placed.shards[i],
                self.placed.schedule[:, i],
                weights,
                val[i],
                self.shuffle,
                o.slow_workers.get(i, 1.0),
                key=f"dasktf-replica-{self.run_id}-{i}"
                + (f"-g{self._generation}" if self._generation else ""),
                workers=[w],
                allow_other_workers=False,
                resources=self.ctx.resources,
            )
            for i, w in enumerate(self.workers)
        ]
        self._futures = futures
        self.engine_inputs = (cfg, weights, val)
        with _config_override("step-timeout", config.get("replica-timeout")):
            wait_for(self.ctx, futures, "building the replicas")
        self.replica_info = self.client.gather(futures)

    # -- the epoch loop -----------------------------------------------------------------
    def train(self, epochs: int, callbacks: Sequence[Any] | None, verbose: int) -> History:
        import keras

        history = History()
        history.run_id, history.workers = self.run_id, list(self.workers)
        history.replica_info = self.replica_info
        cbs = list(callbacks or [])
        if verbose:
            cbs.append(ProgressBar(self.batch_size) if verbose == 1 else _LinePrinter())
        cb = keras.callbacks.CallbackList(
            [*cbs, history], add_history=False, add_progbar=False, model=self.model,
            epochs=epochs, steps=self.ctx.steps_per_epoch, verbose=verbose,
        )
        from dasktf.cluster.membership import MembershipWatcher

        self.ctx.watcher = MembershipWatcher(self.client)
        guard = self.guard = RunGuard(self, self.fault, epochs)
        engine = make_engine(self, epochs)
        history.engine = engine.engine
        # Which engine ran, where Keras callbacks (and users) read a run's settings.
        cb.set_params({**cb.params, "mode": engine.mode, "engine": engine.engine})
        first_epoch, first_step = guard.begin(engine)
        # after begin: a resumed run's learning rate is the checkpoint's
        relay = LearningRateRelay(self.model, guard.lr_factor)
        self.publish(self._run_start_record(epochs, engine.mode, engine.engine))
        self.client.subscribe_topic(TOPIC, self._on_event)
        self.model.stop_training = False
        cb.on_train_begin()

        def on_step(step: int) -> None:
            # The global loss of a step arrives with the next one: until the first
            # has arrived there is none, and callbacks only ever see real numbers.
            latest = self._latest_loss
            cb.on_train_batch_end(step, {} if latest is None else {"loss": latest})
            guard.after_step(engine, epoch, step)

        try:
            for epoch in range(first_epoch, epochs):
                cb.on_epoch_begin(epoch)
                relay.relay(engine)  # LearningRateScheduler, ReduceLROnPlateau, ...
                start = time.perf_counter()
                resume_at = {"start": first_step} if epoch == first_epoch and first_step else {}
                reports = engine.run_epoch(epoch, on_step, **resume_at)
                seconds = time.perf_counter() - start
                logs = self._epoch_logs(reports, seconds)
                logs.update(engine.epoch_logs(seconds))  # bytes, staleness, drops
                self.model.set_weights(reports[0].weights)
                cb.on_epoch_end(epoch, logs)
                relay.relay(engine)  # ReduceLROnPlateau: before the checkpoint
                last_update = (epoch + 1) * self.ctx.steps_per_epoch - 1
                self.publish(epoch_record(self.run_id, epoch, last_update, logs))
                if self.model.stop_training:
                    break
                guard.end_epoch(engine, epoch)
            outcome = engine.finish()  # drains what is in flight
            if outcome is not None:  # the master weights lived in the holders
                self.model.set_weights(outcome.final_weights)
                history.updates = outcome.updates
                history.dropped = outcome.dropped
                history.gradient_tasks = outcome.gradient_tasks
                history.holder_traffic = outcome.holder_traffic
            history.recoveries = list(engine.losses)
            history.workers = list(self.ctx.workers)  # after any loss or growth
            history.applied_updates = engine.applied_logs()
            guard.finish(self.model, engine)
        except BaseException as exc:
            self.publish(run_end_record(self.run_id, exc))
            lost = guard.scheduler_lost(exc)
            if lost is not None:
                raise lost from exc
            raise
        finally:
            self.client.unsubscribe_topic(TOPIC)
            self.ctx.watcher.close()
            engine.close()
        self.publish(run_end_record(self.run_id))
        cb.on_train_end()
        history.set_model(self.model)
        return history

    def _epoch_logs(self, reports: list[Any], seconds: float) -> dict[str, float]:
        logs = merge_metric_states(self.model, [r.train_states for r in reports])
        if reports[0].val_states is not None:
            val = merge_metric_states(self.model, [r.val_states for r in reports])
            logs.update({f"val_{k}": v for k, v in val.items()})
        logs["examples_per_sec"] = self.placed.n_samples / seconds
        logs["epoch_seconds"] = seconds
        return logs

    def _run_start_record(self, epochs: int, mode: str, engine: str) -> dict[str, Any]:
        return run_start_record(
            self.run_id, mode=mode, engine=engine, model=self.spec_description,
            workers=self.workers,
            replica_info=self.replica_info, epochs=epochs,
            steps_per_epoch=self.ctx.steps_per_epoch, batch_size=self.batch_size,
            n_samples=self.placed.n_samples,
        )

    def publish(self, record: dict[str, Any]) -> None:
        """Send a run record to the scheduler's MetricsStore; never fails the run."""
        try:
            if record["kind"] == "run_start":
                ensure_store(self.client)
            publish(self.client, record)
        except Exception:
            logger.warning("publishing the %s record of run %s failed",
                           record["kind"], self.run_id, exc_info=True)

    def _on_event(self, event: Any) -> None:
        for record in unpack(event):
            if record.get("run") == self.run_id and record.get("loss") is not None:
                self._latest_loss = float(record["loss"])

    def reform(self, workers: list[str], batch_size: int) -> None:
        """Rebuild the run on ``workers`` at an epoch boundary: data re-placed,
        replicas rebuilt (their state is then loaded by :class:`RunGuard`)."""
        self.release()
        self.workers = list(workers)
        self.batch_size = batch_size
        self.placed = self.source.place(self.client, self.workers, batch_size)
        self.ctx.workers = list(workers)
        self.ctx.steps_per_epoch = self.placed.steps_per_epoch
        self._generation += 1
        # a ring's chunks are cut for the worker count
        self._cfg = dataclasses.replace(
            self._cfg, comm=dataclasses.replace(self._cfg.comm, n_workers=len(workers)))
        self._create_replicas()

    def release(self) -> None:
        """Free the replicas and shards on the workers, whatever happened."""
        try:
            # Only the live ones: a dead worker's address costs a 30 s connect timeout.
            alive = set(alive_workers(self.client))
            workers = [w for w in self.ctx.workers if w in alive]
            if workers:
                self.client.run(release_replicas, self.run_id, workers=workers,
                                on_error="ignore")
        except Exception:
            logger.debug("releasing replicas of %s failed", self.run_id, exc_info=True)
        self._futures = []
        self.placed.shards = []


class _LinePrinter(ProgressBar):
    def __init__(self) -> None:
        super().__init__(batch_size=0)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        pass


def _metrics_objects(metrics: list[Any] | None) -> list[Any] | None:
    import keras

    if metrics is None:
        return None
    return [keras.metrics.deserialize(m) if isinstance(m, dict) else m for m in metrics]


class _config_override:
    def __init__(self, key: str, value: Any) -> None:
        import dask

        self._cm = dask.config.set({f"dasktf.{key}": value})

    def __enter__(self) -> None:
        self._cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)
