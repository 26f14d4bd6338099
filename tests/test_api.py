"""The Python API with a client the test owns, and each kind of input."""

from __future__ import annotations

import dask.array as da
import keras
import numpy as np

import dasktf


def _fit(client, x, y=None, **kw):
    options = dict(
        client=client, n_workers=2, epochs=2, batch_size=32, optimizer="adam",
        learning_rate=0.02, metrics=["accuracy"], seed=1, verbose=0,
    )
    options.update(kw)
    return dasktf.fit("mnist-mlp", x, y, **options)


def test_numpy_input_trains_and_leaves_client_usable(client, digits):
    history = _fit(client, digits.x_train, digits.y_train,
                   validation_data=(digits.x_test, digits.y_test))
    assert set(history.history) >= {"loss", "accuracy", "val_loss", "val_accuracy",
                                     "examples_per_sec", "epoch_seconds"}
    assert history.history["loss"][1] < history.history["loss"][0]
    assert history.history["val_accuracy"][-1] > 0.85
    assert len(history.workers) == 2 and len(history.replica_info) == 2
    assert isinstance(history.model, keras.Model)
    # The distributed validation metrics equal a client-side evaluation of the model.
    local = history.model.evaluate(digits.x_test, digits.y_test, verbose=0, return_dict=True)
    np.testing.assert_allclose(local["accuracy"], history.history["val_accuracy"][-1], rtol=1e-6)
    # The client the test owns is still open and working.
    assert client.submit(sum, [1, 2]).result() == 3
    assert client.status == "running"


def test_dask_array_input_keeps_chunks_on_workers(client, digits):
    x = da.from_array(digits.x_train, chunks=(200, 8, 8)).persist()
    y = da.from_array(digits.y_train, chunks=200).persist()
    history = _fit(client, x, y, validation_data=(digits.x_test, digits.y_test))
    assert history.history["val_accuracy"][-1] > 0.85
    sizes = [info["shard_size"] for info in history.replica_info]
    assert sum(sizes) == len(digits.x_train)
    assert min(sizes) > 0.3 * len(digits.x_train)


def test_shard_loader_runs_on_each_worker(client, digits):
    from distributed import get_worker

    x_all, y_all = digits.x_train, digits.y_train
    seen = []

    def load(index, count):
        seen.append(index)  # on the worker: the client's list stays empty
        rows = slice(index, None, count)
        get_worker()  # raises ValueError off a worker
        return x_all[rows], y_all[rows]

    history = _fit(client, load, validation_data=(digits.x_test, digits.y_test))
    assert seen == []
    assert history.history["val_accuracy"][-1] > 0.85
    sizes = sorted(info["shard_size"] for info in history.replica_info)
    assert sizes == sorted([len(x_all[i::2]) for i in range(2)])


def test_trainer_fit_evaluate_and_callbacks(client, digits):
    stops = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0)
    seen_epochs = []
    trainer = dasktf.Trainer("mnist-mlp", client=client, n_workers=3, optimizer="adam",
                             learning_rate=0.02, metrics=["accuracy"], seed=2)
    history = trainer.fit(
        digits.x_train, digits.y_train, epochs=5, batch_size=64, verbose=0,
        callbacks=[stops, keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: seen_epochs.append((epoch, logs["loss"])))],
    )
    # EarlyStopping (min_delta 10 can never be met) stops after the second epoch.
    assert len(history.history["loss"]) == 2 and [e for e, _ in seen_epochs] == [0, 1]
    result = trainer.evaluate(digits.x_test, digits.y_test)
    assert result["accuracy"] > 0.8
    # A second fit continues from the trained weights.
    before = trainer.evaluate(digits.x_test, digits.y_test)["loss"]
    trainer.fit(digits.x_train, digits.y_train, epochs=1, batch_size=64, verbose=0)
    assert trainer.evaluate(digits.x_test, digits.y_test)["loss"] < before


def test_exp_regression_builtin(client):
    data = dasktf.load_dataset("exp")
    history = dasktf.fit("exp-mlp", data.x_train, data.y_train, client=client, n_workers=2,
                         epochs=10, batch_size=50, optimizer="adam", learning_rate=0.05,
                         verbose=0, seed=0)
    assert history.history["loss"][-1] < 0.1 * history.history["loss"][0]
