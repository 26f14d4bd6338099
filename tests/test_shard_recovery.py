"""Sharded optimizer state that survives (issue 38): ``redundancy=1`` keeps each
slice of the optimizer on a second worker, so a SIGKILLed worker costs no update
and the run ends with the weights *and* every optimizer variable of the
uninterrupted run; checkpoints hold the whole optimizer and a resume cuts it again.

On real worker processes, the kills placed by the workers' own hooks
(:func:`dasktf.testing.kill_worker_at_update`): as a step begins, in the
reduce-scatter, in the ready round (one survivor applied the update, the other
completes it in the recovery), and in the all-gather (every member applied its
slice; with 4 workers one survivor lacks the lost one's new slice); and one
frozen (SIGSTOP) in a staged reduce-scatter, removed by the liveness detector. A loss in an
earlier epoch (the run then re-forms) and a worker joining equal unsharded p2p
doing the same; each worker holds 2/3 of the slots with 3 workers and a step moves
no more bytes than with ``redundancy=0``. With ``redundancy=0`` a lost worker sends
the run back to its newest checkpoint in the epoch (mid-epoch or at the epoch's
start), which then ends as the uninterrupted run does; with none, it stops with the
reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import dask
import keras
import numpy as np
import pytest
from distributed import Client

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.exceptions import ShardingError
from dasktf.run.checkpoint import list_checkpoints
from dasktf.testing import kill_worker_at_update, own_cluster, worker_pids
from tests.conftest import ScaleUpAfterFirstEpoch, relative_error

EPOCHS, BATCH, STEPS = 3, 64, 23  # 1,438 digits at 64: 23 steps an epoch


def _fit(client, digits, **kw):
    kw = {"shard_state": "optimizer", "epochs": EPOCHS, "n_workers": 3, **kw}
    return dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, client=client,
                      batch_size=BATCH, optimizer="adam",
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


#: ZeRO-2 with the backward pass staged: the 1,010 values of the softmax layer's
#: gradient sent first, then the first layer's (buckets of 256 values)
STAGED = {"dasktf.p2p.shard-bucket": 1024, "dasktf.p2p.shard-stage": 0}

# (rank, update, where): updates of the last epoch (a re-form at an epoch's end
# places the data again over the survivors: other global batches than the
# uninterrupted run's; see test_a_reform_after_a_loss_equals_unsharded_p2p)
KILLS = {
    "mid-epoch": (2, 2 * STEPS + 9, "step"),
    # rank 0 of three: its first reduce-scatter part acknowledged, then killed (a
    # survivor may have all its parts, the other not: none applies the update)
    "during-the-reduce-scatter": (0, 2 * STEPS + 5, "allreduce"),
    # rank 0 told rank 1 it could apply the update, then was killed: rank 1 applied
    # it, rank 2 (which never heard rank 0 was ready) completes it in the recovery
    "in-the-ready-round": (0, 2 * STEPS + 3, "ready"),
    # every member applied its slice (and its backup) of the update: the survivors
    # hold it at that update, the lost one's slice as its backup computed it (at
    # the rate the callback set)
    "during-the-all-gather": (1, 2 * STEPS + 7, "allgather"),
    # shard_state="gradients" (ZeRO-2): the same apply and all-gather after its
    # bucketed reduce-scatter (the same sums: equal to the ZeRO-1 run)
    "zero2-during-the-all-gather": (1, 2 * STEPS + 7, "allgather", "gradients"),
    # and its backward pass staged: rank 0 killed once its first part of the last
    # layer's stage was acknowledged
    "zero2-staged-during-the-reduce-scatter": (0, 2 * STEPS + 5, "allreduce", "gradients",
                                               STAGED),
    # the same moment, SIGSTOPped: its connections stay open and nothing answers;
    # the liveness detector removes it (dasktf.liveness-timeout), the survivors'
    # collective is called off, and they recover from the copies as from a kill
    "zero2-staged-frozen-during-the-reduce-scatter": (0, 2 * STEPS + 5, "allreduce",
                                                      "gradients", STAGED, signal.SIGSTOP),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(KILLS.values()), ids=list(KILLS))
@pytest.mark.timeout(300)
def test_a_lost_worker_loses_no_optimizer_state(digits, uninterrupted, case):
    rank, update, where, *rest = case
    shard_state = rest[0] if rest else "optimizer"
    settings = rest[1] if len(rest) > 1 else {}  # the client's: the group reads them
    sig = rest[2] if len(rest) > 2 else signal.SIGKILL
    with own_cluster(3) as (_, client), dask.config.set(settings):
        workers = alive_workers(client)
        pid, _ = worker_pids(client, workers[rank])
        kill_worker_at_update(client, workers[rank], update, where, sig)
        try:
            history = _halved(client, digits, shard_state=shard_state)
        finally:
            with contextlib.suppress(ProcessLookupError):  # (a frozen one: end it)
                os.kill(pid, signal.SIGKILL)
    (recovery,) = history.recoveries
    assert recovery["lost"] == [workers[rank]] and recovery["steps_lost"] == 0
    assert len(history.workers) == 2
    resumed = recovery["resumed_at_update"]
    assert resumed in (update, update + 1), recovery
    if where == "allgather":  # every member had applied it
        assert resumed == update + 1 and recovery["survivors_applied"] == [update] * 2
    if where == "ready":  # one survivor had applied it, the other completed it
        assert resumed == update + 1
        assert recovery["survivors_applied"] == [update, update - 1]
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
            workers = alive_workers(client)
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
def test_redundancy_0_without_a_checkpoint_stops_with_the_reason(digits):
    """One copy of each slice and no checkpoint to go back to: a lost worker stops
    the run with a ShardingError that says to keep checkpoints or use
    ``redundancy=1``."""
    with own_cluster(3) as (_, client):
        workers = alive_workers(client)
        kill_worker_at_update(client, workers[2], STEPS + 5, "step")
        with pytest.raises(ShardingError, match="no other copy") as info:
            _fit(client, digits, epochs=2, redundancy=0)
    assert "checkpoint_dir=" in str(info.value) and "redundancy=1" in str(info.value)


# (update killed at, checkpoint_every, the restore point): the checkpoint after step
# 7 of the last epoch (a segment a grid point), or the one at the previous epoch's
# end (the segment spans epochs: a new one starts at step 1 after the rewind)
REWINDS = {
    "to-a-checkpoint-mid-epoch": (2 * STEPS + 12, 7, 2 * STEPS + 6),
    "to-the-epoch-end-checkpoint": (2 * STEPS + 12, None, 2 * STEPS - 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(REWINDS.values()), ids=list(REWINDS))
@pytest.mark.timeout(300)
def test_redundancy_0_goes_back_to_the_last_checkpoint(digits, uninterrupted, tmp_path,
                                                       caplog, case):
    """One copy of each slice: a SIGKILLed worker sends the survivors back to the
    newest checkpoint of the epoch, whose later steps they train again over the
    same global batches; the run says so and ends with the weights and every
    optimizer variable of the uninterrupted run."""
    update, every, restore = case
    with own_cluster(3) as (_, client):
        workers = alive_workers(client)
        kill_worker_at_update(client, workers[2], update, "step")
        history = _halved(client, digits, redundancy=0, checkpoint_dir=str(tmp_path),
                          checkpoint_every=every)
    (recovery,) = history.recoveries
    assert recovery["lost"] == [workers[2]] and recovery["steps_lost"] == 0
    assert recovery["rewound_to_update"] == restore, recovery
    assert recovery["resumed_at_update"] == restore + 1
    # the survivors had applied the update before the one killed as it began
    assert recovery["steps_recomputed"] == update - 1 - restore > 0
    # the line names the checkpoint (named after the update it goes on from; the
    # newest three are kept: it may be gone since)
    checkpoint = tmp_path / f"ckpt-{restore + 1:09d}.json"
    assert any(f"rewound to the restore point {checkpoint} (update {restore})"
               in r.getMessage() for r in caplog.records), caplog.text
    for log in history.applied_updates.values():  # each update once in the end
        assert log == list(range(EPOCHS * STEPS)), log
    _assert_same_state(_state(history.model), uninterrupted, 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_neighbours_lost_go_back_to_the_last_checkpoint(digits, tmp_path):
    """``redundancy=1`` keeps each slice on two neighbouring ranks: both killed at
    once (ranks 1 and 2 of 4) leave slice 1 with no copy; the survivors go back to
    the epoch's checkpoint and end as the uninterrupted run (of 4) does."""
    update = 2 * STEPS + 12
    with own_cluster(4) as (_, client):
        uninterrupted = _state(_halved(client, digits, n_workers=4).model)
        workers = alive_workers(client)
        for rank in (1, 2):
            kill_worker_at_update(client, workers[rank], update, "step")
        history = _halved(client, digits, n_workers=4, checkpoint_dir=str(tmp_path))
    assert {w for r in history.recoveries for w in r["lost"]} == {workers[1], workers[2]}
    assert len(history.workers) == 2
    rewound = [r for r in history.recoveries if r.get("rewound_to_update") is not None]
    assert rewound and rewound[-1]["rewound_to_update"] == 2 * STEPS - 1, history.recoveries
    for log in history.applied_updates.values():
        assert log == list(range(EPOCHS * STEPS)), log
    _assert_same_state(_state(history.model), uninterrupted, 1e-5)


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


