"""Bad input gets a clear error within seconds, and nothing hangs."""

from __future__ import annotations

import os
import re
import signal
import time

import keras
import numpy as np
import pytest

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.testing import own_cluster


def _fit(client, x, y, **kw):
    kw.setdefault("n_workers", 2)
    return dasktf.fit(kw.pop("model", "mnist-mlp"), x, y, client=client, verbose=0, **kw)


def test_length_mismatch(client, small_digits):
    x, y = small_digits
    with pytest.raises(ValueError, match=r"same number of rows .*got x: 250, y: 249"):
        _fit(client, x, y[:-1])


def test_labels_out_of_range(client, small_digits):
    x, y = small_digits
    model = dasktf.models.mnist_mlp((8, 8), 5)  # 5 outputs, labels go up to 9
    with pytest.raises(ValueError, match=r"Labels y must lie in \[0, 5\).*from 0 to 9"):
        _fit(client, x, y, model=model, loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"Labels y must lie in \[0, 10\).*from -1"):
        _fit(client, x, np.where(y == 3, -1, y))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_data(client, small_digits, bad):
    x, y = small_digits
    x = x.copy()
    x[17, 3, 3] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        _fit(client, x, y)


def test_nan_from_a_shard_loader(client, small_digits):
    x, y = small_digits

    def load(i, n):
        xs = x[i::n].copy()
        xs[0, 0, 0] = np.nan
        return xs, y[i::n]

    with pytest.raises(ValueError, match="NaN or infinite"):
        _fit(client, load, None)


def test_wrong_input_shape(client, small_digits):
    x, y = small_digits
    model = dasktf.models.mnist_mlp((28, 28), 10)
    with pytest.raises(ValueError, match=r"does not accept inputs of shape x: \(None, 8, 8\)"):
        _fit(client, x, y, model=model, loss="sparse_categorical_crossentropy")


def test_more_workers_than_samples(client, small_digits):
    x, y = small_digits
    with pytest.raises(ValueError, match=r"More workers \(3\) than training samples \(2\)"):
        _fit(client, x[:2], y[:2], n_workers=3)
    with pytest.raises(ValueError, match="smaller than the number of workers"):
        _fit(client, x, y, n_workers=3, batch_size=2)


def test_more_workers_than_the_cluster_has(client, small_digits):
    with pytest.raises(ValueError, match="Asked for 5 workers but the cluster has 3"):
        _fit(client, *small_digits, n_workers=5)


def test_unknown_names_and_options(client, small_digits):
    x, y = small_digits
    with pytest.raises(ValueError, match=r"Unknown model 'resnet9000'.*mnist-mlp"):
        _fit(client, x, y, model="resnet9000")
    with pytest.raises(ValueError, match="Cannot import model factory 'nowhere:model'"):
        _fit(client, x, y, model="nowhere:model")
    with pytest.raises(ValueError, match="Unknown optimizer 'adamm'"):
        _fit(client, x, y, optimizer="adamm")
    with pytest.raises(ValueError, match="Unknown loss 'hinge-ish'"):
        _fit(client, x, y, loss="hinge-ish")
    with pytest.raises(TypeError, match=r"'epoch' \(did you mean 'epochs'\?\).*allowed: model"):
        dasktf.fit("mnist-mlp", x, y, client=client, epoch=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        _fit(client, x, y, mode="asap")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        _fit(client, x, y, batch_size=0)
    with pytest.raises(ValueError, match="Unknown data set 'cifar'"):
        dasktf.load_dataset("cifar")


class _ExplodesOnWorkers(keras.layers.Layer):
    """A layer that builds on the client and fails where the workers build it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from distributed import get_worker

        try:
            get_worker()
        except ValueError:  # on the client: build normally
            return
        raise RuntimeError("layer exploded on the worker")

    def call(self, x):
        return x


def _fails_on_workers(input_shape, num_outputs):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             _ExplodesOnWorkers(), keras.layers.Dense(num_outputs)])


def test_a_model_failing_to_build_on_a_worker_shows_its_traceback(client, small_digits):
    start = time.monotonic()
    with pytest.raises(dasktf.ReplicaError) as info:
        _fit(client, *small_digits, model=_fails_on_workers,
             loss="sparse_categorical_crossentropy")
    message = str(info.value)
    assert "building the replicas failed" in message
    assert "layer exploded on the worker" in message  # (Keras' loader wraps it)
    assert "_ExplodesOnWorkers" in message
    assert time.monotonic() - start < 30


def test_unreachable_scheduler_fails_within_ten_seconds(small_digits):
    start = time.monotonic()
    with pytest.raises(dasktf.SchedulerUnreachableError, match=re.escape("tcp://127.0.0.1:1")):
        dasktf.fit("mnist-mlp", *small_digits, scheduler="tcp://127.0.0.1:1", verbose=0)
    assert time.monotonic() - start < 12


class _KillWorkerAtEpochEnd(keras.callbacks.Callback):
    """Deterministic fault injection: SIGKILL one worker process after epoch 1."""

    def __init__(self, client, address):
        super().__init__()
        self.pid = client.run(os.getpid, workers=[address])[address]

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            os.kill(self.pid, signal.SIGKILL)


@pytest.mark.slow
def test_dead_worker_is_reported_fast_and_by_name(small_digits):
    """A killed worker ends the run in seconds with its address, never a hang."""
    import dask

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with own_cluster(2, timeout=60) as (_, client):
            victim = alive_workers(client)[1]
            start = time.monotonic()
            with pytest.raises(dasktf.DasktfError, match=victim) as info:
                _fit(client, *small_digits, epochs=50, batch_size=16,
                     callbacks=[_KillWorkerAtEpochEnd(client, victim)],
                     on_worker_loss="raise")  # the default recovers (tests/test_fault.py)
            assert time.monotonic() - start < 60
            assert isinstance(info.value, (dasktf.WorkerLostError, dasktf.ReplicaError))
