"""``x`` (and ``y``, ``sample_weight``) for inference: matched to the model, cut
into aligned partitions, checked before any task runs.

The inputs are taken as :func:`dasktf.fit` takes them: Dask arrays, Dask DataFrames
and Series, nests of them (lists, tuples, dicts matching the model's inputs by
position or name, as Keras matches them), and NumPy arrays for convenience. A
DataFrame feeds a one-input model whole (its columns as features) or a model with
named inputs column by column (each input reads the column of its name: a string
column for a ``StringLookup``, a number for a ``Normalization``).

:func:`plan_inputs` reads only metadata (dtypes, per-row shapes, chunks, the
model's input specs) and names the input at fault; the caller then runs the model
on one placeholder row (:meth:`InputPlan.probe`) so whatever the static check
cannot see fails on the client too.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from dasktf import compat
from dasktf.data.feeds import STRING, Feed, probe_rows, read_feeds
from dasktf.data.named_inputs import by_column, input_columns, model_inputs
from dasktf.data.partitions import is_dask_frame
from dasktf.data.structure import (
    Nest,
    is_dask_array,
    is_nested,
    is_pandas,
    leaves,
    map_named,
    map_nest,
)

#: Arrays turned into Dask arrays here are cut into blocks of about this many bytes.
_NUMPY_BLOCK_BYTES = 64 * 2**20


@dataclass
class InputPlan:
    """The collections to read, partition-aligned, and how each partition's blocks
    become the model's inputs (and labels, weights)."""

    #: ``"array"``: Dask arrays with the same row chunks and one chunk on every other
    #: axis; ``"frame"``: Dask DataFrames or Series with as many partitions each.
    kind: str
    collections: list[Any]
    #: Per collection: the dtype and per-row shape its blocks hold (for the probe).
    metas: list[tuple[Any, tuple[int, ...]]]
    x: Nest  # a nest of Feed in the model's input structure
    y: Nest = None
    w: Nest = None

    @property
    def npartitions(self) -> int:
        first = self.collections[0]
        return int(first.npartitions if self.kind == "frame" else first.numblocks[0])

    def probe(self, rows: int = 1) -> tuple[Nest, Nest, Nest]:
        """``rows`` placeholder rows of ``x``, ``y`` and ``w``, read through the
        feeds as a worker reads a partition."""
        parts = [_probe_block(c, meta, rows) for c, meta in zip(self.collections, self.metas,
                                                                   strict=True)]
        return (read_feeds(self.x, parts), read_feeds(self.y, parts),
                read_feeds(self.w, parts))


def _probe_block(collection: Any, meta: tuple[Any, tuple[int, ...]], rows: int) -> Any:
    if is_dask_frame(collection):
        import pandas as pd

        empty = compat.meta(collection)
        frame = empty.to_frame() if empty.ndim == 1 else empty
        data = {c: _probe_column(frame[c].dtype, rows) for c in frame.columns}
        out = pd.DataFrame(data, columns=frame.columns)
        return out[out.columns[0]].rename(empty.name) if empty.ndim == 1 else out
    dtype, shape = meta
    return probe_rows(dtype, shape, rows)


def _probe_column(dtype: Any, rows: int) -> Any:
    import pandas as pd

    if isinstance(dtype, pd.CategoricalDtype):
        known = list(dtype.categories) if dtype.categories is not None else []
        return pd.Categorical([known[0] if known else ""] * rows)
    if _is_text(dtype):
        return [""] * rows
    return np.zeros(rows, dtype=dtype)


def plan_inputs(model: Any, x: Nest, y: Nest = None, sample_weight: Nest = None) -> InputPlan:
    """Match ``x`` to ``model``'s inputs and cut ``x``, ``y``, ``sample_weight`` into
    aligned partitions.

    Raises
    ------
    ValueError
        An input of the model that ``x`` lacks, an array or column of the wrong
        per-row shape or kind (text for a numeric input, numbers for a string one),
        collections whose partitions do not line up.
    TypeError
        ``x`` holds something that is neither an array nor a Dask collection.
    """
    if x is None:
        raise ValueError("x is required: a Dask array or DataFrame (or a nest of them).")
    if is_pandas(x, frame=True) and by_column(model_inputs(model), [str(c) for c in x.columns]):
        x, y, sample_weight = _pandas_as_dask(x, y, sample_weight)
    named = _named_leaves({"x": x, "y": y, "sample_weight": sample_weight})
    collections, metas = _align([c for _, c in named])
    index = {path: i for i, (path, _) in enumerate(named)}
    kind = "frame" if is_dask_frame(collections[0]) else "array"
    feeds_x = match_inputs(model, x, {path: (index[path], c, m) for (path, c), m
                                      in zip(named, metas, strict=True)})

    def plain(nest: Nest, name: str) -> Nest:
        if nest is None:
            return None
        return map_named(lambda path, _: Feed(index[path], None, None, None, path), nest, name)

    return InputPlan(kind, collections, metas, feeds_x, plain(y, "y"), plain(sample_weight,
                                                                           "sample_weight"))


