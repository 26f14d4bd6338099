"""Sharding and batch schedules, without a cluster."""

from __future__ import annotations

import numpy as np
import pytest

from dasktf.data.sources import (
    assign_chunks,
    interleaved_indices,
    interleaved_schedule,
    make_source,
    proportional_schedule,
)


@pytest.mark.parametrize("n, batch, workers", [(250, 48, 3), (1000, 100, 3), (7, 7, 7), (101, 10, 1)])
def test_interleaved_shards_reassemble_keras_batches(n, batch, workers):
    schedule = interleaved_schedule(n, batch, workers)
    rows = interleaved_indices(schedule, batch)
    assert schedule.sum() == n and sorted(np.concatenate(rows)) == list(range(n))
    offsets = [np.concatenate([[0], np.cumsum(schedule[:, i])]) for i in range(workers)]
    for k in range(schedule.shape[0]):
        step = np.concatenate([rows[i][offsets[i][k]:offsets[i][k + 1]] for i in range(workers)])
        assert list(step) == list(range(k * batch, min(n, (k + 1) * batch)))


def test_proportional_schedule_reads_every_row_once():
    schedule = proportional_schedule([340, 330, 10], 100)
    assert schedule.shape == (7, 3)
    assert list(schedule.sum(axis=0)) == [340, 330, 10]
    assert schedule.max() - schedule.min(axis=0).min() <= 49


def test_chunks_stay_with_their_holder_unless_it_is_full():
    # Worker a holds three of four equal chunks; fairness moves one of them to b.
    assignment = assign_chunks([10, 10, 10, 10], [["a"], ["a"], ["a"], ["b"]], ["a", "b"])
    assert sorted(map(len, assignment)) == [2, 2]
    assert 3 in assignment[1]


def test_source_dispatch_rejects_unknown_input():
    with pytest.raises(TypeError, match="x must be a NumPy array"):
        make_source(object(), None)
    with pytest.raises(ValueError, match="y is required"):
        make_source(np.zeros((3, 2)), None)
    with pytest.raises(ValueError, match="must be None when x is a shard loader"):
        make_source(lambda i, n: (None, None), np.zeros(3))
