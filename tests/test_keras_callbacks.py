"""Keras' own callbacks driven by a dasktf run on real worker processes.

Each fit is the bundled digits (or ``exp``) data on 2 workers of the session's
cluster, a few seconds each; the callbacks run on the client with the merged logs.
"""

from __future__ import annotations

import csv
import math
import numbers
import os
import time

import keras
import numpy as np
import pytest

import dasktf
from dasktf.callbacks import check_callbacks

EPOCHS = 3


def _fit(client, digits, callbacks, *, epochs=EPOCHS, validation=True, **options):
    kwargs = dict(client=client, n_workers=2, epochs=epochs, batch_size=64,
                  optimizer="adam", learning_rate=0.01, metrics=["accuracy"], seed=3,
                  verbose=0, callbacks=callbacks)
    if validation:
        kwargs["validation_data"] = (digits.x_test, digits.y_test)
    return dasktf.fit("mnist-mlp", digits.x_train, digits.y_train, **{**kwargs, **options})


class FiniteLogs(keras.callbacks.Callback):
    """Records every value a batch or epoch hook got that is not a finite number
    (asserting inside the hook would surface wrapped in the run's error)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[tuple[str, int, str, object]] = []
        self.batches = 0
        self.batch_losses = 0
        self.epochs = 0

    def _check(self, hook: str, index: int, logs: dict | None) -> None:
        for key, value in (logs or {}).items():
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                self.bad.append((hook, index, key, value))

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        self.batch_losses += "loss" in (logs or {})
        self._check("on_train_batch_end", batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1
        self._check("on_epoch_end", epoch, logs)


def _scalars(log_dir: str) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` from the TensorBoard event files under ``log_dir``."""
    import tensorflow as tf
    from tensorboard.backend.event_processing.event_accumulator import (
        TENSORS,
        EventAccumulator,
    )

    events = EventAccumulator(log_dir, size_guidance={TENSORS: 0})
    events.Reload()
    return {
        tag: {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)}
        for tag in events.Tags()[TENSORS]
        if tag.startswith("epoch_")
    }


def test_tensorboard_writes_each_epochs_losses_and_callbacks_see_only_numbers(
        client, digits, tmp_path):
    log_dir = str(tmp_path / "tb")
    finite = FiniteLogs()
    history = _fit(client, digits, [keras.callbacks.TensorBoard(log_dir), finite])
    train = _scalars(os.path.join(log_dir, "train"))
    validation = _scalars(os.path.join(log_dir, "validation"))
    for scalars, key in ((train, "loss"), (train, "accuracy"),
                         (validation, "loss"), (validation, "accuracy")):
        name = key if scalars is train else f"val_{key}"
        steps = scalars[f"epoch_{key}"]
        assert sorted(steps) == list(range(EPOCHS))
        np.testing.assert_allclose([steps[e] for e in range(EPOCHS)],
                                   history.history[name], rtol=1e-6)
    # Every value the hooks saw was a finite number, and the loss did arrive.
    assert finite.bad == []
    assert finite.epochs == EPOCHS
    assert finite.batches == EPOCHS * history.params["steps"]
    assert finite.batch_losses > 0


def test_csv_logger_writes_a_row_per_epoch_with_the_historys_values(
        client, digits, tmp_path):
    path = tmp_path / "log.csv"
    history = _fit(client, digits, [keras.callbacks.CSVLogger(str(path))])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == list(range(EPOCHS))
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose([float(r[key]) for r in rows], history.history[key],
                                   rtol=1e-6)


def test_model_checkpoint_file_loads_and_predicts_as_the_trained_model(
        client, digits, tmp_path):
    path = str(tmp_path / "model.keras")
    history = _fit(client, digits, [keras.callbacks.ModelCheckpoint(path)], epochs=2,
                   validation=False)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(digits.x_test, verbose=0),
                                  history.model.predict(digits.x_test, verbose=0))


