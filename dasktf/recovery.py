"""What a run does about faults: resume, checkpoints, worker loss, elastic growth.

:class:`RunGuard` is the policy side of one ``fit`` call; the mechanisms live in
:mod:`dasktf.elastic` (recovering a sync run), :mod:`dasktf.checkpoint` (files) and
:mod:`dasktf.membership` (hearing of workers from the scheduler). The trainer calls
the guard at a few points: before the first epoch (resume), after every step
(periodic checkpoints), at every epoch end (checkpoint, re-form the run on the
workers alive now) and at the end (the final ``.keras`` model).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import checkpoint as ckpt
from dasktf.callbacks import adopt_learning_rate
from dasktf.elastic import (
    ON_WORKER_LOSS,
    ElasticSyncEngine,
    reload_shard,
    set_state_task,
)
from dasktf.replica import non_trainable_floats
from dasktf.sync import wait_for

if TYPE_CHECKING:
    from dasktf.trainer import _Run

logger = logging.getLogger(__name__)

#: Steps of linear warm-up when ``scale_lr`` changes the learning rate.
WARMUP_STEPS = 5


@dataclass(frozen=True)
class FaultOptions:
    """The fault-tolerance options of one ``fit`` call (validated)."""

    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    on_worker_loss: str = "recover"
    scale_lr: bool = False

    def __post_init__(self) -> None:
        if self.on_worker_loss not in ON_WORKER_LOSS:
            raise ValueError(
                f"on_worker_loss must be one of {ON_WORKER_LOSS}; got {self.on_worker_loss!r}."
            )
        if self.checkpoint_every is not None:
            if isinstance(self.checkpoint_every, bool) or not isinstance(
                self.checkpoint_every, (int, np.integer)
            ) or self.checkpoint_every < 1:
                raise ValueError(
                    f"checkpoint_every must be a positive number of steps; got "
                    f"{self.checkpoint_every!r}."
                )
            if self.checkpoint_dir is None:
                raise ValueError("checkpoint_every needs checkpoint_dir (where to write).")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir (where the checkpoints are).")


class RunGuard:
    """Fault tolerance for one run (see the module docstring)."""

    def __init__(self, run: _Run, options: FaultOptions, epochs: int) -> None:
        self.run = run
        self.options = options
        self.epochs = epochs
        self.n0 = len(run.workers)
        self.batch0 = run.batch_size
        self.started = time.time()
        self.last_checkpoint: Path | None = None
        #: the sync graph engine, once :meth:`begin` has it (its servers load states)
        self.engine: ElasticSyncEngine | None = None
        self._since_checkpoint = 0
        self.lines: list[str] = []

    # -- engines ------------------------------------------------------------------
    def sync_engine(self) -> ElasticSyncEngine:
        run = self.run
        spec = dataclasses.replace(run.trainer.comm, n_workers=len(run.workers))
        shapes = [tuple(v.shape) for v in run.model.trainable_variables]
        engine = ElasticSyncEngine(
            run.ctx, spec, shapes, run.placed.schedule,
            {w: [i] for i, w in enumerate(run.workers)},
            self._reload, run._publish, self._on_all_lost, self._announce,
        )
        engine.policy = self.options.on_worker_loss
        engine.average_stats = bool(non_trainable_floats(run.model))
        engine.ps_layout = run.ps_layout  # where the servers' slices go in a state
        return engine

    def attach_async(self, engine: Any) -> Any:
        """Give an async engine what it needs to go on after losing a worker."""
        engine.policy = self.options.on_worker_loss
        engine.publish, engine.announce = self.run._publish, self._announce
        engine.reload, engine.shuffle = self._reload, self.run.shuffle
        engine.last_checkpoint = self._on_all_lost
        engine.holder_inputs = self._holder_inputs
        if self.options.on_worker_loss == "recover" and engine.mode == "async":
            # and grow: a joined worker helps a shard (quorum runs keep their workers)
            from dasktf.async_elastic import grow_async

            engine.grow = grow_async
        return engine

    def scheduler_lost(self, exc: BaseException) -> Exception | None:
        """A :class:`SchedulerUnreachableError` naming the last checkpoint when ``exc``
        means the client lost its scheduler; else ``None``."""
        from dasktf.exceptions import DasktfError, SchedulerUnreachableError

        client = self.run.client
        if isinstance(exc, DasktfError) and not isinstance(exc, SchedulerUnreachableError):
            return None
        if client.status == "running" and not isinstance(exc, (OSError, ConnectionError)):
            return None
        where = getattr(getattr(client, "scheduler", None), "address", "the scheduler")
        path = self.last_checkpoint
        return SchedulerUnreachableError(
            f"Lost the scheduler {where} during the run ({type(exc).__name__}: {exc}). "
            + (f"The last checkpoint is {path}: restart the scheduler and workers, then "
               "resume with resume=True (dasktf fit --resume)."
               if path else "No checkpoint was written; pass checkpoint_dir= "
               "(--checkpoint-dir) to be able to resume.")
        )

    def _announce(self, line: str) -> None:
        self.lines.append(line)
        if self.run.verbose:
            print(f"dasktf: {line}", flush=True)  # the CLI's one line per loss
        logger.warning("%s", line)

    def _reload(self, index: int, worker: str) -> tuple[Any, Any]:
        run = self.run
        n = run.placed.schedule.shape[1]
        shard = reload_shard(run.client, run.source, index, n, worker,
                             run.placed.schedule, run.batch_size)
        val = None
        if run.validation_data is not None:
            from dasktf.data import Shard

            x, y = (np.asarray(a) for a in run.validation_data)
            part = np.array_split(np.arange(len(x)), n)[index]
            val = run.client.scatter(Shard(x[part], y[part]), workers=[worker],
                                     direct=True, hash=False)
        return shard, val

    def _holder_inputs(self, worker: str) -> tuple[Any, list[Any]]:
        """What a parameter holder rebuilt on ``worker`` starts from: a probe batch
        (to build its model) and the whole validation set, placed there."""
        run = self.run
        val = None
        if run.validation_data is not None:
            from dasktf.data import Shard

            x, y = (np.asarray(a) for a in run.validation_data)
            val = run.client.scatter(Shard(x, y), workers=[worker], direct=True, hash=False)
        probe = val if val is not None else self._reload(0, worker)[0]
        return probe, [val]

    def _on_all_lost(self) -> str | None:
        return str(self.last_checkpoint) if self.last_checkpoint else None

    def lr_factor(self) -> float:
        """What ``scale_lr`` multiplies a learning rate set on the client by: the
        global batch now over the one the run started with."""
        return self.run.batch_size / self.batch0 if self.options.scale_lr else 1.0

    # -- resume -------------------------------------------------------------------
    def begin(self, engine: Any) -> tuple[int, int]:
        """Load the newest valid checkpoint into the replicas; (epoch, step) to start at."""
        if getattr(engine, "mode", None) == "async":  # the holder's state and progress
            from dasktf.async_checkpoint import resume_async

            return resume_async(self, engine) if self.options.resume else (0, 0)
        if hasattr(engine, "keep_every"):
            engine.keep_every = self.options.checkpoint_every
        if isinstance(engine, ElasticSyncEngine):
            self.engine = engine
        if self.options.checkpoint_every is not None and not hasattr(engine, "state"):
            raise ValueError(
                "checkpoint_every checkpoints sync steps and async updates; a "
                "sync_quorum run's checkpoint_dir receives the final model.keras."
            )
        if not self.options.resume:
            self._restore_point(engine)
            return 0, 0
        if not hasattr(engine, "update_base"):
            raise ValueError(
                "resume=True continues sync and async runs; a sync_quorum run's "
                "checkpoint_dir only receives the final model.keras."
            )
        found = ckpt.load_latest(self.options.checkpoint_dir)  # type: ignore[arg-type]
        if found is None:
            self._announce(f"no checkpoint in {self.options.checkpoint_dir}; starting afresh")
            self._restore_point(engine)
            return 0, 0
        state, manifest, path = found
        if manifest.get("mode") == "async":
            raise ValueError(f"{path} is an async run's checkpoint; resume it with mode='async'.")
        # The collective engine's state lives in its TensorFlow children.
        getattr(engine, "load_state", self.set_state)(state)
        self.last_checkpoint = path
        epoch, step = int(manifest["next_epoch"]), int(manifest["next_step"])
        if hasattr(engine, "update_base"):
            engine.update_base = int(manifest["epoch_base"]) if step else state["applied"] + 1
        self.run.model.set_weights(state["weights"])
        adopt_learning_rate(self.run.model, state["optimizer"])
        self._restore_point(engine, state)
        self._announce(f"resumed from {path} at epoch {epoch + 1}, step {step + 1} "
                       f"(update {state['applied'] + 1})")
        return epoch, step

    @staticmethod
    def _restore_point(engine: Any, state: dict[str, Any] | None = None) -> None:
        """Sharded sync servers rewind to this after a loss (dasktf.elastic)."""
        if isinstance(engine, ElasticSyncEngine):
            engine.take_restore_point(state)

    def set_state(self, state: dict[str, Any]) -> None:
        """Load ``state`` into the replicas (and the sharded servers, if any)."""
        run = self.run
        big = run.client.scatter(state, broadcast=True, hash=False)
        futures = [run.client.submit(set_state_task, run.run_id, big, workers=[w],
                                     allow_other_workers=False, pure=False)
                   for w in run.ctx.workers]
        wait_for(run.ctx, futures, "loading the checkpoint into the replicas")
        if self.engine is not None:
            self.engine.load_servers(state)

    # -- checkpoints --------------------------------------------------------------
    def after_step(self, engine: Any, epoch: int, step: int) -> None:
        every = self.options.checkpoint_every
        is_async = getattr(engine, "mode", None) == "async"
        if every is None or not (hasattr(engine, "state") or is_async):
            return
        if hasattr(engine, "checkpoint_due"):
            # sync: every ``every`` steps of each epoch, on a grid the engine knew
            # when it submitted them (its first replica kept those states)
            if engine.checkpoint_due(step):
                self.checkpoint(engine, epoch)
            return
        self._since_checkpoint += 1
        if self._since_checkpoint >= every:
            self.checkpoint(engine, epoch)

    def _checkpoint_async(self, engine: Any, epoch: int, epoch_end: bool) -> Path | None:
        from dasktf.async_checkpoint import save_async_checkpoint
        from dasktf.asynchronous import HolderLostError

        self._since_checkpoint = 0
        try:
            return save_async_checkpoint(self, engine, epoch + 1 if epoch_end else epoch)
        except HolderLostError:
            # the holder went between two results: the engine rebuilds it from its
            # restore point as soon as it looks again; this checkpoint is skipped
            logger.warning("checkpoint skipped: the parameter holder was lost")
            return None

    def checkpoint(self, engine: Any, epoch: int, epoch_end: bool = False) -> Path | None:
        if self.options.checkpoint_dir is None:
            return None
        if getattr(engine, "mode", None) == "async":
            return self._checkpoint_async(engine, epoch, epoch_end)
        state = engine.state()
        base = engine.update_base
        step = state["applied"] + 1 - base
        if epoch_end or step >= self.run.ctx.steps_per_epoch:
            next_epoch, next_step = epoch + 1, 0
        else:
            next_epoch, next_step = epoch, step
        meta = {
            "next_epoch": next_epoch, "next_step": next_step,
            "epoch_base": base if next_step else state["applied"] + 1,
            "epochs": self.epochs, "seed": self.run.trainer.seed,
            "batch_size": self.run.batch_size, "workers": list(self.run.ctx.workers),
            "mode": self.run.trainer.mode, "run": self.run.run_id,
            "model": self.run.spec_description, "wall_time": time.time(),
        }
        self.last_checkpoint = ckpt.save_checkpoint(self.options.checkpoint_dir, state, meta)
        self._restore_point(engine, state)
        self._since_checkpoint = 0
        logger.info("checkpoint %s", self.last_checkpoint)
        return self.last_checkpoint

    def end_epoch(self, engine: Any, epoch: int) -> None:
        if self.options.checkpoint_dir is not None and (
            hasattr(engine, "state") or getattr(engine, "mode", None) == "async"
        ):
            checkpointed = self.checkpoint(engine, epoch, epoch_end=True) is not None
        else:
            checkpointed = False
        if epoch + 1 >= self.epochs:
            return
        reformed = isinstance(engine, ElasticSyncEngine) and self.maybe_reform(engine)
        if not (checkpointed or reformed):  # each of those took the restore point
            self._restore_point(engine)

    def finish(self, model: Any, engine: Any) -> None:
        if self.options.checkpoint_dir is not None:
            if hasattr(engine, "state"):  # the replicas' optimizer state goes along
                state = engine.state()
                model.optimizer.build(model.trainable_variables)
                for v, value in zip(model.optimizer.variables, state["optimizer"], strict=False):
                    v.assign(value)
            path = Path(self.options.checkpoint_dir) / ckpt.FINAL_MODEL
            model.save(path)

    # -- elastic growth / rebalancing at an epoch boundary --------------------------
    def maybe_reform(self, engine: ElasticSyncEngine) -> bool:
        """Re-form the run over the workers alive now if any joined or left;
        whether it did."""
        run = self.run
        watcher = run.ctx.watcher
        joined = watcher.added_since(self.started, run.ctx.workers) if watcher else []
        from dasktf.cluster import alive_workers

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
        engine.respec(n)
        engine.carried = {w: [i] for i, w in enumerate(workers)}
        engine.schedule = run.placed.schedule
        engine.reform_needed = False
        self.set_state(state)  # the servers too, placed over the workers now
        self._restore_point(engine, state)
        if lr_change is not None:
            self._scale_lr(state, lr_change, n, batch)
        self._announce(f"re-formed on {n} worker(s)" + (f" (joined: {', '.join(joined)})"
                                                        if joined else "")
                       + f", global batch {batch}")
        self.started = time.time()
        return True

    def _scale_lr(self, state: dict[str, Any], factor: float, n: int, batch: int) -> None:
        from dasktf.elastic import ramp_lr_task

        run = self.run
        futures = [run.client.submit(ramp_lr_task, run.run_id, factor, WARMUP_STEPS,
                                     workers=[w], allow_other_workers=False, pure=False)
                   for w in run.ctx.workers]
        wait_for(run.ctx, futures, "rescaling the learning rate")
        old, new = run.client.gather(futures)[0]
        run._publish({"run": run.run_id, "kind": "lr_scaled", "workers": n,
                      "batch_size": batch, "learning_rate_from": old, "learning_rate": new,
                      "warmup_steps": WARMUP_STEPS, "wall_time": time.time()})
        self._announce(f"learning rate {old:.4g} -> {new:.4g} over {WARMUP_STEPS} "
                       f"warm-up steps (linear scaling, {n} workers, batch {batch})")
