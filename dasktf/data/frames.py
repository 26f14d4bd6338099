"""Dask DataFrames and Series as training data, where their partitions live.

A frame becomes Dask arrays chunked by its partitions (one pass on the workers
counts their rows; the client receives the counts), and the arrays go through
:class:`~dasktf.data.sources.DaskArraySource`: each partition is converted on the
worker that holds it and stays there. Numeric columns become float32 features;
columns of any other dtype are refused by name, before anything is computed
(their dtypes are known from the frame's metadata).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dasktf.data.structure import Nest, leaves, map_named


def is_dask_frame(obj: Any) -> bool:
    """A Dask DataFrame or Series (legacy or dask-expr)."""
    module = type(obj).__module__
    return module.startswith(("dask.dataframe", "dask_expr")) and hasattr(obj, "npartitions")


def holds_frames(*nests: Nest) -> bool:
    return any(is_dask_frame(leaf) for nest in nests if nest is not None
               for _, leaf in leaves(nest))


def frames_to_arrays(x: Nest, y: Any, sample_weight: Any) -> tuple[Nest, Nest, Nest]:
    """``x``, ``y`` and ``sample_weight`` with every frame leaf a Dask array.

    ``y`` (and ``sample_weight``) may name columns of a DataFrame ``x``: they are
    taken out of the features, as a label column is.
    """
    if y is None:
        raise ValueError("y is required when x is a Dask DataFrame: give a Series, a "
                         "DataFrame, or the name(s) of x's label column(s).")
    named = [v for v in (y, sample_weight) if _names_columns(v)]
    if named:
        if not is_dask_frame(x) or x.ndim != 2:
            raise ValueError("y or sample_weight names columns, so x must be one Dask "
                             "DataFrame holding them.")
        columns = [c for v in named for c in ([v] if isinstance(v, str) else v)]
        missing = [c for c in columns if c not in x.columns]
        if missing:
            raise ValueError(f"Columns {missing} are not in x (its columns: "
                             f"{list(x.columns)}).")
        y = x[y] if _names_columns(y) else y
        sample_weight = x[sample_weight] if _names_columns(sample_weight) else sample_weight
        x = x.drop(columns=columns)
    nests = {"x": x, "y": y, "sample_weight": sample_weight}
    check_numeric(nests)
    lengths = _row_counts(nests)
    return (map_named(lambda path, leaf: _to_array(path, leaf, lengths, features=True), x, "x"),
            map_named(lambda path, leaf: _to_array(path, leaf, lengths, features=False), y, "y"),
            None if sample_weight is None else map_named(
                lambda path, leaf: _to_array(path, leaf, lengths, features=False),
                sample_weight, "sample_weight"))


def _names_columns(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value))


def _row_counts(nests: dict[str, Nest]) -> tuple[int, ...] | None:
    """Rows per partition of the first frame, counted on the workers (the client
    receives one integer per partition); every frame must be partitioned alike."""
    frames = [(f"{name}{path[len(name):]}", leaf) for name, nest in nests.items()
              if nest is not None for path, leaf in leaves(nest, name) if is_dask_frame(leaf)]
    if not frames:
        return None
    counts = {}
    for path, frame in frames:
        key = (frame.npartitions, tuple(getattr(frame, "divisions", ()) or ()))
        if key not in counts:
            counts[key] = (path, tuple(int(n) for n in frame.map_partitions(len).compute()))
    if len({c for _, c in counts.values()}) > 1:
        said = ", ".join(f"{p}: {sum(c)} rows in {len(c)} partitions" for p, c in counts.values())
        raise ValueError(f"The Dask frames must be partitioned alike (same rows per "
                         f"partition); got {said}.")
    return next(iter(counts.values()))[1]


def _to_array(path: str, leaf: Any, lengths: tuple[int, ...] | None, features: bool) -> Any:
    if not is_dask_frame(leaf):
        return leaf
    frame = leaf
    # Features are float32, as Keras casts them; integer labels stay integers
    # (class indices), float ones become float32.
    if features or any(not _integral(t) for t in _dtypes(frame).values()):
        frame = frame.astype("float32")
    return frame.to_dask_array(lengths=list(lengths) if lengths else True)


def check_numeric(nests: dict[str, Nest]) -> None:
    """Refuse non-numeric columns by name, from the frames' metadata alone."""
    for name, nest in nests.items():
        if nest is None:
            continue
        for path, leaf in leaves(nest, name):
            if not is_dask_frame(leaf):
                continue
            bad = {str(c): str(t) for c, t in _dtypes(leaf).items() if _kind(t) is None}
            if bad:
                said = ", ".join(f"{c!r} ({t})" for c, t in bad.items())
                raise ValueError(
                    f"{path} has columns that are not numeric: {said}. Encode them "
                    "first (e.g. df[col].cat.codes after categorize(), or "
                    "dd.get_dummies), or keep them out of the features."
                )


def _dtypes(frame: Any) -> dict[Any, Any]:
    return dict(frame.dtypes) if frame.ndim == 2 else {frame.name: frame.dtype}


def _kind(dtype: Any) -> str | None:
    """``"i"`` integral (ints, bools), ``"f"`` float, ``None`` not numeric
    (object, string, category, datetime)."""
    name = str(dtype).lower()
    try:
        kind = np.dtype(dtype).kind
    except TypeError:  # pandas extension dtypes: category, string, nullable Int64
        kind = ("f" if name.startswith("float") else
                "i" if name.startswith(("int", "uint", "bool")) else "")
    return "i" if kind in "iub" and kind else "f" if kind == "f" else None


def _integral(dtype: Any) -> bool:
    return _kind(dtype) == "i"
