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


def _replica() -> Replica:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(24, activation="relu"),
                              keras.layers.Dense(5, activation="softmax")])
    recipe = CompileRecipe(keras.optimizers.serialize(keras.optimizers.Adam(0.01)),
                           "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.integers(0, 5, 32).astype(np.int64)
    config = ReplicaConfig(ModelPackage.pack(model).ref(), recipe, 0, publish_metrics=False)
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
