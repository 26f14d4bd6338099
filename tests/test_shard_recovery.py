"""Sharded optimizer state that survives (issue 38): ``redundancy=1`` keeps each
slice of the optimizer on a second worker, so a SIGKILLed worker costs no update
and the run ends with the weights *and* every optimizer variable of the
uninterrupted run; checkpoints hold the whole optimizer and a resume cuts it again.

On real worker processes, the kills placed by the workers' own hooks
(:func:`dasktf.testing.kill_worker_at_update`): as a step begins (mid-epoch, the
run then re-forms at the epoch's end), in the reduce-scatter, and in the
all-gather (every member has applied its slice, the new weights half sent).
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
from distributed import Client

import dasktf
from dasktf.exceptions import ShardingError
from dasktf.run.checkpoint import list_checkpoints
from dasktf.testing import kill_worker_at_update, own_cluster
from tests.conftest import relative_error

EPOCHS, BATCH, STEPS = 3, 64, 23  # 1,438 digits at 64: 23 steps an epoch


def _fit(client, digits, **kw):
    kw = {"shard_state": "optimizer", "epochs": EPOCHS, **kw}
    return dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, client=client,
                      n_workers=3, batch_size=BATCH, optimizer="adam",
                      learning_rate=0.01, seed=4, verbose=0, engine="p2p", **kw)


def _halving(epoch: int, lr: float) -> float:
    return 0.01 * 0.5 ** epoch


def _halved(client, digits, **kw):
    """:func:`_fit` with the learning rate a callback sets each epoch (the backup
    copies follow the owners' rate)."""
    return _fit(client, digits, callbacks=[keras.callbacks.LearningRateScheduler(_halving)],
                **kw)


def _state(model):
    return ([np.asarray(w) for w in model.get_weights()],
            [np.asarray(v.numpy()) for v in model.optimizer.variables])


def _assert_same_state(got, want, tol: float) -> None:
    (weights, slots), (weights0, slots0) = got, want
    flat = np.concatenate([np.ravel(w) for w in weights])
    flat0 = np.concatenate([np.ravel(w) for w in weights0])
    assert relative_error(flat, flat0) < tol, "weights"
    assert [v.shape for v in slots] == [v.shape for v in slots0]
    for k, (v, v0) in enumerate(zip(slots, slots0, strict=True)):
        v, v0 = np.asarray(v, np.float64), np.asarray(v0, np.float64)
        assert relative_error(v, v0) < tol or np.allclose(v, v0, atol=1e-8), (
            f"optimizer variable {k} of shape {v.shape}: {relative_error(v, v0)}")


@pytest.fixture(scope="module")
def uninterrupted(cluster, digits):
    with Client(cluster) as client:
        client.wait_for_workers(3, timeout=60)
        return _state(_halved(client, digits).model)


# (rank, update, where): updates of the last epoch (a re-form at an epoch's end
# places the data again over the survivors: other global batches than the
# uninterrupted run's; see test_a_reform_after_a_loss_equals_unsharded_p2p)
KILLS = {
    "mid-epoch": (2, 2 * STEPS + 9, "step"),
    # rank 0 of three: its first reduce-scatter part acknowledged, then killed (a
    # survivor may have all its parts, the other not: none applies the update)
    "during-the-reduce-scatter": (0, 2 * STEPS + 5, "allreduce"),
    # every member applied its slice (and its backup) of the update: the survivors
    # hold it at that update, the lost one's slice as its backup computed it (at
    # the rate the callback set)
    "during-the-all-gather": (1, 2 * STEPS + 7, "allgather"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(KILLS.values()), ids=list(KILLS))
@pytest.mark.timeout(300)
def test_a_sigkilled_worker_loses_no_optimizer_state(digits, uninterrupted, case):
    rank, update, where = case
    with own_cluster(3) as (_, client):
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        kill_worker_at_update(client, workers[rank], update, where)
        history = _halved(client, digits)
    (recovery,) = history.recoveries
    assert recovery["lost"] == [workers[rank]] and recovery["steps_lost"] == 0
    assert len(history.workers) == 2
    resumed = recovery["resumed_at_update"]
    assert resumed in (update, update + 1), recovery
    if where == "allgather":  # every member had applied it
        assert resumed == update + 1 and recovery["survivors_applied"] == [update] * 2
    for log in history.applied_updates.values():  # each update once, none skipped
        assert log == list(range(log[0], EPOCHS * STEPS)), log
    _assert_same_state(_state(history.model), uninterrupted, 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_reform_after_a_loss_equals_unsharded_p2p(digits):
    """A worker killed in epoch 2 of 3: the survivors re-cut the slices over two,
    and the run re-forms at the epoch's end (the state gathered whole, cut again
    over the new replicas); equal, weights and optimizer, to an unsharded p2p run
    killed at the same update (the same global batches after the re-form)."""
    states, recoveries = {}, {}
    for shard_state in ("optimizer", None):
        with own_cluster(3) as (_, client):
            workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
            kill_worker_at_update(client, workers[2], STEPS + 9, "step")
            history = _fit(client, digits, shard_state=shard_state)
        states[shard_state] = _state(history.model)
        (recoveries[shard_state],) = history.recoveries
    assert recoveries["optimizer"]["steps_lost"] == 0
    assert (recoveries["optimizer"]["resumed_at_update"]
            == recoveries[None]["resumed_at_update"] == STEPS + 9)
    _assert_same_state(states["optimizer"], states[None], 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_redundancy_0_stops_with_the_reason_and_names_the_checkpoint(digits, tmp_path):
    """One copy of each slice: a lost worker stops the run with a ShardingError that
    names the last checkpoint to resume from and ``redundancy=1``."""
    with own_cluster(3) as (_, client):
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        kill_worker_at_update(client, workers[2], STEPS + 5, "step")
        with pytest.raises(ShardingError, match="no other copy") as info:
            _fit(client, digits, epochs=2, redundancy=0, checkpoint_dir=str(tmp_path))
    assert str(list_checkpoints(tmp_path)[0]) in str(info.value)
    assert "redundancy=1" in str(info.value)


@pytest.mark.timeout(300)
def test_checkpoints_hold_the_whole_optimizer_and_resume_cuts_it_again(client, digits,
                                                                       tmp_path):
    full = _fit(client, digits)
    part = tmp_path / "part"
    _fit(client, digits, epochs=2, checkpoint_dir=str(part), checkpoint_every=7)
    manifests = [json.loads(p.read_text()) for p in list_checkpoints(part)]
    assert manifests[0]["next_epoch"] == 2 and manifests[1]["next_step"] == 21
    for newest in list_checkpoints(part)[:1]:  # resume mid-epoch 2, from step 21
        newest.unlink()
        newest.with_suffix(".npz").unlink()
    with np.load(list_checkpoints(part)[0].with_suffix(".npz")) as saved:
        sizes = sorted(int(saved[k].size) for k in saved.files)
    assert sizes.count(64 * 100) >= 3  # a kernel, and its two Adam slots, whole
    resumed = _fit(client, digits, checkpoint_dir=str(part), resume=True)
    assert len(resumed.history["loss"]) == 2
    _assert_same_state(_state(resumed.model), _state(full.model), 1e-6)


def _held_bytes(dask_worker=None) -> list[int]:
    """Per live replica on this worker: the bytes of the optimizer variables it
    holds (its slice's, and its backup's with redundancy=1; all of them unsharded)."""
    from dasktf.runtime.replica import registered_replicas

    def nbytes(variables):
        return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables))

    out = []
    for r in registered_replicas(dask_worker).values():
        shard = r.shard_optimizer
        backup = getattr(shard, "backup", None)
        out.append(nbytes(r.model.optimizer.variables)
                   + (0 if backup is None else nbytes(backup.optimizer.variables)))
    return out


class _ReadHeld(keras.callbacks.Callback):
    def __init__(self, client):
        super().__init__()
        self.client, self.seen = client, None

    def on_epoch_end(self, epoch, logs=None):
        self.seen = [b for held in self.client.run(_held_bytes).values() for b in held]


def test_each_replica_holds_two_thirds_with_redundancy_1(client, digits):
    held = {}
    for name, kw in (("whole", {"shard_state": None}), ("r0", {"redundancy": 0}),
                     ("r1", {})):
        reader = _ReadHeld(client)
        _fit(client, digits, epochs=1, callbacks=[reader], **kw)
        assert reader.seen is not None and len(reader.seen) == 3, reader.seen
        held[name] = reader.seen
    print(f"optimizer bytes a worker, 3 workers: {held}")
    slots = 2 * 7510 * 4  # Adam's two float32 slots of mnist-mlp on digits
    assert all(b >= slots for b in held["whole"]), held
    for b in held["r0"]:  # a third of the slots, plus the two scalars
        assert b <= slots / 3 + 64, held
    for b in held["r1"]:  # two thirds: its slice and its neighbour's
        assert slots * 2 / 3 - 16 <= b <= slots * 2 / 3 + 2 * 64, held
