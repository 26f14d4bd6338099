"""Dask arrays, DataFrames and Series (or nests of them), cut into partitions by
:mod:`.partitions`: resident (:class:`DaskArraySource`, each worker's shard built
from partitions it mostly holds already), or streamed (``stream=True``,
:class:`DaskStreamSource`: lazy partitions read one at a time, every epoch).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.cluster.batch import TaskBatch
from dasktf.data.base import WorkerSideSource
from dasktf.data.partitions import convert, partition_leaves
from dasktf.data.shards import Shard, with_weights
from dasktf.data.streams import StreamSource
from dasktf.data.structure import Nest, first_leaf, is_dask, leaves, map_nest

if TYPE_CHECKING:
    from distributed import Client, Future


def dask_source(x: Nest, y: Nest, sample_weight: Nest = None,
                class_weight: dict[int, float] | None = None,
                stream: bool = False) -> DaskArraySource | DaskStreamSource:
    """The adapter for Dask collections: cut into partitions once, then resident or
    (``stream``, lazy collections only) streamed."""
    if stream:
        check_lazy(x, y, sample_weight)
    chunks, row_chunks = partition_leaves(x, y, sample_weight)
    if stream:
        return DaskStreamSource(chunks, class_weight)
    return DaskArraySource(chunks, row_chunks, class_weight)


class DaskArraySource(WorkerSideSource):
    """Dask arrays, DataFrames and Series (or nests of them): each worker's shard is
    built from partitions it mostly already holds, converted where they live."""

    def __init__(self, chunks: list[Nest], row_chunks: list[int] | None,
                 class_weight: dict[int, float] | None = None) -> None:
        self.chunks, self.row_chunks = chunks, row_chunks
        self.class_weight = class_weight

    def _parts(self, client: Client, chunks: Sequence[int]) -> list[Any]:
        """Futures of partitions ``chunks``: per partition, the nest ``[x, y, w]``."""
        import dask

        per_chunk = [self.chunks[j] for j in chunks]
        # One future per array of a partition, each computed on the cluster where
        # its partition is (compute() of a nest would make one per nest).
        futures = iter(client.compute([dask.delayed(convert)(leaf.delayed, leaf.kind, leaf.path)
                                       for nest in per_chunk for _, leaf in leaves(nest)]))
        return [map_nest(lambda _: next(futures), nest) for nest in per_chunk]

    def _submit(self, client: Client, parts: list[Any], worker: str) -> Future:
        return client.submit(shard_from_parts, parts, self.class_weight, workers=[worker],
                             pure=False)

    def _build(self, batch: TaskBatch, workers: list[str], batch_size: int) -> list[Any]:
        client = batch.client
        parts = self._parts(client, range(len(self.chunks)))
        lead = [first_leaf(p[0]) for p in parts]
        if self.row_chunks:
            sizes = self.row_chunks
        else:  # one message for the lengths (pure=False: TaskBatch's keys)
            counts = TaskBatch(client)
            sizes = client.gather(counts.send([counts.add(len, f) for f in lead]))
        holders = client.who_has(lead)
        self.assignment = assignment = assign_chunks(
            sizes, [holders.get(f.key, ()) for f in lead], workers
        )
        return [batch.add(shard_from_parts, [parts[j] for j in chunks], self.class_weight,
                          workers=[w])
                for w, chunks in zip(workers, assignment, strict=True)]

    def reload(self, client: Client, index: int, worker: str, schedule: np.ndarray,
               batch_size: int) -> Future:
        """Shard ``index`` rebuilt on ``worker``, recomputed from the Dask graph where
        a lost worker held the only copy of its partitions."""
        return self._submit(client, self._parts(client, self.assignment[index]), worker)


def assign_chunks(
    sizes: Sequence[int], holders: Sequence[Sequence[str]], workers: Sequence[str]
) -> list[list[int]]:
    """Give every chunk to a worker: its holder unless that worker is full.

    A worker is full once it holds its fair share (total / workers) of the rows;
    chunks that cannot stay are given to the least-loaded worker.
    """
    fair = sum(sizes) / len(workers)
    load = dict.fromkeys(workers, 0)
    out: dict[str, list[int]] = {w: [] for w in workers}
    for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
        local = [w for w in holders[j] if w in load and load[w] + sizes[j] <= fair * 1.1]
        target = min(local or workers, key=lambda w: load[w])
        out[target].append(j)
        load[target] += sizes[j]
    return [sorted(out[w]) for w in workers]


def shard_from_parts(parts: list[Nest], class_weight: dict[int, float] | None = None) -> Shard:
    """One shard of partitions, each the nest ``[x, y(, w)]`` of its arrays."""
    return with_weights(Shard.concat([Shard(*p) for p in parts]), class_weight)


# -- streamed ------------------------------------------------------------------------
class DaskStreamSource(StreamSource):
    """Lazy Dask arrays or DataFrames (or nests of them) streamed: each worker reads
    its block of partitions one at a time, every epoch (:class:`DaskParts`)."""

    def __init__(self, chunks: list[Nest], class_weight: dict[int, float] | None = None) -> None:
        self.chunks = chunks
        self.class_weight = class_weight

    def blocks(self, n: int) -> list[np.ndarray]:
        if len(self.chunks) < n:
            raise ValueError(
                f"The data has {len(self.chunks)} partitions for {n} workers; streaming "
                "gives each worker whole partitions. Repartition into at least "
                f"{n} (more, smaller ones bound memory better)."
            )
        return np.array_split(np.arange(len(self.chunks)), n)

    def parts_of(self, index: int, n: int) -> DaskParts:
        block = self.blocks(n)[index]
        return DaskParts([self.chunks[j] for j in block], self.class_weight,
                         f"partitions {block[0]}-{block[-1]}")


class DaskParts:
    """Partitions of lazy Dask collections, computed on the worker when read.

    ``chunks[j]`` is the nest ``[x, y]`` (``[x, y, w]``) of partition ``j``'s
    :class:`~dasktf.data.partitions.PartLeaf` leaves.
    """

    shuffles_itself = False

    def __init__(self, chunks: list[Nest], class_weight: dict[int, float] | None = None,
                 label: str = "") -> None:
        self.chunks = chunks
        self.class_weight = class_weight
        self.label = label

    def read(self, j: int) -> Any:
        import dask

        nest = self.chunks[j]
        flat = [leaf for _, leaf in leaves(nest)]
        # One local compute for every leaf: the partition is read once even when
        # its features and labels come from the same file.
        values = iter(dask.compute(*[leaf.delayed for leaf in flat], scheduler="sync"))
        arrays = map_nest(lambda leaf: convert(next(values), leaf.kind, leaf.path), nest)
        return with_weights(Shard(*arrays), self.class_weight)

    def parts(self, epoch: int, seed: tuple[int, ...] | None) -> Iterator[Any]:
        order = (np.random.default_rng([*seed, 1]).permutation(len(self.chunks))
                 if seed is not None else range(len(self.chunks)))
        for j in order:
            yield self.read(int(j))

    def describe(self, j: int) -> str:
        return f"partition {j} of {self.label}"


def check_lazy(*nests: Any) -> None:
    """``stream=True`` reads partitions from their sources on each worker; a
    persisted collection's partitions are already in the cluster's memory."""
    from distributed import futures_of

    persisted = [path for name, nest in zip(("x", "y", "sample_weight"), nests, strict=True)
                 if nest is not None for path, leaf in leaves(nest, name)
                 if is_dask(leaf) and futures_of(leaf)]
    if persisted:
        raise ValueError(
            f"stream=True reads lazy collections part by part, but {', '.join(persisted)} "
            "is persisted: its partitions are already in memory. Drop stream=True (the "
            "workers use the partitions they hold), or pass the collection unpersisted."
        )
