"""Tell a stalled or vanished worker from a slow step, and remove it from the cluster.

A SIGKILLed worker's connections close at once, and the scheduler drops it within
milliseconds. A host that freezes (a paused VM, a stopped process) or drops off the
network (no RST ever comes) closes nothing: its TCP connections stay open, Dask
notices only after ``distributed.comm.timeouts.tcp`` (30 s) or
``distributed.scheduler.worker-ttl`` (5 minutes), and a peer waiting for its message
waits as long. A step that takes a minute looks the same to anyone who waits for
the step, so the signal must come from somewhere the step does not block: the
worker's event loop, which keeps answering while its training thread computes.

:class:`LivenessPlugin` (on the scheduler) watches the workers of the runs that
asked (:class:`LivenessWatch`, armed by a run as its set-up begins). While a run is
set up its workers import TensorFlow, whose extension modules hold a worker's event
loop for up to 1.5 s at a time with 8 workers on 2 cores (0.4 s with 3): the watch
then allows ``dasktf.liveness-setup-timeout`` (20 s), and ``dasktf.liveness-timeout``
from the first step on. A frozen worker is so noticed in the set-up too, where its
calls (the package's copy, the replicas' build) would otherwise wait for Dask's
``worker-ttl`` or the run's own timeouts, minutes:

- every worker's event loop heartbeats the scheduler (Dask's own, every 0.5 s up to
  10 workers: ``heartbeat_interval``); a heartbeat is a sign of life;
- a worker silent for ``suspect_after`` is *probed*: a fresh connection to its
  listener and an ``echo`` through its event loop, every ``dasktf.liveness-interval``.
  A fresh connection, because the heartbeat's own connection may hold a message
  the kernel is retransmitting with exponential backoff: after a 3 s flap its next
  try can come 6 s after the flap began, while a new connection answers as soon as
  the link is back;
- a worker with no sign of life for ``dasktf.liveness-timeout`` is *declared lost*:
  an ``unresponsive`` record on :data:`~dasktf.cluster.membership.TOPIC`, then
  ``Scheduler.remove_worker(close=True)``, its nanny (if it has one) first asked to
  SIGKILL it at once and start a fresh worker (Dask's worker-ttl asks the nanny too,
  but for a graceful stop, whose window lets a process thawed within it shut its
  nanny down). The run hears of it through its
  :class:`~dasktf.cluster.membership.MembershipWatcher` as of a SIGKILLed worker and
  recovers the same way. A process with a nanny never runs again; one without, if
  it wakes up, is told it was removed (its next heartbeat answers ``missing`` and
  the queued ``close`` arrives) and shuts down; what it sends meanwhile is refused
  by the run's identities (a p2p group id, a holder's list of lost workers).

Silence only counts while the detector itself runs: a scheduler whose event loop
was held (a large graph, a loaded machine) does not declare its workers lost for the
heartbeats it had not read yet. The timeout grows with Dask's heartbeat interval
(at least three of them: 0.5 s up to 10 workers, ``n / 200 + 1`` s past 200).

The same registration tells the scheduler which client owns the run: a client that
leaves the cluster (killed, its machine gone) and does not come back within
``dasktf.client-lost-timeout`` leaves orphans on the workers (replicas, shards, the
model's package), which nobody would ever release; the plugin then runs the
run's clean-up on its workers and stops watching them.

The rules are :class:`SilenceTracker`'s, which does no I/O (tested without a
cluster); the plugin feeds it the signs and carries out what it returns.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dasktf import config
from dasktf.cluster.membership import TOPIC
from dasktf.cluster.plugins import register_once

if TYPE_CHECKING:
    from distributed import Client, Scheduler

logger = logging.getLogger(__name__)

PLUGIN_NAME = "dasktf-liveness"
#: the scheduler handler a run arms and disarms its watch with
HANDLER = "dasktf_liveness"
#: probes in flight to one worker at most (each bounded by its own timeout)
MAX_PROBES = 4
#: seconds a lost worker's removal waits for its nanny to have killed it
KILL_FIRST = 0.25
#: seconds the nanny's kill may take in all
NANNY_TIMEOUT = 3.0


def heartbeat_interval(n_workers: int) -> float:
    """Dask's heartbeat interval for a cluster of ``n_workers`` (as
    ``distributed.scheduler.heartbeat_interval`` computes it)."""
    if n_workers <= 10:
        return 0.5
    if n_workers < 50:
        return 1.0
    if n_workers < 200:
        return 2.0
    return n_workers / 200 + 1


@dataclass
class Silence:
    """What the detector knows of one watched worker."""

    #: the newest sign of life (scheduler wall clock)
    heard: float
    #: seconds of detector time since then (only while the detector ran)
    silent: float = 0.0
    #: the probes in flight
    probes: int = 0


@dataclass
class Verdict:
    """One tick's decisions."""

    probe: list[str] = field(default_factory=list)
    #: ``(worker, seconds silent)``
    lost: list[tuple[str, float]] = field(default_factory=list)


