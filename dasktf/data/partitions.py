"""Dask collections cut into partitions: the tasks of each partition's arrays.

Dask arrays, DataFrames and Series (or nests of them, for several inputs and
outputs) become one list: per partition, the nest ``[x, y(, w)]`` of
:class:`PartLeaf` tasks. The resident source computes those tasks on the cluster,
where the partitions live, the streamed one on the worker, one partition at a time
(:mod:`dasktf.data.dask_collections`). A DataFrame of features becomes one
float32 matrix and must be numeric; a Series among the features is one column,
``(n, 1)``, as Keras' ``fit`` reads a pandas Series: floats as float32, integers and
booleans as they are, strings, object and category columns as strings (a string
lookup layer's input). Labels and weights must be numeric. A column that breaks
these rules is refused by name, from the frame's metadata, before anything is
computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dasktf.data.structure import (
    Nest,
    broadcast_to,
    column_kind,
    first_leaf,
    holds_frames,
    is_dask_frame,
    leaves,
    map_named,
    map_nest,
    num_rows,
    strings_or_numbers,
)


@dataclass(frozen=True)
class PartLeaf:
    """One array of a partition: its task (a ``Delayed``) and how the computed
    value becomes an array: ``"array"`` as it is, ``"features"`` a frame as
    float32 (a series: one column, see the module docstring), ``"labels"`` a frame
    or series as integers (float32 if it holds floats). ``path``: its name in
    ``x``/``y`` (``x['thal']``), for messages."""

    delayed: Any
    kind: str
    path: str = ""


def convert(value: Any, kind: str, path: str = "x") -> np.ndarray:
    """A computed partition leaf as the array a shard holds (see :class:`PartLeaf`)."""
    if kind == "array":
        array = np.asarray(value)
        return strings_or_numbers(path, array) if array.dtype == object else array
    array = value.to_numpy()
    if kind == "features" and value.ndim == 1:  # one column, as Keras reads a Series
        if array.dtype.kind == "f":
            array = array.astype(np.float32)
        elif array.dtype.kind not in "iub":
            array = strings_or_numbers(path, array.astype(object))
        return array[:, None]
    if kind == "features" or array.dtype.kind not in "iub":
        array = array.astype(np.float32)
    return array


def partition_leaves(x: Nest, y: Nest, sample_weight: Nest) -> tuple[list[Any], list[int] | None]:
    """Per partition, the nest ``[x, y(, w)]`` of its :class:`PartLeaf` tasks, and
    the rows per partition where they are known (arrays; frames: ``None``).

    Frames give their partitions as declared (unoptimized: an optimized read may
    merge small files differently for different columns), and their tasks are
    shared between features and labels, so one compute reads a partition once.
    Arrays mixed with frames are cut into the frames' partitions (counted on the
    cluster).
    """
    if y is None:
        raise ValueError("y is required when x is a Dask array or DataFrame.")
    if holds_frames(x, y, sample_weight):
        x, y, sample_weight = select_columns(x, y, sample_weight)
    nests = [x, y] + ([] if sample_weight is None else [broadcast_to(sample_weight, y)])
    names = ["x", "y", "sample_weight"]
    frames = [f for nest in nests for _, f in leaves(nest) if is_dask_frame(f)]
    if frames:
        parts = {f.npartitions for f in frames}
        if len(parts) > 1:
            raise ValueError(f"The Dask frames must have as many partitions each; got "
                             f"{sorted(parts)}.")
        lengths = None
        if len(frames) < sum(1 for nest in nests for _ in leaves(nest)):  # arrays too
            lengths = frame_lengths(frames[0])
        tasks = [map_named(lambda path, a, kind=kind: _frame_tasks(a, kind, lengths, path),
                           nest, name)
                 for nest, kind, name in zip(nests, ["features", "labels", "labels"], names,
                                             strict=False)]
    else:
        num_rows(dict(zip(names, nests, strict=False)))
        lead = first_leaf(x).rechunk({i: -1 for i in range(1, first_leaf(x).ndim)})
        lengths = list(lead.chunks[0])
        tasks = [map_named(lambda path, a: _array_tasks(a, lengths, path), nest, name)
                 for nest, name in zip(nests, names, strict=False)]
    count = len(first_leaf(tasks[0]))
    return [map_nest(lambda t, j=j: t[j], tasks) for j in range(count)], lengths


def _objects(items: list[Any]) -> np.ndarray:
    """A list as a 1-d object array: a leaf to :func:`map_nest`, not a nest."""
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def _frame_tasks(leaf: Any, kind: str, lengths: list[int] | None, path: str) -> np.ndarray:
    if is_dask_frame(leaf):
        return _objects([PartLeaf(d, kind, path)
                         for d in leaf.to_delayed(optimize_graph=False)])
    return _array_tasks(leaf, lengths, path)


def _array_tasks(array: Any, lengths: list[int] | None, path: str) -> np.ndarray:
    import dask.array as da

    array = da.asarray(array)
    array = array.rechunk({0: tuple(lengths), **{i: -1 for i in range(1, array.ndim)}})
    return _objects([PartLeaf(d, "array", path) for d in array.to_delayed().ravel()])


def frame_lengths(frame: Any) -> list[int]:
    """Rows per declared partition, counted on the cluster (the client gets ints)."""
    import dask

    counts = [dask.delayed(len)(d) for d in frame.to_delayed(optimize_graph=False)]
    return [int(n) for n in dask.compute(*counts)]


def compute_leaves(x: Nest, y: Nest, sample_weight: Nest) -> tuple[Nest, Nest, Nest]:
    """Frames and Dask arrays computed into NumPy arrays here, on the client (for
    validation data, which is small)."""
    import dask

    if holds_frames(x, y, sample_weight):
        x, y, sample_weight = select_columns(x, y, sample_weight)

    def local(path: str, value: Any, kind: str) -> Any:
        if is_dask_frame(value):
            return convert(value.compute(), kind, path)
        if type(value).__module__.startswith("dask"):
            return np.asarray(dask.compute(value)[0])
        return value

    return (map_named(lambda p, v: local(p, v, "features"), x, "x_val"),
            map_named(lambda p, v: local(p, v, "labels"), y, "y_val"),
            None if sample_weight is None else map_named(
                lambda p, v: local(p, v, "labels"), sample_weight, "sample_weight_val"))


def select_columns(x: Nest, y: Any, sample_weight: Any) -> tuple[Nest, Nest, Nest]:
    """Every frame's dtypes checked (``y`` and ``sample_weight`` that named columns
    were taken out of ``x`` by the factory: :func:`.named_inputs.frame_inputs`)."""
    if y is None:
        raise ValueError("y is required when x is a Dask DataFrame: give a Series, a "
                         "DataFrame, or the name(s) of x's label column(s).")
    check_numeric({"x": x, "y": y, "sample_weight": sample_weight})
    return x, y, sample_weight


def check_numeric(nests: dict[str, Nest]) -> None:
    """Refuse, by name and from the frames' metadata alone, what no model input
    can be: a non-numeric column in a DataFrame of features or among the labels
    and weights, a date or time column anywhere. A Series of strings, objects or
    categories among the features is one string column (a lookup layer's input)."""
    for name, nest in nests.items():
        if nest is None:
            continue
        for path, leaf in leaves(nest, name):
            if not is_dask_frame(leaf):
                continue
            column = name == "x" and leaf.ndim == 1
            bad = {str(c): str(t) for c, t in _dtypes(leaf).items()
                   if column_kind(t) is None and not (column and _stringlike(t))}
            if not bad:
                continue
            said = ", ".join(f"{c!r} ({t})" for c, t in bad.items())
            if name == "x" and leaf.ndim == 2:
                raise ValueError(
                    f"{path} has columns that are not numeric: {said}. A DataFrame of "
                    "features for a model without named inputs is one float32 matrix; "
                    "a model that takes string or categorical columns takes each as an "
                    "input of its own (keras.io's structured data classification), "
                    "matched to the frame's columns by name when fit gets the built "
                    "keras.Model (a function that builds it is called on the workers, "
                    "after the data is placed): pass the model itself, or pass "
                    "x={name: df[name] for name in df.columns}. Or encode them first "
                    "(df[col].cat.codes after categorize(), dd.get_dummies).")
            raise ValueError(
                f"{path} is not numeric: {said}. "
                + ("Labels and sample weights must be numbers: encode them first (e.g. "
                   "df[col].cat.codes after categorize())." if name != "x" else
                   "Convert it to numbers or strings first."))


def _stringlike(dtype: Any) -> bool:
    """Strings, Python objects (strings, checked when computed) or categories."""
    return str(dtype).lower().startswith(("object", "string", "str", "category"))


def _dtypes(frame: Any) -> dict[Any, Any]:
    return dict(frame.dtypes) if frame.ndim == 2 else {frame.name: frame.dtype}
