"""The collective step engine: sync training on ``tf.distribute`` ring all-reduce.

The task-graph engine (:mod:`dasktf.engines.graph.steps`) pays a scheduler hop or two per step,
which a model whose step takes a few milliseconds cannot amortize. This engine runs
the same Keras model under ``tf.distribute.MultiWorkerMirroredStrategy`` instead:
one TensorFlow child process per Dask worker (started through the bridge,
:mod:`dasktf.tf.bridge`), fed from the shard dasktf already placed on that worker,
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

Checkpoints are the graph engine's (:mod:`dasktf.run.checkpoint`, driven by
:class:`~dasktf.run.guard.RunGuard`), written at epoch ends from replica 0's weights
and optimizer variables, so either engine resumes the other's checkpoints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf import config
from dasktf.engines.base import Capabilities, Engine, RunHooks
from dasktf.engines.collective.child import (
    collective_epoch_task,
    collective_load_task,
    collective_start_task,
    stop_children,
)
from dasktf.exceptions import DasktfError, WorkerLostError
from dasktf.runtime.replica import EpochReport, ReplicaConfig

if TYPE_CHECKING:
    from distributed import Future

    from dasktf.cluster.waits import RunContext

logger = logging.getLogger(__name__)


# -- the engine (client side) ---------------------------------------------------
class CollectiveEngine(Engine):
    """Runs sync epochs on ``MultiWorkerMirroredStrategy`` children of the workers,
    from what the graph engine's replicas are built from. ``hooks.on_epoch_end``
    gets replica 0's state after every epoch (every replica holds the same);
    ``keep_state``: fetch replica 0's optimizer state every epoch for
    :meth:`state` (the run checkpoints it).
    """

    mode = "sync"
    engine = "collective"
    capabilities = Capabilities(checkpoints="epochs", resume=True)

    def __init__(self, ctx: RunContext, cfg: ReplicaConfig, shards: list[Future],
                 schedule: np.ndarray, weights: Any, val_shards: list[Any],
                 hooks: RunHooks, keep_state: bool = False) -> None:
        from dasktf.cluster.waits import wait_for
        from dasktf.tf.bridge import tf_config, warn_tf_servers

        shuffle = hooks.shuffle
        self.ctx = ctx
        self.on_epoch_end = hooks.on_epoch_end
        self.keep_state = keep_state
        self.last_checkpoint = hooks.last_checkpoint
        self.losses: list[dict[str, Any]] = []
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
        from dasktf.cluster.waits import check_alive, wait_for

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
                raise self._lost(exc, what) from exc
            raise
        reports: list[EpochReport] = client.gather(futures)
        if on_step is not None:
            # The steps ran in the children; Keras batch callbacks (the progress bar
            # among them) hear of them at the epoch's end, in order.
            for step in range(start, self.ctx.steps_per_epoch):
                on_step(step)
        first = reports[0]
        optimizer = first.optimizer_variables or []
        steps = self.ctx.steps_per_epoch
        self.update_base = (epoch + 1) * steps
        if self.keep_state:
            self._state = {"weights": first.weights or [], "optimizer": optimizer,
                           "applied": self.update_base - 1}
        if self.on_epoch_end is not None:
            self.on_epoch_end(first.weights or [], optimizer, epoch)
        return reports

    def _lost(self, exc: WorkerLostError, what: str) -> WorkerLostError:
        """The lost worker(s) and what to do: resume from the last checkpoint."""
        path = self.last_checkpoint()
        advice = (f"Nothing new was saved; the last checkpoint is {path}: restart or "
                  "replace the worker(s), then resume with resume=True (dasktf fit "
                  "--resume)." if path else
                  "No checkpoint was written; pass checkpoint_dir= (--checkpoint-dir) "
                  "to be able to resume a collective run.")
        return WorkerLostError(
            f"Worker(s) {exc.workers} left the cluster during {what}; the ring "
            "all-reduce cannot go on without them (TensorFlow cannot re-form it in a "
            f"running process), so every child was stopped. "
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

    def final_state(self) -> dict[str, Any] | None:
        """The last epoch's state, kept when the run checkpoints (``keep_state``)."""
        return self.state() if self.keep_state else None

    def set_learning_rate(self, lr: float) -> None:
        """The children take ``lr`` with the next epoch's message."""
        self.learning_rate = lr

    def load_state(self, state: dict[str, Any]) -> None:
        """Load a checkpoint (of either engine) into every child."""
        from dasktf.cluster.broadcast import broadcast
        from dasktf.cluster.waits import WatchedClient, wait_for

        client = self.ctx.client
        big = broadcast(WatchedClient(self.ctx, "loading the checkpoint"), state)
        futures = [client.submit(collective_load_task, self.ctx.run_id, big,
                                 key=f"dasktf-collective-load-{self.ctx.run_id}-{i}",
                                 workers=[w], allow_other_workers=False)
                   for i, w in enumerate(self.ctx.workers)]
        wait_for(self.ctx, futures, "loading the checkpoint into the collective children")
        self._state = state

    def close(self) -> None:
        """Kill every child of the run on the workers still alive; never raises."""
        from dasktf.cluster.membership import alive_workers

        try:
            alive = set(alive_workers(self.ctx.client))
            workers = [w for w in self.ctx.workers if w in alive]
            if workers:
                self.ctx.client.run(stop_children, self.ctx.run_id, workers=workers,
                                    on_error="ignore")
        except Exception:
            logger.debug("stopping the collective children of %s failed",
                         self.ctx.run_id, exc_info=True)


def dask_config(values: dict[str, Any]) -> Any:
    import dask

    return dask.config.set(values)
