"""Shards read part by part on their worker: data larger than memory.

A :class:`StreamedShard` stands in a worker's memory where a resident
:class:`~dasktf.data.sources.Shard` would, but holds only a recipe for its parts:

* :class:`DaskParts`: partitions (or row chunks) of a lazy Dask collection, each
  computed on the worker itself, one at a time (``scheduler="sync"``), so files are
  read where the worker is and no partition stays once its rows were used;
* :class:`LoaderParts`: a loader ``load(shard_index, num_shards)`` that returns an
  iterator of ``(x, y[, sample_weight])`` parts instead of one tuple;
* :class:`DatasetParts`: ``dataset_fn(ctx) -> tf.data.Dataset`` (as
  ``tf.distribute``'s ``distribute_datasets_from_function``), its elements the parts.

Each epoch a background thread reads the parts ahead into a bounded queue
(``dasktf.data.prefetch`` parts), and a replica takes the rows of each step as a
window of that stream: at most the prefetched parts plus the current one are in
memory. With ``shuffle=True`` Dask partitions come in a seeded order per epoch and
rows are shuffled within each part (a block shuffle); with ``shuffle=False`` the
rows come in order, so N workers train exactly as on resident shards.

Building a streamed shard reads it once (:meth:`StreamedShard.scan`): the rows are
counted for the step schedule, and the same checks as for resident data run on
every part (shapes, NaN, label ranges), so bad data fails before training starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dasktf.data.partitions import convert
from dasktf.data.shards import Shard, ShardStats, check_stats, with_weights
from dasktf.data.structure import Nest, as_arrays, broadcast_to, leaves, map_nest

_DONE = object()


@dataclass(frozen=True)
class DatasetContext:
    """What ``dataset_fn(ctx)`` is told on each worker (as ``tf.distribute.InputContext``)."""

    shard_index: int
    num_shards: int
    #: rows this worker reads per step (the global ``batch_size`` split N ways)
    local_batch_size: int
    global_batch_size: int
    epoch: int
    seed: int

    # tf.distribute.InputContext's names, so a dataset_fn written for
    # distribute_datasets_from_function runs unchanged.
    @property
    def input_pipeline_id(self) -> int:
        return self.shard_index

    @property
    def num_input_pipelines(self) -> int:
        return self.num_shards

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        return global_batch_size // self.num_shards


def accepts_context(fn: Any) -> bool:
    """A callable of one argument: a ``dataset_fn(ctx)``, not a ``load(i, n)``."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                         p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def part_from(out: Any, where: str, class_weight: dict[int, float] | None = None) -> Any:
    """One ``(x, y[, sample_weight])`` element as a :class:`Shard` (``class_weight``
    turned into sample weights, as Keras does)."""
    if not (isinstance(out, tuple) and len(out) in (2, 3)):
        raise TypeError(f"{where} must give (x, y) or (x, y, sample_weight) tuples; got "
                        f"{type(out).__name__}.")
    x, y = as_arrays(out[0], "x"), as_arrays(out[1], "y")
    w = as_arrays(broadcast_to(out[2], y), "sample_weight") if len(out) == 3 else None
    if w is not None and class_weight is not None:
        raise ValueError(f"{where} gives sample weights: give no class_weight too.")
    return with_weights(Shard(x, y, w), class_weight)


# -- the part sources ---------------------------------------------------------------
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
        x, y, *w = arrays
        return with_weights(Shard(x, y, w[0] if w else None), self.class_weight)

    def parts(self, epoch: int, seed: tuple[int, ...] | None) -> Iterator[Any]:
        order = (np.random.default_rng([*seed, 1]).permutation(len(self.chunks))
                 if seed is not None else range(len(self.chunks)))
        for j in order:
            yield self.read(int(j))

    def describe(self, j: int) -> str:
        return f"partition {j} of {self.label}"


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
        for element in dataset.as_numpy_iterator():
            yield part_from(tuple(element) if isinstance(element, (tuple, list)) else element,
                            "dataset_fn(ctx)'s dataset", self.class_weight)

    def describe(self, j: int) -> str:
        return f"element {j} of dataset_fn(ctx) on shard {self.context.shard_index}"


