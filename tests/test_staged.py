"""The staged backward pass (:mod:`dasktf.runtime.staged`): a chain model's gradient
(a ``Sequential``, or a functional model whose graph is a chain)
a group of layers at a time, the last first, equal to the one-call backward pass.

A replica built here, in the test process, as a worker builds it; the sharded
step that sends each stage's parts is tested on real workers in test_sharding.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from dasktf.data.shards import Shard
from dasktf.models import CompileRecipe
from dasktf.runtime.keras_step import batch_args
from dasktf.runtime.replica import Replica, ReplicaConfig
from dasktf.runtime.staged import StagedBackward, layer_stages
from dasktf.transport import ModelPackage


def _chain(kind: str = "sequential") -> keras.Model:
    """1,560 + 48 (the BatchNormalization's scale and offset) + 85 trainable values;
    a frozen layer between, a dropout drawing from the seed: a ``Sequential``, or
    the same chain built functionally."""
    keras.utils.set_random_seed(3)
    layers = [keras.layers.Flatten(),
              keras.layers.Dense(24, activation="relu"), keras.layers.BatchNormalization(),
              keras.layers.Dropout(0.3),
              keras.layers.Dense(16, activation="tanh", trainable=False),
              keras.layers.Dense(5, activation="softmax")]
    if kind == "sequential":
        return keras.Sequential([keras.Input((8, 8)), *layers])
    inputs = keras.Input((8, 8))
    outputs = inputs
    for layer in layers:
        outputs = layer(outputs)
    return keras.Model(inputs, outputs)


def _residual() -> keras.Model:
    """Two residual blocks (the second's sum an op of keras.ops, its scale a call's
    argument of its own) between plain layers: cut around each block, never in it."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8))
    h = keras.layers.Dense(24, activation="relu")(keras.layers.Flatten()(inputs))
    h = keras.layers.Add()([h, keras.layers.Dense(24, activation="tanh")(h)])
    h = keras.layers.BatchNormalization()(h)
    inner = keras.layers.Dropout(0.3)(keras.layers.Dense(24, activation="relu")(h))
    h = keras.ops.add(h, _Scale()(inner, factor=0.5))
    return keras.Model(inputs, keras.layers.Dense(5, activation="softmax")(h))


class _Scale(keras.layers.Layer):
    def call(self, x, factor=1.0):
        return x * factor


KINDS = ["sequential", "functional", "residual"]
BUILD = {"sequential": _chain, "functional": _chain, "residual": lambda _: _residual()}


def _replica(model: keras.Model, rows: int = 32) -> Replica:
    recipe = CompileRecipe(keras.optimizers.serialize(keras.optimizers.Adam(0.01)),
                           "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 8, 8)).astype(np.float32)
    y = rng.integers(0, 5, rows).astype(np.int64)
    config = ReplicaConfig(ModelPackage.pack(model).ref(), recipe, 0, publish_metrics=False)
    return Replica(config, 0, Shard(x, y), np.array([rows]))


@pytest.mark.parametrize("kind", KINDS[:2])
def test_stages_cut_between_layers_with_at_least_the_least_values(kind):
    replica = _replica(_chain(kind))
    stages = layer_stages(replica.model, replica.variables, 32)
    assert [(s.start, s.stop, s.first, s.count) for s in stages] == [
        (0, 1560, 0, 2),       # the flatten and the first dense layer
        (1560, 1608, 2, 2),    # the batch normalization
        (1608, 1693, 4, 2)]    # the dropout, the frozen layer and the softmax
    assert [len(s.blocks) for s in stages] == [2, 1, 3]  # a layer each
    # at least 64 values a stage: the normalization's 48 join the last layers
    assert [(s.start, s.stop) for s in layer_stages(replica.model, replica.variables, 64)
            ] == [(0, 1560), (1560, 1693)]
    # more than the model has: one stage, the whole pass
    assert len(layer_stages(replica.model, replica.variables, 10**6)) == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [32, 0])
def test_the_stages_give_the_one_call_gradient(rows, kind):
    """Put together and times the rows, the stages' gradients are the one-call
    backward pass's bit for bit (the same ops, in parts), with the same loss, the
    same moving statistics and the same dropout mask (the seed generator drawn in
    the same order); a batch without rows gives zeros."""
    model = BUILD[kind](kind)
    one, staged = _replica(model, max(rows, 1)), _replica(model, max(rows, 1))
    stages = layer_stages(staged.model, staged.variables, 32)
    batch = one.batch(0, 0) if rows else Shard(np.zeros((0, 8, 8), np.float32),
                                               np.zeros(0, np.int64))
    keras.utils.set_random_seed(9)
    backward = StagedBackward(staged, stages, batch)
    got = np.full(sum(staged.sizes), np.nan, np.float32)
    order = []
    for start, part in backward.parts():
        order.append(start)
        got[start:start + len(part)] = part
    # a variable at a time (kernel, bias), the last stage first
    assert order == ([1608, 1688, 1560, 1584, 0, 1536] if kind != "residual" else
                     [2808, 2928, 2208, 2784, 2160, 2184, 1560, 2136, 0, 1536])
    if not rows:
        assert backward.largest == 4 * 1536  # one variable's zeros at a time
        assert not got.any() and backward.count == 0 and backward.loss_sum == 0
        return
    assert backward.largest == 4 * 1560  # the largest stage held, not the whole
    keras.utils.set_random_seed(9)
    flat, loss_sum = one.batch_gradient(*batch_args(batch))
    # times the rows (the collective's product): the same bits
    np.testing.assert_array_equal(got * np.float32(rows), np.asarray(flat))
    assert backward.loss_sum == float(loss_sum) and backward.count == rows
    for mine, theirs in zip(staged.model.non_trainable_variables,
                            one.model.non_trainable_variables, strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))
    assert float(staged.loss_tracker.result()) == float(one.loss_tracker.result())


