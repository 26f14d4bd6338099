"""One ``fit`` call: the replicas, the engine, the epoch loop and the clean-up."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from dasktf import config
from dasktf.callbacks import History, LearningRateRelay, ProgressBar, saves_optimizer
from dasktf.cluster.liveness import LivenessWatch
from dasktf.cluster.local import (
    alive_workers,
)
from dasktf.cluster.membership import MembershipWatcher
from dasktf.cluster.waits import RunContext, WatchedClient, wait_for
from dasktf.data.base import PlacedData
from dasktf.data.structure import leaves
from dasktf.data.validation import place_validation
from dasktf.diagnostics.events import (
    LOSS_TOPIC,
    epoch_record,
    publish,
    run_end_record,
    run_start_record,
    unpack,
)
from dasktf.diagnostics.metrics import ensure_store
from dasktf.engines.base import Engine
from dasktf.exceptions import WorkerLostError
from dasktf.models import (
    BUILTIN_MODELS,
    check_trainable_by_dasktf,
    model_spec,
)
from dasktf.run.compiling import (
    check_sparse_labels,
    compile_recipe,
    compile_reference,
    factory_input_shape,
    num_outputs,
)
from dasktf.run.ending import END_PHASES, EndGuard
from dasktf.run.engine import EngineInputs, make_engine, plan_engine
from dasktf.run.guard import RunGuard
from dasktf.run.inputs import RunInputs
from dasktf.run.setup import SetupGuard, enter_phase, register_worker_plugin
from dasktf.runtime.keras_step import build_metrics, merge_metric_states
from dasktf.runtime.replica import ReplicaConfig
from dasktf.runtime.tasks import create_replica_task, release_replicas
from dasktf.transport import ModelPackage, SharedModel, set_seed_states, share_model

if TYPE_CHECKING:
    from distributed import Client

logger = logging.getLogger(__name__)
#: held while a run seeds Keras and builds its model from the seed
SEEDED_BUILD = threading.Lock()

class Run:
    """One ``fit`` call: the replicas, the engine, the epoch loop and the clean-up."""

    def __init__(
        self,
        inputs: RunInputs,
        client: Client,
        workers: list[str],
        resources: dict[str, float] | None = None,
    ) -> None:
        #: what the fit call asked for, frozen (dasktf.run.inputs)
        self.inputs = inputs
        self.options = inputs.options
        self.client = client
        self.workers = workers
        self.placed: PlacedData | None = None
        #: the global batch now (a re-form with ``scale_lr`` changes it)
        self.batch_size = inputs.batch_size
        self.run_id = uuid.uuid4().hex[:10]
        self.ctx = RunContext(client, self.run_id, workers, 0, resources)
        #: ``{worker index: factor}``: the options' ``slow_workers``, re-indexed
        #: when a worker is lost during the set-up
        self.slow_workers = dict(inputs.options.slow_workers)
        self.replica_info: list[dict[str, Any]] = []
        #: the client's model, trained in place: what the run hands back
        self.model: Any = None
        self._latest_loss: float | None = None
        self._heard: int | None = None
        self._futures: list[Any] = []
        self._generation = 0
        self._cfg: ReplicaConfig | None = None
        self.engine: Engine | None = None
        self.guard: RunGuard | None = None
        self.setup: SetupGuard | None = None
        #: (epoch, step) the first epoch starts at: RunGuard.begin's, after a resume
        self.begin_at = (0, 0)
        self.shared: SharedModel | None = None
        self._factory: Any = None
        #: the scheduler's failure detector, armed for the run's workers once they
        #: have built their replicas (dasktf.cluster.liveness)
        self.liveness: LivenessWatch | None = None

    def fit(self, plugin: Any = None) -> History:
        """Set the run up (:meth:`set_up`, registering ``plugin`` on the workers),
        train it (:meth:`train`) and clean up (:meth:`close`), whatever happened.
        Returns the :class:`History`, whose ``model`` is the trained model."""
        try:
            # a worker lost while setting up: recovered, or named with the phase
            self.set_up(plugin)
            return self.train()
        finally:
            self.close()

    # -- set-up -------------------------------------------------------------------
    def _reference_model(self) -> tuple[Any, Any]:
        """Build (or take) the client-side model; check the shapes. Returns the
        model and its outputs on a probe batch."""
        import keras

        o = self.options
        stats = self.placed.stats[0]
        if self.inputs.model is not None:  # a second fit() continues from its weights
            model = self.inputs.model
        elif isinstance(o.model, keras.Model):
            model = o.model
        else:
            # Keras' seeds are the process's: two fits in threads of one client must
            # not draw one's initial weights from the other's seed.
            with SEEDED_BUILD:
                keras.utils.set_random_seed(o.seed)
                spec = model_spec(o.model, factory_input_shape(stats),
                                  num_outputs(self.placed.stats))
                model = spec.build()
            self._factory = spec.build  # what rebuilds a subclassed model it makes
        check_trainable_by_dasktf(model)
        probe_x = stats.probe(2)[0]
        try:
            # Builds a subclassed model's weights: only then can it be saved.
            y_pred = model(probe_x)
        except Exception as exc:
            shapes = ", ".join(f"{leaf.name}: {(None, *leaf.shape)}"
                               for _, leaf in leaves(stats.x, "x"))
            raise ValueError(
                f"The model does not accept inputs of shape {shapes} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0]}). Check x's shape "
                "(and its structure: one array, or a list/dict matching the model's "
                "inputs by position or name) against the model's input."
            ) from exc
        return model, y_pred

    def set_up(self, plugin: Any = None) -> None:
        """Connect to the workers, register ``plugin`` (a worker plugin, if any) on
        them, place the data, build the replicas and start the engine: the phases of
        :data:`dasktf.run.setup.PHASES`. A worker lost in any of them is recovered by
        doing the set-up again on the survivors, or raised naming it and the phase
        (:class:`~dasktf.run.setup.SetupGuard`)."""
        setup = self.setup = SetupGuard(self.ctx, self.inputs)
        while True:
            try:
                with setup.phase("connecting"):
                    if self.ctx.watcher is None:  # hears of losses as they happen
                        self.ctx.watcher = MembershipWatcher(self.client)
                if plugin is not None:
                    with setup.phase("registering plugins"):
                        register_worker_plugin(self.ctx, plugin, "registering plugins")
                    plugin = None  # stored by the scheduler for every worker
                with setup.phase("placing data"):
                    self._place()
                with setup.phase("building replicas"):
                    if self._cfg is None:
                        self._prepare()
                    self._create_replicas()
                with setup.phase("starting the engine"):
                    self.guard = RunGuard(self, self.inputs)
                    self.engine = make_engine(self._engine_inputs(), self.guard.hooks())
                    self.begin_at = self.guard.begin(self.engine)
                    self.engine.prepare()
            except WorkerLostError as exc:
                if exc.phase is None:
                    raise
                self._start_over(setup.recover(exc))
                continue
            setup.done()
            return

    def _start_over(self, survivors: list[str]) -> None:
        """Drop what the set-up built so far and go on with ``survivors`` under a
        new run id (keys and worker-side state of the first attempt may linger)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.release(wait=config.get_seconds("poll-interval"), model=False)  # old id
        index = {w: i for i, w in enumerate(self.workers)}
        self.slow_workers = {new: self.slow_workers[index[w]]
                             for new, w in enumerate(survivors)
                             if index[w] in self.slow_workers}
        self.run_id = self.ctx.run_id = uuid.uuid4().hex[:10]
        self._use_workers(survivors)

    def _use_workers(self, workers: list[str]) -> None:
        self.workers = list(workers)
        self.ctx.workers = list(workers)
        if self._cfg is not None:  # a ring's chunks are cut for the worker count
            self._cfg = dataclasses.replace(self._cfg, comm=dataclasses.replace(
                self._cfg.comm, n_workers=len(workers)))

    def _place(self) -> None:
        """Place the shards over the run's workers (never waiting on a lost one)."""
        self.placed = self.inputs.source.place(WatchedClient(self.ctx, "placing data"),
                                        self.workers, self.batch_size)
        self.ctx.steps_per_epoch = self.placed.steps_per_epoch

    def _prepare(self) -> None:
        """The client's model, its compile recipe and the replicas' config (once)."""
        o = self.options
        model, y_pred = self._reference_model()
        stats = self.placed.stats[0]
        builtin = isinstance(o.model, str) and o.model in BUILTIN_MODELS
        recipe = compile_recipe(o, model, stats, y_pred, builtin)
        check_sparse_labels(recipe.loss, model, y_pred, self.placed.stats)
        compile_reference(recipe, model, o.learning_rate)
        probe_x, probe_y, probe_w = stats.probe(1)
        build_metrics(model, probe_x, probe_y, probe_w)
        self.model = model
        self.spec_description = (o.model if isinstance(o.model, str) else
                                 getattr(model, "name", ""))
        if o.comm.num_ps > 1:  # refuse a num_ps the parameters cannot be split over
            from dasktf.wire.packets import shard_plan

            shapes = [tuple(v.shape) for v in model.trainable_variables]
            shard_plan(shapes, o.comm.num_ps)
        self.engine_plan = plan_engine(o, model, recipe)  # refused here, before any work
        # The model travels whole, once per worker (dasktf.transport): the optimizer's
        # state too where the run continues it and it has one.
        package = ModelPackage.pack(
            model, optimizer=recipe.optimizer if (
                recipe.continues and model.optimizer.built) else None,
            factory=self._factory, probe=probe_x)
        self.shared = share_model(WatchedClient(self.ctx, "building replicas"), package,
                                  self.workers)
        self._cfg = ReplicaConfig(
            self.shared.ref, recipe, o.seed, eval_batch_size=self.inputs.eval_batch_size,
            mixed_precision=o.mixed_precision,
            publish_metrics=bool(config.get("metrics")),
            comm=dataclasses.replace(o.comm, n_workers=len(self.workers)),
            local=o.local,
        )

    def _create_replicas(self) -> None:
        """One replica per worker of ``self.workers`` from ``self.model``'s weights."""
        cfg, validation_data = self._cfg, self.inputs.validation_data
        client = WatchedClient(self.ctx, "building the replicas")
        val = (
            place_validation(client, validation_data, self.workers)
            if validation_data is not None
            else [None] * len(self.workers)
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
                val[i],
                self.inputs.shuffle,
                self.slow_workers.get(i, 1.0),
                key=f"dasktf-replica-{self.run_id}-{i}"
                + (f"-g{self._generation}" if self._generation else ""),
                workers=[w],
                allow_other_workers=False,
                resources=self.ctx.resources,
            )
            for i, w in enumerate(self.workers)
        ]
        self._futures = futures
        self._validation_shards = val
        with _config_override("step-timeout", config.get("replica-timeout")):
            wait_for(self.ctx, futures, "building the replicas")
        self.replica_info = self.client.gather(futures)

    # -- the epoch loop -----------------------------------------------------------------
    def _engine_inputs(self) -> EngineInputs:
        """What the factory builds this run's engine from (replicas built)."""
        return EngineInputs(
            options=self.options, fault=self.inputs.fault, epochs=self.inputs.epochs,
            ctx=self.ctx, workers=self.workers, slow_workers=self.slow_workers,
            placed=self.placed, model=self.model, config=self._cfg,
            # the engines' replicas and holders start from the package's weights (None)
            weights=None, validation=self._validation_shards, plan=self.engine_plan)

    def train(self) -> History:
        """The epoch loop, on a run :meth:`set_up` set up; returns its History."""
        import keras

        inputs = self.inputs
        epochs, verbose, initial_epoch = inputs.epochs, inputs.verbose, inputs.initial_epoch

        engine, guard, setup = self.engine, self.guard, self.setup
        assert engine and guard and setup, "Run.set_up() comes first"
        history = History()
        history.run_id, history.workers = self.run_id, list(self.workers)
        history.replica_info = self.replica_info
        cbs = list(inputs.callbacks)
        if verbose:
            cbs.append(ProgressBar(self.batch_size) if verbose == 1 else _LinePrinter())
        cb = keras.callbacks.CallbackList(
            [*cbs, history], add_history=False, add_progbar=False, model=self.model,
            epochs=epochs, steps=self.ctx.steps_per_epoch, verbose=verbose,
        )
        history.engine = engine.engine
        # Which engine ran, where Keras callbacks (and users) read a run's settings.
        cb.set_params({**cb.params, "mode": engine.mode, "engine": engine.engine})
        first_epoch, first_step = self.begin_at
        if initial_epoch > first_epoch:  # Keras' initial_epoch; a resume may be later
            first_epoch, first_step = initial_epoch, 0
            engine.start_at(initial_epoch * engine.units(self.ctx.steps_per_epoch))
        # after begin: a resumed run's learning rate is the checkpoint's
        relay = LearningRateRelay(self.model, guard.lr_factor)
        self.publish(self._run_start_record(engine))
        for record in setup.records:  # workers lost while setting up
            self.publish(record)
        self.client.subscribe_topic(LOSS_TOPIC, self._on_event)
        self.model.stop_training = False
        engine.stop_on_nonfinite = any(isinstance(c, keras.callbacks.TerminateOnNaN)
                                       for c in cbs)
        cb.on_train_begin()
        ending = EndGuard(self.ctx, inputs.fault.on_worker_loss, self.publish,
                          guard.announce)
        #: the engine's losses before the first step completed (its recoveries)
        first: list[int] = []

        def on_step(unit: int) -> None:
            if not first:
                first.append(len(engine.losses))
            # The global loss of a step arrives with the next one: until the first
            # has arrived there is none, and callbacks only ever see real numbers.
            # (A unit is a round with local_steps: callbacks count its last step.)
            latest = self._latest_loss
            cb.on_train_batch_end(engine.last_step(unit, self.ctx.steps_per_epoch),
                                  {} if latest is None else {"loss": latest})
            if self.model.stop_training:
                engine.stop_requested = True
            guard.after_step(engine, epoch, unit)

        try:
            enter_phase("the first step", self.ctx.workers)
            key = self.shared.ref.key if self.shared is not None else None
            self.liveness = LivenessWatch(  # + the clean-up, should this client be lost
                self.client, self.run_id, on_client_lost=(release_replicas, (self.run_id, key)))
            for epoch in range(first_epoch, epochs):
                self.liveness.watch(self.ctx.workers)  # after any loss or growth
                cb.on_epoch_begin(epoch)
                relay.relay(engine)  # LearningRateScheduler, ReduceLROnPlateau, ...
                start = time.perf_counter()
                resume_at = {"start": first_step} if epoch == first_epoch and first_step else {}
                reports = engine.run_epoch(epoch, on_step, **resume_at)
                seconds = time.perf_counter() - start
                logs = self._epoch_logs(reports, seconds)
                logs.update(engine.epoch_logs(seconds))  # bytes, staleness, drops
                self.model.set_weights(reports[0].weights)
                set_seed_states(self.model, tuple(reports[0].seeds or ()), 0)
                if saves_optimizer(cbs, logs):  # ModelCheckpoint: the optimizer too
                    read = functools.partial(guard.optimizer_to_model, engine)
                    if epoch + 1 < epochs:
                        read()
                    else:  # a loss there is the run's end's
                        ending.run(END_PHASES[0], read)
                cb.on_epoch_end(epoch, logs)
                last_update = (epoch + 1) * engine.units(self.ctx.steps_per_epoch) - 1
                history.rounds.extend({"epoch": epoch, **r}
                                      for r in engine.round_records())
                self.publish(epoch_record(self.run_id, epoch, last_update, logs))
                # ReduceLROnPlateau: before the checkpoint; after the last epoch, a
                # loss there is the run's end's (dasktf.run.ending)
                end_epoch = functools.partial(_end_epoch, relay, guard, engine, epoch,
                                              self.model.stop_training)
                if epoch + 1 < epochs and not self.model.stop_training:
                    end_epoch()
                else:
                    ending.run(END_PHASES[0], end_epoch)
                    break
            outcome = ending.run(END_PHASES[1], engine.finish)  # drains what is in flight
            if outcome is not None:  # the master weights lived in the holders
                self.model.set_weights(outcome.final_weights)
                history.updates = outcome.updates
                history.dropped = outcome.dropped
                history.gradient_tasks = outcome.gradient_tasks
                history.holder_traffic = outcome.holder_traffic
            settled = first[0] if first else len(engine.losses)
            history.applied_updates = ending.run(END_PHASES[2], engine.applied_logs)
            ending.run(END_PHASES[3], functools.partial(guard.finish, self.model, engine))
            history.recoveries = [*setup.losses, *(
                {**r, "phase": "the first step" if i < settled else "training"}
                for i, r in enumerate(engine.losses)), *ending.losses]
            history.workers = list(self.ctx.workers)  # after any loss or growth
        except BaseException as exc:
            if isinstance(exc, WorkerLostError) and exc.phase is None:
                # before the engine finished a step, or after (on_worker_loss="raise")
                exc.phase = "the first step" if not first else "training"
                exc.args = (f"{exc.args[0]} (phase: {exc.phase})", *exc.args[1:])
            self.publish(run_end_record(self.run_id, exc))
            lost = guard.scheduler_lost(exc)
            if lost is not None:
                raise lost from exc
            raise
        finally:
            try:
                self.client.unsubscribe_topic(LOSS_TOPIC)
            except Exception:  # noqa: BLE001 - a client closed with its scheduler has nothing to unsubscribe, and must not hide why the run ended
                pass
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

    def _run_start_record(self, engine: Engine) -> dict[str, Any]:
        local, epochs = engine.local, self.inputs.epochs
        return run_start_record(
            self.run_id, mode=engine.mode, engine=engine.engine,
            model=self.spec_description, workers=self.workers,
            replica_info=self.replica_info, epochs=epochs,
            steps_per_epoch=self.ctx.steps_per_epoch, batch_size=self.batch_size,
            n_samples=self.placed.n_samples,
            total_updates=(None if local is None or engine.mode != "sync"
                           else epochs * engine.units(self.ctx.steps_per_epoch)),
            local_steps=local.steps if local is not None else 1,
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
                if record.get("loss_step") is not None:
                    self._heard = int(record["loss_step"])

    def heard(self) -> int | None:
        """The newest global update whose loss reached the client (``None``: none)."""
        return self._heard

    def reform(self, workers: list[str], batch_size: int) -> None:
        """Rebuild the run on ``workers`` at an epoch boundary: data re-placed,
        replicas rebuilt (their state is then loaded by :class:`RunGuard`)."""
        self.release(model=False)  # the re-formed replicas build from it again
        self._use_workers(workers)
        self.batch_size = batch_size
        self._generation += 1
        self._place()
        self._create_replicas()

    def release(self, wait: float | None = None, model: bool = True) -> None:
        """Free the replicas and shards on the workers, whatever happened, and the
        model's package unless ``model=False`` (a re-form or a set-up done again
        builds from it). ``wait``: give up waiting after that long (the workers
        still get the message: one busy with a set-up, importing TensorFlow, frees
        them when it gets to it)."""
        try:
            # Only the live ones: a dead worker's address costs a 30 s connect timeout.
            alive = set(alive_workers(self.client))
            workers = [w for w in self.ctx.workers if w in alive]
            if workers:
                key = self.shared.ref.key if model and self.shared is not None else None
                self.client.run(release_replicas, self.run_id, key, workers=workers,
                                on_error="ignore", callback_timeout=wait)
        except Exception:
            logger.debug("releasing replicas of %s failed", self.run_id, exc_info=True)
        self._futures = []
        if self.placed is not None:
            self.placed.shards = []
        if model and self.shared is not None:
            self.shared.release()
            self.shared = None

    def close(self) -> None:
        """The end of the run, whatever happened: the engine closed, the replicas
        and shards released, the membership no longer listened to."""
        try:
            if self.liveness is not None:
                self.liveness.close()
            if self.engine is not None:
                self.engine.close()
        finally:
            self.release(wait=config.get_seconds("poll-interval"))
            if self.ctx.watcher is not None:
                self.ctx.watcher.close()


def _end_epoch(relay: LearningRateRelay, guard: RunGuard, engine: Engine, epoch: int,
               stopped: bool) -> None:
    """What follows an epoch's callbacks: a learning rate they set carried to the
    engine, then (unless they stopped the run) the guard's checkpoint and re-form."""
    relay.relay(engine)
    if not stopped:
        guard.end_epoch(engine, epoch)


class _LinePrinter(ProgressBar):
    def __init__(self) -> None:
        super().__init__(batch_size=0)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        pass


class _config_override:
    def __init__(self, key: str, value: Any) -> None:
        import dask

        self._cm = dask.config.set({f"dasktf.{key}": value})

    def __enter__(self) -> None:
        self._cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)
