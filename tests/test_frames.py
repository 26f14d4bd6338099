"""Dask DataFrames as training data: partitions stay where they live.

A persisted frame's partitions are converted on the workers holding them; the
client receives row counts, metrics and weights, never the partitions (counted
here at the client's one door for data, ``Client._gather``). One worker reading
its partitions in order trains exactly as Keras on the same rows.
"""

from __future__ import annotations

import shutil
import time

import dask.array as da
import dask.dataframe as dd
import keras
import numpy as np
import pandas as pd
import pytest
from dask.sizeof import sizeof

import dasktf
from tests.conftest import relative_error


def _frame(digits, copies: int = 1) -> pd.DataFrame:
    x = np.concatenate([digits.x_train.reshape(len(digits.x_train), -1)] * copies)
    y = np.concatenate([digits.y_train] * copies)
    frame = pd.DataFrame(x.astype("float64"), columns=[f"p{i}" for i in range(64)])
    frame["label"] = y.astype("int64")
    frame["weight"] = np.where(y % 2 == 0, 2.0, 0.5)
    return frame


def _model(seed: int = 3) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.3), loss="sparse_categorical_crossentropy",
                  weighted_metrics=["accuracy"])
    return model


class _Received:
    """Bytes the client gathers from the cluster while it is installed."""

    def __init__(self, client) -> None:
        self.client, self.bytes, self._gather = client, 0, client._gather

    async def _counting(self, *args, **kwargs):
        out = await self._gather(*args, **kwargs)
        self.bytes += sizeof(out)
        return out

    def __enter__(self) -> _Received:
        self.client._gather = self._counting
        return self

    def __exit__(self, *exc) -> None:
        self.client._gather = self._gather


def test_a_persisted_frame_trains_without_its_partitions_reaching_the_client(client, digits):
    frame = _frame(digits, copies=8)  # 11,504 rows, 6 MB
    df = dd.from_pandas(frame, npartitions=12).persist()
    with _Received(client) as received:
        history = dasktf.fit(_model(), df, "label", sample_weight="weight", client=client,
                             n_workers=3, epochs=2, batch_size=256, verbose=0, seed=0)
    assert history.history["accuracy"][-1] > 0.85
    assert received.bytes < 0.05 * frame.memory_usage().sum(), received.bytes


def test_one_worker_on_a_frame_equals_keras_on_its_rows(client, digits):
    frame = _frame(digits)[:600]
    reference = _model()
    ours = keras.models.clone_model(reference)
    ours.set_weights(reference.get_weights())
    ours.compile(optimizer=keras.optimizers.SGD(0.3), loss="sparse_categorical_crossentropy",
                 weighted_metrics=["accuracy"])
    features = frame[[f"p{i}" for i in range(64)]].to_numpy("float32")
    want = reference.fit(features, frame["label"].to_numpy(), sample_weight=frame["weight"],
                         batch_size=50, epochs=2, shuffle=False, verbose=0)
    df = dd.from_pandas(frame, npartitions=4)
    history = dasktf.fit(ours, df.drop(columns=["label", "weight"]), df["label"],
                         sample_weight=df["weight"], client=client, n_workers=1,
                         batch_size=50, epochs=2, shuffle=False, verbose=0)
    for got, exp in zip(history.model.get_weights(), reference.get_weights(), strict=True):
        assert relative_error(got, exp) < 2e-5
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=2e-5)


def test_frames_as_several_inputs(client, digits):
    frame = _frame(digits)[:480]
    frame["meta"] = frame["label"] % 3
    df = dd.from_pandas(frame, npartitions=3)
    keras.utils.set_random_seed(0)
    pixels, meta = keras.Input((64,), name="pixels"), keras.Input((1,), name="meta")
    h = keras.layers.Concatenate()([keras.layers.Dense(8)(pixels), meta])
    model = keras.Model({"pixels": pixels, "meta": meta},
                        keras.layers.Dense(10, activation="softmax")(h))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    history = dasktf.fit(model, {"pixels": df[[f"p{i}" for i in range(64)]],
                                 "meta": df[["meta"]]},
                         df["label"], client=client, n_workers=2, epochs=2, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_non_numeric_columns_are_named_before_anything_is_computed(client, digits):
    frame = _frame(digits)[:100]
    frame["city"] = "Lyon"
    frame["kind"] = pd.Categorical(["a", "b"] * 50)
    df = dd.from_pandas(frame, npartitions=2)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"not numeric: 'city' \(.*\), 'kind' \(category\)"):
        dasktf.fit(_model(), df, "label", client=client, n_workers=2, verbose=0)
    with pytest.raises(ValueError, match=r"Columns \['labels'\] are not in x"):
        dasktf.fit(_model(), df, "labels", client=client, n_workers=2, verbose=0)
    assert time.perf_counter() - started < 5


