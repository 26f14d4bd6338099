"""dasktf.predict and dasktf.evaluate: Keras' results, computed where the data lives.

Every prediction is compared with the same model's ``model.predict`` on the same
rows in this process (float32 tolerance), every evaluation with ``model.evaluate``.
"""

from __future__ import annotations

import os
import pickle
import signal
import warnings

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import as_completed

import dasktf
from dasktf.testing import own_cluster

keras = pytest.importorskip("keras")

ATOL = 1e-5


def _mlp(inputs: int = 8, outputs: int = 3, hidden: int = 16, seed: int = 0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(outputs, activation="softmax"),
    ])


def _rows(n: int = 600, d: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


def _scheduler_tasks(client) -> int:
    return client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))


def test_single_output_equals_keras_and_is_lazy(client):
    model, x = _mlp(), _rows()
    before = _scheduler_tasks(client)
    pred = dasktf.predict(model, da.from_array(x, chunks=70), client=client)
    # Nothing ran: the model was scattered (one key), no partition task exists.
    assert _scheduler_tasks(client) <= before + 1
    assert isinstance(pred, da.Array) and pred.shape == (600, 3)
    assert pred.chunks[0] == da.from_array(x, chunks=70).chunks[0]
    np.testing.assert_allclose(pred.compute(), model.predict(x, verbose=0), atol=ATOL)


def test_multi_output_dict_and_two_inputs(client):
    keras.utils.set_random_seed(1)
    image = keras.Input((4, 3), name="image")
    extra = keras.Input((2,), name="extra")
    h = keras.layers.Concatenate()([keras.layers.Flatten()(image), extra])
    h = keras.layers.Dense(8, activation="tanh")(h)
    model = keras.Model({"image": image, "extra": extra},
                        {"label": keras.layers.Dense(3, activation="softmax")(h),
                         "score": keras.layers.Dense(1)(h)})
    rng = np.random.default_rng(1)
    x = {"image": rng.normal(size=(300, 4, 3)).astype(np.float32),
         "extra": rng.normal(size=(300, 2))}
    # The two inputs come chunked differently: their rows are lined up.
    dx = {"image": da.from_array(x["image"], chunks=(64, 2, 3)),
          "extra": da.from_array(x["extra"], chunks=(100, 1))}
    pred = dasktf.predict(model, dx, client=client)
    want = model.predict(x, verbose=0)
    assert set(pred) == {"label", "score"}
    assert pred["label"].shape == (300, 3) and pred["score"].shape == (300, 1)
    label, score = dask.compute(pred["label"], pred["score"])
    np.testing.assert_allclose(label, want["label"], atol=ATOL)
    np.testing.assert_allclose(score, want["score"], atol=ATOL)
    # A list of inputs, by position, gives the same.
    keras.utils.set_random_seed(1)
    a, b = keras.Input((3,)), keras.Input((2,))
    listed = keras.Model([a, b], [keras.layers.Dense(2)(a), keras.layers.Dense(1)(b)])
    xs = [x["image"][:, 0, :], x["extra"]]
    out = dasktf.predict(listed, [da.from_array(v, chunks=50) for v in xs], client=client)
    for got, ref in zip(dask.compute(*out), listed.predict(xs, verbose=0), strict=True):
        np.testing.assert_allclose(got, ref, atol=ATOL)


def test_dataframe_keeps_index_and_divisions(client, tmp_path):
    model, x = _mlp(), _rows(400)
    index = pd.Index(np.arange(400) * 7 + 3, name="row_id")
    df = dd.from_pandas(pd.DataFrame(x, columns=list("abcdefgh"), index=index),
                        npartitions=5)
    framed = dasktf.predict(model, df, as_frame=True, client=client)
    assert framed.divisions == df.divisions and framed.npartitions == 5
    got = framed.compute()
    assert got.index.equals(index) and list(got.columns) == ["0", "1", "2"]
    want = model.predict(x, verbose=0)
    np.testing.assert_allclose(got.to_numpy(), want, atol=ATOL)
    # String column names: Dask writes the frame to Parquet as it comes (issue 36).
    framed.to_parquet(tmp_path / "predictions")
    back = dd.read_parquet(tmp_path / "predictions").compute()
    pd.testing.assert_frame_equal(back, got)
    # Without as_frame: arrays, as Keras' predict returns them.
    np.testing.assert_allclose(dasktf.predict(model, df, client=client).compute(), want,
                               atol=ATOL)
    with pytest.raises(ValueError, match="as_frame=True needs x to be a Dask DataFrame"):
        dasktf.predict(model, da.from_array(x), as_frame=True, client=client)


