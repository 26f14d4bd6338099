"""One ``fit`` call: the replicas, the engine, the epoch loop and the clean-up."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from dasktf import config
from dasktf.callbacks import (
    History,
    LearningRateRelay,
    ProgressBar,
    adopt_learning_rate,
    saves_optimizer,
)
from dasktf.cluster.calls import CallsPlugin, call_on_workers, tell_workers
from dasktf.cluster.liveness import LivenessWatch
from dasktf.cluster.malloc import warn_fixed_malloc
from dasktf.cluster.membership import MembershipWatcher, alive_workers, listed_workers
from dasktf.cluster.waits import RunContext, WatchedClient, wait_for
from dasktf.data.base import PlacedData
from dasktf.data.validation import place_validation
from dasktf.diagnostics.events import (
    epoch_record,
    listen_for_losses,
    publish,
    run_end_record,
    run_start_record,
)
from dasktf.diagnostics.metrics import ensure_store
from dasktf.engines.base import Checkpoint, Engine, RunHooks
from dasktf.exceptions import WorkerLostError
from dasktf.run.compiling import (
    adopt_optimizer,
    client_model,
    compile_reference,
    model_statistics,
)
from dasktf.run.ending import END_PHASES, EndGuard
from dasktf.run.engine import EngineInputs, make_engine
from dasktf.run.guard import GuardedRun, RunGuard
from dasktf.run.inputs import RunInputs
from dasktf.run.setup import SetupGuard, enter_phase, register_worker_plugin
from dasktf.runtime.keras_step import build_metrics, merge_metric_states
from dasktf.runtime.replica import ReplicaConfig
from dasktf.runtime.tasks import create_replica_task, release_replicas
from dasktf.transport import (
    ModelPackage,
    SharedModel,
    keras_archive,
    set_seed_states,
    share_model,
)

if TYPE_CHECKING:
    from distributed import Client

logger = logging.getLogger(__name__)

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
        self.placed: PlacedData | None = None
        #: the global batch now (a re-form with ``scale_lr`` changes it)
        self.batch_size = inputs.batch_size
        self.run_id = uuid.uuid4().hex[:10]
        #: the run's workers, assigned here only (:meth:`_use_workers`); an engine
        #: that loses or gains one reports it (``RunHooks.workers_changed``)
        self.ctx = RunContext(client, self.run_id, list(workers), 0, resources)
        #: ``{worker index: factor}``: the options' ``slow_workers``, re-indexed
        #: when a worker is lost during the set-up
        self.slow_workers = dict(inputs.options.slow_workers)
        self.replica_info: list[dict[str, Any]] = []
        #: the client's model, trained in place: what the run hands back
        self.model: Any = None
        self._latest_loss: float | None = None
        self._heard: int | None = None
        self._cfg: ReplicaConfig | None = None
        self.engine: Engine | None = None
        self.guard: RunGuard | None = None
        self.setup: SetupGuard | None = None
        #: (epoch, step) the first epoch starts at: RunGuard.begin's, after a resume
        self.begin_at = (0, 0)
        self.shared: SharedModel | None = None
        self._factory: Any = None
        #: the scheduler's failure detector for the run's workers, armed as the
        #: set-up begins (dasktf.cluster.liveness)
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
    def set_up(self, plugin: Any = None) -> None:
        """Connect to the workers, register ``plugin`` (a worker plugin, if any) on
        them, place the data, build the replicas and start the engine: the phases of
        :data:`dasktf.run.setup.PHASES`. A worker lost in any of them is recovered by
        doing the set-up again on the survivors, or raised naming it and the phase
        (:class:`~dasktf.run.setup.SetupGuard`)."""
        setup = self.setup = SetupGuard(self.ctx, self.inputs, self.announce)
        while True:
            try:
                with setup.phase("connecting"):
                    if self.ctx.watcher is None:  # hears of losses as they happen
                        self.ctx.watcher = MembershipWatcher(self.client)
                    self._watch(setting_up=True)  # a frozen worker, too
                with setup.phase("registering plugins"):
                    # the scheduler sends a worker plugin to every worker of the
                    # cluster and waits for each: meanwhile the detector watches
                    # those outside the run too, so a frozen one is removed (and
                    # the call made again without it), not waited on until
                    # dasktf.step-timeout
                    outside = [w for w in alive_workers(self.client)
                               if w not in self.ctx.workers]
                    if outside:  # (else the run's own watch stands: no message)
                        self._watch(setting_up=True, workers=self.ctx.workers + outside)
                    for each in [CallsPlugin(), *([] if plugin is None else [plugin])]:
                        register_worker_plugin(self.ctx, each, "registering plugins")
                    self._watch(setting_up=True)
                plugin = None  # stored by the scheduler for every worker
                with setup.phase("placing data"):
                    self._place()
                with setup.phase("building replicas"):
                    if self._cfg is None:
                        self._prepare()
                    self._watch(setting_up=True)  # the lease's clean-up: the package too
                    self._create_replicas()
                with setup.phase("starting the engine"):
                    self.guard = RunGuard(self._guarded(), self.inputs)
                    self.engine = make_engine(self._engine_inputs(), self._hooks())
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
        index = {w: i for i, w in enumerate(self.ctx.workers)}
        self.slow_workers = {new: self.slow_workers[index[w]]
                             for new, w in enumerate(survivors)
                             if index[w] in self.slow_workers}
        self.run_id = self.ctx.run_id = uuid.uuid4().hex[:10]
        self._use_workers(survivors)

    def _watch(self, setting_up: bool = False, workers: list[str] | None = None) -> None:
        """Arm the scheduler's failure detector for the run's workers now (its id
        too: a set-up done again has a new one), or ``workers`` (a call that waits
        on others), with the set-up's timeout while ``setting_up``, and the run's
        clean-up should this client be lost."""
        if self.liveness is not None and self.liveness.run != self.run_id:
            self.liveness.close()
            self.liveness = None
        if self.liveness is None:
            self.liveness = LivenessWatch(self.client, self.run_id)
        key = self.shared.ref.key if self.shared is not None else None
        self.liveness.watch(self.ctx.workers if workers is None else workers,
                            setting_up=setting_up,
                            on_client_lost=(release_replicas, (self.run_id, key)))

    def _use_workers(self, workers: list[str]) -> None:
        """The one writer of the run's workers (a loss, a join, a re-form)."""
        self.ctx.workers = list(workers)
        if self._cfg is not None:  # a ring's chunks are cut for the worker count
            self._cfg = dataclasses.replace(self._cfg, comm=dataclasses.replace(
                self._cfg.comm, n_workers=len(workers)))

    def _place(self) -> None:
        """Place the shards over the run's workers (never waiting on a lost one)."""
        self.placed = self.inputs.source.place(WatchedClient(self.ctx, "placing data"),
                                        self.ctx.workers, self.batch_size)
        self.ctx.steps_per_epoch = self.placed.steps_per_epoch

    def _prepare(self) -> None:
        """The client's model, its compile recipe and the replicas' config (once)."""
        o = self.options
        # built and checked before the cluster was contacted where the client holds
        # the data, else here from the placed shards' stats
        prepared = self.inputs.prepared or client_model(self.inputs, self.placed.stats)
        model, recipe, self._factory = prepared.model, prepared.recipe, prepared.factory
        compile_reference(recipe, model, o.learning_rate)
        probe_x, probe_y, probe_w = self.placed.stats[0].probe(1)
        build_metrics(model, probe_x, probe_y, probe_w)
        self.model = model
        self.spec_description = (o.model if isinstance(o.model, str) else
                                 getattr(model, "name", ""))
        self.engine_plan = prepared.plan
        # The model travels whole, once per worker (dasktf.transport): the optimizer's
        # state too where the run continues it and it has one.
        package = ModelPackage.pack(
            model, optimizer=recipe.optimizer if (
                recipe.continues and model.optimizer.built) else None,
            factory=self._factory, probe=probe_x)
        self.shared = share_model(WatchedClient(self.ctx, "building replicas"), package,
                                  self.ctx.workers)
        self._cfg = ReplicaConfig(
            self.shared.ref, recipe, o.seed, eval_batch_size=self.inputs.eval_batch_size,
            mixed_precision=o.mixed_precision,
            publish_metrics=bool(config.get("metrics")),
            comm=dataclasses.replace(o.comm, n_workers=len(self.ctx.workers)),
            local=o.local, sliced=o.shard_state is not None,
        )

    def _create_replicas(self) -> None:
        """One replica per worker of ``self.ctx.workers`` from ``self.model``'s weights."""
        cfg, validation_data = self._cfg, self.inputs.validation_data
        client = WatchedClient(self.ctx, "building the replicas")
        val = (
            place_validation(client, validation_data, self.ctx.workers)
            if validation_data is not None
            else [None] * len(self.ctx.workers)
        )
        self._validation_shards = val
        # Over the client's connections to the workers, not as tasks: N tasks were
        # the largest fixed part of what a short fit cost the scheduler (issue 39,
        # dasktf.cluster.calls). Each worker reads its shard from its own memory.
        held = [f for f in [*self.placed.shards, *val] if hasattr(f, "key")]
        wait_for(self.ctx, held, "building the replicas", timeout_key="replica-timeout")
        self.replica_info = call_on_workers(
            self.ctx, "building the replicas", create_replica_task,
            [(w, (self.run_id, w, cfg, i, self.placed.shards[i],
                  self.placed.schedule[:, i], val[i], self.inputs.shuffle,
                  self.slow_workers.get(i, 1.0)))
             for i, w in enumerate(self.ctx.workers)],
            timeout_key="replica-timeout")
        warn_fixed_malloc(self.replica_info)  # workers dasktf did not spawn

    # -- the epoch loop -----------------------------------------------------------------
    def _engine_inputs(self) -> EngineInputs:
        """What the factory builds this run's engine from (replicas built)."""
        return EngineInputs(
            options=self.options, fault=self.inputs.fault, epochs=self.inputs.epochs,
            ctx=self.ctx, slow_workers=self.slow_workers,
            placed=self.placed, model=self.model, config=self._cfg,
            # the engines' replicas and holders start from the package's weights (None)
            weights=None, validation=self._validation_shards, plan=self.engine_plan)

    def _guarded(self) -> GuardedRun:
        """What the run's guard reads of it and asks it to change."""
        return GuardedRun(
            self.ctx, self.spec_description, batch_size=lambda: self.batch_size,
            schedule=lambda: self.placed.schedule, publish=self.publish,
            announce=self.announce,
            reform=self.reform, statistics=functools.partial(model_statistics, self.model),
            load=self._load_state, archive=self._archive)

    # -- the client's model: written here only --------------------------------------
    def _load_state(self, state: dict[str, Any]) -> None:
        """A resumed checkpoint's weights and learning rate."""
        self.model.set_weights(state["weights"])
        adopt_learning_rate(self.model, state["optimizer"])

    def _archive(self, cut: Checkpoint | None) -> bytes:
        """The client's model as Keras saves it (a checkpoint's ``.keras``), holding
        ``cut``'s state first (weights, the optimizer's variables but its learning
        rate, which stays the client's): the newest state the run has."""
        model = self.model
        if cut is not None:
            model.set_weights(cut.state["weights"])
            if cut.model_optimizer:
                adopt_optimizer(model, cut.state["optimizer"], learning_rate=False)
            elif not model.optimizer.built:  # saved fresh, whole: loads without a warning
                model.optimizer.build(model.trainable_variables)
        return keras_archive(model)

    def _adopt_optimizer(self, engine: Engine, learning_rate: bool = True) -> None:
        """The trained optimizer's state (:meth:`Engine.final_state`) into the
        client's model: ``history.model`` saves and resumes like a model Keras
        trained (the weights are the last epoch's report's, already there)."""
        state = engine.final_state()
        if state is not None:
            adopt_optimizer(self.model, state["optimizer"], learning_rate=learning_rate)

    def _hooks(self) -> RunHooks:
        """What the run's engine (and its end's guard) report to and ask of it."""
        import keras

        guard, fault = self.guard, self.inputs.fault
        assert guard is not None, "the guard comes first"
        return RunHooks(
            publish=self.publish, announce=self.announce, reload=self._reload,
            last_checkpoint=guard.last_checkpoint_path, holder_inputs=self._holder_inputs,
            on_worker_loss=fault.on_worker_loss, shuffle=self.inputs.shuffle,
            on_epoch_end=self.options.on_epoch_end, heard=self.heard,
            workers_changed=self._use_workers,
            stop_on_nonfinite=any(isinstance(c, keras.callbacks.TerminateOnNaN)
                                  for c in self.inputs.callbacks))

    def _reload(self, index: int, worker: str) -> tuple[Any, Any]:
        """Shard ``index`` (and its validation piece) placed on ``worker`` again."""
        schedule, validation_data = self.placed.schedule, self.inputs.validation_data
        shard = self.inputs.source.reload(self.client, index, worker, schedule,
                                          self.batch_size)
        val = None
        if validation_data is not None:
            from dasktf.data.validation import validation_piece, validation_shard

            piece = validation_piece(validation_shard(validation_data), index,
                                     schedule.shape[1])
            val = self.client.scatter(piece, workers=[worker], direct=True, hash=False)
        return shard, val

    def _holder_inputs(self, worker: str) -> tuple[Any, list[Any]]:
        """What a parameter holder rebuilt on ``worker`` starts from: a probe batch
        (to build its model) and the whole validation set, placed there."""
        val = None
        if self.inputs.validation_data is not None:
            from dasktf.data.validation import validation_shard

            val = self.client.scatter(validation_shard(self.inputs.validation_data),
                                      workers=[worker], direct=True, hash=False)
        probe = val if val is not None else self._reload(0, worker)[0]
        return probe, [val]

    def train(self) -> History:
        """The epoch loop, on a run :meth:`set_up` set up; returns its History."""
        import keras

        inputs = self.inputs
        epochs, verbose, initial_epoch = inputs.epochs, inputs.verbose, inputs.initial_epoch

        engine, guard, setup = self.engine, self.guard, self.setup
        assert engine and guard and setup, "Run.set_up() comes first"
        history = History()
        history.run_id, history.workers = self.run_id, list(self.ctx.workers)
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
        stop_listening = listen_for_losses(self.client, self.run_id, self._on_loss)
        self.model.stop_training = False
        cb.on_train_begin()
        ending = EndGuard(self.ctx, self._hooks())
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
                engine.request_stop()
            guard.after_step(engine, epoch, unit)

        try:
            enter_phase("the first step", self.ctx.workers)
            for epoch in range(first_epoch, epochs):
                self._watch()  # after any loss or growth
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
                    # the trained optimizer's state (not its learning rate: the
                    # client's, which callbacks set) for a callback saving it whole
                    read = functools.partial(self._adopt_optimizer, engine, False)
                    if epoch + 1 < epochs:
                        read()
                    else:  # a loss there is the run's end's
                        ending.run(END_PHASES[0], read)
                cb.on_epoch_end(epoch, logs)
                last_update = (epoch + 1) * engine.units(self.ctx.steps_per_epoch) - 1
                history.rounds.extend({"epoch": epoch, **r}
                                      for r in engine.round_records())
                # with the step records the replicas handed over (EpochReport.records)
                self.publish(epoch_record(self.run_id, epoch, last_update, logs),
                             steps=[r for rep in reports for r in rep.records or ()])
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
            ending.run(END_PHASES[3], functools.partial(self._adopt_optimizer, engine))
            guard.finish()
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
            stop_listening()
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
            model=self.spec_description, workers=self.ctx.workers,
            replica_info=self.replica_info, epochs=epochs,
            steps_per_epoch=self.ctx.steps_per_epoch, batch_size=self.batch_size,
            n_samples=self.placed.n_samples,
            total_updates=(None if local is None or engine.mode != "sync"
                           else epochs * engine.units(self.ctx.steps_per_epoch)),
            local_steps=local.steps if local is not None else 1,
        )

    def publish(self, record: dict[str, Any], steps: list[dict[str, Any]] | None = None
                ) -> None:
        """Send a run record to the scheduler's MetricsStore (``steps``: step records
        before it, in the same message); never fails the run."""
        try:
            if record["kind"] == "run_start":
                ensure_store(self.client)
            publish(self.client, *steps or (), record)
        except Exception:
            logger.warning("publishing the %s record of run %s failed",
                           record["kind"], self.run_id, exc_info=True)

    def announce(self, line: str) -> None:
        """One line for the user (a loss, a re-form, a resume), and the log's."""
        if self.inputs.verbose:
            print(f"dasktf: {line}", flush=True)  # the CLI's one line per loss
        logger.warning("%s", line)

    def _on_loss(self, record: dict[str, Any]) -> None:
        if record.get("loss") is not None:
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
        self._place()
        self._create_replicas()

    def release(self, wait: float | None = None, model: bool = True) -> None:
        """Free the replicas and shards on the workers, whatever happened, and the
        model's package unless ``model=False`` (a re-form or a set-up done again
        builds from it). ``wait``: give up waiting after that long (the workers
        still get the message: one busy with a set-up, importing TensorFlow, frees
        them when it gets to it)."""
        try:
            # Only the live ones: a dead worker's address costs a 30 s connect timeout
            # (those the scheduler lists: not its identity, O(cluster) to describe).
            alive = listed_workers(self.client, self.ctx.workers)
            workers = [w for w in self.ctx.workers if w in alive]
            if workers:
                key = self.shared.ref.key if model and self.shared is not None else None
                tell_workers(self.client, release_replicas, [self.run_id, key],
                             workers, wait)
        except Exception:
            logger.debug("releasing replicas of %s failed", self.run_id, exc_info=True)
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