def _pandas_as_dask(x: Any, y: Nest, sample_weight: Nest) -> tuple[Any, Nest, Nest]:
    """A pandas frame for a model with named inputs, and its pandas labels and
    weights, as Dask frames of the same partitions: read column by column as a
    Dask frame is (text columns as strings), not as one NumPy matrix."""
    import dask.dataframe as dd

    n = max(1, -(-int(x.memory_usage(index=False).sum()) // _NUMPY_BLOCK_BYTES))

    def lazy(nest: Nest) -> Nest:
        if nest is None:
            return None
        return map_nest(lambda leaf: dd.from_pandas(leaf, npartitions=n, sort=False)
                        if is_pandas(leaf) or is_pandas(leaf, frame=True) else leaf, nest)

    return lazy(x), lazy(y), lazy(sample_weight)


def _named_leaves(nests: dict[str, Nest]) -> list[tuple[str, Any]]:
    out = []
    for name, nest in nests.items():
        if nest is None:
            continue
        for path, leaf in leaves(nest, name):
            if not (is_dask_frame(leaf) or is_dask_array(leaf) or hasattr(leaf, "__array__")):
                raise TypeError(
                    f"{path} is a {type(leaf).__name__}; dasktf.predict and evaluate take "
                    "Dask arrays, Dask DataFrames or Series, NumPy arrays, or lists/dicts "
                    "of them.")
            out.append((path, leaf))
    return out


# -- partitions ---------------------------------------------------------------------
def _align(items: list[Any]) -> tuple[list[Any], list[tuple[Any, tuple[int, ...]]]]:
    """The collections partition-aligned, and per collection (dtype, row shape)."""
    frames = [is_dask_frame(c) for c in items]
    if any(frames) and not all(frames):
        raise ValueError(
            "x (with y and sample_weight) mixes Dask DataFrames or Series with arrays, "
            "whose partitions cannot be lined up without counting rows: pass every "
            "input as columns of the frame (or Series with its partitions), or "
            "turn the frame into arrays first (df.to_dask_array(lengths=True)).")
    if all(frames):
        counts = {c.npartitions for c in items}
        if len(counts) > 1:
            raise ValueError(f"The Dask frames must have as many partitions each; got "
                             f"{sorted(counts)}.")
        return items, [_frame_meta(c) for c in items]
    import dask.array as da

    arrays = [c if is_dask_array(c) else _from_numpy(np.asarray(c)) for c in items]
    lead = arrays[0]
    if lead.ndim == 0:
        raise ValueError("x must have a leading sample axis; got a scalar.")
    rows = lead.chunks[0]
    if any(np.isnan(n) for n in rows):
        raise ValueError(
            "x has blocks of unknown length (a frame's to_dask_array()): call "
            "x.compute_chunk_sizes() first, or pass the DataFrame itself.")
    out = []
    for a in arrays:
        a = da.asarray(a)
        if a.shape[0] != lead.shape[0]:
            raise ValueError(f"x, y and sample_weight must have as many rows each; got "
                             f"{lead.shape[0]} and {a.shape[0]}.")
        wanted = (rows, *((n,) for n in a.shape[1:]))
        out.append(a if a.chunks == wanted else a.rechunk(wanted))
    return out, [(a.dtype, tuple(int(n) for n in a.shape[1:])) for a in out]


def _from_numpy(array: np.ndarray) -> Any:
    import dask.array as da

    if array.ndim == 0:
        raise ValueError("x must have a leading sample axis; got a scalar.")
    row_bytes = max(1, array[:1].nbytes)
    rows = max(1, min(len(array), _NUMPY_BLOCK_BYTES // row_bytes))
    return da.from_array(array, chunks=(rows, *array.shape[1:]))


def _frame_meta(frame: Any) -> tuple[Any, tuple[int, ...]]:
    meta = compat.meta(frame)
    return (None, (len(meta.columns),)) if meta.ndim == 2 else (meta.dtype, ())


def _is_text(dtype: Any) -> bool:
    """Strings, categories or Python objects: what feeds a string input."""
    import pandas as pd

    if isinstance(dtype, (pd.StringDtype, pd.CategoricalDtype)):
        return True
    if isinstance(dtype, pd.api.extensions.ExtensionDtype):  # nullable Int64, ...
        return False
    return np.dtype(dtype).kind in "OUS"


# -- matching the model's inputs (a frame's columns by name: dasktf.data.named_inputs) --
def match_inputs(model: Any, x: Nest, found: dict[str, tuple[int, Any, Any]]) -> Nest:
    """A nest of :class:`Feed` in the model's input structure (``found``: x's leaf
    paths to their position, collection and (dtype, row shape))."""
    specs = model_inputs(model)
    if specs is None:  # unknown until called: the probe checks
        return map_named(lambda path, _: _feed(found[path], None, path, None), x, "x")
    columns = [str(c) for c in x.columns] if is_dask_frame(x) and x.ndim == 2 else None
    if columns is not None and (is_nested(specs) or by_column(specs, columns)):
        position, _, _ = found["x"]
        wanted = input_columns(specs, columns)
        _warn_unused(columns, [name for _, name, _ in wanted])
        fed = {key: _column_feed(position, x, name, kt) for key, name, kt in wanted}
        if not is_nested(specs):
            return fed[None]
        return fed if isinstance(specs, dict) else [fed[i] for i in range(len(fed))]
    if not is_nested(specs):
        return _match_one(specs, x, found)
    wanted = list(specs.items()) if isinstance(specs, dict) else list(enumerate(specs))
    by_name = {str(kt.name): key for key, kt in wanted}
    if isinstance(x, dict):
        keys = [str(k) for k in x]
        names = [str(k) for k, _ in wanted] if isinstance(specs, dict) else list(by_name)
        missing = [n for n in names if n not in keys]
        extra = [k for k in keys if k not in names]
        if missing or extra:
            raise ValueError(
                f"x's keys {keys} do not match the model's inputs {names}: "
                + (f"missing {missing}" if missing else "")
                + ("; " if missing and extra else "")
                + (f"not inputs of the model: {extra}" if extra else "")
                + ". Key x by the model's input names.")
        fed = {}
        for key, kt in wanted:
            name = str(key) if isinstance(specs, dict) else str(kt.name)
            path = f"x[{name!r}]"
            fed[key] = _feed(found[path], kt, path, _spec_name(key, kt))
        return fed if isinstance(specs, dict) else [fed[i] for i in range(len(wanted))]
    if isinstance(x, (list, tuple)) and isinstance(specs, (list, tuple)):
        if len(x) != len(specs):
            raise ValueError(
                f"The model takes {len(specs)} inputs {list(by_name)}; x holds "
                f"{len(x)}. Give one array per input, in order, or a dict by name.")
        return [_feed(found[f"x[{i}]"], kt, f"x[{i}]", str(kt.name))
                for i, kt in enumerate(specs)]
    raise ValueError(
        f"The model takes {len(wanted)} inputs {list(by_name)}; x is "
        f"{'a list' if isinstance(x, (list, tuple)) else 'one array'}. Give x as a dict "
        "{input name: array} (or a DataFrame with a column per input).")


def _warn_unused(columns: list[str], used: list[str]) -> None:
    """A frame's columns that are no input are left out, and said so (Keras warns
    of a dict's keys that are no input and leaves them out; ``fit`` refuses them,
    as a likely mistake in what the model trains on)."""
    left = [c for c in columns if c not in used]
    if left:
        warnings.warn(
            f"x has columns that are not inputs of the model: {left} (its inputs: "
            f"{used}); they are left out. Select the inputs' columns (x[{used}]) "
            "to silence this.", UserWarning, stacklevel=4)


def _match_one(spec: Any, x: Nest, found: dict[str, tuple[int, Any, Any]]) -> Feed:
    """A one-input model: one leaf of x, the only entry of a list or dict, or a frame
    whole (its columns as the features)."""
    paths = list(found)
    x_paths = [p for p in paths if p == "x" or p.startswith("x[")]
    if len(x_paths) != 1:
        raise ValueError(
            f"The model takes one input (rows of shape {_shape(spec)}); x holds "
            f"{len(x_paths)} arrays ({', '.join(x_paths)}).")
    path = x_paths[0]
    if isinstance(x, dict) and str(next(iter(x))) != str(spec.name):
        raise ValueError(f"x's key {next(iter(x))!r} is not the name of "
                         f"{_called(str(spec.name))}.")
    return _feed(found[path], spec, path, str(spec.name))


def _spec_name(key: Any, kt: Any) -> str:
    return str(key) if isinstance(key, str) else str(kt.name)


def _shape(kt: Any) -> tuple[Any, ...]:
    return tuple(kt.shape[1:])


def _feed(found: tuple[int, Any, Any], kt: Any, path: str, input_name: str | None) -> Feed:
    """How the leaf at ``path`` feeds input ``kt``: its per-row shape and kind checked."""
    position, collection, (dtype, row) = found
    if kt is None:
        text = dtype is not None and _is_text(dtype)
        return Feed(position, None, STRING if text else None, None, path)
    want = _shape(kt)
    text_input = kt.dtype == "string"
    if is_dask_frame(collection):
        dtypes = (list(compat.meta(collection).dtypes) if collection.ndim == 2
                  else [compat.meta(collection).dtype])
        _check_kinds(dtypes, text_input, path, input_name)
        # A whole frame: its columns as one float vector per row (or strings).
        dtype_name = STRING if text_input else str(np.dtype(kt.dtype))
        _check_shape(row, want, path, input_name)
        return Feed(position, None, dtype_name, want, path)
    _check_kinds([dtype], text_input, path, input_name)
    _check_shape(row, want, path, input_name)
    return Feed(position, None, STRING if text_input else None, want, path)


def _column_feed(position: int, frame: Any, column: str, kt: Any) -> Feed:
    path = f"x[column {column!r}]"
    text_input = kt.dtype == "string"
    _check_kinds([compat.meta(frame)[column].dtype], text_input, path, str(kt.name))
    _check_shape((), _shape(kt), path, str(kt.name))
    return Feed(position, column, STRING if text_input else str(np.dtype(kt.dtype)),
                _shape(kt), path)


def _check_kinds(dtypes: list[Any], text_input: bool, path: str, name: str | None) -> None:
    texts = [_is_text(d) for d in dtypes]
    if text_input and not all(texts):
        raise ValueError(
            f"{path} holds numbers ({', '.join(str(d) for d in dtypes)}), but "
            f"{_called(name)} takes strings (dtype string).")
    if not text_input and any(texts):
        said = ", ".join(str(d) for d, t in zip(dtypes, texts, strict=True) if t)
        raise ValueError(
            f"{path} holds text ({said}), but {_called(name)} takes numbers: "
            "give the model a StringLookup (keras.Input(dtype='string')) for it, or "
            "encode it first (e.g. df[col].cat.codes).")


def _check_shape(row: tuple[int, ...], want: tuple[Any, ...], path: str,
                 name: str | None) -> None:
    if len(row) == len(want) and all(w is None or int(w) == r for r, w in
                                     zip(row, want, strict=True)):
        return
    if row == () and tuple(want) in ((1,), (None,)):  # a column for a (None, 1) input
        return
    raise ValueError(
        f"{path} has rows of shape {tuple(row)}, but {_called(name)} takes rows of "
        f"shape {tuple(want)}. Reshape {path}, or check which array feeds which input.")


def _called(name: str | None) -> str:
    """How a message names a model input: Keras names an unnamed one
    ``keras_tensor_<n>``, which says nothing to the user."""
    if name is None or name.startswith("keras_tensor"):
        return "the model's input"
    return f"the model's input {name!r}"


def probe_outputs(model: Any, plan: InputPlan) -> Nest:
    """The model run on one placeholder row, on the client: its output nest (the
    structure, dtypes and per-row shapes of the prediction). Whatever the static
    checks let through and the model refuses fails here, before any task."""
    x = plan.probe(1)[0]
    try:
        return _call(model, x)
    except Exception as exc:
        said = "; ".join(f"{feed.name}: rows of {tuple(feed_x.shape[1:])} {feed_x.dtype}"
                         for feed, feed_x in _pairs(plan.x, x))
        raise ValueError(
            f"The model refuses x ({said}): {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0]} Check x's structure (one array, or a "
            "list/dict matching the model's inputs by position or name) and shapes."
        ) from exc


def _pairs(feeds: Nest, arrays: Nest) -> list[tuple[Feed, np.ndarray]]:
    return list(zip([f for _, f in leaves(feeds)], [a for _, a in leaves(arrays)],
                    strict=True))


def _call(model: Any, x: Nest) -> Nest:
    import tensorflow as tf

    def tensor(a: np.ndarray) -> Any:
        return tf.constant(a.astype(str)) if a.dtype.kind in "OUS" else tf.constant(a)

    out = model(map_nest(tensor, x), training=False)
    return map_nest(lambda t: np.asarray(t), out)
