"""The model's checks come before the cluster is touched (issue 36), and what they
accept is what Keras' ``fit`` accepts.

A refused model must be refused before anything reaches a worker: no worker
plugin, no data, no task, so no worker imports TensorFlow for it, and without a
client no embedded cluster is started. The clusters here are a user's own,
freshly made: their workers have never imported TensorFlow.
"""

from __future__ import annotations

import multiprocessing
import sys

import dask.array as da
import keras
import numpy as np
import pytest
from distributed import Client, LocalCluster

import dasktf
from dasktf.cluster.membership import described_workers
from tests.test_keras_examples import MyModel

RTOL = 1e-4


class OwnStep(keras.Sequential):
    def train_step(self, data):  # pragma: no cover - never run
        raise AssertionError


def own_step(input_shape=(8,), num_outputs=3):
    """A factory whose model overrides train_step: built on the client."""
    model = OwnStep([keras.Input(input_shape), keras.layers.Dense(num_outputs)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def _compiled_own_step() -> keras.Model:
    model = OwnStep([keras.Input((8,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def _plain(**compile_args) -> keras.Model:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", **compile_args)
    return model


def _data(dask: bool):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = rng.integers(0, 3, 96)
    return (da.from_array(x, chunks=32), da.from_array(y, chunks=32)) if dask else (x, y)


def _untouched(dask_scheduler) -> tuple[int, int, list[str]]:
    return (dask_scheduler.transition_counter, len(dask_scheduler.tasks),
            list(dask_scheduler.worker_plugins))


@pytest.fixture(scope="module")
def fresh_client():
    """A user's cluster: plain worker processes that have not imported TensorFlow."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      host="127.0.0.1", dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        yield client, client.run_on_scheduler(_untouched)  # distributed's own plugins


REFUSED = {
    "train_step": (_compiled_own_step, {}, "overrides train_step"),
    "no loss": (_plain, {}, "not compiled and no loss was given"),
    "unknown loss": (_plain, {"loss": "msee"}, "Unknown loss 'msee'"),
    "factory's train_step": (lambda: own_step, {}, "overrides train_step"),
}


@pytest.mark.parametrize("dask", [False, True], ids=["numpy", "dask"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_model_never_reaches_the_workers(fresh_client, case, dask):
    client, untouched = fresh_client
    if dask and case == "factory's train_step":
        # a factory's input_shape and num_outputs are the placed shards' stats
        pytest.skip("built after placement from Dask data (see check_before_placing)")
    make, options, message = REFUSED[case]
    x, y = _data(dask)
    with pytest.raises(ValueError, match=message):
        dasktf.fit(make(), x, y, client=client, verbose=0, **options)
    # no task, no data, no plugin of dasktf's; TensorFlow never imported there
    assert client.run_on_scheduler(_untouched) == untouched
    assert untouched[:2] == (0, 0)
    assert client.run(lambda: "tensorflow" in sys.modules) == {
        w: False for w in described_workers(client)}


def test_without_a_client_a_refused_model_starts_no_cluster():
    x, y = _data(False)
    before = set(multiprocessing.active_children())
    trainer = dasktf.Trainer(_compiled_own_step(), n_workers=1)
    try:
        with pytest.raises(ValueError, match="overrides train_step"):
            trainer.fit(x, y, verbose=0)
        assert set(multiprocessing.active_children()) == before
    finally:
        trainer.close()


# -- a model making its own loss: compiled without one, as Keras' fit takes it --------
def _own_loss_model(seed: int) -> keras.Model:
    """keras.io's Model.compute_loss example (tests/test_keras_examples.py), compiled
    as the guide compiles it: an optimizer, no loss."""
    keras.utils.set_random_seed(seed)
    inputs = keras.layers.Input(shape=(10,), name="my_input")
    model = MyModel(inputs, keras.layers.Dense(10)(inputs))
    model.compile(keras.optimizers.SGD())
    return model


def test_an_overridden_compute_loss_needs_no_compiled_loss(client):
    rng = np.random.default_rng(5)
    x, y = rng.random((160, 10)).astype("float32"), rng.random((160, 10)).astype("float32")
    reference = _own_loss_model(6)
    want = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    ours = _own_loss_model(6)
    history = dasktf.fit(ours, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                         client=client, n_workers=2)
    for g, w in zip(ours.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * max(1.0, np.abs(w).max()))
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=RTOL)


def test_without_a_loss_or_an_override_keras_and_dasktf_refuse(client):
    x, y = _data(False)
    with pytest.raises(ValueError, match="No loss to compute"):
        _plain().fit(x, y, verbose=0)
    with pytest.raises(ValueError, match="not compiled and no loss was given"):
        dasktf.fit(_plain(), x, y, client=client, n_workers=2, verbose=0)
