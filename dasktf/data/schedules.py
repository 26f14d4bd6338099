"""Batch schedules: ``steps_per_epoch x workers`` local batch sizes. Gradients are
weighted by them, so uneven shards and a short last batch average correctly.
In-memory arrays are cut *interleaved*: with ``shuffle=False`` the workers' batches
at step ``k`` are exactly ``x[k*B:(k+1)*B]``, the global batch Keras would use.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
