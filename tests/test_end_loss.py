"""A worker lost at the run's end, after its training (issue 35): the run hands back
the trained model, equal to the uninterrupted run's, with the loss in
``history.recoveries``; never an error (unless ``on_worker_loss="raise"``, which
names the worker and the phase).

The moments: the last epoch's validation (inside the engine's epoch: a worker-side
hook kills the replica that reports the weights as it starts validating), and the
phases of :data:`dasktf.run.ending.END_PHASES` (the last epoch's end with its
checkpoint, reading the applied updates, reading the final state), where a phase
hook (:data:`dasktf.run.setup.phase_hooks`) kills the run's first worker, whose
replica those reads went to, and waits until the scheduler has dropped it. Each test
runs the uninterrupted run first, on the same cluster, then the one with the loss.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import dasktf
from dasktf.diagnostics.events import unpack
from dasktf.exceptions import WorkerLostError
from dasktf.run.ending import END_PHASES
from dasktf.run.setup import phase_hooks
from dasktf.testing import own_cluster
from tests.test_setup_loss import KillAt, hooked


def _fit(client, x, y, tmp_path, name, **kw):
    options = dict(client=client, n_workers=3, epochs=2, batch_size=48, seed=5,
                   shuffle=False, validation_data=(x[:60], y[:60]), verbose=0,
                   checkpoint_dir=str(tmp_path / name))
    options.update(kw)
    return dasktf.fit("mnist-mlp", x, y, **options)


def _same_model(got, reference):
    for a, b in zip(got.model.get_weights(), reference.model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _arm_kill_in_validation(client, victim, last):
    """``victim`` SIGKILLs itself as its replica starts validating after global
    update ``last`` (an epoch end's report), its nanny first told not to restart it."""
    def no_restart(dask_worker=None):
        from distributed.core import Status

        dask_worker.status = Status.closing_gracefully

    def arm():
        import os
        import signal

        from dasktf.runtime.replica import Replica

        evaluate = Replica.evaluate

        def dying(self, *args, **kwargs):
            if self.applied >= last:
                os.kill(os.getpid(), signal.SIGKILL)
            return evaluate(self, *args, **kwargs)

        Replica.evaluate = dying

    client.run(no_restart, nanny=True, workers=[victim])
    client.run(arm, workers=[victim])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["p2p", "graph"])
def test_a_worker_lost_in_the_last_validation(small_digits, tmp_path, engine):
    """The replica that reports the weights (the run's first) dies validating the
    last epoch, after the last update: the run ends the epoch on the survivors, the
    weights read from one of them (p2p: the group's rank 0 reported them alone)."""
    x, y = small_digits
    start = time.monotonic()
    with own_cluster(3) as (_cluster, client):
        reference = _fit(client, x, y, tmp_path, "reference", engine=engine)
        victim = reference.workers[0]
        total = len(reference.applied_updates[0])
        _arm_kill_in_validation(client, victim, total - 1)
        history = _fit(client, x, y, tmp_path, "faulted", engine=engine)
        (recovery,) = history.recoveries
        assert recovery["lost"] == [victim]
        assert victim not in history.workers and len(history.workers) == 2
        assert np.isfinite(history.history["loss"]).all()
    _same_model(history, reference)
    assert time.monotonic() - start < 240


@pytest.mark.slow
@pytest.mark.parametrize("phase", [END_PHASES[0], END_PHASES[2], END_PHASES[3]])
@pytest.mark.parametrize("engine", ["p2p", "graph"])
def test_a_worker_lost_in_a_phase_of_the_run_end(small_digits, tmp_path, phase, engine):
    """The run's first worker (whose replica the checkpoint and the final state are
    read from) SIGKILLed as the phase begins: the run reads on from the survivors."""
    x, y = small_digits
    start = time.monotonic()
    with own_cluster(3) as (_cluster, client):
        reference = _fit(client, x, y, tmp_path, "reference", engine=engine)
        killer = KillAt(client, phase, 0, restart=False)
        with hooked(killer):
            history = _fit(client, x, y, tmp_path, "faulted", engine=engine)
        # the end goes on from the survivors at once: a p2p span's end waited
        # dasktf.worker-loss-timeout (30 s) for a notice of the peer it had lost
        assert time.time() - killer.killed_at < 15, time.time() - killer.killed_at
        victim = killer.victims[0]
        (recovery,) = history.recoveries
        assert recovery["phase"] == phase and recovery["lost"] == [victim]
        assert recovery["steps_lost"] == 0 and sorted(recovery["workers"]) == sorted(
            history.workers)
        assert victim not in history.workers and len(history.workers) == 2
        total = len(reference.applied_updates[0])
        # every survivor applied every update once (the lost replica's log may be
        # gone with it)
        assert len(history.applied_updates) >= 2
        for log in history.applied_updates.values():
            assert log == list(range(total))
        assert (tmp_path / "faulted" / "model.keras").exists()
        records = [r for e in client.get_events("dasktf-metrics")
                   for r in unpack(e) if r.get("run") == history.run_id]
        assert any(r["kind"] == "worker_lost" and r["worker_address"] == victim
                   for r in records)
    _same_model(history, reference)
    assert time.monotonic() - start < 240


@pytest.mark.slow
def test_on_worker_loss_raise_names_the_worker_and_the_end_phase(small_digits, tmp_path):
    x, y = small_digits
    with own_cluster(3) as (_cluster, client):
        killer = KillAt(client, END_PHASES[3], 0, restart=False)
        with hooked(killer), pytest.raises(WorkerLostError) as info:
            _fit(client, x, y, tmp_path, "faulted", engine="p2p",
                 on_worker_loss="raise")
    assert info.value.workers == killer.victims
    assert info.value.phase == END_PHASES[3] and END_PHASES[3] in str(info.value)
    assert not phase_hooks