def _held(dask_worker=None) -> list[tuple[int, str, bool]]:
    """Per live replica on this worker: the bytes of the optimizer variables it
    holds (its slice's, and its backup's with redundancy=1; all of them unsharded),
    a digest of its weights, and whether its backup's optimizer has the slice's
    variables and no other (one the backup tracked by mistake would be checkpointed
    and counted)."""
    import hashlib

    from dasktf.runtime.replica import registered_replicas

    def nbytes(variables):
        return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables))

    out = []
    for r in registered_replicas(dask_worker).values():
        backup = getattr(r.shard_optimizer, "backup", None)
        held = nbytes(r.model.optimizer.variables) + (
            0 if backup is None else nbytes(backup.optimizer.variables))
        digest = hashlib.sha1(b"".join(np.asarray(w, np.float32).tobytes()
                                       for w in r.model.get_weights())).hexdigest()
        alike = backup is None or [v.path for v in backup.optimizer.variables] == [
            v.path for v in r.model.optimizer.variables]
        out.append((held, digest, alike))
    return out


class _ReadHeld(keras.callbacks.Callback):
    def __init__(self, client):
        super().__init__()
        self.client, self.seen = client, None

    def on_epoch_end(self, epoch, logs=None):
        self.seen = [h for held in self.client.run(_held).values() for h in held]