class SilenceTracker:
    """The detector's rules, without I/O.

    Parameters
    ----------
    interval
        Seconds between ticks; a tick later than twice this counts only twice this
        towards anyone's silence (the detector was held, not the workers).
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.watched: dict[str, Silence] = {}
        #: per worker, the timeout of each run watching it
        self.timeouts: dict[str, dict[str, float]] = {}
        self._last_tick: float | None = None

    def watch(self, run: str, workers: list[str], timeout: float, now: float) -> None:
        """Watch ``workers`` for ``run`` (replacing its earlier list)."""
        self.unwatch(run)
        for w in workers:
            self.timeouts.setdefault(w, {})[run] = timeout
            self.watched.setdefault(w, Silence(heard=now))

    def unwatch(self, run: str) -> None:
        for w in list(self.timeouts):
            self.timeouts[w].pop(run, None)
            if not self.timeouts[w]:
                del self.timeouts[w]
                self.watched.pop(w, None)

    def forget(self, worker: str) -> None:
        """``worker`` left the cluster (by itself or declared lost)."""
        self.timeouts.pop(worker, None)
        self.watched.pop(worker, None)

    def pause(self) -> None:
        """The next tick starts the clock afresh."""
        self._last_tick = None

    def runs_of(self, worker: str) -> list[str]:
        return sorted(self.timeouts.get(worker, {}))

    def limits(self, worker: str, n_workers: int) -> tuple[float, float]:
        """(timeout, suspect after) for ``worker`` in a cluster of ``n_workers``."""
        heartbeat = heartbeat_interval(n_workers)
        timeout = max(min(self.timeouts[worker].values()), 3 * heartbeat)
        return timeout, min(timeout / 2, max(1.0, 2 * heartbeat))

    def tick(self, now: float, signs: dict[str, float], n_workers: int) -> Verdict:
        """Advance to ``now`` with each watched worker's newest sign of life."""
        step = 0.0 if self._last_tick is None else max(0.0, now - self._last_tick)
        step = min(step, 2 * self.interval)
        self._last_tick = now
        verdict = Verdict()
        for w, s in self.watched.items():
            heard = signs.get(w, s.heard)
            if heard > s.heard:
                s.heard = heard
                s.silent = min(max(0.0, now - heard), s.silent + step)
            else:
                s.silent += step
            timeout, suspect = self.limits(w, n_workers)
            if s.silent >= timeout:
                verdict.lost.append((w, s.silent))
            elif s.silent >= suspect and s.probes < MAX_PROBES:
                s.probes += 1
                verdict.probe.append(w)
        return verdict

    def probe_ended(self, worker: str) -> None:
        """One of ``worker``'s probes ended (answered or not)."""
        silence = self.watched.get(worker)
        if silence is not None:
            silence.probes = max(0, silence.probes - 1)


@dataclass
class Lease:
    """A run as the scheduler knows it: its client, its workers, and the clean-up
    (a pickled function and its args, run on the workers) if the client is lost
    for ``grace`` seconds."""

    client: str
    workers: list[str]
    cleanup: bytes | None
    cleanup_args: bytes | None
    grace: float