# -- the shard -----------------------------------------------------------------------
class StreamedShard:
    """A shard whose rows are read part by part (see the module docstring)."""

    def __init__(self, source: Any, prefetch: int, where: str) -> None:
        self.source = source
        self.prefetch = max(1, int(prefetch))
        self.where = where
        self.n = 0
        self.stats: Any = None
        self.empty: Any = None  # no rows, the stream's structure (a worker's empty step)
        self.head: Any = None  # the first row: what a replica builds its model on
        self._reader: _Reader | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reader": None}

    def __len__(self) -> int:
        return self.n

    def scan(self) -> StreamedShard:
        """Read every part once: count the rows, check and merge their stats."""

        merged = None
        for j, part in enumerate(self.source.parts(0, None)):
            stats = ShardStats.of(part)
            check_stats([stats], where=f"{self.source.describe(j)} ({self.where})")
            merged = stats if merged is None else merge_stats(merged, stats, self.source
                                                               .describe(j))
            if self.empty is None:
                self.empty = part.take(slice(0, 0))
                self.head = part.take(slice(0, 1))
        if merged is None or merged.n == 0:
            raise ValueError(f"The stream of {self.where} yielded no rows: every worker "
                             "needs data (check the loader, dataset_fn or partitions).")
        self.n, self.stats = merged.n, merged
        return self

    def take(self, rows: Any) -> Any:
        """The first rows (``slice(0, k)``: what a model is built on)."""
        if not (isinstance(rows, slice) and rows.start in (None, 0) and rows.step is None):
            raise ValueError("A streamed shard is read in order; it takes slice(0, k) only.")
        if self.head is not None and rows.stop is not None and rows.stop <= len(self.head):
            return self.head.take(rows)
        pieces, need = [], rows.stop
        for part in self.source.parts(0, None):
            pieces.append(part.take(slice(0, need)))
            need -= len(pieces[-1])
            if need <= 0:
                break
        return Shard.concat(pieces)

    def close(self) -> None:
        """Stop reading ahead (the run is over, or the shard moved)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def window(self, epoch: int, start: int, stop: int, seed: tuple[int, ...] | None) -> Any:
        """Rows ``[start, stop)`` of epoch ``epoch``'s stream. Steps come in order;
        an earlier window (a replayed step) restarts the epoch's stream."""
        reader = self._reader
        if reader is None or reader.epoch != epoch or start < reader.position:
            if reader is not None:
                reader.close()
            reader = self._reader = _Reader(self, epoch, seed)
        return reader.read(start, stop)


def merge_stats(a: Any, b: Any, where: str) -> Any:
    """Two parts' :class:`~dasktf.data.sources.ShardStats` as one; parts must agree
    on every array's shape and dtype."""
    if a.layout() != b.layout():
        raise ValueError(f"{where} has other shapes than the parts before it: "
                         f"{b.layout()} against {a.layout()}.")

    def leaf(x: Any, y: Any) -> Any:
        return dataclasses.replace(x, finite=x.finite and y.finite, low=min(x.low, y.low),
                                   high=max(x.high, y.high), integral=x.integral and y.integral)

    def nest(x: Any, y: Any) -> Any:
        return None if x is None else map_nest(leaf, x, y)

    return dataclasses.replace(a, n=a.n + b.n, x=nest(a.x, b.x), y=nest(a.y, b.y),
                               w=nest(a.w, b.w))


class _Reader:
    """One epoch's stream: a thread reads parts ahead into a bounded queue."""

    def __init__(self, shard: StreamedShard, epoch: int, seed: tuple[int, ...] | None) -> None:
        self.shard, self.epoch, self.seed = shard, epoch, seed
        self.position = 0  # rows handed out so far
        self.buffer: Any = None  # the part being read, from row self.offset
        self.offset = 0
        self.index = 0  # parts taken from the queue
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=shard.prefetch)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._fill, name="dasktf-stream", daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        try:
            for part in self.shard.source.parts(self.epoch, self.seed):
                if (self.seed is not None and len(part) > 1
                        and not self.shard.source.shuffles_itself):
                    rng = np.random.default_rng([*self.seed, 2, self.index])
                    part = part.take(rng.permutation(len(part)))
                self._put(part)
                if self.stopped.is_set():
                    return
            self._put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the reading thread
            self._put(exc)

    def _put(self, item: Any) -> None:
        """Queue ``item`` unless the reader was closed (never blocks past a close)."""
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _next_part(self) -> Any:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is _DONE:
            raise ValueError(
                f"The stream of {self.shard.where} ran out at row {self.position} of "
                f"{self.shard.n} in epoch {self.epoch + 1}: it must yield the same rows "
                "every epoch (as it did when it was first read)."
            )
        self.index += 1
        return item

    def read(self, start: int, stop: int) -> Any:
        pieces = []
        while self.position < stop:
            if self.buffer is None or self.offset >= len(self.buffer):
                self.buffer, self.offset = self._next_part(), 0
            take = min(len(self.buffer) - self.offset, stop - self.position)
            skip = max(0, start - self.position)
            if skip < take:
                pieces.append(self.buffer.take(slice(self.offset + skip, self.offset + take)))
            self.offset += take
            self.position += take
        return Shard.concat(pieces) if pieces else self.shard.empty

    def close(self) -> None:
        self.stopped.set()
        while True:  # unblock a waiting put, then let the thread see the flag
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
