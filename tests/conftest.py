"""Shared fixtures: one real LocalCluster of worker processes for the session.

Importing TensorFlow costs seconds per process, so tests that only need *a* cluster
share this one (each run gets its own run id and replicas). Tests that kill workers
start their own cluster (:func:`dasktf.testing.own_cluster`) and are marked ``slow``
(``pytest -m "not slow"`` leaves them out); a test waiting for an event without a
hook polls with :func:`dasktf.testing.wait_until`, bounded and naming what it waits for.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dask
from distributed import Client

import dasktf

MNIST = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


@pytest.fixture(autouse=True)
def keras_seeds_of_their_own(request):
    """A test's own Keras models draw their default seeds from a generator of their
    own (seeded by ``keras.utils.set_random_seed``, as Python's is): the session
    cluster's event loop runs in this process and draws from Python's ``random``
    (``dask.sizeof``, the scheduler's ``gather``), which could give a reference
    model other initial weights than dasktf's for the same seed."""
    if request.node.get_closest_marker("keras_global_seeds"):
        yield
        return
    from dasktf import compat

    with compat.keras_seeds_apart():
        yield


@pytest.fixture(scope="session")
def cluster():
    # A run must never be silently retried elsewhere: fail on the first lost task.
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        with dasktf.make_local_cluster(3, tf_threads=1) as c:
            yield c


@pytest.fixture
def client(cluster):
    with Client(cluster) as c:
        c.wait_for_workers(3, timeout=60)
        yield c


@pytest.fixture(scope="session")
def digits():
    return dasktf.load_dataset("digits")


@pytest.fixture
def small_digits(digits):
    """A few hundred digits: enough to train on, quick to step through."""
    return digits.x_train[:250], digits.y_train[:250]


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def kill_once_checkpointed(proc, directory, timeout: float) -> None:
    """SIGKILL ``proc`` (a client running a fit) once ``directory`` holds a
    checkpoint after the first epoch's end; it must still be running then."""
    import json
    import signal

    from dasktf.run.checkpoint import list_checkpoints
    from dasktf.testing import wait_until

    def past_first_epoch() -> bool:
        if proc.poll() is not None:
            return True
        try:
            return any(json.loads(p.read_text())["next_epoch"] >= 1
                       for p in list_checkpoints(directory))
        except (OSError, ValueError):  # a manifest renamed away by the pruning
            return False

    try:
        wait_until(past_first_epoch, timeout, "a checkpoint after the first epoch",
                   interval=0.1)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


class ScaleUpAfterFirstEpoch(keras.callbacks.Callback):
    """Grow ``cluster`` to ``n`` workers at the first epoch's end (a run's re-form
    tests: the joiners are taken in at the next epoch boundary)."""

    def __init__(self, cluster, client, n):
        super().__init__()
        self.cluster, self.client, self.n = cluster, client, n

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.cluster.scale(self.n)
            self.client.wait_for_workers(self.n, timeout=120)
