"""A worker lost at a run's end: the trained model comes back all the same.

After its last update a run still reaches its workers: the last epoch's end (a
learning rate carried, the checkpoint), the engine's finish, the log of applied
updates, the final training state for the client's optimizer. Each is a phase of
:data:`END_PHASES`, and a worker lost in one of them used to end a run whose
training was complete with a :class:`~dasktf.exceptions.WorkerLostError` (issue 35).
:class:`EndGuard` runs each phase so that it does not:

- ``on_worker_loss="recover"`` with a survivor: the lost workers leave the run and
  the phase is done again over the survivors. A sync run's replicas are identical
  after each update, so any survivor's state is the run's state; its applied
  updates are the survivors' logs (the lost replica's went with it); an engine whose
  state lives elsewhere (a parameter holder) reads it from there as before.
  Nothing is trained again: ``history.recoveries`` holds a ``recovered`` record
  naming the ``phase`` and the ``lost`` workers, published with one
  ``worker_lost`` record each, as a loss during training is.
- ``on_worker_loss="raise"``: :class:`WorkerLostError` naming the workers and the
  phase; no survivor: :class:`~dasktf.exceptions.AllWorkersLostError`.

A loss at the last step or the last epoch's validation happens inside the engine's
epoch and is its recovery (``phase`` ``"training"``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from dasktf import config
from dasktf.cluster.waits import lost_workers
from dasktf.exceptions import WorkerLostError
from dasktf.run.setup import enter_phase, go_on_without

if TYPE_CHECKING:
    from dasktf.cluster.waits import RunContext
    from dasktf.engines.base import RunHooks

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The phases of a run's end, in order (each also calls the set-up's test hooks,
#: :data:`dasktf.run.setup.phase_hooks`, as it begins).
END_PHASES = ("the last epoch's end", "finishing the engine",
              "reading the applied updates", "reading the final state")


class EndGuard:
    """The phases of one run's end and what a worker lost in one leads to (see the
    module). ``hooks``: the run's (``publish``, ``announce``, ``workers_changed``,
    ``on_worker_loss``)."""

    def __init__(self, ctx: RunContext, hooks: RunHooks) -> None:
        self.ctx = ctx
        self.hooks = hooks
        #: the ``recovered`` records, one per loss the run's end went on without
        self.losses: list[dict[str, Any]] = []

    def run(self, phase: str, read: Callable[[], T]) -> T:
        """``read()``, done again over the survivors as long as it meets a lost
        worker of the run; a worker found lost once it returned is recorded too."""
        enter_phase(phase, self.ctx.workers)
        while True:
            try:
                result = read()
            except WorkerLostError as exc:
                if exc.phase is not None:
                    raise
                self._recover(phase, exc.workers, exc)
                continue
            except OSError as exc:  # a CommClosedError of a call the loss cut short
                lost = lost_workers(self.ctx, wait=config.get_seconds("poll-interval") * 4)
                if not lost:
                    raise
                self._recover(phase, lost, exc)
                continue
            # gone without the phase's calls noticing
            lost = lost_workers(self.ctx, ask=True)
            if lost:
                self._recover(phase, lost, None)
            return result

    def _recover(self, phase: str, named: list[str], cause: BaseException | None) -> None:
        """Take the lost workers out of the run, or raise (see the module)."""
        ctx = self.ctx
        detected = time.time()
        lost = sorted((set(named) | set(lost_workers(ctx, ask=True))) & set(ctx.workers))
        if not lost:  # nothing of the run to go on without: not a loss this guard owns
            if cause is not None:
                raise cause
            return
        refusal = None if self.hooks.on_worker_loss != "raise" else (
            "on_worker_loss='raise' stops the run. Pass on_worker_loss='recover' to "
            "have the survivors hand back the model")
        records = go_on_without(
            ctx, lost, phase, detected, cause, refusal,
            f"Worker(s) {', '.join(lost)} left the cluster at the end of run "
            f"{ctx.run_id}, after its training (phase: {phase})", since=detected)
        survivors = records[-1]["workers"]
        self.hooks.workers_changed(survivors)
        for record in records:
            self.hooks.publish(record)
        self.losses.append(records[-1])
        self.hooks.announce(f"worker lost at the run's end ({phase}): {', '.join(lost)}; "
                            f"reading on from {len(survivors)} worker(s)")
