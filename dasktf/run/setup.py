"""A worker lost while a run is being set up: recovered, or named with its phase.

Preemption does not wait for the first step. A run's set-up goes through
:data:`PHASES` (:meth:`dasktf.run.run.Run.set_up`), and every call in it that reaches
workers is bounded by the run's membership (:func:`~dasktf.cluster.waits.wait_for`,
:func:`~dasktf.cluster.waits.call_watched`), so a worker that dies in any of them
is a :class:`~dasktf.exceptions.WorkerLostError` within ``dasktf.poll-interval`` of
the scheduler's notice, never a raw ``CommClosedError`` or a wait on a dead peer.
:class:`SetupGuard` turns it into one of two outcomes:

- ``on_worker_loss="recover"`` with a survivor: the set-up is done again on the
  survivors from the placing of the data on, as an epoch-boundary re-form does
  (every shard, the lost one's included, re-placed over them; the replicas and the
  engine built again). Nothing had been trained, so the run is the run it would
  have been on the survivors alone; ``history.recoveries`` holds a ``recovered``
  record with the ``phase``, the ``lost`` workers and the survivors (``workers``).
- otherwise (``on_worker_loss="raise"``, no survivor, a ``sync_quorum`` larger than
  the survivors, an async resume, whose checkpoint needs its own worker count):
  :class:`~dasktf.exceptions.WorkerLostError` naming the workers and the phase.

A loss at the first step is the engine's recovery (docs/faults.md; the collective
engine cannot re-form a ring in a running process and raises); the run labels it ``"the first step"`` until the
client has seen a step (the collective engine's steps reach it at each epoch end:
there, that is the first epoch).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from dasktf import compat, config
from dasktf.cluster.deadline import poll_until
from dasktf.cluster.membership import alive_workers
from dasktf.cluster.plugins import register_once
from dasktf.cluster.waits import call_watched, lost_workers
from dasktf.diagnostics.events import recovered_record, worker_lost_records
from dasktf.exceptions import AllWorkersLostError, DasktfError, WorkerLostError
from dasktf.run.engine import setup_refusal

if TYPE_CHECKING:
    from dasktf.cluster.waits import RunContext
    from dasktf.run.inputs import RunInputs

logger = logging.getLogger(__name__)

#: The set-up's phases, in order; a run's training begins with ``"the first step"``.
PHASES = ("connecting", "registering plugins", "placing data", "building replicas",
          "starting the engine", "the first step")

#: For tests (not public API): each ``hook(phase, workers)`` is called as a phase of
#: :data:`PHASES` begins, with the run's workers; a test kills one there.
phase_hooks: list[Callable[[str, list[str]], None]] = []


def enter_phase(phase: str, workers: list[str]) -> None:
    """Call the test hooks: ``phase`` begins, on ``workers``."""
    for hook in list(phase_hooks):
        hook(phase, list(workers))


def _symptom(exc: BaseException) -> bool:
    """Whether ``exc`` is what a call meets when a peer dies (so the scheduler's
    notice of a removal is worth waiting a moment for)."""
    return isinstance(exc, (OSError, TimeoutError, DasktfError)) or type(exc).__name__ in (
        "KilledWorker", "FutureCancelledError", "CancelledError")


class SetupGuard:
    """The phases of one run's set-up and what a worker lost in one of them leads to
    (see the module)."""

    def __init__(self, ctx: RunContext, inputs: RunInputs,
                 announce: Callable[[str], None]) -> None:
        #: the run's workers and id now (a set-up done again changes both)
        self.ctx = ctx
        self.inputs = inputs
        self.policy = inputs.fault.on_worker_loss
        self.announce = announce
        #: the ``recovered`` records, one per loss the set-up went on without
        self.losses: list[dict[str, Any]] = []
        #: ``worker_lost`` and ``recovered`` records, published once the run is
        #: announced to the metrics store
        self.records: list[dict[str, Any]] = []
        self._detected: float | None = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run one phase: the test hooks first; a worker of the run lost in it (the
        reason its calls failed, or found at its end) is a :class:`WorkerLostError`
        whose ``phase`` is ``name``."""
        enter_phase(name, self.ctx.workers)
        try:
            yield
        except WorkerLostError as exc:
            exc.phase = exc.phase or name
            raise
        except (Exception, asyncio.CancelledError) as exc:
            poll = config.get_seconds("poll-interval")
            lost = lost_workers(self.ctx, wait=poll * 4 if _symptom(exc) else 0.0)
            if not lost:
                raise
            raise WorkerLostError(
                f"Worker(s) {lost} left the cluster during {name} "
                f"({type(exc).__name__}: {exc}).", lost, phase=name) from exc
        # gone without any call of the phase noticing
        lost = lost_workers(self.ctx, ask=True)
        if lost:
            raise WorkerLostError(f"Worker(s) {lost} left the cluster during {name}.",
                                  lost, phase=name)

    def recover(self, loss: WorkerLostError) -> list[str]:
        """The workers to set the run up again on, after ``loss``; raises where the
        run cannot go on (see the module)."""
        ctx = self.ctx
        detected = time.time()
        self._detected = self._detected or detected
        phase = loss.phase or "the set-up"
        lost = sorted(set(loss.workers) | set(lost_workers(ctx, ask=True)))
        survivors = [w for w in ctx.workers if w not in lost]
        why = ("on_worker_loss='raise' stops the run. Restart the worker(s), or "
               "pass on_worker_loss='recover' to go on with the others"
               if self.policy == "raise" else
               setup_refusal(self.inputs.options, self.inputs.fault, len(survivors)))
        records = go_on_without(
            ctx, lost, phase, detected, loss, why,
            f"Worker(s) {', '.join(lost)} left the cluster while run {ctx.run_id} "
            f"was being set up (phase: {phase}), before its first step",
            " Start workers and train again.", since=None, reformed=True)
        self.records.extend(records)
        self.losses.append(records[-1])
        self.announce(f"worker lost while setting up ({phase}): {', '.join(lost)}; "
                       f"setting the run up again on {len(survivors)} worker(s)")
        return survivors

    def done(self) -> None:
        """The set-up finished: each recovery's ``resume_s`` (its notice to now)."""
        now = time.time()
        for record in self.records:  # of the run that set up, under its last id
            record["run"] = self.ctx.run_id
        for record in self.losses:
            if record["resume_s"] is None:
                record["resume_s"] = now - record["detected_at"]
        if self.losses:
            self.announce(f"set up on {len(self.ctx.workers)} worker(s) "
                           f"{now - (self._detected or now):.2f}s after the loss")


