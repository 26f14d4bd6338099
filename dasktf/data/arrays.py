"""In-memory training data (NumPy, pandas, array-likes, or nests of them, and what
:mod:`.keras_inputs` read), converted once and scattered interleaved
(:func:`~dasktf.data.base.interleaved_schedule`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dasktf.data.base import (
    PlacedData,
    Source,
    check_worker_count,
    interleaved_indices,
    interleaved_schedule,
)
from dasktf.data.shards import check_stats, shard_of

if TYPE_CHECKING:
    import numpy as np
    from distributed import Client, Future


class ArraySource(Source):
    """NumPy (or array-like) ``x``/``y``/``sample_weight`` held by the client, each
    an array or a nest of them, scattered once."""

    def __init__(self, x: Any, y: Any, sample_weight: Any = None,
                 class_weight: dict[int, float] | None = None) -> None:
        if y is None:
            raise ValueError("y is required when x is an array.")
        self.data = shard_of(x, y, sample_weight, class_weight)
        self.stats = self.data.stats
        check_stats([self.stats])

    def place(self, client: Client, workers: list[str], batch_size: int) -> PlacedData:
        check_worker_count(self.stats.n, len(workers), batch_size)
        schedule = interleaved_schedule(self.stats.n, batch_size, len(workers))
        rows = interleaved_indices(schedule, batch_size)
        # one message to the scheduler for every worker's shard (WatchedClient's)
        shards = client.scatter_each(  # type: ignore[attr-defined]
            [self.data.take(r) for r in rows], workers)
        stats = [dataclasses.replace(self.stats, n=len(r)) for r in rows]
        return PlacedData(shards, stats, schedule)

    def reload(self, client: Client, index: int, worker: str, schedule: np.ndarray,
               batch_size: int) -> Future:
        rows = interleaved_indices(schedule, batch_size)[index]
        return client.scatter(self.data.take(rows), workers=[worker], direct=True,
                              hash=False)
