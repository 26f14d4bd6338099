"""The input forms Keras' ``fit`` takes that only the client can read.

Keras' ``fit`` pulls batches from a ``tf.data.Dataset``, a ``keras.utils.PyDataset``
or a Python generator in its own process; dasktf's workers read their own rows
every epoch. So the datasets (told apart by :mod:`.sources`) are read here once,
into arrays, when small (``dasktf.data.materialize-limit``, with a warning), as ``x``
and as ``validation_data``; a larger one, or a generator (read only once, only
here), is refused with the forms that run on the workers. The batch size of what
was read is the run's when ``fit`` is given none, as in Keras.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import dask.utils

from dasktf import config
from dasktf.data.shards import Shard, part_from

_WORKER_FORM = (
    "pass x=dataset_fn, where dataset_fn(ctx) builds each worker's part of the data "
    "(ctx.shard_index of ctx.num_shards, ctx.local_batch_size, ctx.epoch, ctx.seed) and "
    "returns a tf.data.Dataset of (x, y) batches, or a loader load(shard_index, "
    "num_shards) -> (x, y) that reads each worker's rows there")


def generator_refused(what: str) -> TypeError:
    return TypeError(
        f"{what} is a Python generator: Keras' fit pulls its batches in this "
        "process, but dasktf's workers each read their own rows every epoch, and a "
        "generator can be read only once and only here. Pass arrays, a "
        "keras.utils.PyDataset or a tf.data.Dataset (read here when small), or, for "
        f"data that does not fit, {_WORKER_FORM}."
    )


def read_input(x: Any, what: str, tf_dataset: bool) -> tuple[Shard, int]:
    """A finite ``tf.data.Dataset`` (``tf_dataset``) or ``keras.utils.PyDataset``
    read into one shard (when small), and its batch size. ``what``: ``"x"`` or
    ``"validation_data"``."""
    if tf_dataset:
        if int(x.cardinality()) == -1:  # tf.data.INFINITE_CARDINALITY
            raise ValueError(f"{what} is an infinite tf.data.Dataset: dasktf reads every "
                             f"row once per epoch. Instead, {_WORKER_FORM}.")
        elements = dataset_elements(x)
        said = f"{what} is a tf.data.Dataset built on the client"
    else:
        if x.num_batches is None:
            raise ValueError(f"{what} is an infinite keras.utils.PyDataset (num_batches "
                             f"is None): dasktf reads every row once per epoch. Instead, "
                             f"{_WORKER_FORM}.")
        elements = (_as_tuple(x[i]) for i in range(x.num_batches))
        said = f"{what} is a keras.utils.PyDataset"
    return _read(elements, said, what)


def dataset_elements(dataset: Any) -> Iterator[Any]:
    """A ``tf.data.Dataset``'s elements as NumPy, a tuple or list element as a
    tuple (``(x, y[, sample_weight])``, as Keras reads it): the one conversion, for
    a dataset read on the client and a ``dataset_fn``'s on the workers."""
    for element in dataset.as_numpy_iterator():
        yield tuple(element) if isinstance(element, (tuple, list)) else element


def _as_tuple(batch: Any) -> Any:
    return tuple(batch) if isinstance(batch, list) else batch


def _read(elements: Any, said: str, what: str) -> tuple[Shard, int]:
    limit_text = config.get("data.materialize-limit")
    limit = dask.utils.parse_bytes(limit_text)
    parts: list[Shard] = []
    size = batch = 0
    for element in elements:
        part = part_from(element, f"{said} and its batches")
        size += part.nbytes
        if size > limit:
            raise ValueError(
                f"{said}, larger than dasktf.data.materialize-limit ({limit_text}): it "
                "cannot be split over the workers without reading it all here. "
                f"Instead, {_WORKER_FORM}."
            )
        parts.append(part)
        batch = max(batch, len(part))
    if not parts:
        raise ValueError(f"{said} and yields no batches.")
    data = Shard.concat(parts)
    warnings.warn(
        f"{said}: dasktf read it into memory once ({len(data)} rows in {len(parts)} "
        f"batches of up to {batch}, {size / 2**20:.1f} MiB) and splits the rows over "
        "the workers" + (" (batched by batch_size; when fit gets none, by its batches')"
                         if what == "x" else "")
        + f". A dataset that shuffles is read in this one order. For data that does not "
        f"fit, {_WORKER_FORM}.",
        UserWarning, stacklevel=5,  # Trainer.fit's frame, through the factory
    )
    return data, batch