def go_on_without(ctx: RunContext, lost: list[str], phase: str, detected: float,
                  cause: BaseException | None, refusal: str | None, where: str,
                  all_lost_hint: str = "", *, since: float | None, **fields: Any
                  ) -> list[dict[str, Any]]:
    """The ``worker_lost`` records and, last, the ``recovered`` one of a set-up or
    end going on without ``lost``; raises if no worker is left or ``refusal`` says
    why it cannot (``where``: the messages' start)."""
    survivors = [w for w in ctx.workers if w not in lost]
    if not survivors:
        raise AllWorkersLostError(
            f"{where}, and no worker of the run is left.{all_lost_hint}", lost,
            phase=phase) from cause
    if refusal is not None:
        raise WorkerLostError(f"{where}; {refusal}.", lost, phase=phase) from cause
    return [*worker_lost_records(ctx.run_id, lost, detected, phase=phase),
            recovered_record(ctx.run_id, survivors, lost, since, phase=phase,
                             steps_recomputed=0, detected_at=detected, **fields)]


def register_worker_plugin(ctx: RunContext, plugin: Any, what: str) -> None:
    """``client.register_plugin(plugin)``, bounded by the run's workers' liveness.

    The scheduler stores the plugin, then sends it to every worker of the cluster
    and fails the whole call (``CommClosedError``) if any of them dies meanwhile.
    A worker of the run: :class:`WorkerLostError` (:func:`call_watched`). A worker
    outside the run: the plugin is already stored for the others, so the call is
    made again once the scheduler has dropped that worker. Once per client and
    scheduler connection for a plugin of the same settings (its pickle)
    (:mod:`dasktf.cluster.plugins`): the scheduler keeps it for every worker.
    """
    name = getattr(plugin, "name", type(plugin).__name__)
    register_once(ctx.client, (name, pickle.dumps(plugin)),
                  lambda: _register_worker_plugin(ctx, plugin, name, what))


def _register_worker_plugin(ctx: RunContext, plugin: Any, name: str, what: str) -> None:
    client = ctx.client
    idempotent = bool(getattr(plugin, "idempotent", False))
    attempts = 3
    for attempt in range(attempts):
        before = set(alive_workers(client))
        try:
            call_watched(ctx, lambda: compat.register_worker_plugin(
                client, plugin, name, idempotent), what)
            return
        except OSError:
            if attempt + 1 == attempts or not _dropped(client, before):
                raise
            logger.info("a worker outside run %s left while %s; registering again",
                        ctx.run_id, what)


def _dropped(client: Any, before: set[str]) -> bool:
    """Whether the scheduler drops one of ``before`` within a few polls."""
    return poll_until(lambda: not before <= set(alive_workers(client)),
                      config.get_seconds("poll-interval") * 4, 0.05)
