"""p2p segments that span epochs (dasktf.runtime.p2p.span): one task per worker for
a whole fit, and nothing the client does at an epoch end changes meaning.

Each test trains the same fit twice, spanning (the default) and with one segment
per epoch (``dasktf.p2p.span-epochs: false``, the engine as it was), and asks for
the same bits: callbacks that change the learning rate and stop the run at epoch
ends, BatchNormalization's averaged statistics, validation and shuffling; a stop
asked for at an epoch's last step leaves no update of the next epoch applied (the
workers wait at the epoch's end for the client); a worker killed while the others
wait there costs no update and the final weights are the uninterrupted run's.
"""

from __future__ import annotations

import dask
import keras
import numpy as np
import pytest

import dasktf
from dasktf.cluster.membership import alive_workers, described_workers
from dasktf.testing import kill_worker, own_cluster, wait_until
from tests.conftest import relative_error
from tests.test_p2p_engine import BATCH, EPOCHS, _fault_fit, _flat, uninterrupted
from tests.test_scaling import GraphCounter, _segments

__all__ = ["uninterrupted"]  # the module fixture, shared with test_p2p_engine


def _bn_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32),
                             keras.layers.BatchNormalization(),
                             keras.layers.Activation("relu"),
                             keras.layers.Dense(10, activation="softmax")])


def _twice(client, fit):
    """``fit()`` spanning and with a segment per epoch: (history, segment graphs)
    of each."""
    client.register_plugin(GraphCounter())
    out = []
    for span in (True, False):
        client.run_on_scheduler(_segments)  # forget earlier runs'
        with dask.config.set({"dasktf.p2p.span-epochs": span}):
            history = fit()
        out.append((history, client.run_on_scheduler(_segments)))
    return out


def _same(a, b, keys):
    for key in keys:
        assert a.history[key] == b.history[key], key
    for x, y in zip(a.model.get_weights(), b.model.get_weights(), strict=True):
        np.testing.assert_array_equal(x, y)


def test_epoch_end_callbacks_act_on_a_spanning_fit_as_between_segments(client, digits):
    """LearningRateScheduler (each epoch's rate), ReduceLROnPlateau, and
    EarlyStopping with restore_best_weights (stops the run at an epoch end) on a
    BatchNormalization model with validation and shuffling: the spanning fit is
    the per-epoch one, bit for bit, with one graph of N tasks for the whole fit."""
    x = digits.x_train[:960].reshape(-1, 64)
    y = digits.y_train[:960]

    def fit():
        callbacks = [
            keras.callbacks.LearningRateScheduler(lambda e, lr: 0.2 / (1 + e)),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                              min_delta=10.0),  # every epoch
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1,
                                          min_delta=10.0, restore_best_weights=True),
        ]
        return dasktf.fit(_bn_model(), x, y, client=client, n_workers=3, epochs=6,
                          batch_size=48, optimizer="sgd", shuffle=True, seed=2,
                          validation_split=0.2, metrics=["accuracy"], verbose=0,
                          engine="p2p", loss="sparse_categorical_crossentropy",
                          callbacks=callbacks)

    (spanned, graphs), (per_epoch, per_epoch_graphs) = _twice(client, fit)
    assert len(spanned.history["loss"]) == 2  # EarlyStopping after epoch 2
    assert graphs == [3] and per_epoch_graphs == [3, 3]
    _same(spanned, per_epoch, ("loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"))
    # the rates the callbacks set reached the workers: the two epochs differ
    assert spanned.history["learning_rate"][0] != spanned.history["learning_rate"][1]
    logs = list(spanned.applied_updates.values())
    assert all(log == list(range(2 * 16)) for log in logs)  # 768 rows / 48: 16 an epoch


