"""A loader ``load(shard_index, num_shards) -> (x, y[, sample_weight])`` as training
data: run on each worker, so data can be read where it is.

A loader that returns one tuple gives a resident shard (:func:`load_shard`); one
that returns an iterator of such tuples gives a streamed shard, read anew every
epoch (:class:`LoaderParts`, :mod:`dasktf.data.streams`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dasktf.data.base import WorkerSideSource
from dasktf.data.shards import Shard, ShardStats, part_from
from dasktf.data.streams import StreamedShard, build_stream

if TYPE_CHECKING:
    import numpy as np
    from distributed import Client, Future

ShardLoader = Callable[[int, int], tuple[Any, Any]]


class LoaderSource(WorkerSideSource):
    """A function ``load(shard_index, num_shards) -> (x, y[, sample_weight])`` run on
    each worker."""

    def __init__(self, load: ShardLoader, class_weight: dict[int, float] | None = None) -> None:
        self.load = load
        self.class_weight = class_weight

    def _build(self, client: Client, workers: list[str], batch_size: int) -> list[Future]:
        n = len(workers)
        return [
            # pure=False: a loader may read files that change between runs.
            client.submit(load_shard, self.load, i, n, self.class_weight, workers=[w],
                          pure=False)
            for i, w in enumerate(workers)
        ]

    def reload(self, client: Client, index: int, worker: str, schedule: np.ndarray,
               batch_size: int) -> Future:
        return client.submit(load_shard, self.load, index, schedule.shape[1],
                             self.class_weight, workers=[worker], pure=False)


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