def _preprocessing_model(numbers: np.ndarray, words: np.ndarray):
    """An adapted Normalization on the numbers, a StringLookup on the words."""
    keras.utils.set_random_seed(2)
    num = keras.Input((3,), name="num")
    word = keras.Input((1,), name="word", dtype="string")
    norm = keras.layers.Normalization()
    norm.adapt(numbers)
    lookup = keras.layers.StringLookup(output_mode="one_hot")
    lookup.adapt(words)
    h = keras.layers.Concatenate()([norm(num), keras.layers.Flatten()(lookup(word))])
    return keras.Model({"num": num, "word": word},
                       keras.layers.Dense(2, activation="softmax")(h))


def test_preprocessing_layers_from_arrays_and_frame_columns(client):
    rng = np.random.default_rng(3)
    numbers = rng.normal(loc=5.0, scale=3.0, size=(240, 3)).astype(np.float32)
    words = rng.choice(["red", "green", "blue", "unseen"], size=240)
    model = _preprocessing_model(numbers, words[:200])
    import tensorflow as tf

    want = model.predict({"num": numbers, "word": tf.constant(words[:, None])}, verbose=0)
    dx = {"num": da.from_array(numbers, chunks=50),
          "word": da.from_array(words[:, None].astype(object), chunks=(50, 1))}
    np.testing.assert_allclose(dasktf.predict(model, dx, client=client).compute(), want,
                               atol=ATOL)
    # A frame feeds named inputs column by column: a 3-wide input is no column.
    frame = pd.DataFrame({"word": pd.Categorical(words)})
    frame[["n0", "n1", "n2"]] = numbers
    ddf = dd.from_pandas(frame, npartitions=4)
    with pytest.raises(ValueError, match=r"model's inputs \['num'\] are not columns of x"):
        dasktf.predict(model, ddf, client=client)


def test_frame_columns_feed_named_inputs(client):
    rng = np.random.default_rng(4)
    age = rng.uniform(20, 60, size=200).astype(np.float32)
    city = rng.choice(["paris", "oslo", "lima"], size=200)
    keras.utils.set_random_seed(4)
    a = keras.Input((1,), name="age")
    c = keras.Input((1,), name="city", dtype="string")
    norm = keras.layers.Normalization()
    norm.adapt(age[:, None])
    lookup = keras.layers.StringLookup(vocabulary=["paris", "oslo"], output_mode="one_hot")
    model = keras.Model({"age": a, "city": c}, keras.layers.Dense(1)(
        keras.layers.Concatenate()([norm(a), keras.layers.Flatten()(lookup(c))])))
    import tensorflow as tf

    want = model.predict({"age": age[:, None], "city": tf.constant(city[:, None])},
                         verbose=0)
    frame = pd.DataFrame({"city": pd.Categorical(city), "age": age, "other": 1.0})
    ddf = dd.from_pandas(frame, npartitions=3)
    # a column that is no input is left out, and said so (fit refuses it)
    with pytest.warns(UserWarning, match=r"not inputs of the model: \['other'\]"):
        got = dasktf.predict(model, ddf, client=client).compute()
    np.testing.assert_allclose(got, want, atol=ATOL)
    as_text = dd.from_pandas(frame.astype({"city": "string"})[["city", "age"]],
                             npartitions=3)
    # only the inputs' columns: nothing to say (recorded, not raised: the filters
    # are the process's, and the cluster's threads run beside this one)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = dasktf.predict(model, as_text, as_frame=True, client=client).compute()
    assert not [w for w in caught if "not inputs of the model" in str(w.message)]
    np.testing.assert_allclose(got.to_numpy(), want, atol=ATOL)
    assert got.index.equals(frame.index)


