"""Labels and rows as the estimators feed them to a model, NumPy or Dask."""

from __future__ import annotations

from typing import Any

import numpy as np

from dasktf.data.structure import is_dask_frame


def n_features(X: Any) -> int:
    if is_dask_frame(X):
        return len(X.columns) if X.ndim == 2 else 1
    return int(X.shape[1]) if X.ndim > 1 else 1


def row_shape(X: Any) -> tuple[int, ...]:
    if is_dask_frame(X):
        return (n_features(X),)
    return tuple(int(n) for n in X.shape[1:]) or (1,)


def row_weights(sample_weight: Any, n: int) -> np.ndarray:
    """One float32 weight per row, else a ValueError saying what came."""
    weights = np.asarray(sample_weight, dtype=np.float32)
    if weights.ndim == 0:
        return np.full(n, weights, dtype=np.float32)
    if weights.shape != (n,):
        raise ValueError(f"sample_weight must hold one weight per row of X: shape ({n},); "
                         f"got shape {weights.shape}.")
    if n and not weights.any():
        raise ValueError("sample_weight is zero for every row: there is nothing to train on.")
    return weights


def encode(classes: np.ndarray, y: Any) -> np.ndarray:
    """Labels as their index in the sorted ``classes``."""
    values = np.asarray(y)
    return np.searchsorted(classes, values).astype(np.int32)


def one_hot(indices: np.ndarray, n: int) -> np.ndarray:
    return np.eye(n, dtype=np.float32)[np.asarray(indices).reshape(-1)]


def encode_series(part: Any, classes: np.ndarray) -> Any:
    """A partition of a label Series as class indices, on its index."""
    import pandas as pd

    return pd.Series(encode(classes, part), index=part.index, name=part.name)


def encode_dask(y: Any, classes: np.ndarray) -> Any:
    """A Dask label collection as class indices (lazy)."""
    import functools

    if is_dask_frame(y):
        return y.map_partitions(encode_series, classes, meta=(y.name, np.int32))
    return y.map_blocks(functools.partial(encode, classes), dtype=np.int32)


def one_hot_dask(indices: Any, n: int) -> Any:
    """Lazy one-hot rows of a Dask array or Series of class indices."""
    array = as_dask_array(indices)
    return array.map_blocks(one_hot, n, dtype=np.float32, new_axis=1,
                            chunks=(array.chunks[0], (n,)))


def dask_classes(y: Any) -> np.ndarray:
    """The sorted distinct labels of a Dask collection (computed: ``fit`` is eager)."""
    import dask.array as da

    if is_dask_frame(y):
        return np.sort(np.asarray(y.unique().compute()))
    return np.asarray(da.unique(y).compute())


def as_dask_array(y: Any) -> Any:
    return y.to_dask_array() if is_dask_frame(y) else y


def weighted_mean(values: Any, sample_weight: Any) -> float:
    import dask

    if sample_weight is None:
        return float(values.mean().compute())
    w = as_dask_array(sample_weight).astype(np.float64)
    num, den = dask.compute((values * w).sum(), w.sum())
    return float(num / den)
