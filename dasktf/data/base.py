"""The contract of an input kind: what the run and the engines ask of training data.

Every adapter of :mod:`dasktf.data.sources` derives from :class:`Source`: it places
one shard per worker (:meth:`Source.place`) and rebuilds one of them on another
worker when its worker was lost (:meth:`Source.reload`), so nothing above ``data/``
asks which kind of input it holds.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from distributed import Client, Future

    from dasktf.data.shards import ShardStats


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