def test_mismatched_inputs_fail_before_any_task(client):
    keras.utils.set_random_seed(5)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(
        keras.layers.Concatenate()([a, b])))
    x3, x2 = da.zeros((40, 3), chunks=10), da.zeros((40, 2), chunks=10)
    before = _scheduler_tasks(client)
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        dasktf.predict(model, {"a": x3}, client=client)
    with pytest.raises(ValueError, match=r"not inputs of the model: \['c'\]"):
        dasktf.predict(model, {"a": x3, "b": x2, "c": x2}, client=client)
    with pytest.raises(ValueError, match=r"x\['b'\] has rows of shape \(3,\), but the "
                                         r"model's input 'b' takes rows of shape \(2,\)"):
        dasktf.predict(model, {"a": x3, "b": x3}, client=client)
    with pytest.raises(ValueError, match=r"x\['b'\] holds text"):
        dasktf.predict(model, {"a": x3, "b": da.from_array(np.full((40, 2), "z"))},
                       client=client)
    with pytest.raises(ValueError, match="takes 2 inputs"):
        dasktf.predict(model, x3, client=client)
    with pytest.raises(ValueError, match="as many rows"):
        dasktf.predict(model, {"a": x3, "b": da.zeros((41, 2))}, client=client)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        dasktf.predict(model, {"a": x3, "b": x2}, batch_size=0, client=client)
    with pytest.raises(TypeError, match=r"model must be a keras\.Model"):
        dasktf.predict(42, x3, client=client)
    assert _scheduler_tasks(client) == before


def test_graph_carries_the_models_key_not_its_bytes(client):
    """1,000 partitions: the graph's pickled size does not depend on the model's."""
    x = da.zeros((4000, 64), chunks=(4, 64), dtype=np.float32)
    assert x.numblocks[0] == 1000
    small, large = _mlp(64, 10, hidden=8), _mlp(64, 10, hidden=2048)
    sizes = {}
    for name, model in (("small", small), ("large", large)):
        pred = dasktf.predict(model, x, client=client)
        graph = dict(pred.__dask_graph__())
        sizes[name] = len(pickle.dumps(graph))
        assert len(graph) >= 1000
    large_bytes = len(pickle.dumps(large))  # what map_blocks(model.predict) puts in each task
    assert large_bytes > 500_000
    assert abs(sizes["large"] - sizes["small"]) < 2_000, sizes
    assert sizes["large"] < large_bytes, (sizes, large_bytes)


def test_models_are_built_once_per_worker(client):
    model, x = _mlp(seed=7), _rows(seed=7)
    from dasktf.runtime.inference import cached_models
    from dasktf.transport import ModelPackage

    key = ModelPackage.pack(model).key
    for _ in range(2):
        dasktf.predict(model, da.from_array(x, chunks=20), client=client).compute()
    held = client.run(cached_models)
    assert sum(keys.count(key) for keys in held.values()) >= 1
    assert all(keys.count(key) <= 1 for keys in held.values())


def test_inference_cache_keeps_the_last_few_models():
    """The worker-side LRU, in this process: one model per package, the least
    recently used dropped past dasktf.inference.cache-size."""
    from dasktf.runtime.inference import cached_models, inference_model
    from dasktf.transport import ModelPackage

    packages = [ModelPackage.pack(_mlp(seed=s)) for s in (11, 12, 13)]
    with dask.config.set({"dasktf.inference.cache-size": 2}):
        first = inference_model(packages[0])
        assert inference_model(packages[0]) is first
        inference_model(packages[1])
        inference_model(packages[0])  # used again: now the most recent
        inference_model(packages[2])
        held = cached_models()
    assert packages[1].key not in held
    assert held[-2:] == [packages[0].key, packages[2].key]
    x = _rows(50)
    np.testing.assert_allclose(first.predict(x, batch_size=16),
                               first.model.predict(x, verbose=0), atol=ATOL)


