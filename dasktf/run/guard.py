"""What a run does about faults: resume, checkpoints, worker loss, elastic growth.

:class:`RunGuard` is the policy side of one ``fit`` call; it talks to the engine only
through the contract (:mod:`dasktf.engines.base`: capabilities, ``checkpoint``,
``resume``, ``reform``), and the mechanisms live in the engines (recovering a run),
:mod:`dasktf.run.checkpoint` (files) and :mod:`dasktf.cluster.membership` (hearing of
workers from the scheduler). The trainer calls
the guard at a few points: before the first epoch (resume), after every step
(periodic checkpoints), at every epoch end (checkpoint, re-form the run on the
workers alive now) and at the end (the final ``.keras`` model).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dasktf.callbacks import adopt_learning_rate
from dasktf.engines.base import Checkpoint, Engine, RunHooks, Saved, StateLostError
from dasktf.run import checkpoint as ckpt
from dasktf.runtime.replica import non_trainable_floats
from dasktf.transport import keras_archive

if TYPE_CHECKING:
    from distributed import Client

    from dasktf.cluster.waits import RunContext
    from dasktf.data.base import PlacedData
    from dasktf.run.inputs import RunInputs

logger = logging.getLogger(__name__)

#: Steps of linear warm-up when ``scale_lr`` changes the learning rate.
WARMUP_STEPS = 5


class GuardedRun(Protocol):
    """What the guard reads of its run (:class:`dasktf.run.run.Run`) as it goes:
    where it runs now and what it placed. What the fit call asked for comes once,
    frozen (:class:`~dasktf.run.inputs.RunInputs`)."""

    client: Client
    ctx: RunContext
    run_id: str
    placed: PlacedData
    batch_size: int
    #: the client's model (a resume loads the checkpoint's weights into it)
    model: Any
    spec_description: str

    def publish(self, record: dict[str, Any]) -> None: ...

    def heard(self) -> int | None: ...

    def reform(self, workers: list[str], batch_size: int) -> None: ...


class RunGuard:
    """Fault tolerance for one run (see the module docstring)."""

    def __init__(self, run: GuardedRun, inputs: RunInputs) -> None:
        self.run = run
        self.inputs = inputs
        self.options = inputs.fault
        self.epochs = inputs.epochs
        self.n0 = len(run.ctx.workers)
        self.batch0 = run.batch_size
        self.started = time.time()
        self.last_checkpoint: Path | None = None
        self._since_checkpoint = 0
        self.lines: list[str] = []
        #: named when the scheduler is lost: by then a client that gave up
        #: reconnecting has closed, and no longer knows where it was connected
        self.scheduler_address = str(getattr(getattr(run.client, "scheduler", None),
                                             "address", None) or "the scheduler")

    # -- what the engine gets ------------------------------------------------------
    def hooks(self) -> RunHooks:
        """What the run's engine is built with (see :class:`RunHooks`)."""
        run = self.run
        return RunHooks(
            publish=run.publish, announce=self.announce, reload=self._reload,
            last_checkpoint=self._on_all_lost, holder_inputs=self._holder_inputs,
            on_worker_loss=self.options.on_worker_loss, shuffle=self.inputs.shuffle,
            on_epoch_end=self.inputs.options.on_epoch_end, heard=run.heard,
        )

    def scheduler_lost(self, exc: BaseException) -> Exception | None:
        """A :class:`SchedulerUnreachableError` naming the last checkpoint when ``exc``
        means the client lost its scheduler; else ``None``."""
        from dasktf.exceptions import DasktfError, SchedulerUnreachableError

        client = self.run.client
        if isinstance(exc, DasktfError) and not isinstance(exc, SchedulerUnreachableError):
            return None
        if client.status == "running" and not isinstance(exc, (OSError, ConnectionError)):
            return None
        path = self.last_checkpoint
        return SchedulerUnreachableError(
            f"Lost the scheduler {self.scheduler_address} during the run ({type(exc).__name__}: {exc}). "
            + (f"The last checkpoint is {path}: restart the scheduler and workers, then "
               "resume with resume=True (dasktf fit --resume)."
               if path else "No checkpoint was written; pass checkpoint_dir= "
               "(--checkpoint-dir) to be able to resume.")
        )

    def announce(self, line: str) -> None:
        self.lines.append(line)
        if self.inputs.verbose:
            print(f"dasktf: {line}", flush=True)  # the CLI's one line per loss
        logger.warning("%s", line)

    def _reload(self, index: int, worker: str) -> tuple[Any, Any]:
        """Shard ``index`` (and its validation piece) placed on ``worker`` again."""
        run = self.run
        n = run.placed.schedule.shape[1]
        shard = self.inputs.source.reload(run.client, index, worker, run.placed.schedule,
                                          run.batch_size)
        val = None
        validation_data = self.inputs.validation_data
        if validation_data is not None:
            from dasktf.data.validation import validation_piece, validation_shard

            piece = validation_piece(validation_shard(validation_data), index, n)
            val = run.client.scatter(piece, workers=[worker], direct=True, hash=False)
        return shard, val

    def _holder_inputs(self, worker: str) -> tuple[Any, list[Any]]:
        """What a parameter holder rebuilt on ``worker`` starts from: a probe batch
        (to build its model) and the whole validation set, placed there."""
        run = self.run
        val = None
        if self.inputs.validation_data is not None:
            from dasktf.data.validation import validation_shard

            val = run.client.scatter(validation_shard(self.inputs.validation_data),
                                     workers=[worker], direct=True, hash=False)
        probe = val if val is not None else self._reload(0, worker)[0]
        return probe, [val]

    def _on_all_lost(self) -> str | None:
        return str(self.last_checkpoint) if self.last_checkpoint else None

    def lr_factor(self) -> float:
        """What ``scale_lr`` multiplies a learning rate set on the client by: the
        global batch now over the one the run started with."""
        return self.run.batch_size / self.batch0 if self.options.scale_lr else 1.0

    # -- resume -------------------------------------------------------------------
    def begin(self, engine: Engine) -> tuple[int, int]:
        """Load the newest valid checkpoint into the replicas; (epoch, step) to start at."""
        engine.set_checkpoint_grid(self.options.checkpoint_every)
        if (self.options.checkpoint_every is not None
                and engine.capabilities.checkpoints == "final"):
            raise ValueError(
                "checkpoint_every checkpoints sync steps and async updates; a "
                "sync_quorum run's checkpoint_dir receives the final model.keras."
            )
        if not self.options.resume:
            engine.keep_restore_point()
            return 0, 0
        if not engine.capabilities.resume:
            raise ValueError(
                "resume=True continues sync and async runs; a sync_quorum run's "
                "checkpoint_dir only receives the final model.keras."
            )
        found = ckpt.load_latest(self.options.checkpoint_dir)  # type: ignore[arg-type]
        if found is None:
            self.announce(f"no checkpoint in {self.options.checkpoint_dir}; starting afresh")
            engine.keep_restore_point()
            return 0, 0
        state, manifest, path = found
        model = self.run.model
        resumed = engine.resume(Saved(state, manifest, str(path), self.run.batch_size,
                                      _statistics(model, state["weights"])))
        self.last_checkpoint = path
        model.set_weights(state["weights"])
        adopt_learning_rate(model, state["optimizer"])
        self.announce(resumed.announce)
        return resumed.epoch, resumed.step

    # -- checkpoints --------------------------------------------------------------
    def after_step(self, engine: Engine, epoch: int, step: int) -> None:
        every = self.options.checkpoint_every
        kind = engine.capabilities.checkpoints
        if every is None or kind in ("final", "epochs"):
            return
        if kind == "steps":
            # sync: every ``every`` steps of each epoch, on a grid the engine knew
            # when it submitted them (its first replica kept those states)
            if engine.checkpoint_due(step):
                self.checkpoint(engine, epoch)
            return
        self._since_checkpoint += 1  # "updates": every ``every`` applied updates
        if self._since_checkpoint >= every:
            self.checkpoint(engine, epoch)

    def checkpoint(self, engine: Engine, epoch: int, epoch_end: bool = False) -> Path | None:
        """Save the engine's :meth:`~dasktf.engines.base.Engine.checkpoint` with the
        run's fields; its path (``None``: no ``checkpoint_dir``, or skipped)."""
        if self.options.checkpoint_dir is None:
            return None
        self._since_checkpoint = 0
        try:
            cut = engine.checkpoint(epoch, epoch_end)
        except StateLostError as exc:
            # what holds the state (a parameter holder) went between two results:
            # the engine rebuilds it as soon as it looks again; this one is skipped
            logger.warning("checkpoint skipped: %s", exc)
            return None
        run = self.run
        meta = {
            **cut.fields, "epochs": self.epochs, "seed": self.inputs.options.seed,
            "batch_size": run.batch_size, "workers": list(run.ctx.workers),
            "mode": engine.mode, "run": run.run_id, "model": run.spec_description,
            "wall_time": time.time(),
        }
        self.last_checkpoint = ckpt.save_checkpoint(self.options.checkpoint_dir, cut.state,
                                                    meta, model=self._archive(cut))
        cut.kept(str(self.last_checkpoint))
        logger.info("checkpoint %s", self.last_checkpoint)
        return self.last_checkpoint

    def _archive(self, cut: Checkpoint) -> bytes:
        """The client's model holding ``cut``'s state (weights, the optimizer's
        variables but its learning rate, which stays the client's), as Keras saves
        it: the checkpoint's ``.keras``. The client's model keeps that state (it is
        the newest the run has; its epoch end brings the next)."""
        model = self.run.model
        model.set_weights(cut.state["weights"])
        if cut.model_optimizer:
            adopt_optimizer(model, cut.state["optimizer"], learning_rate=False)
        elif not model.optimizer.built:  # saved fresh, whole: it loads without a warning
            model.optimizer.build(model.trainable_variables)
        return keras_archive(model)

    def end_epoch(self, engine: Engine, epoch: int) -> None:
        if (self.options.checkpoint_dir is not None
                and engine.capabilities.checkpoints != "final"):
            checkpointed = self.checkpoint(engine, epoch, epoch_end=True) is not None
        else:
            checkpointed = False
        if epoch + 1 >= self.epochs:
            return
        reformed = engine.capabilities.reforms and self.maybe_reform(engine)
        if not (checkpointed or reformed):  # each of those took the restore point
            engine.keep_restore_point()

    def finish(self, model: Any, engine: Engine) -> None:
        """The trained optimizer's state into the client's model (``history.model``
        saves and resumes like a model Keras trained), then the final checkpoint."""
        state = engine.final_state()
        if state is not None:
            adopt_optimizer(model, state["optimizer"])
        if self.options.checkpoint_dir is not None:
            path = Path(self.options.checkpoint_dir) / ckpt.FINAL_MODEL
            ckpt.write_file(path, keras_archive(model))  # a kill mid-write: none or whole

    def optimizer_to_model(self, engine: Engine) -> None:
        """At an epoch end, before the callbacks: the trained optimizer's state into
        the client's model, for a callback that saves it whole
        (:func:`~dasktf.callbacks.saves_optimizer`: ``ModelCheckpoint``). Its
        weights are the epoch's report's, already there. The learning rate stays
        the client's: it is what callbacks set and the relay compares with."""
        state = engine.final_state()
        if state is not None:
            adopt_optimizer(self.run.model, state["optimizer"], learning_rate=False)

    # -- elastic growth / rebalancing at an epoch boundary --------------------------
    def maybe_reform(self, engine: Engine) -> bool:
        """Re-form the run over the workers alive now if any joined or left;
        whether it did."""
        run = self.run
        watcher = run.ctx.watcher
        joined = watcher.added_since(self.started, run.ctx.workers) if watcher else []
        from dasktf.cluster.local import alive_workers

        alive = set(alive_workers(run.client))
        joined = [w for w in joined if w in alive]
        if not joined and not engine.reform_needed:
            return False
        workers = [w for w in run.ctx.workers if w in alive] + joined
        state = engine.state()
        n = len(workers)
        batch = run.batch_size
        lr_change = None
        if self.options.scale_lr and n != len(run.placed.schedule[0]):
            # Linear scaling rule (Goyal et al., 2017): the per-worker batch stays,
            # the global batch and the learning rate follow the worker count.
            batch = max(n, round(self.batch0 * n / self.n0))
            lr_change = (batch / run.batch_size)
        run.reform(workers, batch)
        engine.reform(run.placed.schedule)
        engine.load_state(state)  # the servers too, placed over the workers now
        engine.keep_restore_point(state)
        if lr_change is not None:
            self._scale_lr(engine, lr_change, n, batch)
        self.announce(f"re-formed on {n} worker(s)" + (f" (joined: {', '.join(joined)})"
                                                        if joined else "")
                       + f", global batch {batch}")
        self.started = time.time()
        return True

    def _scale_lr(self, engine: Engine, factor: float, n: int, batch: int) -> None:
        run = self.run
        old, new = engine.ramp_learning_rate(factor, WARMUP_STEPS)
        run.publish({"run": run.run_id, "kind": "lr_scaled", "workers": n,
                      "batch_size": batch, "learning_rate_from": old, "learning_rate": new,
                      "warmup_steps": WARMUP_STEPS, "wall_time": time.time()})
        self.announce(f"learning rate {old:.4g} -> {new:.4g} over {WARMUP_STEPS} "
                       f"warm-up steps (linear scaling, {n} workers, batch {batch})")


def adopt_optimizer(model: Any, values: list[Any], learning_rate: bool = True) -> bool:
    """Give the client's model's optimizer the trained one's variables (``values``,
    in ``optimizer.variables``' order: ``iterations``, the learning rate, the
    slots), so it saves and goes on as the optimizer Keras' ``fit`` would have
    trained; ``learning_rate=False`` leaves its learning rate. Whether it could: a
    ``LossScaleOptimizer`` on the workers (``mixed_float16``) has other variables."""
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    variables = optimizer.variables
    if len(variables) != len(values):
        logger.debug("optimizer state not copied: %d variables against %d",
                     len(variables), len(values))
        return False
    for v, value in zip(variables, values, strict=True):
        if learning_rate or not v.path.endswith("learning_rate"):
            v.assign(value)
    return True


def _statistics(model: Any, weights: list[np.ndarray]) -> list[np.ndarray] | None:
    """``model``'s moving statistics as ``weights`` (its ``get_weights()``) hold them."""
    position = {id(v): i for i, v in enumerate(model.weights)}
    return [np.asarray(weights[position[id(v)]]) for v in non_trainable_floats(model)] or None
