"""Nested inputs and outputs: arrays, or lists, tuples and dicts of them.

Keras' ``fit`` takes ``x``, ``y`` and ``sample_weight`` as one array or as a nest
matching the model's inputs and outputs (by position or by name). dasktf keeps the
nest as given and only ever does row-wise work on it: take rows, concatenate
parts, describe each leaf. Every leaf has a path name such as ``x['image']`` or
``y[1]``, so an error says which input or output is at fault.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

Nest = Any  # np.ndarray | list[Nest] | tuple[Nest, ...] | dict[str, Nest]


def is_nested(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict))


def leaves(nest: Nest, name: str = "x") -> Iterator[tuple[str, Any]]:
    """``(path name, leaf)`` pairs in a stable order (dict keys as given)."""
    if isinstance(nest, dict):
        for key, value in nest.items():
            yield from leaves(value, f"{name}[{key!r}]")
    elif isinstance(nest, (list, tuple)):
        for i, value in enumerate(nest):
            yield from leaves(value, f"{name}[{i}]")
    else:
        yield name, nest


def map_nest(fn: Callable[..., Any], nest: Nest, *others: Nest) -> Nest:
    """``fn`` applied leaf by leaf over nests of the same structure."""
    if isinstance(nest, dict):
        return {k: map_nest(fn, v, *(o[k] for o in others)) for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        return type(nest)(
            map_nest(fn, v, *(o[i] for o in others)) for i, v in enumerate(nest)
        )
    return fn(nest, *others)


def map_named(fn: Callable[[str, Any], Any], nest: Nest, name: str = "x") -> Nest:
    """``fn(path name, leaf)`` leaf by leaf, keeping the structure."""
    if isinstance(nest, dict):
        return {k: map_named(fn, v, f"{name}[{k!r}]") for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        return type(nest)(map_named(fn, v, f"{name}[{i}]") for i, v in enumerate(nest))
    return fn(name, nest)


def take(nest: Nest, rows: Any) -> Nest:
    """The rows ``rows`` of every leaf (a plain array is the fast path: every step)."""
    if isinstance(nest, np.ndarray):
        return nest[rows]
    return map_nest(lambda a: a[rows], nest)


def concat(parts: list[Nest]) -> Nest:
    """Row-wise concatenation of nests of the same structure."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return map_nest(lambda *leaf: np.concatenate(leaf), parts[0], *parts[1:])


def as_arrays(nest: Nest, name: str) -> Nest:
    """Every leaf as a NumPy array with a sample axis (a list of numbers at the top
    is one array, as Keras reads it, not a list of scalar inputs). Numbers, and
    strings (``str`` or ``bytes``: NumPy object arrays from pandas, ``tf.string``
    elements) are kept as they are; a pandas Series in ``x`` is one column, as
    Keras' ``fit`` takes it (``(n, 1)``); anything else is refused by its cause."""
    if isinstance(nest, (list, tuple)) and not any(_is_array(leaf) for _, leaf in leaves(nest)):
        nest = _dense(name, nest)

    def convert(path: str, leaf: Any) -> np.ndarray:
        if is_pandas(leaf, frame=True):
            check_frame_columns(path, leaf)
        array = _dense(path, leaf)
        if array.ndim == 0:
            raise ValueError(f"{path} must have a leading sample axis; got a scalar.")
        if is_pandas(leaf) and path.startswith("x"):
            array = array[:, None]  # Keras' fit reads a Series as one column
        return strings_or_numbers(path, array) if array.dtype == object else array

    return map_named(convert, nest, name)


def _dense(path: str, value: Any) -> np.ndarray:
    try:
        return np.asarray(value)
    except ValueError as exc:  # NumPy 2: "inhomogeneous shape"
        raise ValueError(
            f"{path} has rows of different lengths (ragged), which no array holds "
            f"({exc}). Pad them to one length (keras.utils.pad_sequences), or pass "
            "each input as its own array."
        ) from None


def is_pandas(value: Any, frame: bool = False) -> bool:
    """A pandas Series (``frame``: a DataFrame)."""
    return (type(value).__module__.startswith("pandas") and hasattr(value, "to_numpy")
            and hasattr(value, "columns") == frame)


def is_dask_array(value: Any) -> bool:
    return type(value).__module__.startswith("dask.array")


def is_dask_frame(value: Any) -> bool:
    """A Dask DataFrame or Series (legacy or dask-expr)."""
    module = type(value).__module__
    return module.startswith(("dask.dataframe", "dask_expr")) and hasattr(value, "npartitions")


def is_frame(x: Any) -> bool:
    """A pandas or Dask DataFrame (not a Series): matched to a model's named inputs."""
    return is_pandas(x, frame=True) or (is_dask_frame(x) and x.ndim == 2)


