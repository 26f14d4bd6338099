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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dasktf.engines.base import Checkpoint, Engine, Saved, StateLostError
from dasktf.run import checkpoint as ckpt

if TYPE_CHECKING:
    import numpy as np

    from dasktf.cluster.waits import RunContext
    from dasktf.run.inputs import RunInputs

logger = logging.getLogger(__name__)

#: Steps of linear warm-up when ``scale_lr`` changes the learning rate.
WARMUP_STEPS = 5


@dataclass(frozen=True)
class GuardedRun:
    """What the guard needs of its run (:class:`dasktf.run.run.Run`), no more: the
    run's workers and the client's model are the run's to write (``reform``,
    ``load``, ``archive``); what the fit call asked for comes in ``RunInputs``."""

    ctx: RunContext
    spec_description: str
    #: the global batch now, and the placed data's ``steps x workers`` schedule
    batch_size: Callable[[], int]
    schedule: Callable[[], np.ndarray]
    publish: Callable[[dict[str, Any]], None]
    announce: Callable[[str], None]
    #: ``reform(workers, batch_size)``: the run rebuilt over ``workers``
    reform: Callable[[list[str], int], None]
    #: the client model's moving statistics as a state's weights hold them
    statistics: Callable[[list[np.ndarray]], list[np.ndarray] | None]
    #: a resumed state's weights and learning rate into the client's model
    load: Callable[[dict[str, Any]], None]
    #: the client's model as a ``.keras`` archive, holding a checkpoint's state first
    archive: Callable[[Checkpoint | None], bytes]


class RunGuard:
    """Fault tolerance for one run (see the module docstring)."""

    def __init__(self, run: GuardedRun, inputs: RunInputs) -> None:
        self.run = run
        self.inputs = inputs
        self.options = inputs.fault
        self.epochs = inputs.epochs
        self.n0 = len(run.ctx.workers)
        self.batch0 = run.batch_size()
        self.started = time.time()
        self.last_checkpoint: Path | None = None
        self._since_checkpoint = 0
        #: named when the scheduler is lost: by then a client that gave up
        #: reconnecting has closed, and no longer knows where it was connected
        self.scheduler_address = str(getattr(getattr(run.ctx.client, "scheduler", None),
                                             "address", None) or "the scheduler")

    def scheduler_lost(self, exc: BaseException) -> Exception | None:
        """A :class:`SchedulerUnreachableError` naming the last checkpoint when ``exc``
        means the client lost its scheduler; else ``None``."""
        from dasktf.exceptions import DasktfError, SchedulerUnreachableError

        client = self.run.ctx.client
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

    def last_checkpoint_path(self) -> str | None:
        """The newest checkpoint written, named when a run must stop."""
        return str(self.last_checkpoint) if self.last_checkpoint else None

    def lr_factor(self) -> float:
        """What ``scale_lr`` multiplies a learning rate set on the client by: the
        global batch now over the one the run started with."""
        return self.run.batch_size() / self.batch0 if self.options.scale_lr else 1.0

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
            self.run.announce(f"no checkpoint in {self.options.checkpoint_dir}; starting afresh")
            engine.keep_restore_point()
            return 0, 0
        state, manifest, path = found
        resumed = engine.resume(Saved(state, manifest, str(path), self.run.batch_size(),
                                      self.run.statistics(state["weights"])))
        self.last_checkpoint = path
        self.run.load(state)
        self.run.announce(resumed.announce)
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
            "batch_size": run.batch_size(), "workers": list(run.ctx.workers),
            "mode": engine.mode, "run": run.ctx.run_id, "model": run.spec_description,
            "wall_time": time.time(),
        }
        self.last_checkpoint = ckpt.save_checkpoint(self.options.checkpoint_dir, cut.state,
                                                    meta, model=run.archive(cut))
        cut.kept(str(self.last_checkpoint))
        logger.info("checkpoint %s", self.last_checkpoint)
        return self.last_checkpoint

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

    def finish(self) -> None:
        """The final checkpoint: the client's model as the run hands it back."""
        if self.options.checkpoint_dir is not None:
            path = Path(self.options.checkpoint_dir) / ckpt.FINAL_MODEL
            ckpt.write_file(path, self.run.archive(None))  # a kill mid-write: none or whole

    # -- elastic growth / rebalancing at an epoch boundary --------------------------
    def maybe_reform(self, engine: Engine) -> bool:
        """Re-form the run over the workers alive now if any joined or left;
        whether it did."""
        run = self.run
        watcher = run.ctx.watcher
        joined = watcher.added_since(self.started, run.ctx.workers) if watcher else []
        if not joined and not engine.reform_needed:
            # (before asking the scheduler to describe every worker: an epoch end
            # with nothing to re-form costs it nothing)
            return False
        from dasktf.cluster.membership import alive_workers

        alive = set(alive_workers(run.ctx.client))
        joined = [w for w in joined if w in alive]
        if not joined and not engine.reform_needed:
            return False
        workers = [w for w in run.ctx.workers if w in alive] + joined
        state = engine.state()
        n = len(workers)
        batch = run.batch_size()
        lr_change = None
        if self.options.scale_lr and n != len(run.schedule()[0]):
            # Linear scaling rule (Goyal et al., 2017): the per-worker batch stays,
            # the global batch and the learning rate follow the worker count.
            batch = max(n, round(self.batch0 * n / self.n0))
            lr_change = (batch / run.batch_size())
        run.reform(workers, batch)
        engine.reform(run.schedule())
        engine.load_state(state)  # the servers too, placed over the workers now
        engine.keep_restore_point(state)
        if lr_change is not None:
            self._scale_lr(engine, lr_change, n, batch)
        self.run.announce(f"re-formed on {n} worker(s)" + (f" (joined: {', '.join(joined)})"
                                                        if joined else "")
                       + f", global batch {batch}")
        self.started = time.time()
        return True

    def _scale_lr(self, engine: Engine, factor: float, n: int, batch: int) -> None:
        run = self.run
        old, new = engine.ramp_learning_rate(factor, WARMUP_STEPS)
        run.publish({"run": run.ctx.run_id, "kind": "lr_scaled", "workers": n,
                      "batch_size": batch, "learning_rate_from": old, "learning_rate": new,
                      "warmup_steps": WARMUP_STEPS, "wall_time": time.time()})
        self.run.announce(f"learning rate {old:.4g} -> {new:.4g} over {WARMUP_STEPS} "
                       f"warm-up steps (linear scaling, {n} workers, batch {batch})")
