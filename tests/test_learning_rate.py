"""A learning rate set by a Keras callback on the client reaches the optimizers that
train: every replica (sync, the parameter-server slices too), the parameter holders
(async) and the TensorFlow children (collective engine)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import dasktf
from dasktf.run.checkpoint import load_latest

from .conftest import relative_error


class _EpochWeights(keras.callbacks.Callback):
    """The client's weights at every epoch end (dasktf sets them from the run)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[np.ndarray] = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(np.concatenate([w.ravel() for w in self.model.get_weights()]))


def _freeze_after_first_epoch(epoch, lr):
    return 0.1 if epoch == 0 else 0.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("options", [
    {}, {"placement": "ps", "num_ps": 2}, {"engine": "collective"},
    {"mode": "async"}, {"mode": "async", "num_ps": 2},
], ids=["sync", "sync-ps", "collective", "async", "async-ps2"])
def test_learning_rate_scheduler_reaches_the_optimizers(client, small_digits, options):
    """A learning rate of 0 from the second epoch on: the weights stop changing
    (plain SGD), which they would not if only the client's optimizer heard of it."""
    x, y = small_digits
    seen = _EpochWeights()
    history = dasktf.fit(
        "mnist-mlp", x, y, client=client, n_workers=2, epochs=3, batch_size=50, seed=1,
        optimizer=keras.optimizers.SGD(0.1), verbose=0,
        callbacks=[keras.callbacks.LearningRateScheduler(_freeze_after_first_epoch), seen],
        **options,
    )
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.0, 0.0])
    first, second, third = seen.weights
    # async: gradients of the second pass may be applied before the client sees the
    # first epoch end, so only the third epoch is certainly at learning rate 0
    np.testing.assert_array_equal(third, second)
    if options.get("mode") != "async":
        np.testing.assert_array_equal(second, first)


def _flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


class _Halve(keras.callbacks.Callback):
    """Logs the learning rate an epoch trained with, then halves it (the way
    ReduceLROnPlateau reduces it: at the epoch end, on the client's optimizer)."""

    def on_epoch_end(self, epoch, logs=None):
        lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        logs["learning_rate"] = lr
        self.model.optimizer.learning_rate = lr / 2


@pytest.mark.timeout(300)
def test_a_learning_rate_set_at_an_epoch_end_is_checkpointed_and_resumed(
    client, small_digits, tmp_path
):
    """The checkpoint after epoch 2 holds the halved learning rate, and a run resumed
    from it goes on from that value to the uninterrupted run's weights."""
    x, y = small_digits

    def fit(epochs, directory, resume=False):
        return dasktf.fit(
            "mnist-mlp", x, y, client=client, n_workers=2, epochs=epochs, batch_size=50,
            seed=2, optimizer=keras.optimizers.SGD(0.2), verbose=0,
            checkpoint_dir=str(directory), resume=resume, callbacks=[_Halve()],
        )

    full = fit(4, tmp_path / "full")
    assert full.history["learning_rate"] == pytest.approx([0.2, 0.1, 0.05, 0.025])
    fit(2, tmp_path / "part")
    state, manifest, _ = load_latest(tmp_path / "part")
    assert manifest["next_epoch"] == 2
    scalars = [float(v) for v in state["optimizer"] if np.ndim(v) == 0]
    assert any(abs(v - 0.05) < 1e-7 for v in scalars), scalars  # (and the iteration)
    resumed = fit(4, tmp_path / "part", resume=True)
    assert resumed.history["learning_rate"] == pytest.approx([0.05, 0.025])
    assert relative_error(_flat(resumed.model), _flat(full.model)) < 1e-6
