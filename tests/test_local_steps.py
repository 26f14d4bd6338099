"""Rounds of local steps (``local_steps=H``, Local SGD / DiLoCo) on real workers.

Each equivalence test trains on the session's LocalCluster with ``shuffle=False``
and compares with a reference computed in this process: plain sync steps, Keras'
own ``fit`` (one worker), and N Keras replicas stepping one after the other and
averaged (N workers). Then: a resumed run equals the uninterrupted one, a SIGKILL
mid-round loses no update, async rounds report their staleness in rounds.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.run.checkpoint import list_checkpoints
from dasktf.testing import own_cluster

from .conftest import relative_error


def _data(n: int = 240, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = ((x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5)).astype("int64")
    return x, y


def _mlp(seed: int = 7) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(12, activation="tanh"),
        keras.layers.Dense(3, activation="softmax"),
    ])


def _fit(client, model, x, y, **kw):
    """dasktf.fit on a copy of ``model`` (fit trains the instance it is given)."""
    options = dict(client=client, n_workers=3, epochs=2, batch_size=48, shuffle=False,
                   loss="sparse_categorical_crossentropy", seed=1, verbose=0)
    options.update(kw)
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return dasktf.fit(copy, x, y, **options)


def _moved_and_close(got, want, initial, tol=2e-5):
    moved = max(relative_error(w, w0) for w, w0 in zip(want, initial, strict=True))
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    errors = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errors) < tol, errors


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_one_local_step_averaged_is_the_sync_step(client, optimizer):
    """``local_steps=1`` with ``"average"`` is today's sync step; rounds of one step
    averaged by an outer SGD(1.0) instance, which take the round machinery (each
    replica steps, sends its change, every replica applies the mean), reach the
    same weights for SGD."""
    x, y = _data()
    model = _mlp()
    opt = keras.optimizers.SGD(0.3) if optimizer == "sgd" else keras.optimizers.Adam(0.02)
    plain = _fit(client, model, x, y, optimizer=opt)
    named = _fit(client, model, x, y, optimizer=opt, local_steps=1, outer_optimizer="average")
    assert named.rounds == [] and "drift" not in named.history
    for a, b in zip(named.model.get_weights(), plain.model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    if optimizer == "sgd":
        rounds = _fit(client, model, x, y, optimizer=opt, local_steps=1,
                      outer_optimizer=keras.optimizers.SGD(1.0))
        assert len(rounds.rounds) == 2 * 5  # 5 steps an epoch, one round each
        _moved_and_close(rounds.model.get_weights(), plain.model.get_weights(),
                         model.get_weights())
        np.testing.assert_allclose(rounds.history["loss"], plain.history["loss"], rtol=2e-5)


def test_one_worker_in_rounds_is_keras_fit(client):
    """One worker, ``local_steps=3`` averaged: Keras' ``fit`` over the same batches
    (Adam: the inner optimizer's state carries across rounds)."""
    x, y = _data()
    model = _mlp()
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    initial = model.get_weights()
    twin = keras.models.clone_model(model)
    twin.set_weights(initial)
    twin.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy",
                 metrics=["accuracy"])
    want = twin.fit(x, y, batch_size=48, epochs=2, shuffle=False, verbose=0)
    got = dasktf.fit(model, x, y, client=client, n_workers=1, epochs=2, batch_size=48,
                     shuffle=False, local_steps=3, seed=1, verbose=0)
    _moved_and_close(got.model.get_weights(), twin.get_weights(), initial)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got.history[key], want.history[key], rtol=2e-5)
    assert got.history["rounds"] == [2.0, 2.0]  # 5 steps: rounds of 3 and 2
    assert got.history["drift"] == [0.0, 0.0]  # one worker cannot drift


