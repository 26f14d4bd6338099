"""``dataset_fn(ctx) -> tf.data.Dataset`` as training data: run on every worker,
every epoch, as ``tf.distribute``'s ``distribute_datasets_from_function`` runs it
(``ctx``: :class:`~dasktf.data.streams.DatasetContext`); its elements are the
parts of a streamed shard (:mod:`dasktf.data.streams`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dasktf.data.keras_inputs import dataset_elements
from dasktf.data.shards import part_from
from dasktf.data.streams import DatasetContext, StreamSource

if TYPE_CHECKING:
    from distributed import Client, Future


class DatasetFnSource(StreamSource):
    """``dataset_fn(ctx) -> tf.data.Dataset`` run on every worker, every epoch
    (:class:`DatasetParts`), as ``distribute_datasets_from_function`` runs it."""

    label = "dataset_fn on shard"

    def __init__(self, dataset_fn: Any, seed: int,
                 class_weight: dict[int, float] | None = None) -> None:
        self.dataset_fn, self.seed, self.class_weight = dataset_fn, seed, class_weight
        self.batch_size = 0

    def parts_of(self, index: int, n: int) -> DatasetParts:
        local = self.batch_size // n + (index < self.batch_size % n)
        context = DatasetContext(index, n, local, self.batch_size, 0, self.seed)
        return DatasetParts(self.dataset_fn, context, self.class_weight)

    def _build(self, client: Client, workers: list[str], batch_size: int) -> list[Future]:
        self.batch_size = batch_size  # the contexts' global batch
        return super()._build(client, workers, batch_size)


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