def _loaded(path):
    """``keras.models.load_model(path)`` and the warnings it gave."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.models.load_model(path)
    return model, [str(w.message) for w in caught]


@pytest.mark.parametrize("best_only, mode, saved_after", [
    (False, "auto", 2),  # saved at each epoch end: the file is the second's
    (True, "min", 2),  # the loss falls: each epoch is the best so far
    (True, "max", 1),  # only the first epoch is "best": the second saves nothing
])
def test_model_checkpoint_saves_the_trained_optimizer_as_keras_fit_does(
        client, digits, tmp_path, best_only, mode, saved_after):
    """The file ModelCheckpoint writes during ``dasktf.fit`` holds the trained
    optimizer (iterations = updates so far, Adam's moments): what Keras' own
    ``fit`` writes for the same run (``shuffle=False``: Keras' global batches),
    also when ``save_best_only`` skips an epoch (the run then reads no optimizer
    state for it)."""
    x, y = digits.x_train[:300].reshape(300, -1), digits.y_train[:300]
    keras.utils.set_random_seed(7)
    reference = keras.Sequential([keras.Input((64,)),
                                  keras.layers.Dense(24, activation="sigmoid"),
                                  keras.layers.Dense(10, activation="softmax")])
    ours = keras.models.clone_model(reference)
    ours.set_weights(reference.get_weights())
    for m in (reference, ours):
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy")
    paths = {who: str(tmp_path / f"{who}.keras") for who in ("keras", "dasktf")}

    def saver(who):
        return keras.callbacks.ModelCheckpoint(paths[who], monitor="loss", mode=mode,
                                               save_best_only=best_only)

    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                  callbacks=[saver("keras")])
    dasktf.fit(ours, x, y, client=client, n_workers=2, epochs=2, batch_size=64,
               shuffle=False, verbose=0, callbacks=[saver("dasktf")])
    want, _ = _loaded(paths["keras"])
    got, warned = _loaded(paths["dasktf"])
    assert not [m for m in warned if "Skipping variable loading" in m], warned
    assert int(want.optimizer.iterations.numpy()) == 5 * saved_after  # 5 steps an epoch
    assert int(got.optimizer.iterations.numpy()) == 5 * saved_after
    assert len(got.optimizer.variables) == len(want.optimizer.variables)
    for g, w in zip(got.optimizer.variables, want.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)
    for g, w in zip(got.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


class WeightSnapshots(keras.callbacks.Callback):
    """The client model's weights at each epoch end, before later callbacks act."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[list[np.ndarray]] = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([w.copy() for w in self.model.get_weights()])


def test_early_stopping_stops_and_restores_the_best_epochs_weights(client, digits):
    snapshots = WeightSnapshots()
    # The training loss falls every epoch; with mode="max" the first epoch is the
    # best, so the run must stop after the second and restore the first's weights.
    stop = keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1,
                                         restore_best_weights=True)
    history = _fit(client, digits, [snapshots, stop], epochs=5, validation=False)
    assert len(history.history["loss"]) == 2
    assert history.history["loss"][1] < history.history["loss"][0]
    restored = history.model.get_weights()
    for got, best in zip(restored, snapshots.weights[0], strict=True):
        np.testing.assert_array_equal(got, best)
    assert any(not np.array_equal(got, last)
               for got, last in zip(restored, snapshots.weights[1], strict=True))


class LossTrace(keras.callbacks.Callback):
    """The loss each batch hook saw (``None``: none had arrived yet)."""

    def __init__(self, pause: float = 0.0) -> None:
        super().__init__()
        self.losses: list[float | None] = []
        self.pause = pause

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append((logs or {}).get("loss"))
        time.sleep(self.pause)


def _diverging_fit(client, callbacks, epochs=EPOCHS):
    """SGD at 1e6 on the ``exp`` regression: the loss overflows to NaN within the first epoch."""
    data = dasktf.load_dataset("exp")
    return dasktf.fit("exp-mlp", data.x_train, data.y_train, client=client,
                      n_workers=2, epochs=epochs, batch_size=50, optimizer="sgd",
                      learning_rate=1e6, seed=0, verbose=0, callbacks=callbacks)


def test_terminate_on_nan_stops_the_run(client):
    # Without it, dasktf trains on with NaN weights to the last epoch.
    assert len(_diverging_fit(client, []).history["loss"]) == EPOCHS
    # A client that lingers 40 ms a batch: the epoch's 32 steps then outlast the
    # workers' 0.5 s record interval, so a loss reaches the client mid-epoch (on a
    # quiet machine the whole epoch otherwise fits in one interval).
    trace = LossTrace(pause=0.04)
    history = _diverging_fit(client, [trace, keras.callbacks.TerminateOnNaN()])
    assert any(loss is not None and not math.isfinite(loss) for loss in trace.losses)
    # The graph engine submits no step after the one whose loss was not finite (the
    # steps already in flight finish), and the epoch ends there.
    assert len(history.history["loss"]) < EPOCHS
    assert not math.isfinite(history.history["loss"][-1])
    steps = -(-len(dasktf.load_dataset("exp").x_train) // 50)
    assert len(trace.losses) < len(history.history["loss"]) * steps


def test_terminate_on_nan_raise_error_ends_the_fit_with_its_error(client):
    with pytest.raises(RuntimeError, match="NaN or Inf loss"):
        _diverging_fit(client, [keras.callbacks.TerminateOnNaN(raise_error=True)])


# -- what a run refuses ----------------------------------------------------------------


def test_check_callbacks_takes_what_keras_fit_takes():
    stop = keras.callbacks.EarlyStopping()
    logger = keras.callbacks.CSVLogger("unused.csv")
    assert check_callbacks(None) == []
    assert check_callbacks([]) == []
    assert check_callbacks(stop) == [stop]
    assert check_callbacks((stop, logger)) == [stop, logger]


def test_check_callbacks_refuses_backup_and_restore_naming_dasktfs_checkpoints(tmp_path):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(ValueError, match="BackupAndRestore") as info:
        check_callbacks([keras.callbacks.EarlyStopping(), backup])
    message = str(info.value)
    assert "checkpoint_dir=" in message and "resume=True" in message
    assert "workers" in message  # why: the state it would back up is not the client's


@pytest.mark.parametrize("bad, named", [
    ([keras.callbacks.EarlyStopping], "EarlyStopping"),  # the class, not an instance
    ([keras.callbacks.EarlyStopping(), print], "callbacks[1]"),
    ("early_stopping", "list"),
    (keras.callbacks.EarlyStopping, "list"),
])
def test_check_callbacks_refuses_what_is_not_a_callback(bad, named):
    with pytest.raises(TypeError, match=r"keras\.callbacks\.Callback") as info:
        check_callbacks(bad)
    assert named in str(info.value)


def test_fit_refuses_backup_and_restore_before_training(client, digits, tmp_path):
    """Passes once ``Trainer.fit`` calls ``check_callbacks`` (wired in dasktf.trainer,
    outside this change); skipped until then."""
    import dasktf.trainer

    if not hasattr(dasktf.trainer, "check_callbacks"):
        pytest.skip("dasktf.trainer does not call check_callbacks yet")
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(ValueError, match="checkpoint_dir="):
        _fit(client, digits, [backup], epochs=1)