def is_dask(value: Any) -> bool:
    return is_dask_array(value) or is_dask_frame(value)


def holds_frames(*nests: Nest) -> bool:
    return any(is_dask_frame(leaf) for nest in nests if nest is not None
               for _, leaf in leaves(nest))


def check_frame_columns(path: str, frame: Any) -> None:
    """A DataFrame is one matrix input: its columns must all be numbers."""
    bad = {str(c): str(t) for c, t in dict(frame.dtypes).items() if column_kind(t) is None}
    if bad:
        said = ", ".join(f"{c!r} ({t})" for c, t in bad.items())
        raise ValueError(
            f"{path} has columns that are not numeric: {said}. A DataFrame for a "
            "model without named inputs is one matrix input; a model that takes "
            "string or categorical columns takes each as an input of its own "
            "(keras.io's structured data classification), matched to the frame's "
            "columns by name when fit gets the built keras.Model (not a function "
            "that builds it): pass the model itself, or pass {name: df[name] for "
            "name in df.columns} (dict(df)). Or encode them first."
        )


def column_kind(dtype: Any) -> str | None:
    """``"i"`` integral (ints, bools), ``"f"`` float, ``None`` anything else (object,
    string, category, datetime)."""
    name = str(dtype).lower()
    try:
        kind = np.dtype(dtype).kind
    except TypeError:  # pandas extension dtypes: category, string, nullable Int64
        kind = ("f" if name.startswith("float") else
                "i" if name.startswith(("int", "uint", "bool")) else "")
    return "i" if kind in "iub" and kind else "f" if kind == "f" else None


_STRINGS = (str, bytes, np.str_, np.bytes_)


def strings_or_numbers(path: str, array: np.ndarray) -> np.ndarray:
    """An object array as a model input: strings (kept: TensorFlow reads them as
    ``tf.string``) or numbers (made a numeric array); else a ``ValueError`` naming
    what it holds instead (ragged rows, missing values, mixed types)."""
    flat = array.ravel()
    kinds = [type(v) for v in flat]
    if all(issubclass(k, _STRINGS) for k in kinds):
        return array
    if all(issubclass(k, (int, float, bool, np.number)) for k in kinds):
        return np.array(flat.tolist()).reshape(array.shape)
    first = {k: i for i, k in reversed(list(enumerate(kinds)))}
    rows = {k.__name__: int(i // max(1, flat.size // len(array))) for k, i in first.items()}
    if any(issubclass(k, (list, tuple, np.ndarray)) for k in first):
        lengths = sorted({len(v) for v in flat if hasattr(v, "__len__")
                          and not isinstance(v, _STRINGS)})
        raise ValueError(
            f"{path} holds a sequence in each row, of lengths {lengths[:5]} (ragged): no "
            "array holds it. Pad the rows to one length (keras.utils.pad_sequences), or "
            "stack them into one array if they are equal."
        )
    missing = [i for i, v in enumerate(flat) if v is None or (isinstance(v, float) and v != v)
               or type(v).__name__ in ("NAType", "NaTType")]
    if missing and any(issubclass(k, _STRINGS) for k in first):
        raise ValueError(
            f"{path} holds strings with missing values (None or NaN, first at row "
            f"{missing[0] // max(1, flat.size // len(array))}). Fill them (e.g. "
            "df[col].fillna('')) or drop those rows."
        )
    said = ", ".join(f"{k} (first at row {r})" for k, r in rows.items())
    raise ValueError(
        f"{path} mixes values of types {said}: a model input holds numbers or strings. "
        "Convert the column to one type (e.g. df[col].astype(str))."
    )


def _is_array(value: Any) -> bool:
    return hasattr(value, "__array__") or hasattr(value, "shape")


def num_rows(nests: dict[str, Nest]) -> int:
    """The common length of every leaf of ``{"x": x, "y": y, ...}``; a ``ValueError``
    naming the arrays when they differ."""
    lengths = {path: len(leaf) for key, nest in nests.items() for path, leaf in leaves(nest, key)}
    if not lengths:
        raise ValueError(f"{' and '.join(nests)} hold no arrays.")
    if len(set(lengths.values())) > 1:
        said = ", ".join(f"{path}: {n}" for path, n in lengths.items())
        raise ValueError(
            f"{', '.join(nests)} must have the same number of rows in every array; "
            f"got {said}.")
    return next(iter(lengths.values()))


def first_leaf(nest: Nest) -> Any:
    return next(leaves(nest))[1]


def broadcast_to(weights: Nest, like: Nest) -> Nest:
    """One ``sample_weight`` array for every output of a multi-output ``y``, as
    Keras does; a nest of weights must match ``y``'s structure."""
    if weights is None or not is_nested(like) or is_nested(weights):
        return weights
    return map_nest(lambda _: weights, like)