def _averaged_replicas(model, x, y, workers, batch, local_steps, epochs, lr):
    """N Keras replicas, one after the other: each takes its share of every global
    batch for ``local_steps`` SGD steps from the round's start; the round's weights
    are the rows-weighted mean of theirs. Returns the weights and each round's drift."""
    replica = keras.models.clone_model(model)
    replica.compile(keras.optimizers.SGD(lr), "sparse_categorical_crossentropy")
    w = [np.asarray(v) for v in model.get_weights()]
    steps = -(-len(x) // batch)
    drifts = []
    for _ in range(epochs):
        for first in range(0, steps, local_steps):
            deltas, rows = [], []
            for i in range(workers):
                replica.set_weights(w)
                n = 0
                for s in range(first, min(first + local_steps, steps)):
                    lo, hi = s * batch, min((s + 1) * batch, len(x))
                    cut = np.array_split(np.arange(lo, hi), workers)[i]
                    replica.train_on_batch(x[cut], y[cut])
                    n += len(cut)
                deltas.append(np.concatenate([(a - b).ravel() for a, b in
                                              zip(w, replica.get_weights(), strict=True)]))
                rows.append(n)
            rows_ = np.asarray(rows, np.float64)[:, None]
            mean = (np.asarray(deltas, np.float64) * rows_).sum(0) / rows_.sum()
            spread = ((np.asarray(deltas, np.float64) ** 2).sum(1) * rows_[:, 0]).sum() / rows_.sum()
            drifts.append(np.sqrt(max(spread - mean @ mean, 0.0) / (mean @ mean)))
            flat = np.concatenate([v.ravel() for v in w]) - mean
            w = [p.reshape(v.shape).astype(v.dtype) for p, v in zip(
                np.split(flat, np.cumsum([v.size for v in w])[:-1]), w, strict=True)]
    return w, drifts


def test_three_workers_average_their_rounds_like_the_reference(client):
    """3 workers, SGD inner steps, ``local_steps=2`` averaged: the NumPy/Keras
    reference above, weights and per-round drift."""
    x, y = _data()
    model = _mlp()
    want, drifts = _averaged_replicas(model, x, y, 3, 48, 2, 2, 0.3)
    got = _fit(client, model, x, y, optimizer=keras.optimizers.SGD(0.3), local_steps=2)
    _moved_and_close(got.model.get_weights(), want, model.get_weights(), tol=1e-5)
    assert [r["update"] for r in got.rounds] == list(range(6))  # 3 rounds an epoch
    np.testing.assert_allclose([r["drift"] for r in got.rounds], drifts, rtol=1e-3)
    assert min(drifts) > 0.01  # the replicas did wander apart
    # the bytes: a round per 2 steps sends half of what sync steps send
    sync = _fit(client, model, x, y, optimizer=keras.optimizers.SGD(0.3))
    ratio = sync.history["bytes_per_example"][0] / got.history["bytes_per_example"][0]
    assert 1.5 < ratio < 2.5, ratio


@pytest.mark.parametrize("compression", [None, "topk:0.1"])
def test_a_resumed_run_in_rounds_equals_the_uninterrupted_one(client, tmp_path,
                                                              compression):
    """Adam inner steps and the Nesterov outer step both carry state, and with a
    sparse codec so does each worker's change not sent yet: a run stopped after a
    mid-epoch checkpoint and resumed reaches the uninterrupted weights."""
    x, y = _data(480)
    model = _mlp()
    kw = dict(optimizer=keras.optimizers.Adam(0.01), local_steps=2,
              outer_optimizer="nesterov", epochs=3, compression=compression)
    full = _fit(client, model, x, y, **kw)
    part = tmp_path / "part"
    _fit(client, model, x, y, checkpoint_dir=str(part), checkpoint_every=2,
         **{**kw, "epochs": 2})
    # keep only a mid-epoch checkpoint of epoch 2: the resume starts mid-epoch
    checkpoints = list_checkpoints(part)
    import json

    mid = [p for p in checkpoints if json.loads(p.read_text())["next_step"] > 0]
    assert mid, [json.loads(p.read_text()) for p in checkpoints]
    for p in checkpoints:
        if p not in mid[:1]:
            p.unlink()
    state_file = np.load(mid[0].with_suffix(".npz"))
    assert any(k.startswith("u") for k in state_file) and any(
        k.startswith("i2_") for k in state_file)  # outer state, worker 2's inner state
    resumed = _fit(client, model, x, y, checkpoint_dir=str(part), resume=True, **kw)
    _moved_and_close(resumed.model.get_weights(), full.model.get_weights(),
                     model.get_weights(), tol=1e-6)
    with pytest.raises(ValueError, match="same local_steps"):
        _fit(client, model, x, y, checkpoint_dir=str(part), resume=True,
             **{**kw, "local_steps": 3})


def test_async_rounds_count_staleness_in_rounds(client):
    """Async rounds: one update per worker round, staleness counted in rounds and
    gated by ``max_staleness`` as single updates are."""
    x, y = _data(480)
    history = _fit(client, _mlp(), x, y, mode="async", local_steps=4, max_staleness=2,
                   optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"])
    updates = history.updates
    # 10 steps an epoch per shard: rounds of 4, 4 and 2 steps, each one update
    assert len(updates) == 3 * 3 * 2
    assert sorted(updates.groupby(["worker", "shard_pass"]).size()) == [3] * 6
    assert (updates["staleness"] <= 2).all() and updates["staleness"].max() >= 1
    assert set(updates["batch_size"]) == {64, 32}  # 4 and 2 inner steps of 16 rows
    assert history.history["accuracy"][-1] > 0.5


@pytest.mark.parametrize("kw, message", [
    (dict(local_steps=0), "local_steps must be a positive integer"),
    (dict(local_steps=4, sync_quorum=2), "cannot combine with sync_quorum"),
    (dict(local_steps=4, engine="collective"), "task-graph engine"),
    (dict(local_steps=4, num_ps=2), "num_ps"),
    (dict(local_steps=4, outer_optimizer="momentum"), "outer_optimizer must be one of"),
    (dict(local_steps=4, outer_momentum=0.9), "without momentum"),
])
def test_bad_round_options_fail_before_training(kw, message):
    with pytest.raises(ValueError, match=message):
        dasktf.Trainer("mnist-mlp", n_workers=2, **kw)


@pytest.mark.slow
def test_sync_rounds_survive_sigkill_mid_round(digits):
    """Worker 2 of 3 is SIGKILLed while rounds are in flight: the survivors redo
    the unfinished round from its start, apply every round's update exactly once,
    and reach the target."""
    from dasktf.testing import KillWorkerAt

    with own_cluster(3) as (_cluster, client):
        workers = alive_workers(client)
        steps = -(-len(digits.x_train) // 64)
        rounds = -(-steps // 4)
        killer = KillWorkerAt(client, workers[2], step=rounds + rounds // 2)
        history = dasktf.fit(
            "mnist-mlp", digits.x_train, digits.y_train, client=client, n_workers=3,
            validation_data=(digits.x_test, digits.y_test), callbacks=[killer],
            epochs=3, batch_size=64, optimizer="adam", learning_rate=0.01,
            metrics=["accuracy"], seed=3, verbose=0, local_steps=4,
            # the graph engine's client sees each round as it ends, so the kill
            # lands mid-round (the p2p engine's: tests/test_p2p_engine.py)
            engine="graph",
        )
        assert killer.killed_at is not None
        (recovery,) = history.recoveries
        assert recovery["lost"] == [workers[2]] and recovery["steps_lost"] == 0
        for log in history.applied_updates.values():
            assert log == list(range(3 * rounds))  # each round's update once
        # the round in flight was redone from its start (weights, inner state)
        assert sum(r["redone"] for r in history.rounds) >= 1, history.rounds
        assert history.history["val_accuracy"][-1] > 0.85
