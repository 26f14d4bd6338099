"""The collective engine: trains, equals the graph engine, fails fast."""

from __future__ import annotations

import os
import shutil
import signal
import time

import dask
import numpy as np
import pytest

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.diagnostics.events import TOPIC, unpack
from dasktf.engines.collective.child import child_count
from dasktf.exceptions import WorkerLostError
from dasktf.run.checkpoint import list_checkpoints
from dasktf.run.engine import resolve_engine
from dasktf.testing import own_cluster


@pytest.mark.timeout(240)
def test_two_workers_reach_the_digits_target_and_publish_records(client, digits):
    hooked: list[tuple[int, int, int]] = []
    history = dasktf.fit(
        "mnist-mlp", digits.x_train, digits.y_train, client=client, n_workers=2,
        engine="collective", epochs=6, batch_size=32, optimizer="adam",
        learning_rate=3e-3, metrics=["accuracy"], seed=0, verbose=0,
        validation_data=(digits.x_test, digits.y_test),
        on_epoch_end=lambda w, opt, e: hooked.append((len(w), len(opt), e)),
    )
    assert history.engine == "collective"
    assert history.history["val_accuracy"][-1] >= 0.9, history.history
    final = history.model.evaluate(digits.x_test, digits.y_test, verbose=0, return_dict=True)
    assert final["accuracy"] == pytest.approx(history.history["val_accuracy"][-1], abs=1e-6)
    # The checkpoint hook saw replica 0's weights and optimizer state every epoch.
    assert [h[2] for h in hooked] == list(range(6))
    assert all(h[0] == len(history.model.get_weights()) and h[1] > 0 for h in hooked)
    # The workers forwarded their children's step records to the scheduler topic.
    seen = [r for e in client.get_events(TOPIC) for r in unpack(e)]
    steps = [r for r in seen if r.get("run") == history.run_id and r["kind"] == "step"]
    assert {r["worker"] for r in steps} == {0, 1}
    assert all(r["engine"] == "collective" for r in steps)


@pytest.mark.timeout(240)
def test_collective_equals_the_graph_engine_after_sgd_steps(client, digits):
    x, y = digits.x_train[:301], digits.y_train[:301]  # a short last batch
    weights = {}
    for engine in ("graph", "collective"):
        history = dasktf.fit(
            "mnist-mlp", x, y, client=client, n_workers=2, engine=engine, epochs=2,
            batch_size=64, optimizer="sgd", learning_rate=0.5, seed=3, verbose=0,
        )
        assert history.engine == engine
        weights[engine] = history.model.get_weights()
    for a, b in zip(weights["collective"], weights["graph"], strict=False):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    moved = max(float(np.abs(w).max()) for w in weights["graph"])
    assert moved > 0


def test_engine_choice():
    # The collective engine only ever runs when named (tests/test_security.py).
    assert resolve_engine("auto") == "p2p" and resolve_engine("graph") == "graph"
    assert resolve_engine("collective") == "collective"
    with pytest.raises(ValueError, match="has no async"):
        dasktf.Trainer("mnist-mlp", mode="async", engine="collective")
    with pytest.raises(ValueError, match="engine must be one of"):
        dasktf.Trainer("mnist-mlp", engine="ring")


def test_collective_engine_refuses_step_checkpoints(client, small_digits, tmp_path):
    x, y = small_digits
    with pytest.raises(ValueError, match="does not support checkpoint_every"):
        dasktf.fit("mnist-mlp", x, y, client=client, n_workers=2, engine="collective",
                   checkpoint_dir=str(tmp_path), checkpoint_every=3, verbose=0)