def test_evaluate_equals_keras(client):
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc")],
                  weighted_metrics=[keras.metrics.BinaryAccuracy(name="weighted_acc")])
    x = _rows(700, seed=8)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.float32)
    w = np.random.default_rng(8).uniform(0.1, 2.0, size=700).astype(np.float32)
    want = model.evaluate(x, y, sample_weight=w, verbose=0, return_dict=True)
    got = dasktf.evaluate(model, da.from_array(x, chunks=90), da.from_array(y, chunks=90),
                          sample_weight=da.from_array(w, chunks=90), client=client)
    assert set(got) == set(want) == {"loss", "accuracy", "auc", "weighted_acc"}
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name
    # A frame with the label as a column, in partitions of unequal size.
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(8)]).assign(label=y)
    ddf = dd.from_pandas(frame, npartitions=6)
    got = dasktf.evaluate(model, ddf, "label", client=client)
    want = model.evaluate(x, y, verbose=0, return_dict=True)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name
    uncompiled = _mlp()
    with pytest.raises(ValueError, match="is not compiled"):
        dasktf.evaluate(uncompiled, da.from_array(x), da.from_array(y), client=client)


def test_trainer_predicts_and_evaluates_its_model(client, small_digits):
    x, y = small_digits
    with dasktf.Trainer("mnist-mlp", client=client, optimizer="adam", seed=0,
                        metrics=["accuracy"]) as trainer:
        with pytest.raises(RuntimeError, match="Call fit"):
            trainer.predict(x)
        trainer.fit(x, y, epochs=1, batch_size=64, verbose=0)
        pred = trainer.predict(da.from_array(x, chunks=60))
        np.testing.assert_allclose(pred.compute(), trainer.model.predict(x, verbose=0),
                                   atol=ATOL)
        got = trainer.evaluate(da.from_array(x, chunks=60), da.from_array(y, chunks=60))
        want = trainer.model.evaluate(x, y, verbose=0, return_dict=True)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["accuracy"] == pytest.approx(want["accuracy"])


def test_no_client_is_a_clear_error():
    model = _mlp()
    with pytest.raises(ValueError, match="No Dask client"):
        dasktf.predict(model, da.zeros((10, 8)))


@pytest.mark.slow
def test_lost_worker_during_prediction_is_retried_with_the_same_result():
    """A real worker process killed while partitions are being predicted: Dask
    runs its tasks again elsewhere (they are pure) and the result is unchanged."""
    model, x = _mlp(seed=9, hidden=256), _rows(20_000, seed=9)
    want = model.predict(x, verbose=0)
    # The session cluster fails a task on its first lost worker; this one retries.
    with dask.config.set({"distributed.scheduler.allowed-failures": 3}), \
            own_cluster(3, timeout=60) as (_, client):
        pids = client.run(os.getpid)
        blocks = dasktf.predict(model, da.from_array(x, chunks=250), client=client)
        futures = client.compute(list(blocks.to_delayed().ravel()))
        first = next(as_completed(futures))
        # The worker that computed the first block: its result is lost with it and
        # the blocks it was still computing are run again on the others.
        victim = next(iter(client.who_has([first])[first.key]))
        pending = sum(not f.done() for f in futures)
        os.kill(pids[victim], signal.SIGKILL)
        got = np.concatenate(client.gather(futures))
    assert pending > 0
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_cli_predict_writes_a_partition_per_input_partition(cluster, tmp_path):
    from click.testing import CliRunner

    from dasktf.cli import main

    model, x = _mlp(seed=10), _rows(500, seed=10)
    path = tmp_path / "model.keras"
    model.save(path)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(8)],
                         index=pd.Index(np.arange(500) + 1000, name="id"))
    dd.from_pandas(frame.assign(label="ignored"), npartitions=4).to_parquet(tmp_path / "in")
    out = tmp_path / "out"
    args = ["predict", "-m", str(path), "-d", str(tmp_path / "in"), "-o", str(out),
            "--columns", ",".join(frame.columns), "--scheduler", cluster.scheduler_address]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Wrote 500 predictions in 4 partition(s)" in result.output
    assert sorted(os.listdir(out)) == [f"part.{i}.parquet" for i in range(4)]
    got = pd.read_parquet(out)
    assert got.index.equals(frame.index)
    np.testing.assert_allclose(got.to_numpy(), model.predict(x, verbose=0), atol=ATOL)
    # An output directory holding files is not overwritten by accident.
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "--overwrite" in again.output
    bad = CliRunner().invoke(main, [*args[:7], "--columns", "f0,nope", "--overwrite",
                                    "--scheduler", cluster.scheduler_address])
    assert bad.exit_code == 2 and "['nope'] are not in" in bad.output
