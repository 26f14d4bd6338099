"""The liveness detector's rules (dasktf.cluster.liveness.SilenceTracker), no cluster,
and its work on a real one: a frozen worker removed, a long step never taken for one.

Faults across hosts (a vanished host, link down, a flap) are in tests/test_hosts.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import dask
import psutil
import pytest
from distributed.diagnostics.plugin import SchedulerPlugin

import dasktf
from dasktf.cluster.liveness import (
    MAX_PROBES,
    LivenessWatch,
    SilenceTracker,
    heartbeat_interval,
)
from dasktf.cluster.membership import alive_workers
from dasktf.testing import delay_worker, own_cluster, wait_until, worker_pids

TICK = 0.25


def _run(tracker, signs_at, until, n_workers=3, start=1000.0):
    """Tick from ``start`` to ``until`` seconds later; ``signs_at(t)`` gives the
    signs at relative time t. Returns {worker: time declared lost} and the probes."""
    lost, probes = {}, []
    t = 0.0
    while t <= until:
        verdict = tracker.tick(start + t, {w: start + s for w, s in signs_at(t).items()},
                               n_workers)
        probes += [(t, w) for w in verdict.probe]
        for w, _silent in verdict.lost:
            lost[w] = t
            tracker.forget(w)
        t = round(t + TICK, 6)
    return lost, probes


def test_a_worker_that_heartbeats_is_never_lost_and_a_silent_one_is_at_the_timeout():
    tracker = SilenceTracker(TICK)
    tracker.watch("run", ["a", "b"], 4.5, 1000.0)

    def signs(t):  # a heartbeats every 0.5 s; b's last heartbeat is at 1.0 s
        return {"a": t - t % 0.5, "b": min(1.0, t - t % 0.5)}

    lost, probes = _run(tracker, signs, 20.0)
    assert lost == {"b": pytest.approx(1.0 + 4.5, abs=TICK)}
    assert {w for _, w in probes} == {"b"}  # only the silent one is probed
    first_probe = min(t for t, _ in probes)
    assert first_probe == pytest.approx(1.0 + 1.0, abs=TICK)  # suspect after 1 s


def test_probes_in_flight_are_capped():
    tracker = SilenceTracker(TICK)
    tracker.watch("run", ["a"], 4.5, 1000.0)
    _, probes = _run(tracker, lambda t: {}, 3.0)
    assert len(probes) == MAX_PROBES  # none of them answered (nor ended)


def test_an_answer_after_a_flap_clears_the_silence():
    """Silent from 0.5 s to 3.6 s (a 3 s flap; the probe answers once the link is
    back): never declared lost."""
    tracker = SilenceTracker(TICK)
    tracker.watch("run", ["a"], 4.5, 1000.0)

    def signs(t):
        last = t - t % 0.5
        return {"a": 0.5 if 0.5 <= last < 3.6 else last}

    lost, _ = _run(tracker, signs, 10.0)
    assert lost == {}


def test_a_held_detector_does_not_count_its_own_stall_as_silence():
    """The scheduler's loop held for 10 s (the heartbeats queued unread): a tick that
    late adds two ticks of silence, not ten seconds."""
    tracker = SilenceTracker(TICK)
    tracker.watch("run", ["a"], 4.5, 1000.0)
    assert tracker.tick(1000.0, {"a": 1000.0}, 3).lost == []
    assert tracker.tick(1010.0, {"a": 1000.0}, 3).lost == []
    assert tracker.watched["a"].silent == pytest.approx(2 * TICK)


def test_the_timeout_is_at_least_three_heartbeats_of_a_large_cluster():
    tracker = SilenceTracker(TICK)
    tracker.watch("run", ["a"], 4.5, 1000.0)
    assert tracker.limits("a", 3) == (4.5, 1.0)
    assert heartbeat_interval(1000) == 6.0
    timeout, suspect = tracker.limits("a", 1000)
    assert timeout == 18.0 and suspect == 9.0


def test_runs_watching_one_worker_take_the_shorter_timeout_and_unwatch_cleanly():
    tracker = SilenceTracker(TICK)
    tracker.watch("r1", ["a", "b"], 10.0, 1000.0)
    tracker.watch("r2", ["a"], 5.0, 1000.0)
    assert tracker.limits("a", 3)[0] == 5.0 and tracker.limits("b", 3)[0] == 10.0
    assert tracker.runs_of("a") == ["r1", "r2"]
    tracker.unwatch("r2")
    assert tracker.limits("a", 3)[0] == 10.0
    tracker.unwatch("r1")
    assert tracker.watched == {}


# -- on a real cluster --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_worker_is_removed_within_the_timeout(digits):
    """SIGSTOP of one of three loopback workers in the last epoch (graph engine: its
    steps are long enough to land in): removed by the detector, recovered."""
    import keras

    class Freeze(keras.callbacks.Callback):
        def __init__(self, pid, step):
            super().__init__()
            self.pid, self.step, self.seen, self.at = pid, step, 0, None

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.at is None and self.seen == self.step:
                self.at = time.time()
                os.kill(self.pid, signal.SIGSTOP)

    with own_cluster(3) as (_cluster, client):
        workers = alive_workers(client)
        pid, _nanny = worker_pids(client, workers[2])
        steps = -(-len(digits.x_train) // 64)
        freeze = Freeze(pid, steps + 3)
        try:
            history = dasktf.fit("mnist-mlp", digits.x_train, digits.y_train,
                                 client=client, n_workers=3, epochs=2, batch_size=64,
                                 engine="graph", seed=1, verbose=0, callbacks=[freeze])
        finally:
            if freeze.at is not None:  # its nanny kills it; never leave it stopped
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        (recovery,) = history.recoveries
        assert recovery["lost"] == [workers[2]] and recovery["steps_lost"] == 0
        records = [r for e in client.get_events("dasktf-membership") for r in [e[1]]
                   if r.get("action") == "unresponsive"]
        assert [r["worker"] for r in records] == [workers[2]]
        assert 4.5 <= records[0]["silent"] < 6
        for log in history.applied_updates.values():
            assert log == list(range(2 * steps))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class ThawWhenRemoved(SchedulerPlugin):
    """On the scheduler: SIGCONT the process ``pid`` the moment the worker at
    ``address`` is removed (a pause that ends just then: the worst moment)."""

    def __init__(self, address: str, pid: int) -> None:
        self.address, self.pid = address, pid

    def remove_worker(self, scheduler, worker, **kwargs):
        if worker == self.address:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_removed_worker_thawed_at_once_never_runs_again_and_is_replaced():
    """Frozen, declared lost, and thawed as the scheduler removes it: its nanny
    SIGKILLed it first, so it never reads the scheduler's close, and the nanny
    starts a fresh worker. (Killed after the removal by the nanny's graceful stop,
    which gives a process 0.8 s, the thawed worker read that close and shut its
    nanny down with it: the cluster was a worker short for good.)"""
    with dask.config.set({"dasktf.liveness-timeout": "2s"}), \
            own_cluster(2) as (_cluster, client):
        workers = alive_workers(client)
        pid, _nanny = worker_pids(client, workers[1])
        client.register_plugin(ThawWhenRemoved(workers[1], pid), name="thaw-when-removed")
        watch = LivenessWatch(client, "thawed-at-once")
        watch.watch(workers)
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: workers[1] not in alive_workers(client), 30,
                       "the frozen worker's removal")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # never left stopped
        watch.close()
        wait_until(lambda: _gone(pid), 10, f"process {pid} to end")
        fresh = wait_until(lambda: set(alive_workers(client)) - set(workers), 60,
                           "the nanny's fresh worker")
        time.sleep(2)  # and the cluster stays whole
        assert set(alive_workers(client)) == {workers[0], *fresh}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_long_step_is_not_a_loss(client, small_digits):
    """A step of one worker takes 9 s (twice the liveness timeout, 4.5 s: a detector
    that heard the training thread rather than the event loop, which answers while
    the step computes, would declare it lost half-way through): nobody is."""
    x, y = small_digits
    worker = alive_workers(client)[1]
    start = time.monotonic()
    with delay_worker(client, worker, seconds=9):  # its steps after the first
        history = dasktf.fit("mnist-mlp", x[:96], y[:96], client=client, n_workers=3,
                             epochs=1, batch_size=48, verbose=0)
    assert time.monotonic() - start > 9  # the second step was long
    assert history.recoveries == []
    assert len(alive_workers(client)) == 3


@pytest.mark.parametrize("key,value", [("liveness-timeout", "abc"),
                                       ("client-lost-timeout", "soon"),
                                       ("client-lost-timeout", 0)])
def test_a_malformed_duration_fails_before_any_process_starts(key, value):
    import dask

    from dasktf.run.options import FaultOptions

    with dask.config.set({f"dasktf.{key}": value}), \
            pytest.raises(ValueError, match=f"dasktf.{key}"):
        FaultOptions()
