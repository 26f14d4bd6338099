"""The factory: what the training data ``x`` is, decided here and only here.

:func:`make_source` picks one adapter per input kind, as Keras'
``data_adapters.get_data_adapter`` does: in-memory arrays (:mod:`.arrays`), Dask
collections (:mod:`.dask_collections`), a function run on the workers
(:mod:`.loaders`); a ``tf.data.Dataset`` or ``keras.utils.PyDataset`` built here is
read into arrays first (:mod:`.keras_inputs`). The adapters never ask again.
"""

from __future__ import annotations

import inspect
from typing import Any

from dasktf.data.arrays import ArraySource
from dasktf.data.base import Source
from dasktf.data.dask_collections import dask_source
from dasktf.data.keras_inputs import generator_refused, read_input
from dasktf.data.loaders import DatasetFnSource, LoaderSource
from dasktf.data.named_inputs import frame_inputs, names_columns
from dasktf.data.shards import Shard, check_class_weight
from dasktf.data.structure import is_dask, is_frame, is_nested, leaves
from dasktf.data.validation import Validation, split_validation, validation_parts


def make_source(x: Any, y: Any = None, sample_weight: Any = None,
                class_weight: dict[int, float] | None = None, stream: bool = False,
                seed: int = 0, model: Any = None) -> Source:
    """Pick the adapter for what the user passed as training data (see
    :func:`fit_inputs`, which also takes the validation data)."""
    return fit_inputs(x, y, sample_weight, class_weight=class_weight, stream=stream,
                      seed=seed, model=model)[0]


def fit_inputs(x: Any, y: Any = None, sample_weight: Any = None, *,
               validation_data: Any = None, validation_split: float = 0.0,
               class_weight: dict[int, float] | None = None, stream: bool = False,
               seed: int = 0, model: Any = None) -> tuple[Source, Validation | None]:
    """``fit``'s data, decided once: the training data's adapter and the validation
    data as ``(x, y, sample_weight)`` (given, or Keras' ``validation_split``).

    ``x``, ``y`` and ``sample_weight`` may each be an array or a (nested) list,
    tuple or dict of arrays, matched to the model's inputs and outputs as Keras
    matches them. A DataFrame (pandas or Dask) feeds a ``model`` with named inputs
    column by column, by input name (:mod:`.named_inputs`); ``y`` and
    ``sample_weight`` may name its columns. ``model``: the built model where the
    client has it (a factory's inputs are unknown here: its frames are read whole).

    Raises
    ------
    TypeError
        ``x`` is none of: arrays, Dask arrays, a shard loader.
    ValueError
        The arrays are inconsistent (row counts, NaN/inf values), or
        ``class_weight`` is given with ``sample_weight`` or a multi-output ``y``.
    """
    if class_weight is not None and sample_weight is not None:
        raise ValueError("Give sample_weight or class_weight, not both (as in Keras).")
    if validation_split and validation_data is None and reads_on_client(x):
        raise ValueError("validation_split is only supported for arrays and frames (as "
                         f"in Keras), not a {type(x).__name__}; pass validation_data.")
    x, y, sample_weight, batch_size = _as_given(x, y, sample_weight, model, "x")
    kind = input_kind(x, y, sample_weight)
    if validation_data is not None:
        if reads_on_client(validation_data):
            validation_data = (validation_data, None, None)
        validation_data = _as_given(*validation_parts(validation_data), model,
                                    "validation_data")[:3]
    elif validation_split:
        (x, y, sample_weight), validation_data = split_validation(
            x, y, sample_weight, validation_split, kind)
    source = _adapter(kind, x, y, sample_weight, class_weight, stream, seed)
    #: the batches' size of data read on the client: the run's if fit gets none
    source.batch_size_read = batch_size
    return source, validation_data


def _as_given(x: Any, y: Any, sample_weight: Any, model: Any, what: str
              ) -> tuple[Any, Any, Any, int | None]:
    """Data read here (a Dataset, a PyDataset) as arrays and its batch size; a
    DataFrame as the model takes it; anything else as it is."""
    batch_size = None
    if reads_on_client(x):  # tf.data.Dataset, keras.utils.PyDataset, a generator
        if y is not None or sample_weight is not None:
            raise ValueError(f"y and sample_weight must be None when x is a "
                             f"{type(x).__name__} (it yields them).")
        data, batch_size = read_on_client(x, what)
        x, y, sample_weight = data.x, data.y, data.w
    if is_frame(x) or names_columns(y) or names_columns(sample_weight):
        x, y, sample_weight = frame_inputs(model, x, y, sample_weight)
    return x, y, sample_weight, batch_size


