"""Validation data: Keras' ``validation_split`` and ``validation_data``, checked on
the client and placed in contiguous pieces, one per worker, which the replicas
evaluate at every epoch end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.data.named_inputs import frame_inputs
from dasktf.data.partitions import compute_leaves
from dasktf.data.shards import Shard, check_stats, shard_of
from dasktf.data.sources import input_kind, is_frame, read_on_client, reads_on_client
from dasktf.data.structure import (
    as_arrays,
    holds_frames,
    is_dask_array,
    leaves,
    map_nest,
    num_rows,
    take,
)

if TYPE_CHECKING:
    from distributed import Client, Future


def split_validation(x: Any, y: Any, sample_weight: Any, fraction: float
                     ) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """Keras' ``validation_split``: the last ``fraction`` of the rows, before any
    shuffling, become the validation data (``floor(n * (1 - fraction))`` rows stay)."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation_split must be in (0, 1); got {fraction!r}.")
    kind = input_kind(x)
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
    if is_frame(x):  # a pandas frame stays one: its columns are matched to the model
        return _split_frame(x, y, sample_weight, fraction)
    arrays = {"x": x, "y": y,
              **({} if sample_weight is None else {"sample_weight": sample_weight})}
    if not all(is_dask_array(leaf) for _, leaf in leaves(arrays)):
        arrays = {k: as_arrays(v, k) for k, v in arrays.items()}
    split_at = _split_point(num_rows(arrays), fraction)
    train = {k: take(v, slice(0, split_at)) for k, v in arrays.items()}
    val = {k: take(v, slice(split_at, None)) for k, v in arrays.items()}
    return ((train["x"], train["y"], train.get("sample_weight")),
            (val["x"], val["y"], val.get("sample_weight")))


def _split_point(n: int, fraction: float) -> int:
    split_at = int(np.floor(n * (1.0 - fraction)))
    if split_at in (0, n):
        raise ValueError(
            f"validation_split={fraction} leaves no rows for training or validation "
            f"out of {n}; use a fraction that leaves at least one row each."
        )
    return split_at


def _split_frame(x: Any, y: Any, sample_weight: Any, fraction: float
                 ) -> tuple[tuple[Any, Any, Any], tuple[Any, Any, Any]]:
    """A pandas frame's last rows by position; ``y`` and ``sample_weight`` that name
    its columns name them in both parts."""
    split_at = _split_point(len(x), fraction)

    def rows(nest: Any, part: slice) -> Any:
        if nest is None:
            return None
        return map_nest(lambda leaf: leaf if isinstance(leaf, str) else (
            leaf.iloc[part] if hasattr(leaf, "iloc") else as_arrays(leaf, "y")[part]), nest)

    train, val = slice(0, split_at), slice(split_at, None)
    return ((rows(x, train), rows(y, train), rows(sample_weight, train)),
            (rows(x, val), rows(y, val), rows(sample_weight, val)))


def unpack_validation(validation_data: Any, model: Any = None) -> tuple[Any, Any, Any]:
    """``(x, y)`` or ``(x, y, sample_weight)``, a ``tf.data.Dataset`` or a
    ``keras.utils.PyDataset`` (read here), as Keras takes ``validation_data``; a
    DataFrame ``x`` matched to ``model``'s named inputs as the training frame is."""
    if reads_on_client(validation_data):
        data, _ = read_on_client(validation_data, "validation_data")
        return data.x, data.y, data.w
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise ValueError(
            "validation_data must be a tuple (x_val, y_val) or (x_val, y_val, "
            "sample_weight_val), a tf.data.Dataset or a keras.utils.PyDataset; got "
            f"{type(validation_data).__name__}"
            + (f" of length {len(validation_data)}." if isinstance(
                validation_data, (tuple, list)) else ".")
        )
    x, y, *rest = validation_data
    w = rest[0] if rest else None
    return frame_inputs(model, x, y, w) if is_frame(x) else (x, y, w)


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
    return [client.scatter(validation_piece(data, i, len(workers)), workers=[w], direct=True,
                           hash=False)  # see Run.build
            for i, w in enumerate(workers)]