@pytest.mark.timeout(300)
def test_resume_continues_to_the_uninterrupted_result_across_engines(
    client, digits, tmp_path
):
    import keras

    x, y = digits.x_train[:301], digits.y_train[:301]

    def fit(engine, epochs, directory=None, resume=False, **kw):
        # Momentum: the optimizer state must travel with the weights to match.
        return dasktf.fit(
            "mnist-mlp", x, y, client=client, n_workers=2, engine=engine,
            epochs=epochs, batch_size=64, seed=3, verbose=0,
            optimizer=keras.optimizers.SGD(0.3, momentum=0.9),
            checkpoint_dir=directory and str(directory), resume=resume, **kw,
        )

    full = fit("collective", 4).model.get_weights()
    # Collective, 2 epochs + resume to 4 == uninterrupted 4.
    part = tmp_path / "collective"
    fit("collective", 2, part)
    newest = list_checkpoints(part)[0]
    assert newest.name == "ckpt-000000010.json"  # 5 steps an epoch, 2 epochs
    shutil.copytree(part, tmp_path / "copy")
    resumed = fit("collective", 4, part, resume=True)
    assert resumed.engine == "collective"
    assert len(resumed.history["loss"]) == 2  # epochs 3 and 4 only
    assert list_checkpoints(part)[0].name == "ckpt-000000020.json"
    for a, b in zip(resumed.model.get_weights(), full, strict=False):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The graph engine resumes the collective engine's checkpoint to the same result.
    graph = fit("graph", 4, tmp_path / "copy", resume=True)
    assert graph.engine == "graph" and len(graph.history["loss"]) == 2
    for a, b in zip(graph.model.get_weights(), full, strict=False):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # And the collective engine resumes a graph-engine checkpoint taken mid-epoch:
    # the newest three are after updates 5, 8 and 10; without the last, 8 (epoch 2,
    # step 3).
    mid = tmp_path / "graph"
    fit("graph", 2, mid, checkpoint_every=3)
    kept = list_checkpoints(mid)
    assert [p.name for p in kept] == [f"ckpt-{n:09d}.json" for n in (10, 8, 5)]
    kept[0].unlink()
    resumed = fit("collective", 4, mid, resume=True)
    assert len(resumed.history["loss"]) == 3  # the rest of epoch 2, then 3 and 4
    assert list_checkpoints(mid)[0].name == "ckpt-000000020.json"
    for a, b in zip(resumed.model.get_weights(), full, strict=False):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_worker_gives_a_clear_error_fast(digits, tmp_path):
    import keras

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with own_cluster(2, timeout=60) as (_, c):
            victim = alive_workers(c)[1]
            pid = c.run(os.getpid, workers=[victim])[victim]
            killed: list[float] = []

            class KillAtEpoch2(keras.callbacks.Callback):
                # Deterministic: the worker dies as epoch 2 starts, while its peer's
                # child is about to block in the first all-reduce of the epoch.
                def on_epoch_begin(self, epoch, logs=None):
                    if epoch == 1:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(time.monotonic())

            with pytest.raises(WorkerLostError, match="left the cluster") as info:
                dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, client=c,
                           engine="collective", epochs=3, batch_size=32, seed=0,
                           verbose=0, callbacks=[KillAtEpoch2()],
                           checkpoint_dir=str(tmp_path))
            elapsed = time.monotonic() - killed[0]
            print(f"kill to error: {elapsed:.2f}s")
            assert victim in str(info.value) and info.value.workers == [victim]
            assert elapsed < 30, elapsed
            # Nothing new was saved: the epoch-1 checkpoint is the newest, and the
            # error names it and says how to go on.
            newest = list_checkpoints(tmp_path)
            assert len(newest) == 1, newest
            assert str(newest[0]) in str(info.value)
            assert "resume=True" in str(info.value)
            # The survivor's child is gone too: nothing is left blocked in a ring.
            left = c.run(child_count)
            assert all(n == 0 for n in left.values()), left
            # As the error says: resume from that checkpoint (on the worker left).
            history = dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, client=c,
                                 n_workers=1, engine="collective", epochs=3,
                                 batch_size=32, seed=0, verbose=0, resume=True,
                                 checkpoint_dir=str(tmp_path))
            assert len(history.history["loss"]) == 2  # epochs 2 and 3
            assert list_checkpoints(tmp_path)[0] != newest[0]


@pytest.mark.timeout(240)
def test_collective_takes_structured_weighted_inputs_like_the_graph_engine(client):
    """Two inputs, two outputs with a loss each and per-row weights: the collective
    engine's all-reduced step equals the graph engine's."""
    import keras

    rng = np.random.default_rng(2)
    image, meta = rng.normal(size=(160, 12)), rng.normal(size=(160, 3))
    x = {"image": image.astype("float32"), "meta": meta.astype("float32")}
    y = {"label": (image[:, 0] > 0).astype("int64"),
         "score": image[:, :1].astype("float32")}

    def model() -> keras.Model:
        keras.utils.set_random_seed(5)
        i, m = keras.Input((12,), name="image"), keras.Input((3,), name="meta")
        h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([i, m]))
        net = keras.Model({"image": i, "meta": m},
                          {"label": keras.layers.Dense(2, activation="softmax", name="label")(h),
                           "score": keras.layers.Dense(1, name="score")(h)})
        net.compile(optimizer=keras.optimizers.SGD(0.2), loss_weights={"label": 1, "score": 0.5},
                    loss={"label": "sparse_categorical_crossentropy", "score": "mse"})
        return net

    weights = {}
    for engine in ("graph", "collective"):
        history = dasktf.fit(model(), x, y, sample_weight=np.linspace(0.2, 2, 160),
                             client=client, n_workers=2, engine=engine, epochs=2,
                             batch_size=40, shuffle=False, verbose=0)
        weights[engine] = history.model.get_weights()
    for a, b in zip(weights["collective"], weights["graph"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
