"""The contract of an input kind: every adapter (:mod:`dasktf.data.sources` picks
one) places one shard per worker (:meth:`Source.place`) and rebuilds one on another
worker when its worker was lost (:meth:`Source.reload`), so nothing above ``data/``
asks which kind of input it holds.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.data.schedules import check_worker_count, proportional_schedule
from dasktf.data.shards import Shard, ShardStats, check_stats

if TYPE_CHECKING:
    from distributed import Client, Future


@dataclass
class PlacedData:
    """Shards placed on the workers: one resident ``Shard`` future per worker."""

    shards: list[Future]
    stats: list[ShardStats]
    schedule: np.ndarray  # (steps_per_epoch, n_workers) local batch sizes

    @property
    def steps_per_epoch(self) -> int:
        return int(self.schedule.shape[0])

    @property
    def n_samples(self) -> int:
        return sum(s.n for s in self.stats)


class Source(abc.ABC):
    """Where a run's shards come from (one subclass per input kind)."""

    #: the batches' size of data read on the client (a ``tf.data.Dataset``, a
    #: ``PyDataset``): the run's global batch when ``fit`` is given none
    batch_size_read: int | None = None

    @abc.abstractmethod
    def place(self, client: Client, workers: list[str], batch_size: int) -> PlacedData:
        """One shard per worker of ``workers`` for a global batch of ``batch_size``,
        with their stats and the step schedule."""

    @abc.abstractmethod
    def reload(self, client: Client, index: int, worker: str, schedule: np.ndarray,
               batch_size: int) -> Future:
        """Shard ``index`` of the ``schedule.shape[1]`` that :meth:`place` placed
        (with ``batch_size``), built again on ``worker``: a lost worker's shard,
        taken over by a survivor."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


def stats_of(shard: Shard) -> ShardStats:
    """A placed shard's stats (a :class:`~dasktf.data.streams.StreamedShard` has
    them from its first read)."""
    return shard.stats


class WorkerSideSource(Source):
    """Sources whose shards are built on the workers, each by one task
    (:meth:`task`); stats come back from there."""

    def task(self, index: int, n: int, worker: str) -> tuple[Any, ...]:
        """The function that builds shard ``index`` of ``n`` on ``worker``, and its
        arguments (a source building its shards otherwise overrides :meth:`_build`
        and :meth:`reload`)."""
        raise NotImplementedError

    def _build(self, client: Client, workers: list[str], batch_size: int) -> list[Future]:
        """One shard future per worker, built there."""
        # pure=False: a loader may read files that change between runs.
        return [client.submit(*self.task(i, len(workers), w), workers=[w], pure=False)
                for i, w in enumerate(workers)]

    def reload(self, client: Client, index: int, worker: str, schedule: np.ndarray,
               batch_size: int) -> Future:
        return client.submit(*self.task(index, schedule.shape[1], worker), workers=[worker],
                             pure=False)

    def place(self, client: Client, workers: list[str], batch_size: int) -> PlacedData:
        shards = self._build(client, workers, batch_size)
        stats = client.gather(
            [
                # pure=False: the stats of a shard are cheap, never worth caching.
                client.submit(stats_of, s, workers=[w], pure=False)
                for s, w in zip(shards, workers, strict=True)
            ]
        )
        check_stats(stats)
        check_worker_count(sum(s.n for s in stats), len(workers), batch_size)
        empty = [w for w, s in zip(workers, stats, strict=True) if s.n == 0]
        if empty:
            raise ValueError(
                f"Worker(s) {empty} got an empty shard; every worker needs data. "
                "Use fewer workers or split the data more evenly."
            )
        return PlacedData(shards, stats, proportional_schedule([s.n for s in stats], batch_size))