def test_a_residual_block_is_one_block():
    """The cuts of a functional graph are where one value carries everything on: a
    residual sum (a layer's or an op's) and what it adds up stay in one block."""
    from dasktf.runtime.staged import model_blocks

    blocks = model_blocks(_residual())
    assert [[type(layer).__name__ for layer in b.layers] for b in blocks] == [
        ["Flatten"], ["Dense"], ["Dense", "Add"], ["BatchNormalization"],
        ["Dense", "Dropout", "_Scale"], ["Dense"]]
    assert len(blocks[4].calls) == 4  # keras.ops.add: a call, not a layer


def test_what_cannot_be_cut_keeps_the_one_call():
    inputs = keras.Input((8, 8))
    hidden = keras.layers.Dense(4)(keras.layers.Flatten()(inputs))
    shared = keras.layers.Dense(4)
    twice = keras.Model(inputs, keras.layers.Dense(5)(shared(shared(hidden))))
    two_inputs = keras.Input((4,))
    branches = keras.Model([inputs, two_inputs], keras.layers.Dense(5)(
        keras.layers.Concatenate()([hidden, two_inputs])))

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(5)

        def call(self, x):
            return self.dense(x)

    subclassed = Subclassed()
    subclassed.build((None, 4))
    regularized = keras.Sequential([
        keras.Input((8, 8)), keras.layers.Flatten(),
        keras.layers.Dense(4, kernel_regularizer="l2"), keras.layers.Dense(5)])
    activity = keras.Sequential([
        keras.Input((8, 8)), keras.layers.Flatten(),
        keras.layers.Dense(4, activity_regularizer="l2"), keras.layers.Dense(5)])
    masked = keras.Sequential([
        keras.Input((6,)), keras.layers.Embedding(10, 4, mask_zero=True),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(5)])
    for model in (twice, branches, subclassed, regularized, activity, masked):
        assert layer_stages(model, model.trainable_variables, 1) is None, model


def test_a_keras_application_is_staged_and_gives_the_one_call_gradient():
    """MobileNetV2 as ``keras.applications`` builds it (inverted residual blocks,
    batch normalization, padding): cut between its blocks, its parts are the
    one-call backward pass's bit for bit, and a worker holds at most its largest
    stage's gradient."""
    keras.utils.set_random_seed(1)
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), weights=None,
                                           classes=5, alpha=0.35)
    recipe = CompileRecipe(keras.optimizers.serialize(keras.optimizers.Adam(0.01)),
                           "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 5, 16).astype(np.int64)
    package = ModelPackage.pack(model).ref()
    one, staged = (Replica(ReplicaConfig(package, recipe, 0, publish_metrics=False), 0,
                           Shard(x, y), np.array([16])) for _ in range(2))
    stages = layer_stages(staged.model, staged.variables, 1000)
    assert stages is not None and len(stages) > 10
    batch = one.batch(0, 0)
    keras.utils.set_random_seed(9)
    backward = StagedBackward(staged, stages, batch)
    got = np.full(sum(staged.sizes), np.nan, np.float32)
    for start, part in backward.parts():
        got[start:start + len(part)] = part
    keras.utils.set_random_seed(9)
    flat, _ = one.batch_gradient(*batch_args(batch))
    np.testing.assert_array_equal(got * np.float32(16), np.asarray(flat))
    assert backward.largest < 0.5 * got.nbytes
