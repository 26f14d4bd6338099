"""Async elastic growth with real worker processes: a worker that joins mid-run
helps a shard at once and its updates are applied."""

from __future__ import annotations

import time

import keras
import numpy as np
import pytest

import dasktf
from dasktf.cluster.membership import alive_workers
from dasktf.diagnostics.events import TOPIC, unpack
from dasktf.testing import own_cluster

from .test_fault import ACCURACY, _options


class _ScaleUpAtBatch(keras.callbacks.Callback):
    def __init__(self, cluster, client, n, batch):
        super().__init__()
        self.cluster, self.client, self.n, self.batch = cluster, client, n, batch
        self.done = False

    def on_train_batch_end(self, batch, logs=None):
        if not self.done and batch >= self.batch:
            self.done = True
            self.cluster.scale(self.n)
            # mid-epoch: a new process takes seconds to start, which the short run
            # need not last otherwise
            self.client.wait_for_workers(self.n, timeout=120)


@pytest.mark.slow
def test_async_run_grows_from_two_to_three_workers_at_once(digits):
    start = time.monotonic()
    epochs = 4
    with own_cluster(2) as (cluster, client):
        before = alive_workers(client)
        history = dasktf.fit(
            "mnist-mlp", digits.x_train, digits.y_train, client=client, n_workers=2,
            mode="async", slow_workers={1: 3}, validation_data=(digits.x_test, digits.y_test),
            callbacks=[_ScaleUpAtBatch(cluster, client, 3, 2)],
            **_options(epochs=epochs, learning_rate=0.005),
        )
        joined = [w for w in history.workers if w not in before]
        assert len(history.workers) == 3 and len(joined) == 1
        (grew,) = history.recoveries
        assert grew["kind"] == "worker_joined" and grew["worker_address"] == joined[0]
        # the shard with the most batches left to hand out (the slowed one, unless
        # a loaded machine hides the slow-down)
        assert grew["worker"] == 2 and grew["left"][grew["helps"]] == max(grew["left"].values())
        helped = grew["helps"]
        updates = history.updates
        assert (updates["worker"] == 2).sum() > 0  # the new worker's updates were applied
        # The helper takes its batches from shard 1's cursor: every batch of the run
        # is applied exactly once across the three workers.
        shard = updates["worker"].map({0: 0, 1: 1, 2: helped})
        items = list(zip(shard, updates["shard_pass"], updates["step"], strict=False))
        assert len(items) == len(set(items))
        steps = -(-len(digits.x_train) // 64)
        owed = {(w, p, s) for w in (0, 1) for p in range(epochs) for s in range(steps)}
        assert {i for i in items if i[1] < epochs} == owed
        assert history.history["val_accuracy"][-1] > ACCURACY
        # every epoch has its own figures (one batch of results heard together once
        # finished two epochs, and the second had none: an IndexError)
        assert len(history.history["loss"]) == epochs
        assert all(np.isfinite(history.history["loss"]))
        # the join reached the dashboard's store too (its int-keyed "left" was
        # refused as not msgpack-friendly, the record lost with a warning)
        joins = [r for e in client.get_events(TOPIC) for r in unpack(e)
                 if r.get("kind") == "worker_joined" and r.get("run") == history.run_id]
        assert [r["worker_address"] for r in joins] == joined
        assert joins[0]["left"] == {str(k): v for k, v in grew["left"].items()}
    assert time.monotonic() - start < 150
