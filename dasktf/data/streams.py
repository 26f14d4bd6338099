"""Shards read part by part on their worker: data larger than memory.

A :class:`StreamedShard` stands in a worker's memory where a resident
:class:`~dasktf.data.shards.Shard` would, but holds only a recipe for its parts,
given by its adapter (a :class:`StreamSource`): Dask partitions computed on the
worker one at a time (:mod:`dasktf.data.dask_collections`), a loader's iterator or
``dataset_fn(ctx)``'s elements (:mod:`dasktf.data.loaders`).

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

import abc
import dataclasses
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from dasktf import config
from dasktf.data.base import WorkerSideSource
from dasktf.data.shards import Shard, ShardStats, check_stats
from dasktf.data.structure import map_nest

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
    """Two parts' :class:`~dasktf.data.shards.ShardStats` as one; parts must agree
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


def build_stream(parts: Any, where: str) -> StreamedShard:
    return StreamedShard(parts, int(config.get("data.prefetch")), where).scan()


class StreamSource(WorkerSideSource):
    """Sources whose shards are streamed (:class:`StreamedShard`): each worker's
    shard is the recipe of its parts (:meth:`parts_of`), read there once to check
    and count it, then every epoch."""

    #: how a shard of this source is named in its errors
    label = "shard"

    @abc.abstractmethod
    def parts_of(self, index: int, n: int) -> Any:
        """The parts of shard ``index`` of ``n``: an object with ``parts(epoch,
        seed)``, ``describe(j)`` and ``shuffles_itself``."""

    def task(self, index: int, n: int, worker: str) -> tuple[Any, ...]:
        return build_stream, self.parts_of(index, n), f"{self.label} {index} ({worker})"