def test_each_replica_holds_two_thirds_with_redundancy_1_and_sends_no_more(client, digits):
    """Each worker holds its slice and its neighbour's (2/3 of the slots), the
    replicas' weights stay bit for bit the same (the backup computes the new values
    of its copy's slice itself, the all-gather does not send them), and a step
    moves no more bytes than with redundancy=0."""
    held, moved = {}, {}
    for name, kw in (("whole", {"shard_state": None}), ("r0", {"redundancy": 0}),
                     ("r1", {})):
        reader = _ReadHeld(client)
        history = _fit(client, digits, epochs=1, callbacks=[reader], **kw)
        assert reader.seen is not None and len(reader.seen) == 3, reader.seen
        held[name] = [b for b, _, _ in reader.seen]
        assert len({d for _, d, _ in reader.seen}) == 1, f"{name}: replicas differ"
        assert all(alike for _, _, alike in reader.seen), f"{name}: a backup's variables"
        moved[name] = history.history["bytes_per_step"][0]
    print(f"optimizer bytes a worker, 3 workers: {held}; bytes a step: {moved}")
    slots = 2 * 7510 * 4  # Adam's two float32 slots of mnist-mlp on digits
    assert all(b >= slots for b in held["whole"]), held
    for b in held["r0"]:  # a third of the slots, plus the two scalars
        assert b <= slots / 3 + 64, held
    for b in held["r1"]:  # two thirds: its slice and its neighbour's
        assert slots * 2 / 3 - 16 <= b <= slots * 2 / 3 + 2 * 64, held
    assert moved["r1"] <= moved["r0"] * 1.01, moved


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_four_workers_a_replica_torn_in_the_all_gather_is_made_whole(digits):
    """4 workers: each new slice goes to two ranks in the all-gather (its backup
    computed it). Rank 1 killed after its first message: rank 0 applied the update
    (its slice and its backup) but lacks rank 1's new slice; the recovery takes
    every slice's values at that update from a copy (rank 0's own from what it
    applied, rank 1's from its backup, rank 2) and the run ends as the
    uninterrupted one on 4 workers does."""
    update = 2 * STEPS + 7
    with own_cluster(4) as (_, client):
        want = _state(_halved(client, digits, n_workers=4).model)
        workers = alive_workers(client)
        kill_worker_at_update(client, workers[1], update, "allgather")
        history = _halved(client, digits, n_workers=4)
    (recovery,) = history.recoveries
    assert recovery["steps_lost"] == 0 and recovery["lost"] == [workers[1]]
    assert recovery["survivors_applied"] == [update] * 3
    assert recovery["resumed_at_update"] == update + 1
    for log in history.applied_updates.values():
        assert log == list(range(EPOCHS * STEPS)), log
    _assert_same_state(_state(history.model), want, 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_worker_joining_gets_its_slices_at_the_epoch_end(digits):
    """2 workers, a third joins after the first epoch: the state is gathered whole
    and cut again over three (each holding 2/3 of the slots); equal, weights and
    optimizer, to an unsharded p2p run that grows the same way."""
    states, held = {}, None
    for shard_state in ("optimizer", None):
        with own_cluster(2) as (cluster, client):
            reader = _ReadHeld(client)
            history = _fit(client, digits, shard_state=shard_state, n_workers=None,
                           callbacks=[ScaleUpAfterFirstEpoch(cluster, client, 3),
                                      reader])
            assert len(history.workers) == 3
            states[shard_state] = _state(history.model)
            if shard_state is not None:
                held = [b for b, _, _ in reader.seen]
    slots = 2 * 7510 * 4
    assert held is not None and len(held) == 3
    assert all(slots * 2 / 3 - 16 <= b <= slots * 2 / 3 + 2 * 64 for b in held), held
    _assert_same_state(states["optimizer"], states[None], 1e-5)
