"""The Keras side of a replica's step, in this process (no cluster): the short
``tf.function`` call and the evaluation that stands in for ``model.evaluate``."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from dasktf.data.shards import Shard
from dasktf.runtime.keras_step import MetricEvaluator, SignatureFunction, metric_states


class _NoSlowCall:
    """A ``tf.function`` stand-in that serves the concrete function and refuses the
    ordinary (per-call binding) call."""

    def __init__(self, function):
        self.function = function

    def get_concrete_function(self, *args, **kwargs):
        return self.function.get_concrete_function(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        raise AssertionError("the ordinary tf.function call ran")


class _Step:
    def gradient(self, x, y, w=None):
        loss = tf.reduce_sum(tf.cast(x, tf.float32)) * tf.cast(tf.size(y), tf.float32)
        return loss if w is None else loss * tf.reduce_sum(w)


@pytest.mark.parametrize("weighted", [False, True])
def test_signature_function_takes_the_short_call_with_and_without_weights(weighted):
    # A parameter the signature leaves out (w=None) must not send every call down
    # the slow path: an unweighted batch is the common case.
    x = np.arange(6, dtype=np.uint8).reshape(2, 3)
    y = np.array([1, 2])
    w = np.array([0.5, 2.0], np.float32)
    specs = [tf.TensorSpec((None, 3), tf.uint8), tf.TensorSpec((None,), tf.int64)]
    args = (x, y)
    if weighted:
        specs.append(tf.TensorSpec((None,), tf.float32))
        args = (x, y, w)
    fn = SignatureFunction(_Step().gradient, specs)
    fn.function = _NoSlowCall(fn.function)
    expected = 15.0 * 2 * (2.5 if weighted else 1.0)
    assert float(fn(*args)) == expected
    assert float(fn(*(a[:1] for a in args))) == 3.0 * (0.5 if weighted else 1.0)


def _states_by_keras(model, x, y, w, batch_size):
    model.evaluate(x, y, sample_weight=w, batch_size=batch_size, verbose=0)
    return metric_states(model)


def _assert_same(a, b):
    assert len(a) == len(b) > 0
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6)


def test_metric_evaluator_leaves_the_states_keras_evaluate_leaves():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(2)],
                  weighted_metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(103, 8)).astype(np.float32)
    y = rng.integers(0, 3, 103)
    w = rng.uniform(0.1, 2.0, 103).astype(np.float32)
    evaluator = MetricEvaluator(model)
    for weights in (None, w):  # an uneven last batch (103 = 2 x 40 + 23), weights
        mine = evaluator.states(Shard(x, y, weights), 40)
        _assert_same(mine, _states_by_keras(model, x, y, weights, 40))
    # once traced per signature: a second call with fewer rows does not retrace
    assert len(evaluator._steps) == 2
    evaluator.states(Shard(x[:7], y[:7], w[:7]), 40)
    assert len(evaluator._steps) == 2


def test_metric_evaluator_with_named_outputs_and_an_overridden_test_step():
    inputs = keras.Input((4,), name="features")
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = {"kind": keras.layers.Dense(2, activation="softmax", name="kind")(hidden),
               "size": keras.layers.Dense(1, name="size")(hidden)}

    class Counting(keras.Model):
        """Its test step adds a metric of its own: evaluation must run the model's
        test_step, not a copy of Keras' default."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.batches = keras.metrics.Sum(name="batches")

        def test_step(self, data):
            self.batches.update_state(1.0)
            return super().test_step(data)

    keras.utils.set_random_seed(1)
    model = Counting({"features": inputs}, outputs)
    model.compile("adam", {"kind": "sparse_categorical_crossentropy", "size": "mse"},
                  metrics={"kind": ["accuracy"], "size": ["mae"]},
                  loss_weights={"kind": 1.0, "size": 0.5})
    rng = np.random.default_rng(1)
    x = {"features": rng.normal(size=(50, 4)).astype(np.float32)}
    y = {"kind": rng.integers(0, 2, 50), "size": rng.normal(size=(50, 1)).astype(np.float32)}
    model.evaluate(x, y, batch_size=16, verbose=0)  # builds every metric
    mine = MetricEvaluator(model).states(Shard(x, y), 16)
    _assert_same(mine, _states_by_keras(model, x, y, None, 16))
    assert float(model.batches.result()) == 4.0  # 50 rows in batches of 16
