"""Sharding and batch schedules, without a cluster."""

from __future__ import annotations

import numpy as np
import pytest

from dasktf.data.base import (
    interleaved_indices,
    interleaved_schedule,
    proportional_schedule,
)
from dasktf.data.dask_collections import assign_chunks
from dasktf.data.sources import make_source


@pytest.mark.parametrize("n, batch, workers", [(250, 48, 3), (1000, 100, 3), (7, 7, 7), (101, 10, 1)])
def test_interleaved_shards_reassemble_keras_batches(n, batch, workers):
    schedule = interleaved_schedule(n, batch, workers)
    rows = interleaved_indices(schedule, batch)
    assert schedule.sum() == n and sorted(np.concatenate(rows)) == list(range(n))
    offsets = [np.concatenate([[0], np.cumsum(schedule[:, i])]) for i in range(workers)]
    for k in range(schedule.shape[0]):
        step = np.concatenate([rows[i][offsets[i][k]:offsets[i][k + 1]] for i in range(workers)])
        assert list(step) == list(range(k * batch, min(n, (k + 1) * batch)))


def test_proportional_schedule_reads_every_row_once():
    schedule = proportional_schedule([340, 330, 10], 100)
    assert schedule.shape == (7, 3)
    assert list(schedule.sum(axis=0)) == [340, 330, 10]
    assert schedule.max() - schedule.min(axis=0).min() <= 49


def test_chunks_stay_with_their_holder_unless_it_is_full():
    # Worker a holds three of four equal chunks; fairness moves one of them to b.
    assignment = assign_chunks([10, 10, 10, 10], [["a"], ["a"], ["a"], ["b"]], ["a", "b"])
    assert sorted(map(len, assignment)) == [2, 2]
    assert 3 in assignment[1]


def test_source_dispatch_rejects_unknown_input():
    with pytest.raises(TypeError, match="x must be a NumPy array"):
        make_source(object(), None)
    with pytest.raises(ValueError, match="y is required"):
        make_source(np.zeros((3, 2)), None)
    with pytest.raises(ValueError, match="must be None when x is a shard loader"):
        make_source(lambda i, n: (None, None), np.zeros(3))


def test_the_factory_picks_one_adapter_per_input_kind():
    """``make_source`` decides once what ``x`` is; each kind gets its own adapter."""
    import dask.array as da

    from dasktf.data.arrays import ArraySource
    from dasktf.data.dask_collections import DaskArraySource, DaskStreamSource
    from dasktf.data.loaders import DatasetFnSource, LoaderSource

    x, y = np.zeros((8, 2), dtype="float32"), np.arange(8) % 2
    lazy_x, lazy_y = da.from_array(x, chunks=4), da.from_array(y, chunks=4)
    assert type(make_source(x, y)) is ArraySource
    assert type(make_source(lazy_x, lazy_y)) is DaskArraySource
    assert type(make_source(lazy_x, lazy_y, stream=True)) is DaskStreamSource
    assert type(make_source(lazy_x, y, stream=True)) is DaskStreamSource
    assert type(make_source(lambda i, n: (x, y))) is LoaderSource
    assert type(make_source(lambda ctx: None)) is DatasetFnSource
    with pytest.raises(ValueError, match="stream=True reads lazy"):
        make_source(x, y, stream=True)
    with pytest.raises(TypeError, match="some are in memory"):
        make_source(lazy_x, y)


# -- strings, and the forms of input Keras' fit takes (issue 27) ----------------------
def test_string_inputs_are_kept_and_numeric_checks_apply_to_numbers_only():
    import pandas as pd

    frame = pd.DataFrame({"thal": ["fixed", "normal", "reversible", "normal"],
                          "age": [63.0, 37.0, 41.0, 56.0]})
    source = make_source({"thal": frame["thal"].to_numpy(), "age": frame["age"]},
                         np.array([0, 1, 1, 0]))
    x = source.data.x
    assert x["thal"].dtype == object and list(x["thal"]) == list(frame["thal"])
    assert x["age"].shape == (4, 1)  # a Series is one column, as Keras' fit reads it
    assert source.stats.x["thal"].dtype == "object"
    probe = source.stats.probe(2)[0]
    assert list(probe["thal"]) == ["", ""]  # what the model is first called on
    bytes_source = make_source(np.array([b"a", b"b"], dtype=object), np.array([0, 1]))
    assert bytes_source.data.x.dtype == object  # tf.string elements, as NumPy gives them


