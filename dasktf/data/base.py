"""The contract of an input kind: every adapter (:mod:`dasktf.data.sources` picks
one) places one shard per worker (:meth:`Source.place`) and rebuilds one on another
worker when its worker was lost (:meth:`Source.reload`), so nothing above ``data/``
asks which kind of input it holds.

Batch schedules: ``steps_per_epoch x workers`` local batch sizes. Gradients are
weighted by them, so uneven shards and a short last batch average correctly.
In-memory arrays are cut *interleaved*: with ``shuffle=False`` the workers' batches
at step ``k`` are exactly ``x[k*B:(k+1)*B]``, the global batch Keras would use.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dasktf.cluster.batch import TaskBatch, resolve
from dasktf.data.shards import Shard, ShardStats, check_stats

if TYPE_CHECKING:
    from distributed import Client, Future


def interleaved_schedule(n: int, batch_size: int, n_workers: int) -> np.ndarray:
    """Local batch sizes when each global batch of Keras' order is split N ways."""
    steps = -(-n // batch_size)
    sizes = np.minimum(batch_size, n - batch_size * np.arange(steps))
    base, extra = np.divmod(sizes[:, None], n_workers)
    return base + (np.arange(n_workers)[None, :] < extra)


def proportional_schedule(shard_sizes: Sequence[int], batch_size: int) -> np.ndarray:
    """Local batch sizes for shards of any size: every shard spread over the steps.

    The number of steps is that of the global data at ``batch_size``, so a global
    step still reads about ``batch_size`` rows, each shard exactly once per epoch.
    """
    steps = max(1, -(-sum(shard_sizes) // batch_size))
    columns = [[len(p) for p in np.array_split(np.empty(n), steps)] for n in shard_sizes]
    return np.array(columns, dtype=np.int64).T


def interleaved_indices(schedule: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """The rows of each worker's shard for :func:`interleaved_schedule`."""
    starts = batch_size * np.arange(schedule.shape[0])[:, None] + np.concatenate(
        [np.zeros((schedule.shape[0], 1), dtype=np.int64), schedule.cumsum(axis=1)[:, :-1]],
        axis=1,
    )
    return [
        np.concatenate([np.arange(s, s + c) for s, c in zip(starts[:, i], schedule[:, i], strict=False)])
        for i in range(schedule.shape[1])
    ]


def check_worker_count(n_samples: int, n_workers: int, batch_size: int) -> None:
    if n_workers > n_samples:
        raise ValueError(
            f"More workers ({n_workers}) than training samples ({n_samples}): "
            "every worker needs at least one sample. Use fewer workers."
        )
    if batch_size < n_workers:
        raise ValueError(
            f"The global batch_size ({batch_size}) is smaller than the number of "
            f"workers ({n_workers}); each worker needs at least one sample per step. "
            "Raise batch_size or use fewer workers."
        )


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

    def _build(self, batch: TaskBatch, workers: list[str], batch_size: int) -> list[Any]:
        """One shard task per worker, built there, queued in ``batch`` (whose
        ``client`` a source may ask first); :meth:`place` sends them."""
        # pure=False (TaskBatch's keys): a loader may read files that change between
        # runs.
        return [batch.add(*self.task(i, len(workers), w), workers=[w])
                for i, w in enumerate(workers)]

    def reload(self, client: Client, index: int, worker: str, schedule: np.ndarray,
               batch_size: int) -> Future:
        return client.submit(*self.task(index, schedule.shape[1], worker), workers=[worker],
                             pure=False)

    def place(self, client: Client, workers: list[str], batch_size: int) -> PlacedData:
        # The shards and their stats (cheap, never worth caching: pure=False) as one
        # update-graph message, each pinned to its worker: 2N submits were 2N
        # messages, most of what placing the data cost the scheduler.
        batch = TaskBatch(client)
        built = self._build(batch, workers, batch_size)
        read = [batch.add(stats_of, s, workers=[w])
                for s, w in zip(built, workers, strict=True)]
        batch.want([*built, *read])
        futures = batch.flush()
        shards, stats = resolve(built, futures), client.gather(resolve(read, futures))
        check_stats(stats)
        check_worker_count(sum(s.n for s in stats), len(workers), batch_size)
        empty = [w for w, s in zip(workers, stats, strict=True) if s.n == 0]
        if empty:
            raise ValueError(
                f"Worker(s) {empty} got an empty shard; every worker needs data. "
                "Use fewer workers or split the data more evenly."
            )
        return PlacedData(shards, stats, proportional_schedule([s.n for s in stats], batch_size))