class StopAtEpochEnd(keras.callbacks.Callback):
    """``stop_training`` at the last batch of the first epoch."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.steps - 1:
            self.model.stop_training = True


def test_a_stop_at_an_epoch_end_applies_no_update_of_the_next(client, digits):
    """The workers wait at each epoch's end for the client's word: a stop the
    client asks for on the epoch's last step finds them there, so no replica
    applied an update of the next epoch, as with per-epoch segments."""
    x, y = digits.x_train[:480].reshape(-1, 64), digits.y_train[:480]
    steps = 480 // 48

    def fit():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)),
                                  keras.layers.Dense(10, activation="softmax")])
        return dasktf.fit(model, x, y, client=client, n_workers=3, epochs=3,
                          batch_size=48, optimizer="adam", verbose=0, engine="p2p",
                          loss="sparse_categorical_crossentropy",
                          callbacks=[StopAtEpochEnd(steps)])

    (spanned, graphs), (per_epoch, _) = _twice(client, fit)
    assert graphs == [3]
    assert len(spanned.history["loss"]) == 1
    for log in spanned.applied_updates.values():
        assert log == list(range(steps))
    _same(spanned, per_epoch, ("loss",))


class KillAtEpochEnd(keras.callbacks.Callback):
    """SIGKILL ``address`` at the end of epoch ``epoch``, while the replicas wait
    for the client's word, and wait until the scheduler has removed it."""

    def __init__(self, client, address: str, epoch: int) -> None:
        super().__init__()
        self.client, self.address, self.epoch = client, address, epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            kill_worker(self.client, self.address)
            wait_until(lambda: self.address not in
                       described_workers(self.client), 60,
                       f"the scheduler to remove {self.address}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_killed_between_epochs_of_a_span_costs_no_update(digits, uninterrupted):
    steps = -(-len(digits.x_train) // BATCH)
    with own_cluster(3) as (_, client):
        workers = alive_workers(client)
        history = _fault_fit(client, digits,
                             callbacks=[KillAtEpochEnd(client, workers[1], EPOCHS - 2)])
        (recovery,) = history.recoveries
        assert recovery["lost"] == [workers[1]] and recovery["steps_lost"] == 0
        assert recovery["resumed_at_update"] == (EPOCHS - 1) * steps
        assert len(history.applied_updates) == 2
        for log in history.applied_updates.values():  # each update once, none skipped
            assert log == list(range(EPOCHS * steps))
    got, want = _flat(history.model.get_weights()), _flat(uninterrupted)
    assert relative_error(got, want) < 1e-5


def test_inside_a_span_only_the_loss_replica_sends_its_records_at_each_epoch_end(digits):
    """Replica 0, whose records carry the global loss the client relays, sends its
    buffered step records at every epoch end; the others by the interval (longer
    than the fit here) or, at each epoch end, with their reports to the client,
    which publishes them all in the epoch record's message (issue 39: before, each
    sent its own at the span's end): no message of their own for four epochs, and
    every step's record arrives."""
    from dasktf.diagnostics.events import TOPIC, unpack

    x, y = digits.x_train[:384].reshape(-1, 64), digits.y_train[:384]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    with dask.config.set({"dasktf.metrics-interval": "300s"}), own_cluster(3) as (_, client):
        dasktf.fit(model, x, y, client=client, n_workers=3, epochs=4, batch_size=96,
                   loss="sparse_categorical_crossentropy", verbose=0, seed=0)
        published = [unpack(e) for e in client.get_events(TOPIC)]
    events = [[r for r in e if r.get("kind") == "step"] for e in published]
    epochs = [any(r.get("kind") == "epoch" for r in e) for e in published]
    # the messages holding each worker's records, by who sent them
    own = {w: sum(any(r["worker"] == w for r in e) and not epoch
                  for e, epoch in zip(events, epochs, strict=True)) for w in range(3)}
    with_epochs = {w: sum(any(r["worker"] == w for r in e) and epoch
                          for e, epoch in zip(events, epochs, strict=True))
                   for w in range(3)}
    assert own == {0: 4, 1: 0, 2: 0}, own
    assert with_epochs == {0: 0, 1: 4, 2: 4}, with_epochs
    steps = sorted((r["worker"], r["update"]) for e in events for r in e)
    assert steps == [(w, u) for w in range(3) for u in range(16)]
