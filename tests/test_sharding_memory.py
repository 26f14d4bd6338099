"""What a sharded replica holds in memory (``shard_state="optimizer"``): once its
slice takes over, the whole optimizer and its slots are freed, and writing the
gathered weights makes no whole copies of them for a large model.

A replica and its slice built here, in the test process, as a p2p worker builds
them (what is measured is one process's objects, not the collective).
"""

from __future__ import annotations

import gc
import weakref

import keras
import numpy as np
import pytest

from dasktf.data.shards import Shard
from dasktf.models import CompileRecipe
from dasktf.runtime.p2p import sharding
from dasktf.runtime.p2p.sharding import ShardOptimizer
from dasktf.runtime.replica import Replica, ReplicaConfig
from dasktf.transport import ModelPackage


def _replica(sliced: bool = False) -> Replica:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(24, activation="relu"),
                              keras.layers.Dense(5, activation="softmax")])
    recipe = CompileRecipe(keras.optimizers.serialize(keras.optimizers.Adam(0.01)),
                           "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.integers(0, 5, 32).astype(np.int64)
    config = ReplicaConfig(ModelPackage.pack(model).ref(), recipe, 0, publish_metrics=False,
                           sliced=sliced)
    return Replica(config, 0, Shard(x, y), np.array([32]))


def test_the_slice_frees_the_whole_optimizer():
    replica = _replica()
    whole = replica.model.optimizer
    assert whole.built and len(whole.variables) > 2  # its slots were built
    gone = weakref.ref(whole)
    slots = [weakref.ref(v) for v in whole.variables]
    del whole
    shard = ShardOptimizer(replica, 0, 3)
    gc.collect()
    assert replica.model.optimizer is shard.optimizer
    # Keras' compile config held the whole one (and all its slots) for the model's life
    assert gone() is None
    assert all(s() is None for s in slots)


def test_a_sliced_replica_builds_no_whole_optimizer_until_a_state_is_read():
    """A sharded run's replica never holds the whole optimizer's slots unless a
    state is read or loaded before its first step; its slice starts as the one cut
    from a built whole optimizer does, and applies the same update."""
    sliced, plain = _replica(sliced=True), _replica()
    assert not sliced.model.optimizer.built and plain.model.optimizer.built
    size = sharding.chunk_edges(sum(plain.sizes), 2)[1]
    chunk = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    news = []
    for replica in (sliced, plain):
        shard = ShardOptimizer(replica, 0, 2)
        news.append((shard.apply(chunk, 8.0, lambda v: v),
                     [np.asarray(v.numpy()) for v in shard.optimizer.variables]))
    np.testing.assert_array_equal(news[0][0], news[1][0])
    for a, b in zip(news[0][1], news[1][1], strict=True):
        np.testing.assert_array_equal(a, b)
    # a state read before any step (a checkpoint, a recovery) is the whole one's
    late = _replica(sliced=True)
    names = [v.path for v in plain.model.optimizer.variables]
    assert len(late.training_state()["optimizer"]) == len(names) > 2
    assert late.model.optimizer.built


@pytest.mark.parametrize("in_one_call", [True, False])
def test_take_writes_the_gathered_weights(monkeypatch, in_one_call):
    """Both ways of writing the all-gather's buffer (one TensorFlow call for a
    small model, variable by variable from views for a large one) give the model
    exactly its values, the buffer untouched."""
    if not in_one_call:
        monkeypatch.setattr(sharding, "TAKE_IN_ONE_CALL", 0)
    replica = _replica()
    shard = ShardOptimizer(replica, 1, 3)
    flat = np.random.default_rng(1).standard_normal(sum(replica.sizes)).astype(np.float32)
    kept = flat.copy()
    shard.take(flat)
    np.testing.assert_array_equal(replica.flat_weights(), kept)
    np.testing.assert_array_equal(flat, kept)


@pytest.mark.parametrize("in_one_call", [True, False])
def test_the_next_gradient_call_takes_the_kept_weights(monkeypatch, in_one_call):
    """A step's gathered weights kept for the next step's gradient call (a small
    model: one TensorFlow call does both) are what that gradient is computed at,
    as if taken first; a large model's are taken at once. A replica a recovery
    fenced takes none."""
    if not in_one_call:
        monkeypatch.setattr(sharding, "TAKE_IN_ONE_CALL", 0)
    replica = _replica()
    shard = replica.shard_optimizer = ShardOptimizer(replica, 1, 3)
    before = replica.flat_weights()
    flat = np.random.default_rng(1).standard_normal(sum(replica.sizes)).astype(np.float32)
    shard.take_later(flat, replica)
    if in_one_call:  # kept: the model still holds the old weights, the slice the new
        np.testing.assert_array_equal(replica.flat_weights(), before)
        lo, hi = shard.edges[1], shard.edges[2]
        np.testing.assert_array_equal(shard.own_values(), flat[lo:hi])
    else:
        np.testing.assert_array_equal(replica.flat_weights(), flat)
    fused = shard.take_then_gradient(replica, 0, 0)
    np.testing.assert_array_equal(replica.flat_weights(), flat)
    assert shard.untaken is None
    plain = replica.gradient(0, 0)
    np.testing.assert_allclose(fused.total, plain.total, rtol=1e-6, atol=1e-7)
    assert (fused.count, fused.loss_sum) == (plain.count, pytest.approx(plain.loss_sum))

    replica.fenced = True
    shard.take_later(flat + 1, replica)
    shard.take_then_gradient(replica, 0, 0)
    np.testing.assert_array_equal(replica.flat_weights(), flat)


#: no spilling or pausing (they act on Dask's data, not TensorFlow's); the nanny
#: checks often enough to see a step's short peak
_MEMORY = {"distributed.worker.memory.target": False,
           "distributed.worker.memory.spill": False,
           "distributed.worker.memory.pause": False,
           "distributed.worker.memory.terminate": 0.95,
           "distributed.worker.memory.monitor-interval": "10ms"}


def _resident_after_import(dask_worker=None) -> int:
    import psutil
    import tensorflow  # noqa: F401

    import dasktf.runtime.replica  # noqa: F401

    return int(psutil.Process().memory_info().rss)


def _limit_nanny(limit: int, dask_worker=None) -> None:
    """Lower this nanny's memory limit (its monitor reads it at every check)."""
    dask_worker.memory_manager.memory_limit = limit


#: A worker's budget over its resident set once TensorFlow is imported, in bytes
#: of the model's weights: measured (benchmarks/replica_peak.py --fit, 4 workers,
#: 16.8M parameters; TensorFlow about 680 MiB), unsharded runs peak about
#: 12.5-13.5x over it, "gradients" (one copy of each slice) about 10-11x.
BUDGET_IN_WEIGHTS = 11.9


@pytest.mark.slow
@pytest.mark.memory  # the margins are tens of MiB: run it where it was calibrated
def test_a_model_only_sharding_fits():
    """Under the same per-worker limit (the nanny ends a worker past it), the
    unsharded run stops with WorkerLostError and the sharded one trains."""
    import dask

    import dasktf
    from dasktf.exceptions import WorkerLostError
    from dasktf.testing import own_cluster

    n, batch = 4, 128
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * batch, 2048)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int64)

    def run(shard_state):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2048,))] + [
            keras.layers.Dense(2048, activation="relu") for _ in range(4)
        ] + [keras.layers.Dense(10, activation="softmax")])  # 16.8M parameters
        weights = 4 * model.count_params()
        with dask.config.set(_MEMORY), own_cluster(n, memory_limit="8GiB") as (_, client):
            base = max(client.run(_resident_after_import).values())
            limit = int((base + BUDGET_IN_WEIGHTS * weights) / 0.95)
            client.run(_limit_nanny, limit, nanny=True)
            return dasktf.fit(model, x, y, client=client, n_workers=n, epochs=2,
                              batch_size=batch, optimizer="adam", learning_rate=1e-3,
                              loss="sparse_categorical_crossentropy", shuffle=False,
                              seed=0, verbose=0, engine="p2p", shard_state=shard_state,
                              on_worker_loss="raise",
                              # one copy of each slice: 1/N of the state a worker
                              **({} if shard_state is None else {"redundancy": 0}))

    with pytest.raises(WorkerLostError):
        run(None)
    history = run("gradients")
    assert len(history.history["loss"]) == 2


def test_a_slice_of_nothing_applies_and_counts_its_iteration():
    """More workers than values leaves some slices empty (533 values over 1,000):
    an empty slice's apply gives nothing and counts the iteration, as a slice
    with values does (the whole optimizer's iterations are read from any slice)."""
    replica = _replica()
    empty, full = ShardOptimizer(replica, 0, 1000), ShardOptimizer(_replica(), 1, 1000)
    assert empty.edges[1] == empty.edges[0] and full.edges[2] > full.edges[1]
    assert empty.apply(np.zeros(0, np.float32), 8.0, lambda v: v).shape == (0,)
    full.apply(np.ones(full.edges[2] - full.edges[1], np.float32), 8.0, lambda v: v)
    assert int(empty.optimizer.iterations.numpy()) == int(full.optimizer.iterations.numpy()) == 1
