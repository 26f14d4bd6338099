"""Fault tolerance with real worker processes: SIGKILL mid-run, growth, checkpoints.

Each test that kills or adds workers starts its own loopback cluster (the shared one
must stay whole) and is bounded in time; the cluster is closed whatever happens.
"""

from __future__ import annotations

import logging
import time

import keras
import pytest

import dasktf
from dasktf.cluster.membership import alive_workers, described_workers
from dasktf.diagnostics.events import unpack
from dasktf.testing import KillWorkerAt, own_cluster
from tests.conftest import ScaleUpAfterFirstEpoch

ACCURACY = 0.85  # the digits target every training test in the suite uses


def assert_every_batch_applied_once(history, epochs, steps, successors):
    """Async: updates numbered 1..n without a gap, and every batch of every shard's
    ``epochs`` passes applied exactly once (``successors``: identity -> the shard a
    successor replica carried on)."""
    updates = history.updates
    assert list(updates["update"]) == list(range(1, len(updates) + 1))
    shard = updates["worker"].replace(successors)
    owed = updates[updates["shard_pass"] < epochs].assign(shard=shard)
    assert not owed.duplicated(["shard", "shard_pass", "step"]).any()
    assert (owed.groupby("shard").size() == steps * epochs).all()


def _options(**kw):
    options = dict(epochs=4, batch_size=64, optimizer="adam", learning_rate=0.01,
                   metrics=["accuracy"], seed=3, verbose=0)
    options.update(kw)
    return options


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"topology": "tree", "engine": "graph"},
                                    {"topology": "ring"}, {"num_ps": 3}],
                         ids=["tree", "ring", "ps3"])
