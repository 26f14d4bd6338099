"""``x`` a function run on the workers, so data is read where it is: a shard loader
``load(shard_index, num_shards) -> (x, y[, sample_weight])``, or an iterator of such
parts (streamed, :class:`LoaderParts`); or ``dataset_fn(ctx) -> tf.data.Dataset``,
run every epoch as ``distribute_datasets_from_function`` runs it (:class:`DatasetParts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dasktf.data.base import WorkerSideSource
from dasktf.data.keras_inputs import dataset_elements
from dasktf.data.shards import Shard, ShardStats, part_from
from dasktf.data.streams import (
    DatasetContext,
    StreamedShard,
    StreamSource,
    build_stream,
)

if TYPE_CHECKING:
    from dasktf.cluster.batch import TaskBatch

ShardLoader = Callable[[int, int], tuple[Any, Any]]


class LoaderSource(WorkerSideSource):
    """A function ``load(shard_index, num_shards) -> (x, y[, sample_weight])`` run on
    each worker."""

    def __init__(self, load: ShardLoader, class_weight: dict[int, float] | None = None) -> None:
        self.load = load
        self.class_weight = class_weight

    def task(self, index: int, n: int, worker: str) -> tuple[Any, ...]:
        return load_shard, self.load, index, n, self.class_weight


def load_shard(load: ShardLoader, index: int, n_shards: int,
               class_weight: dict[int, float] | None = None) -> Shard | StreamedShard:
    out = load(index, n_shards)
    if isinstance(out, Iterator):  # parts to stream, read anew every epoch
        return build_stream(LoaderParts(load, index, n_shards, class_weight), f"shard {index}")
    shard = part_from(out, "The shard loader", class_weight)
    ShardStats.of(shard)  # the row counts agree, or an error naming the arrays
    return shard


class LoaderParts:
    """``load(shard_index, num_shards)`` returning an iterator of parts, called anew
    every epoch."""

    shuffles_itself = False

    def __init__(self, load: Callable[..., Any], index: int, n_shards: int,
                 class_weight: dict[int, float] | None = None) -> None:
        self.load, self.index, self.n_shards = load, index, n_shards
        self.class_weight = class_weight

    def parts(self, epoch: int, seed: tuple[int, ...] | None) -> Iterator[Any]:
        for out in self.load(self.index, self.n_shards):
            yield part_from(out, "The shard loader's iterator", self.class_weight)

    def describe(self, j: int) -> str:
        return f"part {j} from the loader of shard {self.index}"


class DatasetFnSource(StreamSource):
    """``dataset_fn(ctx)`` run on every worker, every epoch (:class:`DatasetParts`)."""

    label = "dataset_fn on shard"

    def __init__(self, dataset_fn: Any, seed: int,
                 class_weight: dict[int, float] | None = None) -> None:
        self.dataset_fn, self.seed, self.class_weight = dataset_fn, seed, class_weight
        self.batch_size = 0

    def parts_of(self, index: int, n: int) -> DatasetParts:
        local = self.batch_size // n + (index < self.batch_size % n)
        context = DatasetContext(index, n, local, self.batch_size, 0, self.seed)
        return DatasetParts(self.dataset_fn, context, self.class_weight)

    def _build(self, batch: TaskBatch, workers: list[str], batch_size: int) -> list[Any]:
        self.batch_size = batch_size  # the contexts' global batch
        return super()._build(batch, workers, batch_size)


class DatasetParts:
    """``dataset_fn(ctx) -> tf.data.Dataset`` run on the worker every epoch; each
    element (a batch) is a part. Shuffling is the dataset's (``ctx.seed``,
    ``ctx.epoch``)."""

    shuffles_itself = True

    def __init__(self, dataset_fn: Callable[[DatasetContext], Any], context: DatasetContext,
                 class_weight: dict[int, float] | None = None) -> None:
        self.dataset_fn, self.context, self.class_weight = dataset_fn, context, class_weight

    def parts(self, epoch: int, seed: tuple[int, ...] | None) -> Iterator[Any]:
        dataset = self.dataset_fn(dataclasses.replace(self.context, epoch=epoch))
        if not hasattr(dataset, "as_numpy_iterator"):
            raise TypeError("dataset_fn(ctx) must return a tf.data.Dataset; got "
                            f"{type(dataset).__name__}.")
        for element in dataset_elements(dataset):
            yield part_from(element, "dataset_fn(ctx)'s dataset", self.class_weight)

    def describe(self, j: int) -> str:
        return f"element {j} of dataset_fn(ctx) on shard {self.context.shard_index}"