@pytest.mark.parametrize("column, match", [
    (np.array([[1, 2, 3], [4, 5]], dtype=object), r"sequence in each row, of lengths \[2, 3\]"),
    (np.array(["a", None, "c"], dtype=object), r"missing values .*first at row 1.*fillna"),
    (np.array(["a", 2, "c"], dtype=object), r"mixes values of types str .*int"),
])
def test_an_object_column_that_is_no_input_names_its_real_cause(column, match):
    with pytest.raises(ValueError, match=match):
        make_source({"c": column}, np.arange(len(column)))
    with pytest.raises(ValueError, match=r"x has rows of different lengths \(ragged\)"):
        make_source([[1.0, 2.0], [3.0]], np.array([0, 1]))


def test_a_dataframe_with_string_columns_points_to_one_input_per_column():
    import pandas as pd

    frame = pd.DataFrame({"thal": ["fixed", "normal"], "age": [63.0, 37.0]})
    with pytest.raises(ValueError, match=r"not numeric: 'thal' \(.*\)\. .*df\[name\] for"):
        make_source(frame, np.array([0, 1]))


def test_datasets_and_py_datasets_are_read_with_their_batch_size_and_generators_refused():
    import keras
    import tensorflow as tf

    from dasktf.data.sources import fit_inputs

    x, y = np.arange(40, dtype="float32").reshape(20, 2), np.arange(20) % 2
    with pytest.warns(UserWarning, match="read it into memory once"):
        source = make_source(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    assert source.batch_size_read == 8 and np.array_equal(source.data.x, x)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[5 * i:5 * (i + 1)], y[5 * i:5 * (i + 1)]

    with pytest.warns(UserWarning, match="keras.utils.PyDataset"):
        source = make_source(Batches())
    assert source.batch_size_read == 5 and np.array_equal(source.data.y, y)
    with pytest.warns(UserWarning):
        val_x, val_y, val_w = fit_inputs(x, y, validation_data=Batches())[1]
    assert np.array_equal(val_x, x) and np.array_equal(val_y, y) and val_w is None
    with pytest.raises(TypeError, match=r"generator: .*read only once and only here"):
        make_source((x[i:i + 5], y[i:i + 5]) for i in range(0, 20, 5))
    import dask

    with dask.config.set({"dasktf.data.materialize-limit": "100B"}), \
            pytest.raises(ValueError, match=r"PyDataset, larger than .*x=dataset_fn"):
        make_source(Batches())


def test_dask_columns_of_strings_and_categories_are_string_inputs():
    import dask.dataframe as dd
    import pandas as pd

    from dasktf.data.partitions import check_numeric, convert

    part = pd.DataFrame({"kind": pd.Categorical(["a", "b", "a"]), "n": [1, 2, 3],
                         "f": [0.5, 1.5, 2.5], "when": pd.to_datetime(["2020-01-01"] * 3)})
    kind = convert(part["kind"], "features", "x['kind']")
    assert kind.shape == (3, 1) and kind.dtype == object and list(kind[:, 0]) == ["a", "b", "a"]
    assert convert(part["n"], "features").dtype == np.int64  # ints stay ints, as in Keras
    assert convert(part["f"], "features").dtype == np.float32
    frame = dd.from_pandas(part, npartitions=1)
    check_numeric({"x": {"kind": frame["kind"], "n": frame["n"]}, "y": frame["n"]})
    with pytest.raises(ValueError, match=r"x\['when'\] is not numeric"):
        check_numeric({"x": {"when": frame["when"]}})
    with pytest.raises(ValueError, match=r"y is not numeric.*Labels and sample weights"):
        check_numeric({"y": frame["kind"]})


def test_validation_split_of_data_read_on_the_client_is_refused_as_keras_refuses_it():
    """Keras takes ``validation_split`` only for arrays; a Dataset's rows are not
    split here either (with ``validation_data`` given, the split is not asked for)."""
    import tensorflow as tf

    from dasktf.data.sources import fit_inputs

    x, y = np.arange(40, dtype="float32").reshape(20, 2), np.arange(20) % 2
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(5)
    with pytest.raises(ValueError, match="validation_split is only supported for arrays"):
        fit_inputs(dataset, validation_split=0.2)
    with pytest.warns(UserWarning):
        source, validation = fit_inputs(dataset, validation_split=0.2,
                                        validation_data=(x[:4], y[:4]))
    assert len(source.data.x) == 20 and len(validation[0]) == 4
    train, val = fit_inputs(x, y, validation_split=0.25)
    assert len(train.data.x) == 15 and np.array_equal(val[0], x[15:])
