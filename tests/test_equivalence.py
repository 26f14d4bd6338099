"""The central promise: N-worker sync training equals single-process Keras training.

With ``shuffle=False`` and array inputs, dasktf's global batch at step k is exactly
``x[k*B:(k+1)*B]``, split over the workers; each replica applies the batch-size-
weighted mean of the workers' gradients with its own optimizer. So after a few steps
the weights must match ``keras.Model.fit`` on the same data, batch size and seed to
float32 tolerance, for an optimizer with state (Adam) as well as plain SGD, and for
data that divides neither by the workers nor by the batch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import dasktf
from tests.conftest import relative_error


def _model(seed: int = 7) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8)),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="sigmoid"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def _optimizer(name: str) -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.5) if name == "sgd" else keras.optimizers.Adam(0.01)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_sync_matches_single_process(client, small_digits, optimizer, n_workers):
    x, y = small_digits  # 250 samples: not divisible by 2, 3 or the batch of 48
    batch_size, epochs = 48, 2  # 6 steps per epoch, the last one of 10 samples

    reference = _model()
    distributed = keras.models.clone_model(reference)
    distributed.set_weights(reference.get_weights())
    initial = [w.copy() for w in reference.get_weights()]

    reference.compile(optimizer=_optimizer(optimizer), loss="sparse_categorical_crossentropy")
    ref_history = reference.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    )

    history = dasktf.fit(
        distributed, x, y, client=client, n_workers=n_workers, epochs=epochs,
        batch_size=batch_size, optimizer=_optimizer(optimizer),
        loss="sparse_categorical_crossentropy", shuffle=False, seed=0, verbose=0,
        engine="graph",  # the p2p engine's: tests/test_p2p_engine.py
    )

    trained = history.model.get_weights()
    moved = max(relative_error(w, w0) for w, w0 in zip(trained, initial, strict=False))
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    for got, want in zip(trained, reference.get_weights(), strict=False):
        assert relative_error(got, want) < 1e-5
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)


def test_uneven_last_batch_gives_empty_shares(client, small_digits):
    """249 samples at batch 123 on 3 workers: the last step has 3 samples, one each;
    at batch 124 it has 1 sample and two workers contribute nothing."""
    x, y = small_digits
    x, y = x[:249], y[:249]
    reference = _model(3)
    distributed = keras.models.clone_model(reference)
    distributed.set_weights(reference.get_weights())
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=124, epochs=1, shuffle=False, verbose=0)
    history = dasktf.fit(
        distributed, x, y, client=client, n_workers=3, batch_size=124,
        optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
        shuffle=False, verbose=0, engine="graph",
    )
    for got, want in zip(history.model.get_weights(), reference.get_weights(), strict=False):
        assert relative_error(got, want) < 1e-5
