"""Validation data: Keras' ``validation_split`` and ``validation_data``, checked on
the client and placed in contiguous pieces, one per worker, which the replicas
evaluate at every epoch end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.data.partitions import compute_leaves
from dasktf.data.shards import Shard, check_stats, shard_of
from dasktf.data.structure import (
    as_arrays,
    holds_frames,
    is_dask_array,
    leaves,
    num_rows,
    take,
)

if TYPE_CHECKING:
    from distributed import Client, Future


#: validation data as fit takes it: ``(x, y, sample_weight)``
Validation = tuple[Any, Any, Any]


def split_validation(x: Any, y: Any, sample_weight: Any, fraction: float, kind: str
                     ) -> tuple[Validation, Validation]:
    """Keras' ``validation_split``: the last ``fraction`` of the rows, before any
    shuffling, become the validation data (``floor(n * (1 - fraction))`` rows
    stay). ``kind``: what the data is (:func:`~dasktf.data.sources.input_kind`)."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation_split must be in (0, 1); got {fraction!r}.")
    if holds_frames(x, y, sample_weight):
        raise ValueError(
            "validation_split takes the last rows, which a Dask DataFrame cannot "
            "index by position. Split it by partitions (df.partitions[:-k] and "
            "df.partitions[-k:]) or with df.random_split, and pass validation_data."
        )
    if kind == "function":
        raise ValueError(
            "validation_split needs x and y as arrays (it takes their last rows); a "
            "shard loader's data is only read on the workers. Pass validation_data."
        )
    arrays = {"x": x, "y": y,
              **({} if sample_weight is None else {"sample_weight": sample_weight})}
    if not all(is_dask_array(leaf) for _, leaf in leaves(arrays)):
        arrays = {k: as_arrays(v, k) for k, v in arrays.items()}
    n = num_rows(arrays)
    split_at = int(np.floor(n * (1.0 - fraction)))
    if split_at in (0, n):
        raise ValueError(
            f"validation_split={fraction} leaves no rows for training or validation "
            f"out of {n}; use a fraction that leaves at least one row each."
        )
    train = {k: take(v, slice(0, split_at)) for k, v in arrays.items()}
    val = {k: take(v, slice(split_at, None)) for k, v in arrays.items()}
    return ((train["x"], train["y"], train.get("sample_weight")),
            (val["x"], val["y"], val.get("sample_weight")))


def validation_parts(validation_data: Any) -> Validation:
    """``(x, y)`` or ``(x, y, sample_weight)`` as Keras takes ``validation_data``."""
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise ValueError(
            "validation_data must be a tuple (x_val, y_val) or (x_val, y_val, "
            "sample_weight_val), a tf.data.Dataset or a keras.utils.PyDataset; got "
            f"{type(validation_data).__name__}"
            + (f" of length {len(validation_data)}." if isinstance(
                validation_data, (tuple, list)) else ".")
        )
    x, y, *rest = validation_data
    return x, y, rest[0] if rest else None


def validation_shard(validation_data: tuple[Any, Any, Any]) -> Shard:
    """``(x, y, sample_weight)`` validation data as one checked in-memory shard."""
    x, y, w = validation_data
    data = shard_of(*compute_leaves(x, y, w), suffix="_val")  # Dask ones computed here:
    check_stats([data.stats], where="the validation data")  # validation data is small
    return data


def validation_piece(data: Shard, index: int, n: int) -> Shard:
    """Worker ``index``'s contiguous piece of ``n``."""
    return data.take(np.array_split(np.arange(len(data)), n)[index])


def place_validation(
    client: Client, validation_data: tuple[Any, Any, Any], workers: list[str]
) -> list[Future] | None:
    """Scatter validation data in contiguous pieces, one per worker, for evaluation."""
    data = validation_shard(validation_data)
    # one message to the scheduler for every worker's piece (WatchedClient's)
    return client.scatter_each(  # type: ignore[attr-defined, no-any-return]
        [validation_piece(data, i, len(workers)) for i in range(len(workers))], workers)
