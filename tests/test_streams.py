"""Streamed shards, ``dataset_fn`` and ``tf.data``: data read part by part on the workers.

Streaming changes where rows wait, not which rows a step reads: with
``shuffle=False`` a streamed shard gives exactly the weights of the same rows held
resident, and one worker streaming a Dask collection trains exactly as Keras on
its rows.
"""

from __future__ import annotations

import json
import time
import warnings

import dask.array as da
import dask.dataframe as dd
import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import dasktf
from tests.conftest import relative_error

ROWS = 300


def _xy(digits):
    return (digits.x_train[:ROWS].reshape(ROWS, -1).astype("float32"),
            digits.y_train[:ROWS].astype("int64"))


def _model(seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def _fit(client, x, y=None, **kw):
    options = dict(client=client, n_workers=2, epochs=2, batch_size=40, shuffle=False,
                   verbose=0, seed=0)
    return dasktf.fit(_model(), x, y, **{**options, **kw})


def _same(a, b) -> None:
    for got, want in zip(a.model.get_weights(), b.model.get_weights(), strict=True):
        assert relative_error(got, want) < 2e-5
    np.testing.assert_allclose(a.history["loss"], b.history["loss"], rtol=2e-5)


def test_a_streaming_loader_equals_the_resident_one(client, digits):
    x, y = _xy(digits)

    def resident(i, n):
        return x[i::n], y[i::n]

    def streamed(i, n):  # the same rows, in parts of 17
        xs, ys = x[i::n], y[i::n]
        return ((xs[k:k + 17], ys[k:k + 17]) for k in range(0, len(xs), 17))

    _same(_fit(client, streamed), _fit(client, resident))
    shuffled = _fit(client, streamed, shuffle=True, epochs=4)
    assert shuffled.history["loss"][-1] < shuffled.history["loss"][0]


def test_one_worker_streaming_dask_partitions_equals_keras(client, digits):
    x, y = _xy(digits)
    reference = _model()
    # 300 rows in steps of 50: a worker-side source spreads its rows evenly over
    # the steps, which are Keras' batches when the batch divides the rows.
    want = reference.fit(x, y, batch_size=50, epochs=2, shuffle=False, verbose=0)
    got = _fit(client, da.from_array(x, chunks=(70, 64)), da.from_array(y, chunks=70),
               stream=True, n_workers=1, batch_size=50)
    for g, w in zip(got.model.get_weights(), reference.get_weights(), strict=True):
        assert relative_error(g, w) < 2e-5
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=2e-5)


def test_a_lazy_parquet_frame_streams_from_its_files(client, digits, tmp_path):
    x, y = _xy(digits)
    frame = pd.DataFrame(x, columns=[f"p{i}" for i in range(64)]).assign(label=y)
    dd.from_pandas(frame, npartitions=6).to_parquet(tmp_path / "digits.parquet")
    df = dd.read_parquet(tmp_path / "digits.parquet")  # lazy: read by the workers
    streamed = _fit(client, df, "label", stream=True, epochs=3, shuffle=True)
    assert streamed.history["loss"][-1] < streamed.history["loss"][0]
    # shuffle=False: the same rows as the resident frame gives, in the same order
    _same(_fit(client, df, "label", stream=True, n_workers=1),
          _fit(client, df, "label", n_workers=1))
    with pytest.raises(ValueError, match=r"x is persisted.*Drop stream=True"):
        _fit(client, df.drop(columns="label").persist(), df["label"], stream=True)


def test_dataset_fn_gets_its_context_on_every_worker_and_equals_resident(
        client, digits, tmp_path):
    x, y = _xy(digits)
    log = tmp_path / "contexts.jsonl"

    def dataset_fn(ctx):
        with open(log, "a") as f:
            f.write(json.dumps({"shard": ctx.shard_index, "of": ctx.num_shards,
                                "local": ctx.local_batch_size, "epoch": ctx.epoch,
                                "seed": ctx.seed}) + "\n")
        rows = slice(ctx.shard_index, None, ctx.num_shards)
        return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(
            ctx.local_batch_size)

    def resident(i, n):
        return x[i::n], y[i::n]

    _same(_fit(client, dataset_fn, seed=7, epochs=3), _fit(client, resident, seed=7,
                                                            epochs=3))
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert {(c["shard"], c["of"], c["local"], c["seed"]) for c in seen} == {
        (0, 2, 20, 7), (1, 2, 20, 7)}
    # the first read counts the rows (epoch 0), then every epoch on every worker
    for shard in (0, 1):
        assert sorted(c["epoch"] for c in seen if c["shard"] == shard) == [0, 0, 1, 2]


def test_bad_streams_fail_fast_naming_the_worker(client, digits):
    x, y = _xy(digits)

    def wrong_shapes(ctx):
        if ctx.shard_index == 1:
            return tf.data.Dataset.from_tensor_slices((x[:, :10], y)).batch(20)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(20)

    def nothing(ctx):
        return tf.data.Dataset.from_tensor_slices((x[:0], y[:0])).batch(20)

    def drifting(i, n):  # the second part has another width
        yield x[:50], y[:50]
        yield x[50:100, :32], y[50:100]

    started = time.perf_counter()
    with pytest.raises(ValueError, match="disagree on shapes"):
        _fit(client, wrong_shapes)
    with pytest.raises(ValueError, match=r"dataset_fn on shard \d .* yielded no rows"):
        _fit(client, nothing)
    with pytest.raises(Exception, match=r"part 1 from the loader of shard \d has other shapes"):
        _fit(client, drifting)
    assert time.perf_counter() - started < 30


def test_a_client_side_dataset_is_read_when_small_and_refused_when_infinite(client, digits):
    x, y = _xy(digits)
    small = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit(client, small)
    assert any("dataset_fn" in str(w.message) for w in caught)
    assert np.isfinite(history.history["loss"]).all()
    with pytest.raises(ValueError, match=r"infinite tf\.data\.Dataset.*dataset_fn"):
        _fit(client, small.repeat())


def _words(n: int = 120) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 2, n)
    texts = np.array([" ".join(rng.choice(["good", "fine"] if y else ["bad", "poor"], 4))
                      for y in labels], dtype=object)
    return texts, labels.astype("int64")


def _words_fn(ctx):
    """A module-level dataset_fn (the collective engine's child imports it)."""
    texts, labels = _words()
    rows = slice(ctx.shard_index, None, ctx.num_shards)
    return tf.data.Dataset.from_tensor_slices((texts[rows].astype(str),
                                               labels[rows])).batch(ctx.local_batch_size)


def _string_model(texts: np.ndarray) -> keras.Model:
    keras.utils.set_random_seed(5)
    vectorize = keras.layers.TextVectorization(max_tokens=10, output_mode="multi_hot")
    vectorize.adapt(texts)
    inputs = keras.Input((), dtype="string")
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(vectorize(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize("options", [{}, {"mode": "async"}, {"engine": "collective"}],
                         ids=["graph", "async", "collective"])
def test_tf_string_elements_from_a_dataset_fn_train_on_every_engine(client, options):
    """A ``dataset_fn`` yields tf.string batches: they reach the model's
    TextVectorization as Keras' fit would pass them, whatever the engine."""
    texts, labels = _words()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the collective engine's security warning
        history = dasktf.fit(_string_model(texts), _words_fn, client=client, n_workers=2,
                             epochs=4, batch_size=24, verbose=0, seed=0,
                             validation_data=(texts[:30], labels[:30]), **options)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert history.history["val_loss"][-1] < 0.69  # below chance: it learnt the words