class LivenessPlugin(SchedulerPlugin):
    """The scheduler side: feeds :class:`SilenceTracker` Dask's heartbeats and its
    own probes, and removes the workers it declares lost (see the module)."""

    name = PLUGIN_NAME
    idempotent = True  # every run registers it; the first one stays

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.tracker: SilenceTracker | None = None
        #: per worker, the newest probe answer (scheduler wall clock)
        self.answered: dict[str, float] = {}
        #: probes and removals under way (held: the loop keeps only weak references)
        self._tasks: set[asyncio.Task[None]] = set()
        #: run id -> who runs it, on which workers, and what to do if it is lost
        self.leases: dict[str, Lease] = {}

    async def start(self, scheduler: Scheduler) -> None:
        from tornado.ioloop import PeriodicCallback

        self.scheduler = scheduler
        interval = config.get_seconds("liveness-interval")
        self.tracker = SilenceTracker(interval)
        scheduler.handlers[HANDLER] = self.handle
        callback = PeriodicCallback(self._tick, interval * 1000)
        scheduler.periodic_callbacks[PLUGIN_NAME] = callback
        callback.start()

    async def close(self) -> None:
        if self.scheduler is not None:
            callback = self.scheduler.periodic_callbacks.pop(PLUGIN_NAME, None)
            if callback is not None:
                callback.stop()

    def handle(self, run: str, workers: list[str] | None = None,
               timeout: float | None = None, client: str | None = None,
               cleanup: bytes | None = None, cleanup_args: bytes | None = None,
               grace: float | None = None) -> str:
        """Watch ``workers`` for ``run`` with ``timeout`` (seconds; none: only the
        lease), owned by ``client`` whose loss runs ``cleanup`` on them after
        ``grace``; or forget the run (``workers=None``)."""
        assert self.tracker is not None and self.scheduler is not None
        if workers is None:
            self.tracker.unwatch(run)
            self.leases.pop(run, None)
            return "OK"
        known = [w for w in workers if w in self.scheduler.workers]
        if timeout:
            self.tracker.watch(run, known, float(timeout), time.time())
        if client is not None:
            self.leases[run] = Lease(client, list(workers), cleanup, cleanup_args,
                                     float(grace) if grace is not None else 30.0)
        return "OK"

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        for run, lease in self.leases.items():
            if lease.client == client:
                self._start(self._orphaned(run, lease))

    async def _orphaned(self, run: str, lease: Lease) -> None:
        """``run``'s client left: unless it is back after the lease's grace, the
        run's clean-up runs on its workers, and they are no longer watched."""
        scheduler = self.scheduler
        assert scheduler is not None and self.tracker is not None
        await asyncio.sleep(lease.grace)
        if lease.client in scheduler.clients or self.leases.get(run) is not lease:
            return  # it reconnected, or the run ended meanwhile
        del self.leases[run]
        self.tracker.unwatch(run)
        if lease.cleanup is not None:
            alive = [w for w in lease.workers if w in scheduler.workers]
            logger.warning("dasktf: the client of run %s left; releasing its state on "
                           "%s", run, alive)
            msg = {"op": "run", "function": lease.cleanup, "args": lease.cleanup_args,
                   "wait": True}
            try:
                await scheduler.broadcast(msg=msg, workers=alive, on_error="ignore")
            except Exception:  # a worker gone meanwhile has nothing left
                logger.debug("dasktf: releasing run %s failed", run, exc_info=True)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        if self.tracker is not None:
            self.tracker.forget(worker)
        self.answered.pop(worker, None)

    def _tick(self) -> None:
        scheduler, tracker = self.scheduler, self.tracker
        assert scheduler is not None and tracker is not None
        if not tracker.watched:
            tracker.pause()  # nothing watched: no time passes for anyone
            return
        signs = {}
        for w in tracker.watched:
            ws = scheduler.workers.get(w)
            if ws is not None:
                signs[w] = max(ws.last_seen, self.answered.get(w, 0.0))
        verdict = tracker.tick(time.time(), signs, len(scheduler.workers))
        for w in verdict.probe:
            timeout, _ = tracker.limits(w, len(scheduler.workers))
            self._start(self._probe(w, min(2.0, timeout / 2)))
        for w, silent in verdict.lost:
            runs = tracker.runs_of(w)
            tracker.forget(w)
            self._start(self._declare_lost(w, silent, runs))

    def _start(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe(self, worker: str, timeout: float) -> None:
        """A fresh connection to ``worker``'s listener and an echo from its event
        loop, within ``timeout``; an answer is a sign of life."""
        from distributed.comm import connect
        from distributed.core import send_recv

        assert self.scheduler is not None
        try:
            async def echo() -> None:
                comm = await connect(worker, timeout=timeout,
                                     **self.scheduler.connection_args)  # type: ignore[union-attr]
                try:
                    await send_recv(comm, op="echo", data=b"")
                finally:
                    comm.abort()

            await asyncio.wait_for(echo(), timeout)
            self.answered[worker] = time.time()
        except Exception:  # noqa: BLE001 - no answer is what a probe measures
            pass
        finally:
            if self.tracker is not None:
                self.tracker.probe_ended(worker)

    async def _declare_lost(self, worker: str, silent: float, runs: list[str]) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        ws = scheduler.workers.get(worker)
        if ws is None:
            return  # it left by itself meanwhile
        nanny = ws.nanny
        logger.warning("dasktf: worker %s answered nothing for %.1fs (runs %s); "
                       "removing it from the cluster", worker, silent, runs)
        scheduler.log_event(TOPIC, {
            "action": "unresponsive", "worker": worker, "silent": silent,
            "runs": runs, "time": time.time()})
        killing = None
        if nanny:  # its nanny SIGKILLs it (and starts a fresh worker), first
            # Not Nanny.kill, which asks the process to stop and gives it 0.8 s
            # before the SIGKILL: a process thawed in that window reads the
            # scheduler's close (below) and shuts its nanny down with it, and the
            # cluster is a worker short for good. A SIGKILL ends a stopped process.
            killing = asyncio.ensure_future(asyncio.wait_for(scheduler.rpc(nanny).run(
                function=pickle.dumps(kill_at_once), args=pickle.dumps((worker,))),
                NANNY_TIMEOUT))
            # done in milliseconds where the nanny answers; a nanny that does not
            # (its host frozen or cut off) delays the removal by this much at most
            await asyncio.wait([killing], timeout=KILL_FIRST)
        await scheduler.remove_worker(
            worker, stimulus_id=f"dasktf-liveness-{time.time()}", close=True)
        if killing is not None:
            try:
                await killing
            except Exception:
                logger.debug("dasktf: the nanny of %s did not answer", worker,
                             exc_info=True)


def kill_at_once(address: str, dask_worker: Any = None) -> bool:
    """Run in the nanny of the worker at ``address`` (``dask_worker`` is the nanny):
    SIGKILL that worker process now, with no graceful stop first, and let the nanny
    start a fresh one. False where the nanny runs another worker by now (the one
    removed left by itself and was replaced: that one is not to be killed)."""
    import os
    import signal

    process = getattr(dask_worker, "process", None)
    pid = getattr(process, "pid", None)
    if getattr(dask_worker, "worker_address", None) != address or pid is None:
        return False
    os.kill(pid, signal.SIGKILL)
    return True


class LivenessWatch:
    """The client side of one run: arms the scheduler's detector for the run's
    workers (:meth:`watch`, again whenever they or the phase change) and disarms it
    (:meth:`close`). ``dasktf.liveness-timeout`` ``0``/``off`` turns the detector
    off. The lease: the scheduler runs ``on_client_lost`` (``(function, args)``, the
    run's clean-up: nobody else would release what it left there) on the run's
    workers if this client leaves the cluster for ``dasktf.client-lost-timeout``."""

    def __init__(self, client: Client, run: str) -> None:
        self.client = client
        self.run = run
        self.timeout, self.setup_timeout, grace = settings()
        self.armed = False
        #: what the scheduler was last told (a watch telling it nothing new is no message)
        self._told: tuple[Any, ...] | None = None
        self._lease: dict[str, Any] = {"client": client.id, "grace": grace}
        register_once(client, PLUGIN_NAME, lambda: client.register_plugin(
            LivenessPlugin(), name=PLUGIN_NAME))

    def watch(self, workers: list[str], *, setting_up: bool = False,
              on_client_lost: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
              ) -> None:
        """Watch ``workers`` (the run's, now) with the set-up's timeout while
        ``setting_up``, and lease ``on_client_lost``; a no-op when nothing changed."""
        lease = dict(self._lease)
        if on_client_lost is not None:
            function, args = on_client_lost
            lease.update(cleanup=pickle.dumps(function), cleanup_args=pickle.dumps(args))
        timeout = self.setup_timeout if setting_up else self.timeout
        told = (list(workers), timeout, lease)
        if told == self._told:
            return
        self._told = told
        self._call(workers=list(workers), timeout=timeout, **lease)
        self.armed = True

    def close(self) -> None:
        if self.armed:
            self.armed = False
            self._told = None
            self._call(workers=None)

    def _call(self, **kwargs: Any) -> None:
        client = self.client
        try:
            client.sync(getattr(client.scheduler, HANDLER), run=self.run, **kwargs)
        except Exception:  # a lost scheduler is the run's to report
            logger.warning("run %s: the scheduler's liveness detector did not answer",
                           self.run, exc_info=True)


def settings() -> tuple[float, float, float]:
    """(``dasktf.liveness-timeout``, ``dasktf.liveness-setup-timeout``,
    ``dasktf.client-lost-timeout``) in seconds; the first two 0 where off (the
    second is off where the first is), the second never under the first; a value that is no duration raises
    ``ValueError`` naming its key (a run checks them before its set-up)."""
    values = []
    for key in ("liveness-timeout", "liveness-setup-timeout", "client-lost-timeout"):
        value = config.get(key)
        off = key != "client-lost-timeout"
        if off and value in (None, False, 0, "0", "off", "none"):
            values.append(0.0)
            continue
        try:
            seconds = config.get_seconds(key)
        except (KeyError, TypeError, ValueError) as exc:  # dask's parse errors
            raise ValueError(f"dasktf.{key} must be a duration such as '4.5s'"
                             + (" (or 0/off)" if off else "")
                             + f"; got {value!r}.") from exc
        if not seconds > 0:
            raise ValueError(f"dasktf.{key} must be positive; got {value!r}.")
        values.append(seconds)
    timeout, setup, grace = values
    return timeout, (max(setup, timeout) if timeout and setup else 0.0), grace