def _adapter(kind: str, x: Any, y: Any, sample_weight: Any,
             class_weight: dict[int, float] | None, stream: bool, seed: int) -> Source:
    if class_weight is not None and not callable(x):
        check_class_weight(class_weight, y)
    if kind == "function":
        if y is not None or sample_weight is not None:
            raise ValueError(
                "y and sample_weight must be None when x is a shard loader or a "
                "dataset_fn; it gives (x, y) or (x, y, sample_weight)."
            )
        if accepts_context(x):
            return DatasetFnSource(x, seed, class_weight)
        return LoaderSource(x, class_weight)
    if stream and kind not in ("dask", "mixed"):
        raise ValueError(
            "stream=True reads lazy Dask arrays or DataFrames part by part on the "
            "workers; in-memory arrays are placed whole. Pass Dask collections (e.g. "
            "dd.read_parquet(...)), a loader yielding parts, or a dataset_fn."
        )
    if kind == "arrays" and not stream:
        bad = [path for path, leaf in leaves(x, "x") if not (
            hasattr(leaf, "__array__") or isinstance(leaf, (list, tuple, int, float)))]
        if bad or callable(x):
            raise TypeError(
                "x must be a NumPy array (or array-like), a Dask array, a list/tuple/dict "
                "of them, or a shard loader load(shard_index, num_shards) -> (x, y); got "
                f"{type(x).__name__}" + (f" at {', '.join(bad)}." if is_nested(x) else ".")
            )
        return ArraySource(x, y, sample_weight, class_weight)
    if kind == "mixed" and not stream:
        raise TypeError(
            "Some of x, y and sample_weight are Dask arrays and some are in memory; "
            "pass them all alike (dask.array.from_array wraps in-memory ones)."
        )
    return dask_source(x, y, sample_weight, class_weight, stream)


def input_kind(x: Any, y: Any = None, sample_weight: Any = None) -> str:
    """What the training data is, decided once: ``"function"`` (``x`` a shard
    loader or a ``dataset_fn``), ``"dask"`` (Dask arrays, DataFrames, Series),
    ``"mixed"`` (some of them Dask, some in memory), else ``"arrays"``."""
    if callable(x) and not hasattr(x, "__array__") and not is_nested(x):
        return "function"
    dask = {is_dask(leaf) for nest in (x, y, sample_weight) if nest is not None
            for _, leaf in leaves(nest) if not isinstance(leaf, str)}  # str: a column
    return "mixed" if dask == {True, False} else "dask" if dask == {True} else "arrays"


def accepts_context(fn: Any) -> bool:
    """A callable of one argument: a ``dataset_fn(ctx)``, not a ``load(i, n)``."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                         p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def is_tf_dataset(x: Any) -> bool:
    return type(x).__module__.startswith("tensorflow") and hasattr(x, "element_spec")


def is_py_dataset(x: Any) -> bool:
    """A ``keras.utils.PyDataset`` (Keras 3's loader class; ``Sequence`` in Keras 2)."""
    import keras

    return isinstance(x, keras.utils.PyDataset)


def is_generator(x: Any) -> bool:
    return inspect.isgenerator(x) or (hasattr(x, "__next__") and hasattr(x, "__iter__")
                                      and not hasattr(x, "__len__"))


def reads_on_client(x: Any) -> bool:
    """Data only this process can read: its batches come here, not to the workers."""
    return is_tf_dataset(x) or is_py_dataset(x) or is_generator(x)


def read_on_client(x: Any, what: str = "x") -> tuple[Shard, int]:
    """A ``tf.data.Dataset`` or a ``keras.utils.PyDataset`` read into one shard (when
    small), and its batch size; a generator refused. ``what``: ``"x"`` or
    ``"validation_data"``."""
    if is_generator(x):
        raise generator_refused(what)
    tf_dataset = is_tf_dataset(x)
    if not (tf_dataset or is_py_dataset(x)):
        raise TypeError(f"{what} is not read on the client: {type(x).__name__}.")
    return read_input(x, what, tf_dataset)
