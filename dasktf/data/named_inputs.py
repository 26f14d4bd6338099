"""A DataFrame's columns matched to a model's named inputs, as Keras matches a dict.

keras.io's structured-data models take one ``keras.Input(name=column)`` per
column: a ``StringLookup`` behind a string input, a ``Normalization`` behind a
number. Such a model reads a DataFrame column by column, each input the column of
its name; any other model reads it whole, its columns as one feature matrix. Both
:func:`dasktf.fit` (:func:`frame_inputs`) and :func:`dasktf.predict` and
``evaluate`` (:mod:`dasktf.inference.inputs`) decide it here, from the model's
input specs and the frame's column names alone (pandas, or Dask's metadata).
"""

from __future__ import annotations

from typing import Any

from dasktf import compat
from dasktf.data.structure import Nest, is_frame, is_nested


def model_inputs(model: Any) -> Nest:
    """The model's input specs (``KerasTensor``) in the structure its call takes,
    or ``None`` where Keras does not know them (a subclassed model, a model
    factory not yet called)."""
    if isinstance(model, compat.functional_class()):
        return model.input
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    return inputs[0] if inputs and len(inputs) == 1 else None


def named_specs(specs: Nest) -> list[tuple[Any, str, Any]]:
    """``(key, name, spec)`` per input: a dict model's inputs by key (as Keras
    matches a dict ``x``), a list's by position and their ``Input(name=...)``."""
    if isinstance(specs, dict):
        return [(key, str(key), kt) for key, kt in specs.items()]
    if isinstance(specs, (list, tuple)):
        return [(i, str(kt.name), kt) for i, kt in enumerate(specs)]
    return [(None, str(specs.name), specs)]


def by_column(specs: Nest, columns: list[str]) -> bool:
    """Whether a frame of ``columns`` feeds the model column by column: it has
    several inputs, or its one input is named after a column and takes one value
    per row (a one-input model otherwise reads the frame whole, as a matrix)."""
    if specs is None:
        return False
    if is_nested(specs) and len(named_specs(specs)) > 1:
        return True
    (_, name, kt), = named_specs(specs)
    return name in columns and tuple(kt.shape[1:]) in ((), (1,), (None,))


def input_columns(specs: Nest, columns: list[str]) -> list[tuple[Any, str, Any]]:
    """``(key, column, spec)`` per model input; a ``ValueError`` naming the inputs
    that are not columns of the frame."""
    wanted = named_specs(specs)
    missing = [name for _, name, _ in wanted if name not in columns]
    if missing:
        raise ValueError(
            f"The model's inputs {missing} are not columns of x (its columns: "
            f"{columns}): a DataFrame feeds a model with named inputs column by "
            "column, by input name. Rename the columns, or pass x as a dict "
            "{input name: array}.")
    return wanted


def frame_inputs(model: Any, x: Any, y: Any, sample_weight: Any) -> tuple[Nest, Any, Any]:
    """A pandas or Dask DataFrame ``x`` as the model takes it: ``y`` and
    ``sample_weight`` taken out where they name columns; then, for a model with
    named inputs (:func:`by_column`), ``{input name: column}`` (a one-input model:
    the column), each a Series, a string column reaching its input as
    ``tf.string``. A frame the model reads whole comes back as a frame.

    Raises
    ------
    ValueError
        An input that is not a column, or columns that are neither an input nor
        ``y`` nor ``sample_weight``.
    """
    x, y, sample_weight = label_columns(x, y, sample_weight)
    columns = [str(c) for c in x.columns]
    specs = None if model is None else model_inputs(model)
    if not by_column(specs, columns):
        return x, y, sample_weight
    wanted = input_columns(specs, columns)
    used = [name for _, name, _ in wanted]
    left = [c for c in columns if c not in used]
    if left:
        raise ValueError(
            f"x has columns that are not inputs of the model: {left} (its inputs: "
            f"{used}). A DataFrame feeds a model with named inputs column by column; "
            "drop those columns (x.drop(columns=[...])), or name them as y or "
            "sample_weight (y='label').")
    fed = {str(c): x[c] for c in x.columns}
    if not is_nested(specs):
        return fed[used[0]], y, sample_weight
    return {name: fed[name] for name in used}, y, sample_weight


def label_columns(x: Nest, y: Any, sample_weight: Any) -> tuple[Nest, Nest, Nest]:
    """``y`` and ``sample_weight`` given as column names of a DataFrame ``x``
    (pandas or Dask) become those columns, taken out of ``x``; anything else is
    returned as it is."""
    named = [v for v in (y, sample_weight) if names_columns(v)]
    if named:
        if not is_frame(x):
            raise ValueError("y or sample_weight names columns, so x must be one "
                             "DataFrame (pandas or Dask) holding them.")
        columns = [c for v in named for c in ([v] if isinstance(v, str) else v)]
        missing = [c for c in columns if c not in x.columns]
        if missing:
            raise ValueError(f"Columns {missing} are not in x (its columns: "
                             f"{list(x.columns)}).")
        y = x[y] if names_columns(y) else y
        sample_weight = x[sample_weight] if names_columns(sample_weight) else sample_weight
        x = x.drop(columns=columns)
    return x, y, sample_weight


def names_columns(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value))