def test_a_parquet_directory_gone_missing_names_the_path(client, digits, tmp_path):
    path = tmp_path / "gone.parquet"
    dd.from_pandas(_frame(digits)[:200], npartitions=2).to_parquet(path)
    df = dd.read_parquet(path)  # lazy: the files are read when training starts
    shutil.rmtree(path)
    started = time.perf_counter()
    with pytest.raises(Exception, match=r"gone\.parquet"):
        dasktf.fit(_model(), df, "label", client=client, n_workers=2, verbose=0)
    assert time.perf_counter() - started < 15


@pytest.mark.parametrize("stream", [False, True])
def test_frames_and_dask_arrays_mixed_in_one_input_dict(client, digits, stream):
    """A frame's columns beside a Dask array cut otherwise: the array is re-cut into
    the frame's partitions (their rows counted on the cluster); one worker reading
    them in order trains exactly as Keras on the same rows."""
    frame = _frame(digits)[:400]
    df = dd.from_pandas(frame, npartitions=4)
    extra = np.random.default_rng(0).normal(size=(400, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    pixels, more = keras.Input((64,), name="pixels"), keras.Input((3,), name="more")
    reference = keras.Model({"pixels": pixels, "more": more}, keras.layers.Dense(
        10, activation="softmax")(keras.layers.Concatenate()([pixels, more])))
    ours = keras.models.clone_model(reference)
    ours.set_weights(reference.get_weights())
    for m in (reference, ours):
        m.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    columns = [f"p{i}" for i in range(64)]
    reference.fit({"pixels": frame[columns].to_numpy("float32"), "more": extra},
                  frame["label"].to_numpy(), batch_size=50, shuffle=False, verbose=0)
    x = {"pixels": df[columns], "more": da.from_array(extra, chunks=70)}
    history = dasktf.fit(ours, x, df["label"], client=client, n_workers=1, batch_size=50,
                         shuffle=False, verbose=0, stream=stream)
    for got, want in zip(history.model.get_weights(), reference.get_weights(), strict=True):
        assert relative_error(got, want) < 2e-5


def _named_model() -> keras.Model:
    """keras.io's structured-data form: one named Input per column."""
    keras.utils.set_random_seed(0)
    age = keras.Input((1,), name="age")
    city = keras.Input((1,), name="city", dtype="string")
    lookup = keras.layers.StringLookup(vocabulary=["Lyon", "Oslo"], output_mode="one_hot")
    h = keras.layers.Concatenate()([keras.layers.Normalization(mean=40.0, variance=100.0)(age),
                                    lookup(city)])
    model = keras.Model([age, city], keras.layers.Dense(1, activation="sigmoid")(h))
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    return model


def _people(n: int = 40) -> pd.DataFrame:
    return pd.DataFrame({"age": np.arange(n) % 50 + 20.0, "city": ["Lyon", "Oslo"] * (n // 2),
                         "label": np.arange(n) % 2})


@pytest.mark.parametrize("as_dask", [False, True])
def test_a_frame_for_named_inputs_names_leftover_and_missing_columns(client, as_dask):
    """Matched by name, a frame must hold every input and nothing else but y and
    sample_weight: both refused by name, before anything reaches a worker."""
    def frame(df: pd.DataFrame):
        return dd.from_pandas(df, npartitions=2) if as_dask else df

    people = _people()
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"not inputs of the model: \['notes'\]"):
        dasktf.fit(_named_model(), frame(people.assign(notes="x")), "label", client=client,
                   n_workers=2, verbose=0)
    with pytest.raises(ValueError, match=r"inputs \['city'\] are not columns of x"):
        dasktf.fit(_named_model(), frame(people.drop(columns="city")), "label",
                   client=client, n_workers=2, verbose=0)
    with pytest.raises(ValueError, match=r"Columns \['labels'\] are not in x"):
        dasktf.fit(_named_model(), frame(people), "labels", client=client, n_workers=2,
                   verbose=0)
    assert time.perf_counter() - started < 5


def test_a_frame_with_text_for_a_model_factory_says_to_pass_the_model(client):
    """A factory's inputs are unknown until the workers build it: the text columns
    are refused, saying to pass the built model."""
    df = dd.from_pandas(_people(), npartitions=2)
    with pytest.raises(ValueError, match=r"'city' \(.*pass the model itself"):
        dasktf.fit(_named_model, df, "label", client=client, n_workers=2, verbose=0)
    history = dasktf.fit(_named_model(), df, "label", client=client,
                         n_workers=2, epochs=1, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0])