def test_sync_run_survives_sigkill_of_one_of_three_workers(digits, layout):
    """Worker 2 of 3 is SIGKILLed halfway: the run finishes on 2, reaches the target,
    and every survivor applied every global step exactly once (ring: the survivors
    take the lost worker's chunk, then the run re-forms as a 2-worker ring; ps3:
    every worker is a server, so the run rewinds to the last epoch end, with new
    servers on the survivors, and the survivors' logs are cut back to it; killed in
    the last epoch, so no re-form builds fresh replicas whose logs would hide a
    twice-applied update)."""
    start = time.monotonic()
    failed_ops = _SchedulerOpErrors()
    with own_cluster(3) as (_cluster, client), failed_ops:
        workers = alive_workers(client)
        steps = -(-len(digits.x_train) // 64)
        epoch = 3 if "num_ps" in layout else 2
        killer = KillWorkerAt(client, workers[2], step=epoch * steps + steps // 2)
        history = dasktf.fit(
            "mnist-mlp", digits.x_train, digits.y_train, client=client, n_workers=3,
            validation_data=(digits.x_test, digits.y_test), callbacks=[killer],
            **layout, **_options(),
        )
        assert killer.killed_at is not None
        (recovery,) = history.recoveries
        assert recovery["lost"] == [workers[2]] and recovery["steps_lost"] == 0
        assert recovery["resume_s"] < 5
        if "num_ps" in layout:  # back to the end of epoch 3, the updates since redone
            assert recovery["rewound_to_update"] == 3 * steps - 1
            assert 0 < recovery["steps_recomputed"] <= steps
        total = 4 * steps
        assert sorted(history.applied_updates) == [0, 1]
        for log in history.applied_updates.values():
            assert log == list(range(total))  # each global step once, none skipped
        assert history.history["val_accuracy"][-1] > ACCURACY
        records = [r for e in client.get_events("dasktf-metrics") for r in unpack(e)]
        lost = [r for r in records if r["kind"] == "worker_lost" and r["run"] == history.run_id]
        assert lost and lost[0]["worker_address"] == workers[2]
        assert lost[0]["detect_s"] is not None and lost[0]["detect_s"] < 5
    # Recovery's cancel of the steps in flight must not trip the scheduler (its
    # stimulus_cancel asserts that a client wants every dependent it reaches).
    assert not failed_ops.messages, failed_ops.messages
    assert time.monotonic() - start < 240


class _SchedulerOpErrors(logging.Handler):
    """Collects the in-process scheduler's 'Exception while handling op' errors."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Exception while handling op" in record.getMessage():
            self.messages.append(f"{record.getMessage()}: {record.exc_info!r}")

    def __enter__(self) -> _SchedulerOpErrors:
        logging.getLogger("distributed.core").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("distributed.core").removeHandler(self)


@pytest.mark.slow
def test_async_run_survives_sigkill_of_one_of_three_workers(digits):
    """Async: worker 2 of 3 (not the holder's) is SIGKILLed halfway; its in-flight
    gradient is dropped, its shard goes to a survivor, the run finishes."""
    start = time.monotonic()
    epochs = 3
    with own_cluster(3) as (_cluster, client):
        workers = alive_workers(client)
        steps = -(-len(digits.x_train) // 64)
        killer = KillWorkerAt(client, workers[2], step=3 * steps * epochs // 2)
        history = dasktf.fit(
            "mnist-mlp", digits.x_train, digits.y_train, client=client, n_workers=3,
            mode="async", validation_data=(digits.x_test, digits.y_test),
            callbacks=[killer], **_options(epochs=epochs, learning_rate=0.005),
        )
        assert killer.killed_at is not None
        (recovery,) = history.recoveries
        assert recovery["lost"] == [workers[2]] and recovery["moved"][0][0] == 2
        # the successor, identity 3, carried on shard 2
        assert_every_batch_applied_once(history, epochs, steps, {3: 2})
        assert (history.updates["worker"] == 3).sum() > 0  # the successor did work
        assert history.history["val_accuracy"][-1] > ACCURACY
    assert time.monotonic() - start < 240


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [False, True], ids=["epoch-snapshot", "checkpoint"])
def test_async_run_survives_sigkill_of_the_parameter_holders_worker(digits, tmp_path, checkpoint):
    """Async: the holder's own worker (index 0) is SIGKILLed halfway. The holder is
    rebuilt on a survivor from the newest restore point (the last epoch end, or a
    checkpoint after every update), the updates after it are redone, and over the run
    every batch of every shard's passes is applied exactly once."""
    start = time.monotonic()
    epochs = 3
    with own_cluster(3) as (_cluster, client):
        workers = alive_workers(client)
        steps = -(-len(digits.x_train) // 64)
        # halfway: mid-way through the second epoch, after the first epoch end's cut
        # (a step counted over the run can land in a long first epoch, under load)
        killer = KillWorkerAt(client, workers[0], step=steps // 2, epoch=epochs // 2)
        # a checkpoint after every update: the kill usually lands in one (the
        # client's own holder calls must give up, not wait on the dead actor)
        extra = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1) if checkpoint else {}
        history = dasktf.fit(
            "mnist-mlp", digits.x_train, digits.y_train, client=client, n_workers=3,
            mode="async", validation_data=(digits.x_test, digits.y_test),
            # Adam at 0.01 as the sync tests: at 0.005 the checkpoint variant ends
            # near 0.87, and a loaded CI run fell under the bar (0.838)
            callbacks=[killer], **_options(epochs=epochs, learning_rate=0.01), **extra,
        )
        assert killer.killed_at is not None
        (recovery,) = history.recoveries
        assert recovery["lost"] == [workers[0]] and recovery["moved"][0][0] == 0
        holder = recovery["holder"]
        assert holder["worker"] in workers[1:]
        print("holder restore:", recovery)
        if not checkpoint:
            assert holder["source"] == "the last epoch end"
        else:  # at most one checkpoint interval (and the in-flight ones) redone
            assert str(tmp_path) in holder["source"] and holder["redone"] <= 1 + 3 * 2
        assert_every_batch_applied_once(history, epochs, steps, {3: 0})
        assert history.history["val_accuracy"][-1] > ACCURACY
        records = [r for e in client.get_events("dasktf-metrics") for r in unpack(e)
                   if r.get("run") == history.run_id]
        (event,) = [r for r in records if r["kind"] == "recovered"]
        assert event["holder"]["worker"] == holder["worker"]
    assert time.monotonic() - start < 240


@pytest.mark.slow
def test_a_rebuilt_holder_takes_the_learning_rate_set_after_its_cut(digits, tmp_path):
    """The learning rate changes at the second epoch's start, after the restore point
    (the first epoch's end); the holder's worker is then SIGKILLed. The rebuilt
    holder must go on with the new rate, not the cut's: the last checkpoint holds it."""
    from dasktf.run.checkpoint import load_latest

    def schedule(epoch, lr):
        return 0.005 if epoch == 0 else 0.0025

    epochs = 3
    with own_cluster(3) as (_cluster, client):
        workers = alive_workers(client)
        steps = -(-len(digits.x_train) // 64)
        # in the second epoch, after its learning rate is set (counted over the run,
        # the step could land in the first: under load it can run well past 3 * steps)
        killer = KillWorkerAt(client, workers[0], step=steps // 2, epoch=1)
        history = dasktf.fit(
            "mnist-mlp", digits.x_train, digits.y_train, client=client, n_workers=3,
            mode="async", checkpoint_dir=str(tmp_path),
            callbacks=[keras.callbacks.LearningRateScheduler(schedule), killer],
            **_options(epochs=epochs, learning_rate=0.005),
        )
        assert killer.killed_at is not None
        (recovery,) = history.recoveries
        assert recovery["lost"] == [workers[0]] and "holder" in recovery
        # rebuilt from the first epoch's end checkpoint: before the change
        assert str(tmp_path) in recovery["holder"]["source"]
        state, manifest, _ = load_latest(tmp_path)
        assert manifest["next_epoch"] == epochs
        scalars = [float(v) for v in state["optimizer"] if v.ndim == 0]
        assert any(abs(v - 0.0025) < 1e-9 for v in scalars), scalars


@pytest.mark.slow
@pytest.mark.parametrize("victim", [2, 0], ids=["worker", "holder"])
def test_quorum_run_survives_sigkill(digits, victim):
    """sync_quorum=2 of 3: losing a worker (or the holder's) mid-run leaves enough
    workers for the quorum; the run applies every one of its steps, each made of
    2 gradients read at that step's version."""
    start = time.monotonic()
    epochs = 3
    with own_cluster(3) as (_cluster, client):
        workers = alive_workers(client)
        steps = -(-len(digits.x_train) // 64)
        killer = KillWorkerAt(client, workers[victim], step=steps * epochs // 2)
        history = dasktf.fit(
            "mnist-mlp", digits.x_train, digits.y_train, client=client, n_workers=3,
            sync_quorum=2, validation_data=(digits.x_test, digits.y_test),
            callbacks=[killer], **_options(epochs=epochs),
        )
        assert killer.killed_at is not None
        (recovery,) = history.recoveries
        assert recovery["lost"] == [workers[victim]]
        assert ("holder" in recovery) == (victim == 0)
        updates = history.updates
        assert sorted(set(updates["update"])) == list(range(1, steps * epochs + 1))
        assert (updates.groupby("update").size() == 2).all()
        assert (updates["version_read"] == updates["update"] - 1).all()
        assert history.history["val_accuracy"][-1] > ACCURACY
    assert time.monotonic() - start < 240


@pytest.mark.slow
def test_sync_run_grows_from_two_to_three_workers_with_scaled_lr(digits):
    """A worker that joins mid-run gets a replica and a share of the data at the next
    epoch boundary; with scale_lr the global batch and learning rate follow."""
    start = time.monotonic()
    with own_cluster(2) as (cluster, client):
        before = alive_workers(client)
        history = dasktf.fit(
            "mnist-mlp", digits.x_train, digits.y_train, client=client,
            validation_data=(digits.x_test, digits.y_test), scale_lr=True,
            callbacks=[ScaleUpAfterFirstEpoch(cluster, client, 3)], **_options(epochs=3),
        )
        joined = [w for w in history.workers if w not in before]
        assert len(history.workers) == 3 and len(joined) == 1
        logs = history.applied_updates
        assert sorted(logs) == [0, 1, 2]
        total = len(logs[0])
        steps = -(-len(digits.x_train) // 64) + 2 * -(-len(digits.x_train) // 96)
        assert total == steps and all(log == list(range(total)) for log in logs.values())
        records = [r for e in client.get_events("dasktf-metrics") for r in unpack(e)
                   if r.get("run") == history.run_id]
        (scaled,) = [r for r in records if r["kind"] == "lr_scaled"]
        assert scaled["batch_size"] == 96 and scaled["learning_rate"] == pytest.approx(0.015)
        # the new worker computed gradients after it joined
        steps_of_new = [r for r in records if r["kind"] == "step" and r["worker"] == 2]
        assert steps_of_new and all(r["epoch"] >= 1 for r in steps_of_new)
        assert history.history["val_accuracy"][-1] > ACCURACY
    assert time.monotonic() - start < 240


@pytest.mark.slow
def test_losing_the_last_worker_names_the_last_checkpoint(digits, tmp_path):
    with own_cluster(1) as (_cluster, client):
        (worker,) = described_workers(client)
        steps = -(-len(digits.x_train) // 64)
        with pytest.raises(dasktf.AllWorkersLostError, match="ckpt-") as info:
            dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, client=client,
                       checkpoint_dir=str(tmp_path), checkpoint_every=5,
                       callbacks=[KillWorkerAt(client, worker, step=steps + 3)],
                       **_options(epochs=3))
        assert worker in str(info.value) and str(tmp_path) in str(info.value)


@pytest.mark.parametrize(
    "kw, message",
    [({"on_worker_loss": "ignore"}, "on_worker_loss must be one of"),
     ({"checkpoint_every": 5}, "checkpoint_every needs checkpoint_dir"),
     ({"resume": True}, "resume=True needs checkpoint_dir"),
     ({"checkpoint_every": 0, "checkpoint_dir": "x"}, "positive number of steps")],
)
def test_bad_fault_options_fail_before_training(client, small_digits, kw, message):
    with pytest.raises(ValueError, match=message):
        dasktf.fit("mnist-mlp", *small_digits, client=client, verbose=0, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["loader", "dask-array"])
def test_lost_shard_is_reloaded_from_its_source(digits, source):
    """The lost worker's shard comes back from where it was read (the per-shard
    loader, re-run on the adopting worker, or the Dask array's graph), not from a
    copy the client kept: every global step is still applied exactly once."""
    import dask.array as da

    start = time.monotonic()
    x_all, y_all = digits.x_train, digits.y_train
    with own_cluster(3) as (_cluster, client):
        workers = alive_workers(client)
        if source == "loader":
            def load(index, count):
                return x_all[index::count], y_all[index::count]

            data = (load, None)
        else:
            data = (da.from_array(x_all, chunks=(300, 8, 8)),
                    da.from_array(y_all, chunks=300))
        history = dasktf.fit("mnist-mlp", *data, client=client, n_workers=3,
                             validation_data=(digits.x_test, digits.y_test),
                             callbacks=[KillWorkerAt(client, workers[2], step=10)],
                             **_options(epochs=2))
        (recovery,) = history.recoveries
        assert recovery["steps_lost"] == 0 and recovery["moved"]
        logs = list(history.applied_updates.values())
        assert len(logs) == 2 and logs[0] == logs[1] == sorted(set(logs[0]))
        assert logs[0] == list(range(len(logs[0])))  # none skipped, none twice
        assert sum(info["shard_size"] for info in history.replica_info) == len(x_all)
    assert time.monotonic() - start < 180
